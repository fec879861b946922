"""VLLMRollout: vLLM 0.24 as the rollout side of a colocated step (the Rollout protocol of docs/design.md).

The LLM lives in this (trainer) process; vLLM runs the model in its EngineCore process, so new weights cross
processes through colomem's WeightBridge: the producer here packs the trainer's tensors into exportable GPU
buckets, and `ColomemWorkerExtension` in vLLM's worker applies them from the mapped buckets (the first sync
through the model's `load_weights`, recorded; later ones as the recorded copies, then as one batched copy per
bucket layout). ACKs come after the copies finished.

Weight sync transports (`sync_transport`):
  "listener"  (default) no RPC per sync: a thread in the worker (colomem_listen, started at attach) serves
              the bridge socket and applies each version as it comes; its report comes with the last ACK. If
              that thread stops, it closes its end and the next sync fails at once with its reason.
  "socket"    one collective_rpc("colomem_receive") per sync; buckets and ACKs travel over the bridge
              socket, the worker's report with the last ACK, the RPC's return is collected later.
  "rpc"       one collective_rpc("colomem_apply") per bucket (the slowest; kept as the reference).
  "direct"    with engine_in_process=True (vLLM's EngineCore and worker in this process, as verl runs it):
              the worker's recorded copies read the trainer's tensors themselves; no bridge, no bucket.

One step: sleep() -> [trainer works] -> wake_weights() -> load_weights(...) -> check() -> wake_kv() ->
generate(...). Every call into vLLM runs with a timeout on a helper thread: a hung or dead engine raises
TransferTimeoutError / PeerError instead of blocking, and close() kills the engine process if it must.

Sleep modes (`sleep_level`, `weights_backup`):
  sleep_level=1, weights_backup="vllm"  vLLM's level 1: weights copied to pinned host memory vLLM allocates.
  sleep_level=2, weights_backup="vllm"  vLLM's level 2: weights discarded. generate() refuses until a sync
                                        wrote every parameter (the garbage-after-wake trap, vllm#29341).
  weights_backup="pool"                 the worker copies vLLM's "weights" allocations into a colomem pinned
                                        pool (chunked, pinned once) and vLLM sleeps at level 2; wake_weights()
                                        copies them back (restore=False skips that before a full sync).

Logprobs: `logprobs_mode="processed_logprobs"` (default) returns log-softmax(logits / temperature) of each
sampled token (after top-k/top-p), what the GRPO ratio compares against at top_p=1; "raw_logprobs" ignores the
temperature.

LoRA (`lora=LoraSpec`, `lora_mode`):
  "merged"  (default) vLLM serves a plain model; the trainer merges the adapter and syncs full weights. Always
            correct whatever the sleep level, and the bridge makes a full sync cheap.
  "adapter" vLLM's LoRA support (enable_lora): tensors named *lora_A* / *lora_B* are written as a peft adapter
            (safetensors in /dev/shm) and registered with a fresh id per version; the base weights must
            survive sleep, so this mode needs sleep_level=1 or weights_backup="pool" (a level-2 sleep without a
            backup would leave garbage under a correct adapter, verl#3516). The adapter is registered again
            after every wake (vllm#53888: a wake can drop it).
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import logging
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from colomem._bucket import dtype_name
from colomem.engines import SyncStats
from colomem.engines.vllm_worker import (checksum_parts, finish_checksums, hashed_pick, raise_if_error,
                                         tensor_checksum)
from colomem.errors import (
    ColomemError,
    CudaOutOfMemoryError,
    InvalidArgumentError,
    PeerError,
    PhaseOrderError,
    PoolClosedError,
    StaleWeightsError,
    TransferTimeoutError,
    WeightCheckError,
)
from colomem.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

WORKER_EXTENSION = "colomem.engines.vllm_worker.ColomemWorkerExtension"
AWAKE, WEIGHTS_ONLY, ASLEEP, CLOSED = "awake", "weights", "asleep", "closed"
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM 0.24 LoRAConfig.max_lora_rank choices
_WAKE_MARGIN = 256 << 20                                 # headroom kept free beyond what a wake maps


class _EngineThread:
    """Runs engine calls one at a time on a daemon thread, so the caller can wait with a timeout.

    vLLM's synchronous client has no timeout of its own (a dead engine can leave a call waiting forever);
    a daemon thread stuck in such a call does not keep the interpreter from exiting.
    """

    def __init__(self, init: Optional[Callable[[], None]] = None):
        self._q: "queue.Queue" = queue.Queue()
        self._init = init
        self._t = threading.Thread(target=self._loop, name="colomem-vllm-calls", daemon=True)
        self._t.start()

    def _loop(self):
        if self._init is not None:
            try:
                self._init()
            except Exception as exc:  # noqa: BLE001 - every call then reports it
                log.warning("engine-call thread set-up failed: %s", exc)
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001  (delivered to the caller)
                fut.set_exception(exc)

    def submit(self, fn: Callable) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fn, fut))
        return fut

    def stop(self):
        self._q.put(None)


def _lora_attr(lora, *names, default=None):
    for n in names:
        if hasattr(lora, n):
            return getattr(lora, n)
        if isinstance(lora, dict) and n in lora:
            return lora[n]
    return default


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_embedding_A", ".lora_embedding_B"))


def peft_adapter_name(name: str) -> str:
    """A peft state-dict name vLLM's LoRA loader parses: `base_model.model.` prefix, no adapter segment."""
    for part in (".lora_A.", ".lora_B."):
        if part in name:
            head, tail = name.split(part, 1)
            if tail.count(".") >= 1 and not tail.startswith("weight"):  # lora_A.default.weight -> lora_A.weight
                tail = tail.split(".", 1)[1]
            name = head + part + tail
    return name if name.startswith("base_model.model.") else "base_model.model." + name


