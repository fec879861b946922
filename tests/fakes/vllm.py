"""A fake vLLM engine for CPU tests: a FakeLLM whose collective_rpc calls a real ColomemWorkerExtension
(or a subclass) in-process on CPU tensors, a fake bridge (real bucket plan and pack, queues for the socket),
and stub modules for the few vLLM names the adapter imports.

    rollout = FakeRollout("/models/tiny", bucket_bytes=256)   # VLLMRollout over FakeLLM + FakeWorker
    install_vllm_stubs(monkeypatch)                             # SamplingParams, TokensPrompt, LoRARequest
    from fakes.vllm import fake_vllm  # noqa: F401                # the same, autouse, for a whole module
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

from colomem.bridge.buckets import BucketMessage, Reassembler, entry_view, layout_digest, pack_bucket, plan_buckets
from colomem._torch import copy_ranges
from colomem.engines.vllm.rollout import VLLMRollout
from colomem.engines.vllm.worker import ColomemWorkerExtension
from colomem.bridge import wire
from colomem.bridge.producer import BridgeStats
from colomem.errors import PeerAbortedError, PeerClosedError, PeerError, TransferTimeoutError, error_payload

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUFFERS: dict = {}   # address -> {buffer index: {name: tensor}}: what the fake bridge "maps"
CHANNELS: dict = {}  # address -> (bridge -> worker queue, worker -> bridge queue): the fake "socket"


class FakeImporter:
    """BridgeImporter without CUDA: the same message parsing, views and reassembly of split tensors, and a
    queue standing in for the socket transport (abort, tags, ACKs as in colomem.bridge)."""

    def __init__(self, address):
        if address not in BUFFERS:
            raise ConnectionRefusedError(f"nothing listens on {address}")
        self.address = address
        self.reasm = Reassembler()
        self.closed = False
        self.copied_out = 0   # buckets applied through copy_out (precomputed ranges)

    def copy_out(self, msg, ranges, verify="sampled"):
        m = BucketMessage.from_dict(msg, entries=False)
        copy_ranges(ranges, torch.device("cpu"), src_base=BUFFERS[self.address][m.buffer].data_ptr())
        self.copied_out += 1

    def entries(self, msg, verify="sampled"):
        m = BucketMessage.from_dict(msg)
        base = BUFFERS[self.address][m.buffer]
        for e in m.entries:
            yield e, entry_view(base, e)
        if m.last and self.reasm.pending():
            raise PeerError(f"split tensors missing parts: {self.reasm.pending()}")

    def reassemble(self, e, view):
        return self.reasm.add(e, view)

    def receive(self, timeout=None, tag=None):
        inbox, _ = CHANNELS[self.address]
        while True:
            try:
                kind, d = inbox.get(timeout=timeout)
            except queue.Empty:
                raise TransferTimeoutError("no bucket in time") from None
            if kind == "closed":
                raise PeerClosedError("exporter closed the weight bridge")
            if tag is not None and d.get("tag") != tag:
                continue
            if kind == "abort":
                raise PeerAbortedError(f"exporter abandoned version {d['version']}: {d['error']}")
            return d

    def ack(self, msg, ok=True, error=None, timeout=None, report=None):
        """error: the exception that refused the bucket, carried as its error payload (colomem.errors)."""
        _, outbox = CHANNELS[self.address]
        payload = error_payload(error) if isinstance(error, BaseException) else error
        outbox.put({"ok": bool(ok), "error": payload, "tag": msg.get("tag"), "seq": msg["seq"],
                    "version": msg["version"], "report": report})

    def close(self):
        self.closed = True
        if self.address in CHANNELS:            # the producer's next read sees the hang-up, as on a socket
            CHANNELS[self.address][1].put({"ok": False, "hung_up": True})


class FakeBridge:
    """WeightBridge without CUDA: the real bucket plan and pack into CPU buffers, one message per bucket."""

    count = 0

    def __init__(self, bucket_bytes, buffers):
        FakeBridge.count += 1
        self.address = f"/tmp/fake-bridge-{os.getpid()}-{FakeBridge.count}"
        self.buffers = [torch.zeros(bucket_bytes, dtype=torch.uint8) for _ in range(buffers)]
        self.bucket_bytes = bucket_bytes
        BUFFERS[self.address] = self.buffers
        CHANNELS[self.address] = (queue.Queue(), queue.Queue())
        self.closed = False
        self.last_stats = None
        self.last_reports: list = []

    def publish(self, items, version):
        plans = list(plan_buckets(items, self.bucket_bytes)) or [None]
        for seq, plan in enumerate(plans):
            i = seq % len(self.buffers)
            if plan is not None:
                pack_bucket(plan, self.buffers[i])
            entries = tuple(plan.entries) if plan else ()
            yield BucketMessage(buffer=i, version=version, seq=seq, last=seq == len(plans) - 1,
                                nbytes=plan.nbytes if plan else 0, checksum=None, checksum_stride=0,
                                entries=entries, layout=layout_digest(entries))

    def sync(self, items, version, send=None, timeout=None, tag=None):
        assert send is None
        outbox, inbox = CHANNELS[self.address]
        n, acked = 0, 0.0
        self.last_reports = []
        try:
            for msg in self.publish(items, version):
                outbox.put(("bucket", {**msg.to_dict(), "tag": tag}))
                n += 1
                t1 = time.perf_counter()
                try:
                    ack = inbox.get(timeout=timeout)
                    acked += time.perf_counter() - t1
                except queue.Empty:
                    raise TransferTimeoutError("no ack in time") from None
                if ack.get("hung_up"):
                    raise PeerError("importer process closed the connection")
                if not ack["ok"]:
                    raise wire.refusal(ack["error"], msg, "importer process")   # the real bridge's rule
                if msg.last:
                    self.last_reports = [ack.get("report")]
        except BaseException as exc:
            outbox.put(("abort", {"version": version, "tag": tag, "error": repr(exc)}))
            raise
        self.last_stats = BridgeStats(version=version, messages=n, ack_seconds=acked)
        return self.last_stats

    def close(self):
        self.closed = True
        if self.address in CHANNELS:
            CHANNELS[self.address][0].put(("closed", {}))
        BUFFERS.pop(self.address, None)
        CHANNELS.pop(self.address, None)


class TinyModel(torch.nn.Module):
    """vLLM-like: fused qkv, load_weights(iterable of HF names) -> set of the params it wrote."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Parameter(torch.zeros(12, 4))
        self.o_proj = torch.nn.Parameter(torch.zeros(4, 4))
        self.norm = torch.nn.Parameter(torch.ones(4))
        self.embed = torch.nn.Parameter(torch.zeros(40, 8))     # 1280 bytes: split over 256-byte buckets

    def load_weights(self, weights):
        loaded = set()
        with torch.no_grad():
            for name, w in weights:
                if name in ("q_proj", "k_proj", "v_proj"):
                    i = ("q_proj", "k_proj", "v_proj").index(name)
                    self.qkv_proj[4 * i:4 * i + 4].copy_(w)
                    loaded.add("qkv_proj")
                else:
                    getattr(self, name).copy_(w)
                    loaded.add(name)
        return loaded


class FakeWorkerHooks:
    """What vLLM's Worker gives the extension (model_runner, device, rank), and stand-ins for the methods
    that reach into vLLM's cumem allocator. Mixed in front of a worker extension class."""

    def __init__(self):
        self.model_runner = types.SimpleNamespace(model=TinyModel())
        self.device = torch.device("cpu")
        self.rank = 0
        self.rollbacks: list = []

    def _colomem_connect(self, address, timeout):
        return FakeImporter(address)

    def _colomem_weight_allocations(self):
        return [(p.data_ptr(), p.numel() * p.element_size()) for p in self.model_runner.model.parameters()]

    def colomem_rollback_wake(self, tags, keep_weights, timeout=None):
        self.rollbacks.append((list(tags), keep_weights))
        return {"released_bytes": 0}

    def colomem_memory(self):
        return {"cumem_bytes_by_tag": {"weights": 1 << 20, "kv_cache": 8 << 20}, "pool": {}}


class FakeWorker(FakeWorkerHooks, ColomemWorkerExtension):
    pass


def fake_worker_class(extension: type) -> type:
    """FakeWorkerHooks in front of `extension` (a ColomemWorkerExtension subclass, e.g. the benchmark's)."""
    return type(f"Fake{extension.__name__}", (FakeWorkerHooks, extension), {})


class FakeProcs:
    def __init__(self, procs):
        self.processes = procs