def hf_base_name(name: str) -> str:
    """A peft base-layer name back to the plain HF name vLLM's load_weights expects."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(exc).lower()


class VLLMRollout:
    """vLLM with sleep mode, weight sync through the bridge, a version guard and a post-wake check."""

    def __init__(
        self,
        model_path: str,
        *,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 2048,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        enforce_eager: bool = True,
        lora: Any = None,
        lora_mode: str = "merged",
        sleep_level: int = 1,
        weights_backup: str = "vllm",
        trust_remote_code: bool = False,
        bucket_bytes: Any = 512 << 20,
        bucket_buffers: int = 2,
        dtype: str = "bfloat16",
        device: int = 0,
        max_num_seqs: Optional[int] = None,
        logprobs_mode: str = "processed_logprobs",
        verify: str = "sampled",
        check_sample: int = 8,
        sync_transport: str = "listener",
        engine_in_process: bool = False,
        fast_load: bool = True,
        rpc_timeout_s: float = 120.0,
        generate_timeout_s: float = 1800.0,
        wake_timeout_s: float = 300.0,
        shutdown_timeout_s: float = 30.0,
        llm_kwargs: Optional[dict] = None,
    ):
        if not isinstance(model_path, (str, os.PathLike)) or not str(model_path):
            raise InvalidArgumentError(f"model_path must be a path or a model name, got {model_path!r}")
        if not 0.0 < float(gpu_memory_utilization) <= 1.0:
            raise InvalidArgumentError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if int(max_model_len) <= 0:
            raise InvalidArgumentError(f"max_model_len must be positive, got {max_model_len}")
        if int(tensor_parallel_size) < 1:
            raise InvalidArgumentError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if verify not in ("none", "sampled", "full"):
            raise InvalidArgumentError(f"verify must be 'none', 'sampled' or 'full', got {verify!r}")
        if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise InvalidArgumentError(f"logprobs_mode must be 'processed_logprobs' (log-softmax of logits / "
                                       f"temperature, as the GRPO loss computes them) or 'raw_logprobs', "
                                       f"got {logprobs_mode!r}")
        if sync_transport not in ("socket", "rpc", "listener", "direct"):
            raise InvalidArgumentError(f"sync_transport must be 'socket' (one RPC per sync, buckets announced "
                                       f"over the bridge socket), 'listener' (a thread in vLLM's worker serves "
                                       f"the socket: no RPC per sync), 'rpc' (one collective_rpc per bucket) or "
                                       f"'direct' (engine_in_process=True: the trainer's tensors straight into "
                                       f"the model), got {sync_transport!r}")
        if sync_transport == "direct" and not engine_in_process:
            raise InvalidArgumentError("sync_transport='direct' hands the trainer's tensors to vLLM's worker as "
                                       "Python objects, which needs the worker in this process: pass "
                                       "engine_in_process=True (or use 'listener')")
        if int(bucket_buffers) < 1:
            raise InvalidArgumentError(f"bucket_buffers must be >= 1, got {bucket_buffers}")
        for name, v in (("rpc_timeout_s", rpc_timeout_s), ("generate_timeout_s", generate_timeout_s),
                        ("wake_timeout_s", wake_timeout_s), ("shutdown_timeout_s", shutdown_timeout_s)):
            if not float(v) > 0:
                raise InvalidArgumentError(f"{name} must be positive, got {v}")
        self.sleep_level = sleep_level          # validated by the property setters
        self.weights_backup = weights_backup
        if lora_mode not in ("merged", "adapter"):
            raise InvalidArgumentError(f"lora_mode must be 'merged' or 'adapter', got {lora_mode!r}")
        if lora_mode == "adapter":
            if lora is None:
                raise InvalidArgumentError("lora_mode='adapter' needs lora=LoraSpec(r, alpha, target_modules)")
            if int(_lora_attr(lora, "r", default=0)) not in range(1, _LORA_RANKS[-1] + 1):
                raise InvalidArgumentError(f"LoRA rank must be in 1..{_LORA_RANKS[-1]} for vLLM 0.24")
        self.model_path = str(model_path)
        self.lora = lora
        self.lora_mode = lora_mode if lora is not None else "merged"
        self.device = int(device)
        self.bucket_bytes = parse_bytes(bucket_bytes)
        self.bucket_buffers = int(bucket_buffers)
        self.verify = verify
        self.check_sample = int(check_sample)
        self.sync_transport = sync_transport
        self.engine_in_process = bool(engine_in_process)
        self.fast_load = bool(fast_load)
        self._syncs = 0
        self._receiving = None  # the colomem_receive RPC of a finished sync, collected by the next engine call
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.generate_timeout_s = float(generate_timeout_s)
        self.wake_timeout_s = float(wake_timeout_s)
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self._check_adapter_mode()

        self.llm_kwargs = dict(
            model=self.model_path, enable_sleep_mode=True, worker_extension_cls=WORKER_EXTENSION,
            trust_remote_code=bool(trust_remote_code), seed=int(seed),
            gpu_memory_utilization=float(gpu_memory_utilization), max_model_len=int(max_model_len),
            enforce_eager=bool(enforce_eager), tensor_parallel_size=int(tensor_parallel_size), dtype=dtype,
            logprobs_mode=logprobs_mode,
        )
        if max_num_seqs is not None:
            self.llm_kwargs["max_num_seqs"] = int(max_num_seqs)
        if self.lora_mode == "adapter":
            r = int(_lora_attr(self.lora, "r"))
            self.llm_kwargs.update(enable_lora=True, max_loras=1,
                                   max_lora_rank=next(x for x in _LORA_RANKS if x >= r))
        self.llm_kwargs.update(llm_kwargs or {})

        # state the guards read
        self.weight_version = 0              # version of the weights in vLLM (0: as loaded at start)
        self._expected_version = 0           # newest version the trainer announced
        self._phase = AWAKE
        self._weights_valid = True           # False after a level-2 sleep without backup, until a full sync
        self._expected: list = []            # per worker rank: {vLLM param name: checksum check() must find}
        self._expected_from = "start"
        self._broken: Optional[str] = None
        self._bridge = None
        self._lora_request = None
        self._lora_dir: Optional[str] = None
        self._lora_next_id = 1
        self._param_info: Optional[dict] = None
        self._tag_bytes: dict = {}
        self.last_sync: Optional[SyncStats] = None
        self.timings: dict = {}

        # An in-process engine runs its CUDA work on the engine-call thread: that thread must use its GPU.
        self._calls = _EngineThread(self._set_device if self.engine_in_process else None)
        t0 = time.perf_counter()
        self._llm = self._build_llm(self.llm_kwargs)
        self.timings["start_s"] = time.perf_counter() - t0
        self._pids = self._engine_pids()
        self._refresh_tag_bytes()

    # ------------------------------------------------------------------------------------ construction
    def _set_device(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)

    def _build_llm(self, kwargs: dict):
        """Creates vllm.LLM (overridden by the CPU tests with a fake engine)."""
        from vllm import LLM

        # The runner touches CUDA (pool, trainer) before vLLM starts its engine process; a forked engine
        # then cannot initialise CUDA, so spawn unless the user chose otherwise.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if not self.engine_in_process:
            return LLM(**kwargs)
        from vllm import envs as vllm_envs

        # vLLM reads this when it builds the engine: 0 keeps EngineCore and its worker in this process. An
        # in-process EngineCore also freezes vLLM's environment reads (enable_envs_cache): undone after, so
        # a later engine of this process is not built in-process too.
        old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        was_cached = getattr(vllm_envs, "_is_envs_cache_enabled", lambda: False)()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            self._set_device()
            return LLM(**kwargs)
        finally:
            if old is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
            if not was_cached and hasattr(vllm_envs, "disable_envs_cache"):
                vllm_envs.disable_envs_cache()

    def _make_bridge(self):
        from colomem.bridge import WeightBridge

        # The producer must checksum at least as thoroughly as the worker verifies.
        checksum = {"full": "full", "none": "none"}.get(self.verify, "sampled")
        return WeightBridge(bucket_bytes=self.bucket_bytes, buffers=self.bucket_buffers, device=self.device,
                            checksum=checksum)

    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    @sleep_level.setter
    def sleep_level(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidArgumentError(f"sleep_level must be 1 or 2, got {level!r}")
        self._sleep_level = int(level)
        if getattr(self, "_phase", None) is not None:
            self._check_adapter_mode()

    @property
    def weights_backup(self) -> str:
        return self._weights_backup

    @weights_backup.setter
    def weights_backup(self, backup: str) -> None:
        if backup not in ("vllm", "pool"):
            raise InvalidArgumentError(f"weights_backup must be 'vllm' or 'pool', got {backup!r}")
        self._weights_backup = backup
        if getattr(self, "_phase", None) is not None:
            self._check_adapter_mode()

    def _check_adapter_mode(self) -> None:
        if getattr(self, "lora_mode", "merged") == "adapter" and self._sleep_level == 2 \
                and self._weights_backup == "vllm":
            raise InvalidArgumentError(
                "lora_mode='adapter' keeps the base weights in vLLM across sleep, but sleep_level=2 without a "
                "backup discards them: use sleep_level=1, weights_backup='pool', or lora_mode='merged'")

    # ------------------------------------------------------------------------------ engine call plumbing
    @property
    def llm(self):
        """The vllm.LLM (for what the adapter does not wrap; keep phases in order yourself)."""
        return self._llm

    @property
    def phase(self) -> str:
        return self._phase

    def _engine_dead(self) -> bool:
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        res = getattr(core, "resources", None)
        return bool(getattr(res, "engine_dead", False))

    def _call(self, fn: Callable, timeout: float, what: str):
        return self._await(self._start(fn, what), timeout, what)

    def _start(self, fn: Callable, what: str) -> concurrent.futures.Future:
        """Queues an engine call without waiting for it (collect it with _await)."""
        if self._phase == CLOSED:
            raise PoolClosedError(f"VLLMRollout is closed; cannot {what}")
        self._collect_receive()
        if self._broken:
            raise PeerError(f"the vLLM engine is unusable ({self._broken}); close() it and start a new one")
        if self._engine_dead():
            self._broken = "engine process died"
            raise PeerError(f"vLLM's engine process died before {what}; close() and start a new VLLMRollout")
        return self._calls.submit(fn)

    def _collect_receive(self) -> None:
        """Waits for the RPC of the last socket sync (its report came with the last ACK, so load_weights did
        not wait for it); an error it ended with is raised here, before the next engine call."""
        fut, self._receiving = self._receiving, None
        if fut is not None:
            for r in self._await(fut, self.rpc_timeout_s, "colomem_receive"):
                raise_if_error(r, "colomem_receive")

    def _await(self, fut: concurrent.futures.Future, timeout: float, what: str):
        try:
            return fut.result(timeout=timeout)
        except BaseException as exc:
            if isinstance(exc, TimeoutError) and not fut.done():  # our wait ran out, not the call
                self._broken = f"{what} timed out after {timeout:.0f} s"
                raise TransferTimeoutError(
                    f"vLLM did not finish {what} within {timeout:.0f} s; the engine is stuck or dead. close() "
                    f"kills it (raise the timeout if the work is just slow)") from None
            if isinstance(exc, ColomemError):
                raise
            if type(exc).__name__ == "EngineDeadError" or self._engine_dead():
                self._broken = "engine process died"
                raise PeerError(f"vLLM's engine process died during {what}: {exc}") from exc
            raise

    def rpc(self, method: str, *args, timeout: Optional[float] = None) -> list:
        """Calls ColomemWorkerExtension.<method>(*args) on every vLLM worker; returns one result per worker.

        An error in the worker comes back as its colomem class (WeightCheckError, CudaOutOfMemoryError...).
        """
        t = self.rpc_timeout_s if timeout is None else float(timeout)
        results = self._call(lambda: self._llm.collective_rpc(method, args=tuple(args)), t, method)
        return [raise_if_error(r, method) for r in results]

    # ---------------------------------------------------------------------------------------- the guard
    def expect_version(self, version: int) -> None:
        """The trainer announces its newest weights; generate() refuses older ones from now on."""
        if int(version) < self._expected_version:
            raise InvalidArgumentError(f"announced version {version} is older than {self._expected_version}")
        self._expected_version = int(version)

    @property
    def expected_version(self) -> int:
        return self._expected_version

    def _require(self, phases: Sequence[str], what: str, hint: str) -> None:
        if self._phase == CLOSED:
            raise PoolClosedError(f"VLLMRollout is closed; cannot {what}")
        if self._phase not in phases:
            raise PhaseOrderError(f"{what} while vLLM is {self._phase!r}: {hint}")

    # ------------------------------------------------------------------------------------------- generate
    def generate(self, prompt_ids: list, *, n: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = 0, stop_token_ids: Optional[list] = None,
                 ignore_eos: bool = False, logprobs: bool = True) -> list:
        """Samples n completions per prompt. Returns list[list[Completion]] with vLLM's sampled-token logprobs.

        Prompt i uses seed + i (None: unseeded). Refuses (StaleWeightsError) when the weights are older
        than the version the trainer announced, or were discarded by a sleep and not synced since.
        """
        from colomem.grpo.batch import Completion

        self._require((AWAKE,), "generate", "call wake_weights(), load_weights(...) and wake_kv() first")
        if not self._weights_valid:
            raise StaleWeightsError(
                "vLLM's weights were discarded by a level-2 sleep and no sync wrote every parameter since: call "
                "load_weights(all named weights, version) before generating")
        if self.weight_version < self._expected_version:
            raise StaleWeightsError(
                f"vLLM holds weights version {self.weight_version} but the trainer announced version "
                f"{self._expected_version}: sync with load_weights(..., version={self._expected_version}) first")
        if not isinstance(prompt_ids, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(t, int) for t in p)
                for p in prompt_ids):
            raise InvalidArgumentError("prompt_ids must be a list of non-empty lists of token ids (ints)")
        if int(n) < 1 or int(max_new_tokens) < 1:
            raise InvalidArgumentError(f"n and max_new_tokens must be >= 1, got n={n}, "
                                       f"max_new_tokens={max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise InvalidArgumentError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        if not prompt_ids:
            return []
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=int(n), max_tokens=int(max_new_tokens), temperature=float(temperature),
                                 top_p=float(top_p), seed=None if seed is None else int(seed) + i,
                                 logprobs=0 if logprobs else None, detokenize=False,
                                 stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
                                 ignore_eos=bool(ignore_eos))
                  for i in range(len(prompt_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        kw = {"use_tqdm": False}
        if self._lora_request is not None:
            kw["lora_request"] = self._lora_request
        outs = self._call(lambda: self._llm.generate(prompts, params, **kw), self.generate_timeout_s, "generate")
        result = []
        for ro in outs:
            comps = []
            for c in sorted(ro.outputs, key=lambda c: c.index):
                finish = c.finish_reason
                if finish not in ("stop", "length"):
                    raise ColomemError(f"vLLM ended a completion with finish_reason={finish!r} (aborted?)")
                ids = list(c.token_ids)
                comps.append(Completion(ids, _sampled_logprobs(c, ids) if logprobs else None, finish))
            result.append(comps)
        return result

    # ---------------------------------------------------------------------------------------- sleep / wake
    def sleep(self) -> None:
        """Frees the GPU: KV cache dropped; weights kept in host memory (level 1 / pool) or dropped (level 2)."""
        self._require((AWAKE, WEIGHTS_ONLY), "sleep", "vLLM is already asleep")
        t0 = time.perf_counter()
        keep = self._weights_valid and (self._weights_backup == "pool" or self._sleep_level == 1)
        if keep and not any(self._expected):
            self._snapshot("before sleep")  # what check() must find after the wake
        if self._weights_backup == "pool":
            r = self.rpc("colomem_save_weights_to_pool", self.wake_timeout_s, timeout=self.wake_timeout_s)
            self.timings["pool_save_s"] = max(x["seconds"] for x in r)
            self.timings["pool_bytes"] = max(x["nbytes"] for x in r)
            level = 2
        else:
            level = self._sleep_level
        self._call(lambda: self._llm.sleep(level=level), self.wake_timeout_s, f"sleep(level={level})")
        self._phase = ASLEEP
        self._slept_with = (level, self._weights_backup)
        if level == 2 and self._weights_backup != "pool":
            self._weights_valid = False
            self._expected = []
        self.timings["sleep_s"] = time.perf_counter() - t0

    def wake_weights(self, restore: Optional[bool] = None) -> None:
        """Maps the weights again (KV cache stays asleep, so old weights, new weights and KV never coexist).

        With weights_backup="pool" the saved bytes are copied back unless restore=False (a full sync follows).
        """
        self._require((ASLEEP,), "wake_weights", "call sleep() first")
        t0 = time.perf_counter()
        self._wake(("weights",))
        self._phase = WEIGHTS_ONLY
        level, backup = getattr(self, "_slept_with", (self._sleep_level, self._weights_backup))
        if backup == "pool":
            if restore is None or restore:
                r = self.rpc("colomem_restore_weights_from_pool", self.wake_timeout_s, timeout=self.wake_timeout_s)
                self.timings["pool_restore_s"] = max(x["seconds"] for x in r)
            else:
                self._weights_valid = False
                self._expected = []
        if self._lora_request is not None:
            self._register_adapter(self._lora_dir, self.weight_version)
        self.timings["wake_weights_s"] = time.perf_counter() - t0

    def wake_kv(self) -> None:
        """Maps the KV cache again; vLLM can generate after this."""
        self._require((WEIGHTS_ONLY,), "wake_kv", "call wake_weights() (and sync) first")
        t0 = time.perf_counter()
        self._wake(("kv_cache",))
        self._phase = AWAKE
        self.timings["wake_kv_s"] = time.perf_counter() - t0

    def wake(self) -> None:
        """wake_weights() then wake_kv(), for when no sync happens in between."""
        self.wake_weights()
        self.wake_kv()

    def _wake(self, tags: tuple) -> None:
        need = sum(self._tag_bytes.get(t, 0) for t in tags)
        free = self._free_bytes()
        if need and free is not None and free < need + _WAKE_MARGIN:
            raise CudaOutOfMemoryError(self._oom_message(tags, need, free, "before waking (vLLM still asleep)"))
        try:
            self._call(lambda: self._llm.wake_up(tags=list(tags)), self.wake_timeout_s, f"wake_up({list(tags)})")
        except (TransferTimeoutError, PeerError):
            raise
        except Exception as exc:
            if not _is_oom(exc):
                raise
            keep = tags == ("weights",) and getattr(self, "_slept_with", (1, "vllm")) == (1, "vllm")
            try:
                self.rpc("colomem_rollback_wake", list(tags), keep, timeout=self.wake_timeout_s)
            except ColomemError as rb:
                log.error("rolling back the partial wake failed: %s", rb)
            raise CudaOutOfMemoryError(self._oom_message(tags, need, self._free_bytes(),
                                                         "vLLM was put back to sleep")) from exc

    def _oom_message(self, tags, need, free, state) -> str:
        what = "weights" if "weights" in tags else "KV cache"
        knobs = ("offload more of the trainer first (it must be offloaded before the wake) or use a smaller "
                 "model/tensor_parallel_size" if what == "weights" else
                 "lower gpu_memory_utilization (--gpu-memory-utilization) or max_model_len (--max-model-len), "
                 "or offload more of the trainer (smaller micro-batch)")
        free_s = "unknown" if free is None else format_bytes(free)
        return (f"waking vLLM's {what} needs {format_bytes(need)} but {free_s} is free on cuda:{self.device}; "
                f"{state}. To fit: {knobs}.")

    def _free_bytes(self) -> Optional[int]:
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(self.device)[0])

    def _refresh_tag_bytes(self) -> None:
        try:
            r = self.rpc("colomem_memory")
            self._tag_bytes = dict(r[0].get("cumem_bytes_by_tag", {})) if r else {}
        except ColomemError as exc:
            log.warning("could not read vLLM's memory layout: %s", exc)
            self._tag_bytes = {}

    # -------------------------------------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Iterable, version: int) -> SyncStats:
        """Sends the trainer's (name, tensor) pairs (HF names, GPU tensors) to vLLM as weights `version`.

        In lora_mode="adapter", names with lora_A/lora_B go to vLLM's LoRA manager; the rest are base weights.
        """
        self._require((WEIGHTS_ONLY, AWAKE), "load_weights", "call wake_weights() first (KV may stay asleep)")
        version = int(version)
        if version < self.weight_version:
            raise InvalidArgumentError(f"version {version} is older than the weights vLLM holds "
                                       f"({self.weight_version}); versions never go backwards")
        adapter: list = []
        items: Iterable = named_tensors
        if self.lora_mode == "adapter":
            items, adapter = self._split_adapter(named_tensors)
        stats = SyncStats(version=version)
        sampled: dict = {}
        t0 = time.perf_counter()
        snapshots: list = []
        if self.lora_mode != "adapter" or items:
            stats = self._sync_base(items, version, sampled, snapshots)
        if adapter:
            ta = time.perf_counter()
            self._load_adapter(adapter, version)
            stats.adapter_tensors = len(adapter)
            stats.adapter_seconds = time.perf_counter() - ta
        if stats.ntensors == 0 and not adapter:
            raise InvalidArgumentError("load_weights got no tensors")
        if stats.ntensors and not self._weights_valid and not stats.complete:
            what = (f"{stats.nmissing} parameters missing, e.g. {list(stats.missing[:4])}"
                    if stats.complete is False else "vLLM's load_weights did not say which it wrote")
            raise WeightCheckError(
                f"vLLM's weights were discarded by a level-2 sleep but version {version} may not have written "
                f"all of them ({what}); send every parameter after such a sleep, or sleep with sleep_level=1 / "
                f"weights_backup='pool'")
        if stats.ntensors:
            self._weights_valid = True
            # what check() must find: the trainer's bytes for unfused names, the worker's right after the sync
            self._expected = [{**snap, **sampled} for snap in snapshots] or [dict(sampled)]
            self._expected_from = f"version {version}"
        self.weight_version = version
        self._expected_version = max(self._expected_version, version)
        stats.seconds = time.perf_counter() - t0
        self.last_sync = stats
        return stats

    def _ensure_bridge(self):
        if self._bridge is None:
            if int(self.llm_kwargs.get("tensor_parallel_size", 1)) > 1:
                raise InvalidArgumentError(
                    "the weight bridge maps the trainer's buffers on one GPU, but with tensor_parallel_size > 1 "
                    "vLLM's workers sit on several; sync with tensor_parallel_size=1 (one engine per GPU)")
            bridge = self._make_bridge()
            try:
                self.rpc("colomem_attach", bridge.address, 30.0, self.verify, self.check_sample, self.fast_load,
                         timeout=max(60.0, self.rpc_timeout_s))
                if self.sync_transport == "listener":
                    self.rpc("colomem_listen", self.rpc_timeout_s)
            except BaseException:
                bridge.close()
                raise
            self._bridge = bridge
        return self._bridge

    def set_bucket_bytes(self, bucket_bytes: Any, buffers: Optional[int] = None) -> None:
        """Re-creates the bridge with another bucket size (the worker re-attaches on the next sync)."""
        self.bucket_bytes = parse_bytes(bucket_bytes)
        if buffers is not None:
            self.bucket_buffers = int(buffers)
        self._close_bridge()

    def _close_bridge(self) -> None:
        if self._bridge is not None:
            try:
                self.rpc("colomem_detach", timeout=10.0)
            except ColomemError as exc:
                log.warning("detaching vLLM's worker from the bridge failed: %s", exc)
            finally:
                bridge, self._bridge = self._bridge, None
                bridge.close()

    def _direct_names(self) -> dict:
        """vLLM parameter names that equal an HF name with the same shape (checkable against the trainer)."""
        if self._param_info is None:
            self._param_info = self.rpc("colomem_param_info")[0]
        return self._param_info

    def _sync_base(self, items: Iterable, version: int, sampled: dict, snapshots: list) -> SyncStats:
        bridge = self._ensure_bridge() if self.sync_transport != "direct" else None
        info = self._direct_names()
        stats = SyncStats(version=version)
        k = self.check_sample
        pending: dict = {}

        def watched() -> Iterator:
            for name, t in items:
                if not isinstance(t, torch.Tensor):
                    raise InvalidArgumentError(f"{name!r} is a {type(t).__name__}, not a tensor")
                if len(pending) < k and hashed_pick(name) and _same_layout(t, info.get(name)):
                    pending[name] = checksum_parts(t)  # queued: no wait inside the pack pipeline
                stats.ntensors += 1
                stats.nbytes += t.numel() * t.element_size()
                yield name, t

        t0 = time.perf_counter()
        if self.sync_transport == "rpc":
            acks = self._sync_per_bucket_rpc(bridge, watched(), version, stats)  # sums apply time per bucket
        else:
            if self.sync_transport == "direct":
                acks = self.rpc("colomem_load_direct", list(watched()), version)
            else:
                over = self._sync_to_listener if self.sync_transport == "listener" else self._sync_over_socket
                acks = over(bridge, watched(), version, stats)
                stats.nbuckets = bridge.last_stats.messages if bridge.last_stats else 0
            stats.apply_seconds = max(float(a.get("total_apply_ms", 0.0)) for a in acks) / 1e3 if acks else 0.0
        sampled.update(finish_checksums(pending))
        stats.seconds = time.perf_counter() - t0
        if acks:
            flags = [a.get("complete") for a in acks]
            stats.complete = None if None in flags else all(flags)
            stats.nmissing = max(int(a.get("nmissing", 0)) for a in acks)
            stats.missing = tuple(acks[0].get("missing", ()))
            snapshots.extend(dict(a.get("snapshot", {})) for a in acks)
            stats.replayed_tensors = min(int(a.get("replayed_tensors", 0)) for a in acks)
        return stats

    def _next_tag(self, version: int) -> str:
        """A name for this sync that no earlier one had (each side skips leftovers of failed syncs by it)."""
        self._syncs += 1
        return f"{os.getpid()}.{version}.{self._syncs}"

    def _sync_to_listener(self, bridge, items: Iterator, version: int, stats: SyncStats) -> list:
        """No RPC: the worker's listener thread takes the buckets from the socket; its report comes with the
        last ACK. A worker that refuses a bucket fails the sync with its error text (PeerError)."""
        self._collect_receive()
        tag = self._next_tag(version)
        t0 = time.perf_counter()
        try:
            bridge.sync(items, version=version, send=None, timeout=self.rpc_timeout_s, tag=tag)
        except (PeerError, TransferTimeoutError) as exc:
            self._raise_if_listener_stopped(exc)
            raise
        stats.bridge_seconds = time.perf_counter() - t0
        reports = bridge.last_reports
        if not reports or not all(isinstance(r, dict) and "total_tensors" in r for r in reports):
            raise PeerError("the worker's bridge listener acknowledged the last bucket without its report; "
                            "producer and worker colomem versions differ?")
        return reports

    def _raise_if_listener_stopped(self, exc: BaseException) -> None:
        """After a failed listener sync: when a worker's listener has stopped, raise its reason (the next
        sync attaches again and starts a new listener); otherwise return (the sync's own error stands)."""
        try:
            states = self.rpc("colomem_listener_state", timeout=min(30.0, self.rpc_timeout_s))
        except Exception as ask:  # noqa: BLE001 - the sync's own error is the one to report
            log.debug("asking vLLM's worker about its bridge listener failed: %s", ask)
            return
        stopped = [s for s in states if isinstance(s, dict) and not s.get("listening")]
        if stopped:
            self._close_bridge()
            why = "; ".join(str(s.get("error") or "no error recorded") for s in stopped)
            raise PeerError(f"the bridge listener in vLLM's worker stopped ({why}); this sync failed, the next "
                            f"one attaches again and starts a new listener") from exc

    def _sync_over_socket(self, bridge, items: Iterator, version: int, stats: SyncStats) -> list:
        """One collective_rpc for the whole version: every worker receives the buckets over the bridge socket
        and ACKs each there, while this thread packs (the RPC runs on the engine-call thread)."""
        tag = self._next_tag(version)
        t = self.rpc_timeout_s
        fut = self._start(lambda: self._llm.collective_rpc("colomem_receive", args=(tag, t)), "colomem_receive")
        t0 = time.perf_counter()
        try:
            bridge.sync(items, version=version, send=None, timeout=t, tag=tag)
            stats.bridge_seconds = time.perf_counter() - t0
        except BaseException as exc:
            # The workers were told (an abort on the socket) or refused themselves: their RPC ends at once.
            # A worker's own error says more than "refused", so it is the one raised.
            try:
                results = self._await(fut, t, "colomem_receive after a failed sync")
            except Exception as late:  # noqa: BLE001 - the sync's own error is the one to report
                log.debug("colomem_receive after a failed sync: %s", late)
                raise exc
            if isinstance(exc, PeerError):  # the workers refused: their error is the cause
                for r in results:
                    raise_if_error(r, "colomem_receive")
            raise
        reports = bridge.last_reports
        if reports and all(isinstance(r, dict) and "total_tensors" in r for r in reports):
            # Every worker's last ACK carried its report and came after its copies finished: the weights are
            # in place. The RPC's return is collected by the next engine call (_collect_receive).
            self._receiving = fut
            return reports
        t1 = time.perf_counter()
        acks = [raise_if_error(r, "colomem_receive") for r in self._await(fut, t, "colomem_receive")]
        stats.rpc_wait_seconds = time.perf_counter() - t1
        return acks

    def _sync_per_bucket_rpc(self, bridge, items: Iterator, version: int, stats: SyncStats) -> list:
        acks: list = []
        # Resuming the generator is the ACK (the bridge refills that buffer), so it resumes only after the
        # worker's load_weights finished; the bridge packs the next bucket meanwhile.
        messages = bridge.publish(items, version=version)
        try:
            for msg in messages:
                acks = self.rpc("colomem_apply", msg.to_dict())
                stats.nbuckets += 1
                stats.apply_seconds += max(a.get("apply_ms", 0.0) for a in acks) / 1e3
        finally:
            messages.close()  # an error midway: let in-flight packs finish, free the bridge for the next sync
        return acks

    def _snapshot(self, why: str) -> None:
        """Records checksums of a spread sample of vLLM's parameters (per worker) for check() to find again."""
        self._expected = [r["checksums"] for r in self.rpc("colomem_param_checksums", None, self.check_sample)]
        self._expected_from = why

    def check(self, reference: Optional[Iterable] = None) -> None:
        """Cheap post-wake / post-sync check: checksums of sampled parameters against what they must be.

        Without `reference`: the trainer's tensors recorded at the last sync (direct names) plus a sample
        taken right after it (or before the last sleep). With `reference` (HF (name, tensor) pairs): those
        tensors, for the names vLLM holds unfused. Raises WeightCheckError on any difference.
        """
        self._require((WEIGHTS_ONLY, AWAKE), "check", "call wake_weights() first")
        if not self._weights_valid:
            raise WeightCheckError("vLLM's weights were discarded by a level-2 sleep and not synced since; "
                                   "call load_weights(...) with every parameter")
        if reference is not None:
            info = self._direct_names()
            expected = {n: tensor_checksum(t) for n, t in reference if _same_layout(t, info.get(n))}
            if not expected:
                raise InvalidArgumentError("no reference tensor matches a vLLM parameter's name, shape and dtype")
            source = "the reference tensors"
            per_rank = None
        else:
            per_rank, source = [dict(e) for e in self._expected], self._expected_from
            if not any(per_rank):
                return
            expected = per_rank[0]
        names = sorted(set().union(*per_rank) if per_rank else expected)
        for rank, got in enumerate(self.rpc("colomem_param_checksums", names, 0)):
            want = per_rank[rank] if per_rank and rank < len(per_rank) else expected
            bad = [n for n, c in got["checksums"].items() if n in want and c != want[n]]
            if bad:
                raise WeightCheckError(
                    f"{len(bad)} of {len(want)} sampled vLLM parameters on worker {rank} differ from {source} "
                    f"(e.g. {bad[:3]}); the weights are not what they must be: sync them again "
                    f"(load_weights) before generating")

    # ---------------------------------------------------------------------------------------------- LoRA
    def _split_adapter(self, named_tensors: Iterable):
        base, adapter = [], []
        for name, t in named_tensors:
            if is_lora_name(name):
                adapter.append((peft_adapter_name(name), t))
            else:
                base.append((hf_base_name(name), t))
        return base, adapter

    def _load_adapter(self, adapter: list, version: int) -> None:
        from safetensors.torch import save_file

        d = tempfile.mkdtemp(prefix=f"colomem-lora-v{version}-", dir=_shm_dir())
        try:
            save_file({n: t.detach().to("cpu").contiguous() for n, t in adapter},
                      os.path.join(d, "adapter_model.safetensors"))
            cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(_lora_attr(self.lora, "r")),
                   "lora_alpha": _lora_attr(self.lora, "alpha", "lora_alpha"),
                   "target_modules": list(_lora_attr(self.lora, "target_modules", default=[])),
                   "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False}
            with open(os.path.join(d, "adapter_config.json"), "w") as f:
                json.dump(cfg, f)
            self._register_adapter(d, version)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise

    def _register_adapter(self, d: str, version: int) -> None:
        """Adds the adapter in `d` under a fresh id (so no cached copy is reused) and drops the previous one."""
        from vllm.lora.request import LoRARequest

        lid = self._lora_next_id
        self._lora_next_id += 1
        req = LoRARequest(lora_name=f"colomem-v{version}-{lid}", lora_int_id=lid, lora_path=d)
        self._call(lambda: self._llm.llm_engine.add_lora(req), self.rpc_timeout_s, "add_lora")
        old, old_dir = self._lora_request, self._lora_dir
        self._lora_request, self._lora_dir = req, d
        if old is not None:
            try:
                self._call(lambda: self._llm.llm_engine.remove_lora(old.lora_int_id), self.rpc_timeout_s,
                           "remove_lora")
            except ColomemError:
                raise
            except Exception as exc:  # noqa: BLE001  (already evicted by the LRU of one slot)
                log.debug("remove_lora(%s): %s", old.lora_int_id, exc)
            if old_dir and old_dir != d:
                shutil.rmtree(old_dir, ignore_errors=True)

    # -------------------------------------------------------------------------------------------- report
    def memory(self) -> dict:
        """Free/total GPU memory seen from this process (mem_get_info) and what vLLM's workers hold."""
        out: dict = {"phase": self._phase, "weight_version": self.weight_version}
        if torch.cuda.is_available():
            f, t = torch.cuda.mem_get_info(self.device)
            out.update(free_bytes=int(f), total_bytes=int(t), used_bytes=int(t - f))
        if self._phase != CLOSED and not self._broken:
            out["workers"] = self.rpc("colomem_memory")
        return out

    # --------------------------------------------------------------------------------------------- close
    def _engine_pids(self) -> list:
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        mgr = getattr(getattr(core, "resources", None), "engine_manager", None)
        return [p.pid for p in getattr(mgr, "processes", []) or [] if getattr(p, "pid", None)]

    def close(self, timeout: Optional[float] = None) -> None:
        """Shuts vLLM down within `timeout` seconds (default shutdown_timeout_s), killing it if it must."""
        if self._phase == CLOSED:
            return
        timeout = self.shutdown_timeout_s if timeout is None else float(timeout)
        pids = _with_children(self._pids)
        fut, self._receiving = self._receiving, None
        if fut is not None and not self._broken:
            try:
                fut.result(timeout=min(10.0, timeout))
            except Exception as exc:  # noqa: BLE001 - closing goes on
                log.warning("the last colomem_receive ended with %s", exc)
        try:
            # The worker's bridge mapping and pool backup go now; an in-process worker outlives the engine.
            if (self._bridge is not None or self.engine_in_process or self.weights_backup == "pool") \
                    and not self._broken:
                try:
                    self.rpc("colomem_close", timeout=min(10.0, timeout))
                except ColomemError as exc:
                    log.warning("colomem_close in vLLM's worker failed: %s", exc)
            if self._bridge is not None:
                bridge, self._bridge = self._bridge, None
                try:
                    bridge.close()
                except Exception as exc:  # noqa: BLE001  (closing must go on)
                    log.warning("closing the weight bridge failed: %s", exc)
        finally:
            self._phase = CLOSED
            llm, self._llm = self._llm, None
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                t = threading.Thread(target=_quiet(core.shutdown), args=(timeout,), daemon=True,
                                     name="colomem-vllm-shutdown")
                t.start()
                t.join(timeout + 2.0)
            _kill(pids)
            self._calls.stop()
            if self._lora_dir:
                shutil.rmtree(self._lora_dir, ignore_errors=True)
                self._lora_dir = None
            del llm, core
            gc.collect()

    def __enter__(self) -> "VLLMRollout":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------- helpers
def _same_layout(t: torch.Tensor, info: Optional[list]) -> bool:
    """The trainer's tensor has the bytes layout of vLLM's parameter (same shape and dtype: unfused, unsharded)."""
    return info is not None and list(t.shape) == list(info[0]) and dtype_name(t.dtype) == info[1]


def _sampled_logprobs(c, ids: list) -> list:
    lps = c.logprobs
    if lps is None:
        return [float("nan")] * len(ids)
    if hasattr(lps, "start_indices"):  # FlatLogprobs
        out = []
        for i, tok in enumerate(ids):
            lo, hi = lps.start_indices[i], lps.end_indices[i]
            vals = [lps.logprobs[j] for j in range(lo, hi) if lps.token_ids[j] == tok]
            out.append(float(vals[0]) if vals else float("nan"))
        return out
    out = []
    for i, tok in enumerate(ids):
        pos = lps[i] if i < len(lps) else None
        lp = pos.get(tok) if pos else None
        out.append(float(lp.logprob) if lp is not None else float("nan"))
    return out


def _shm_dir() -> Optional[str]:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else None


def _quiet(fn: Callable) -> Callable:
    def run(*a):
        try:
            fn(*a)
        except Exception as exc:  # noqa: BLE001  (shutdown of a dying engine may raise; we kill it next)
            log.debug("vLLM shutdown: %s", exc)
    return run


def _with_children(pids: list) -> list:
    try:
        import psutil
    except ImportError:
        return list(pids)
    out = []
    for pid in pids:
        try:
            out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except Exception:  # noqa: BLE001  (already gone)
            pass
        out.append(pid)
    return out


def _kill(pids: list) -> None:
    """SIGKILL what is still alive among the engine processes this adapter started."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except OSError:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            log.warning("killed vLLM process %d that did not exit in time", pid)
        except OSError:
            pass


__all__ = ["VLLMRollout", "WORKER_EXTENSION", "hf_base_name", "is_lora_name", "peft_adapter_name"]