class FakeLLM:
    """The slice of vllm.LLM the adapter uses; sleep(2) zeroes the weights (discarded, like cuMem unmap)."""

    def __init__(self, worker, proc=None):
        self.worker = worker
        self.calls: list = []
        self.level = None
        self.backup: Optional[list] = None
        self.wake_error: Optional[str] = None
        self.block = threading.Event()
        self.hang = False
        self.loras: dict = {}
        self.reset_ok = True          # False: vLLM refuses to reset its prefix cache (requests running)
        core = types.SimpleNamespace(resources=types.SimpleNamespace(
            engine_dead=False, engine_manager=FakeProcs([proc] if proc else [])), shutdown=self._shutdown)
        self.llm_engine = types.SimpleNamespace(engine_core=core, add_lora=self._add_lora,
                                                remove_lora=self._remove_lora)
        self.shutdown_called = False

    def _shutdown(self, timeout=None):
        self.shutdown_called = True
        if self.hang:
            self.block.wait()

    def _add_lora(self, req):
        self.loras[req.lora_int_id] = req
        return True

    def _remove_lora(self, lid):
        return self.loras.pop(lid, None) is not None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if self.hang:
            self.block.wait()
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def _params(self):
        return list(self.worker.model_runner.model.parameters())

    def sleep(self, level=1):
        self.calls.append(f"sleep{level}")
        self.level = level
        if level == 1:
            self.backup = [p.detach().clone() for p in self._params()]
        with torch.no_grad():
            for p in self._params():
                p.zero_()

    def wake_up(self, tags=None):
        self.calls.append(f"wake{tags}")
        if self.wake_error:
            raise RuntimeError(self.wake_error)      # what vLLM's cumem allocator raises when a map fails
        if "weights" in (tags or ["weights"]) and self.level == 1 and self.backup is not None:
            with torch.no_grad():
                for p, b in zip(self._params(), self.backup):
                    p.copy_(b)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.reset_ok

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.calls.append(("generate", lora_request.lora_int_id if lora_request else None))
        outs = []
        for prompt, sp in zip(prompts, params):
            comps = []
            for i in range(sp.n):
                toks = [(len(prompt["prompt_token_ids"]) + i + k) % 7 for k in range(sp.max_tokens)]
                lps = flat_logprobs(toks) if getattr(sp, "flat_logprobs", False) else \
                    [{t: types.SimpleNamespace(logprob=-0.5 * (k + 1))} for k, t in enumerate(toks)]
                comps.append(types.SimpleNamespace(index=i, token_ids=toks, logprobs=lps, finish_reason="length"))
            outs.append(types.SimpleNamespace(outputs=comps[::-1]))
        return outs


def flat_logprobs(toks: list) -> types.SimpleNamespace:
    """vLLM's FlatLogprobs of a completion (the sampled token first at each position, then one other),
    with the logprobs the list-of-dicts form gives: -0.5 * (position + 1)."""
    out = types.SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
    for k, t in enumerate(toks):
        out.start_indices.append(len(out.logprobs))
        out.token_ids += [t, (t + 1) % 7]
        out.logprobs += [-0.5 * (k + 1), -9.0]
        out.end_indices.append(len(out.logprobs))
    return out


def install_vllm_stubs(monkeypatch) -> types.ModuleType:
    """Stub modules for the few vLLM names the adapter imports (SamplingParams, TokensPrompt, LoRARequest)."""
    vllm = types.ModuleType("vllm")
    setattr(vllm, "SamplingParams", lambda **kw: types.SimpleNamespace(**kw))
    inputs = types.ModuleType("vllm.inputs")
    setattr(inputs, "TokensPrompt", lambda **kw: dict(**kw))
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    setattr(request, "LoRARequest", LoRARequest)
    for name, mod in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, mod)
    return vllm


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch):
    """install_vllm_stubs for every test of a module that imports this fixture."""
    return install_vllm_stubs(monkeypatch)


class FakeRollout(VLLMRollout):
    """VLLMRollout over FakeLLM and a fake worker (worker_cls: FakeWorker, or fake_worker_class(...))."""

    def __init__(self, *a: Any, proc=None, worker_cls: type = FakeWorker, **kw: Any):
        self._worker = worker_cls()
        self._proc = proc
        super().__init__(*a, **kw)

    def _build_llm(self, kwargs):
        self.built_with = kwargs
        return FakeLLM(self._worker, self._proc)

    def _make_bridge(self):
        return FakeBridge(self.bucket_bytes, self.bucket_buffers)


def trainer_weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in (("q_proj", (4, 4)), ("k_proj", (4, 4)),
                                                          ("v_proj", (4, 4)), ("o_proj", (4, 4)), ("norm", (4,)),
                                                          ("embed", (40, 8)))}


def model_of(r: FakeRollout) -> TinyModel:
    return r._worker.model_runner.model


def make(**kw: Any) -> FakeRollout:
    kw.setdefault("bucket_bytes", 256)
    return FakeRollout("/models/tiny", gpu_memory_utilization=0.3, max_model_len=256, **kw)
