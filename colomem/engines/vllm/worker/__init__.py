"""The colomem side of vLLM's worker process: weight sync through the bridge, checksums, the pool backup.

vLLM runs the model in its own process (the EngineCore, or one worker per rank with tensor parallelism), so
weights must cross processes. `ColomemWorkerExtension` is mixed into vLLM's `Worker` by naming it in
`LLM(worker_extension_cls="colomem.engines.vllm_worker.ColomemWorkerExtension")`; the parent calls its
methods with `llm.collective_rpc("colomem_<method>", args=...)`. Arguments and returns are plain dicts,
lists, ints and strings, because collective_rpc serialises them with msgpack.

A colomem error raised here would reach the parent as a bare `Exception(message)`, so every RPC method
returns `{"error": <class name>, "message": ...}` instead and the parent re-raises the right class.

Importing this module does not import vLLM; only the methods that need vLLM's internals do.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from colomem import errors as _errors
from colomem._bucket import dtype_name
from colomem.errors import (
    ColomemError,
    InvalidArgumentError,
    PeerError,
    TransferTimeoutError,
    WeightCheckError,
)

log = logging.getLogger(__name__)

# Words (4 bytes) read per tensor by tensor_checksum: enough to catch garbage, cheap on a 7B model.
CHECKSUM_SAMPLE_WORDS = 1 << 16
DEFAULT_COPY_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------------------------- checksums
def _byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    try:
        return flat.view(torch.uint8)
    except RuntimeError:  # a view at an offset the dtype reinterpretation refuses: copy once
        return flat.clone().view(torch.uint8)


def checksum_parts(t: torch.Tensor, sample_words: int = CHECKSUM_SAMPLE_WORDS) -> tuple:
    """tensor_checksum without waiting for the device: (an int64 tensor [acc, tail] on t's device, byte
    count), queued on the current stream; finish_checksum turns it into the number. Many of them cost one
    device-to-host copy (finish_checksums) instead of a wait each."""
    b = _byte_view(t)
    n = b.numel()
    nw = n // 4
    zero = torch.zeros((), dtype=torch.int64, device=b.device)
    acc = zero
    if nw:
        w = b[: nw * 4]
        try:
            w = w.view(torch.int32)
        except RuntimeError:
            w = w.clone().view(torch.int32)
        step = max(1, -(-nw // max(1, sample_words)))
        s = w[::step].to(torch.int64)
        pos = torch.arange(1, s.numel() + 1, device=s.device, dtype=torch.int64)
        acc = (s * pos).sum()  # |s| < 2**31, pos <= 2**16 per default: no int64 overflow
    tail = b[nw * 4:].to(torch.int64).sum() if n % 4 else zero
    return torch.stack([acc, tail]), n


def finish_checksum(parts, n: int) -> int:
    acc, tail = (int(v) for v in parts)
    return (acc * 1_000_003 + tail * 31 + n) & ((1 << 63) - 1)


def finish_checksums(pending: dict) -> dict:
    """{name: checksum} from {name: checksum_parts(...)}, with one copy to the host."""
    if not pending:
        return {}
    values = torch.stack([p for p, _ in pending.values()]).cpu().tolist()
    return {name: finish_checksum(v, n) for (name, (_, n)), v in zip(pending.items(), values)}


def tensor_checksum(t: torch.Tensor, sample_words: int = CHECKSUM_SAMPLE_WORDS) -> int:
    """A position-weighted sum of up to `sample_words` evenly spaced 32-bit words of the tensor's bytes.

    Integer arithmetic only, so the trainer process and vLLM's worker get the same number for the same
    bytes whatever the reduction order. It samples: equal checksums do not prove equal tensors, but weights
    that were never restored, zeroed, or loaded into the wrong place differ.
    """
    parts, n = checksum_parts(t, sample_words)
    return finish_checksum(parts.tolist(), n)


def spread_sample(names: Iterable[str], k: int) -> list[str]:
    """A deterministic sample of about k names spread over the list (stable across processes)."""
    names = sorted(names)
    if k <= 0 or not names:
        return []
    if len(names) <= k:
        return names
    step = len(names) / k
    return [names[int(i * step)] for i in range(k)]


def hashed_pick(name: str, modulus: int = 4) -> bool:
    """True for about 1/modulus of names, the same ones in every process."""
    return zlib.crc32(name.encode()) % modulus == 0


# ------------------------------------------------------------------------------------------- RPC plumbing
def _error_dict(exc: BaseException) -> dict:
    name = type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        name = "CudaOutOfMemoryError"
    elif not isinstance(exc, ColomemError):
        name = "PeerError"
    return {"error": name, "message": f"{type(exc).__name__}: {exc}"}


def _rpc(fn: Callable) -> Callable:
    """Runs an RPC method and turns any exception into an error dict the parent re-raises as its class."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (the parent re-raises it; nothing is swallowed)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return _error_dict(exc)

    return wrapper


def raise_if_error(result: Any, what: str) -> Any:
    """Parent side: re-raise an error dict returned by an RPC method as the colomem class it names."""
    if isinstance(result, dict) and "error" in result and "message" in result:
        cls = getattr(_errors, str(result["error"]), None)
        if not (isinstance(cls, type) and issubclass(cls, ColomemError)):
            cls = PeerError
        raise cls(f"{what} failed in vLLM's worker: {result['message']}")
    return result


# --------------------------------------------------------------------------------------------- the state
@dataclass
class _SyncState:
    version: int = -1
    next_seq: int = 0
    loaded: set = field(default_factory=set)
    ntensors: int = 0
    nbytes: int = 0
    apply_s: float = 0.0
    layerwise: bool = False
    replayed: int = 0


@dataclass
class _PoolBackup:
    pool: Any = None
    blocks: list = field(default_factory=list)          # Block per saved allocation, kept between cycles
    layout: list = field(default_factory=list)          # [(device address, nbytes)] they were saved from
    saved: bool = False
    save_s: float = 0.0
    restore_s: float = 0.0


@dataclass
class _WorkerState:
    importer: Any = None
    address: Optional[str] = None
    verify: str = "sampled"
    snapshot_k: int = 8
    fast_load: bool = True                               # replay recorded load_weights copies (load_plan)
    plan: Any = None                                     # LoadPlan of the model, made at the first sync
    sync: _SyncState = field(default_factory=_SyncState)
    backup: _PoolBackup = field(default_factory=_PoolBackup)
    last_ack: dict = field(default_factory=dict)
    listener: Any = None                                 # _Listener while the bridge is served by a thread


class _Listener:
    """A daemon thread in vLLM's worker process that waits on the bridge socket and applies each version as
    it arrives (sync_transport='listener'): the trainer's sync needs no collective_rpc, so it does not wait
    for vLLM's engine process to deliver one. It polls a stop flag between versions; it ends when the
    trainer closes the bridge or dies (the error is kept in `error`)."""

    POLL_S = 0.2

    def __init__(self, worker, st: "_WorkerState", bucket_timeout: float):
        self._worker, self._st, self._timeout = worker, st, bucket_timeout
        self._stop = threading.Event()
        self.error: Optional[str] = None
        self.versions = 0
        self._thread = threading.Thread(target=self._run, name="colomem-bridge-listener", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the bridge listener did not stop within %.0f s (a version in flight?)", timeout)

    def _fail(self, exc: BaseException) -> None:
        """Stops serving for good: keeps why, and closes the bridge connection so the trainer's next sync
        fails at once (PeerError) instead of waiting out its timeout for ACKs nobody will send."""
        self.error = f"{type(exc).__name__}: {exc}"
        log.error("bridge listener stopped: %s", self.error)
        try:
            self._st.importer.close()
        except Exception as close_exc:  # noqa: BLE001 - already failing; the error above is the one kept
            log.warning("bridge listener: closing the importer failed: %s", close_exc)

    def state(self) -> dict:
        return {"listening": self.alive, "versions": self.versions, "error": self.error}

    def _run(self) -> None:
        device = self._worker._colomem_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's copies go to the worker's GPU
        imp = self._st.importer
        while not self._stop.is_set():
            try:
                first = imp.receive(self.POLL_S)
            except TransferTimeoutError:
                continue
            except PeerError as exc:
                if getattr(exc, "kind", None) == "abort":
                    continue  # a version abandoned before its first bucket came
                if getattr(exc, "kind", None) != "closed":
                    self._fail(exc)
                return
            except Exception as exc:  # noqa: BLE001 - e.g. the importer closed under us: stop, remember why
                self._fail(exc)
                return
            try:
                self._worker._colomem_serve(imp.messages(self._timeout, first.get("tag"), first=first))
                self.versions += 1
            except Exception as exc:  # noqa: BLE001 - the trainer got the refusal; keep serving
                log.warning("bridge listener: version %s failed: %s", first.get("version"), exc)
                if getattr(exc, "kind", None) == "closed":
                    return


def _torch_device(worker) -> torch.device:
    dev = getattr(worker, "device", None)
    if isinstance(dev, torch.device):
        return dev
    if dev is not None:
        return torch.device(dev)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------ the worker extension
class ColomemWorkerExtension:
    """Mixed into vLLM's Worker (`worker_extension_cls`). Every public name starts with `colomem_`, so
    nothing collides with the Worker's own attributes (vLLM asserts that)."""

    # -- helpers (overridable in tests: a fake worker supplies model_runner/device) ------------------------
    def _colomem(self) -> _WorkerState:
        st = self.__dict__.get("_colomem_state")
        if st is None:
            st = _WorkerState()
            self.__dict__["_colomem_state"] = st
        return st

    def _colomem_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def _colomem_device(self) -> torch.device:
        return _torch_device(self)

    def _colomem_param_names(self) -> set:
        return {n for n, _ in self._colomem_model().named_parameters()}

    def _colomem_device_uuid(self) -> str:
        from colomem import _C

        return _C.device_uuid(self._colomem_device().index)

    def _colomem_pick_address(self, address) -> str:
        """A bridge address, or {GPU UUID: address} (tensor parallel: one trainer bridge per GPU, each worker
        maps the one on its own GPU, whatever CUDA_VISIBLE_DEVICES numbers it)."""
        if isinstance(address, str):
            return address
        if not isinstance(address, dict) or not address:
            raise InvalidArgumentError(f"address must be a socket path or a {{GPU UUID: path}} dict, got {address!r}")
        mine = self._colomem_device_uuid()
        for uuid, path in address.items():
            if str(uuid).lower() == str(mine).lower():
                return str(path)
        raise PeerError(f"no trainer bridge on this worker's GPU {mine} (rank {getattr(self, 'rank', '?')}); the "
                        f"trainer offered {sorted(address)}: every GPU of the engine needs a trainer rank")

    def _colomem_connect(self, address: str, timeout: float):
        from colomem.bridge import BridgeImporter

        return BridgeImporter.connect(address, timeout=timeout)

    def _colomem_weight_allocations(self) -> list:
        """[(device address, nbytes)] of every allocation vLLM tagged "weights" (params, buffers, LoRA slots).

        These are the exact ranges vLLM's own level-1 sleep backs up; copying them whole restores everything
        a level-2 sleep discards, including tensors that are not parameters.
        """
        from vllm.device_allocator.cumem import CuMemAllocator

        alloc = CuMemAllocator.get_instance()
        out = []
        for ptr, data in sorted(alloc.pointer_to_data.items()):
            if data.tag == "weights":
                out.append((int(ptr), int(data.handle[1])))
        return out

    # -- bridge -----------------------------------------------------------------------------------------
    @_rpc
    def colomem_attach(self, address: Any, timeout: float = 30.0, verify: str = "sampled",
                       snapshot_k: int = 8, fast_load: bool = True) -> dict:
        """Connects to the trainer's WeightBridge at `address` (a Unix socket path, or {GPU UUID: path} with
        one bridge per GPU of a tensor-parallel engine) and maps its buffers.

        snapshot_k: the ACK of a version's last bucket carries checksums of this many parameters, the
        state later checks compare against. fast_load: record what the model's load_weights copies at the
        first sync and replay those copies afterwards (colomem.engines.load_plan); False always calls
        load_weights.
        """
        if verify not in ("none", "sampled", "full"):
            raise InvalidArgumentError(f"verify must be 'none', 'sampled' or 'full', got {verify!r}")
        st = self._colomem()
        self._colomem_drop_importer(st)
        address = self._colomem_pick_address(address)
        st.importer = self._colomem_connect(address, float(timeout))
        st.address = address
        st.verify = verify
        st.snapshot_k = int(snapshot_k)
        st.fast_load = bool(fast_load)
        st.sync = _SyncState()
        dev = self._colomem_device()
        return {"pid": os.getpid(), "rank": int(getattr(self, "rank", 0)), "device": str(dev)}

    @staticmethod
    def _colomem_drop_importer(st) -> None:
        if st.listener is not None:
            listener, st.listener = st.listener, None
            listener.stop()
        st.plan = None
        if st.importer is not None:
            try:
                st.importer.close()
            finally:
                st.importer = None

    @_rpc
    def colomem_ping(self) -> dict:
        """Does nothing: what one collective_rpc round trip costs (runners/bench_sync.py times it)."""
        return {"pid": os.getpid()}

    @_rpc
    def colomem_detach(self) -> dict:
        st = self._colomem()
        self._colomem_drop_importer(st)
        st.address = None
        return {"detached": True}

    @_rpc
    def colomem_apply(self, msg: dict) -> dict:
        """Loads one bucket (the callable transport: one RPC per bucket). Returns the ACK only after the
        copies out of the buffer finished, so the trainer may refill it. The last bucket of a version also
        reports which parameters the version did not touch."""
        self._colomem_no_listener(self._colomem(), "colomem_apply")
        return self._colomem_apply(msg)

    @_rpc
    def colomem_receive(self, tag: Optional[str] = None, timeout: float = 60.0) -> dict:
        """Loads one whole version sent over the bridge socket (WeightBridge.sync(send=None, tag=tag)): one
        RPC per sync instead of one per bucket. Each bucket is ACKed over the socket once applied; returns
        the last bucket's ACK (coverage, snapshot, totals). Waits at most `timeout` s for each bucket; a
        trainer that died or abandoned the version is a PeerError, not a hang."""
        st = self._colomem_attached()
        self._colomem_no_listener(st, "colomem_receive")
        return self._colomem_serve(st.importer.messages(float(timeout), tag))

    def _colomem_serve(self, messages) -> dict:
        """Applies one version from a BridgeImporter.messages() generator; the last bucket's ACK carries the
        version's report, which is also returned."""
        ack: dict = {}
        msg = next(messages)
        while True:
            try:
                ack = self._colomem_apply(msg)
            except BaseException as exc:
                messages.throw(exc)  # refuses the bucket with this error's text, then raises it here
            try:  # the last bucket's ACK carries the version's report: the trainer need not wait for an RPC
                msg = messages.send(ack if msg.get("last") else None)
            except StopIteration:
                return ack

    def _colomem_attached(self) -> _WorkerState:
        """The worker's state, with a bridge attached (PeerError if none is)."""
        st = self._colomem()
        if st.importer is None:
            raise PeerError("no bridge attached in this worker; the adapter must call colomem_attach first")
        return st

    def _colomem_start_version(self, st: _WorkerState, version: int) -> _SyncState:
        """A new version's sync state (vLLM's layerwise reload begun when the model needs it)."""
        sync = st.sync = _SyncState(version=int(version))
        sync.layerwise = self._colomem_layerwise()
        if sync.layerwise:
            self._colomem_layerwise_begin()
        return sync

    @staticmethod
    def _colomem_no_listener(st, what: str) -> None:
        if st.listener is not None and st.listener.alive:
            raise InvalidArgumentError(f"{what}: a listener thread serves this bridge (sync_transport="
                                       f"'listener'); the trainer's syncs need no RPC")

    @_rpc
    def colomem_listen(self, bucket_timeout: float = 60.0) -> dict:
        """Serves the attached bridge from a thread of this process: every version the trainer sends over the
        socket is applied as it comes, with no RPC per sync. Stopped by colomem_detach / colomem_close (or a
        new colomem_attach); idempotent."""
        st = self._colomem_attached()
        if st.listener is None or not st.listener.alive:
            st.listener = _Listener(self, st, float(bucket_timeout))
            st.listener.start()
        return {"listening": True, "pid": os.getpid()}

    @_rpc
    def colomem_listener_state(self) -> dict:
        """{"listening", "versions", "error"} of this worker's bridge listener (the adapter asks after a
        listener sync failed, to say why)."""
        listener = self._colomem().listener
        if listener is None:
            return {"listening": False, "versions": 0, "error": None}
        return listener.state()

    def _colomem_apply(self, msg: dict) -> dict:
        st = self._colomem_attached()
        version, seq = int(msg["version"]), int(msg["seq"])
        sync = st.sync
        if seq == 0:
            sync = self._colomem_start_version(st, version)
        elif version != sync.version or seq != sync.next_seq:
            raise PeerError(f"bucket out of order: got version {version} seq {seq}, expected version "
                            f"{sync.version} seq {sync.next_seq}; the trainer restarted a sync midway: start "
                            f"the version again from its first bucket")
        model = self._colomem_model()
        device = self._colomem_device()
        t0 = time.perf_counter()
        count = self._colomem_load(st, sync, model, msg)
        _synchronize(device)  # the buffer may be refilled as soon as this returns
        dt = time.perf_counter() - t0
        sync.ntensors += count
        sync.nbytes += int(msg.get("nbytes", 0))
        sync.apply_s += dt
        sync.next_seq = seq + 1
        ack = {"version": version, "seq": seq, "checksum": msg.get("checksum"), "ntensors": count,
               "apply_ms": dt * 1e3, "last": bool(msg.get("last"))}
        if msg.get("last"):
            if sync.layerwise:
                self._colomem_layerwise_end()
            ack.update(self._colomem_report(st, sync, model))
        st.last_ack = ack
        return ack

    def _colomem_report(self, st: _WorkerState, sync: _SyncState, model) -> dict:
        """What a finished version reports: coverage, snapshot checksums, totals, the load plan."""
        out = self._colomem_coverage(sync)
        params = dict(model.named_parameters())
        sample = spread_sample(params, st.snapshot_k)
        out["snapshot"] = finish_checksums({n: checksum_parts(params[n]) for n in sample})
        out.update(total_tensors=sync.ntensors, total_bytes=sync.nbytes, total_apply_ms=sync.apply_s * 1e3,
                   replayed_tensors=sync.replayed)
        if st.plan is not None:
            out["load_plan"] = st.plan.summary()
        return out

    def _colomem_load(self, st: _WorkerState, sync: _SyncState, model, msg: dict) -> int:
        """Puts one bucket's tensors into the model: recorded copies for names the plan knows, the model's
        load_weights (recording it) for the rest. Returns the tensors completed by this bucket."""
        plan = self._colomem_plan(st, sync, model, msg.get("seq") == 0)
        key = (msg.get("buffer"), msg.get("layout"))
        compiled = plan.compiled.get(key) if plan is not None and key[1] is not None else None
        if compiled is not None:  # a layout seen before: one batched copy, no entry parsed, no view made
            st.importer.copy_out(msg, compiled.ranges, verify=st.verify)
            compiled.fill()
            sync.loaded.update(compiled.params)
            sync.replayed += compiled.tensors
            return compiled.tensors
        count = 0
        ready: list = []
        seen: list = []
        for e, view in st.importer.entries(msg, verify=st.verify):
            seen.append(e)
            if plan is not None and plan.can_replay(e):
                sync.loaded.update(plan.replay(e, view))
                if e.part is None or e.part[1] == e.part[2]:
                    count += 1
                    sync.replayed += 1
                continue
            out = st.importer.reassemble(e, view)
            if out is not None:
                ready.append(out)
        if plan is not None and key[1] is not None and not ready:
            plan.compile(key, seen, self._colomem_device())  # every entry replayed: next time, raw copies
        return count + self._colomem_load_rest(plan, sync, model, ready)

    @staticmethod
    def _colomem_plan(st: _WorkerState, sync: _SyncState, model, new_version: bool):
        """The model's LoadPlan (None without fast_load); re-made at a version's start if parameters moved."""
        if not st.fast_load or sync.layerwise:
            return None
        from colomem.engines.load_plan import LoadPlan

        if st.plan is None or (new_version and not st.plan.still_valid()):
            st.plan = LoadPlan(model)  # first sync, or the model's parameters moved: record again
        return st.plan

    @staticmethod
    def _colomem_load_rest(plan, sync: _SyncState, model, ready: list) -> int:
        """Whole tensors the plan cannot replay go through the model's load_weights (recorded when useful)."""
        if not ready:
            return 0
        if plan is not None and any(n not in plan.refused for n, _ in ready):
            loaded = plan.record(model.load_weights, ready)
        else:
            loaded = model.load_weights(iter(ready))
        if loaded:
            sync.loaded.update(loaded)
        return len(ready)

    @_rpc
    def colomem_load_direct(self, named: list, version: int) -> dict:
        """sync_transport='direct' (vLLM's engine in the trainer's process): (name, tensor) pairs of the
        trainer go straight into the model: the recorded copies read the trainer's own memory, no bucket in
        between. Returns the same report as a bridge sync's last bucket."""
        from colomem._bucket import Entry

        st = self._colomem()
        model, device = self._colomem_model(), self._colomem_device()
        sync = self._colomem_start_version(st, version)
        plan = self._colomem_plan(st, sync, model, True)
        t0 = time.perf_counter()
        ready: list = []
        for name, t in named:
            n = t.numel() * t.element_size()
            sync.nbytes += n
            e = Entry(name, dtype_name(t.dtype), tuple(t.shape), 0, n)
            if plan is not None and t.device == device and t.is_contiguous() and plan.can_replay(e):
                sync.loaded.update(plan.replay(e, t.detach()))
                sync.replayed += 1
                sync.ntensors += 1
            else:
                ready.append((name, t))
        sync.ntensors += self._colomem_load_rest(plan, sync, model, ready)
        _synchronize(device)  # the trainer may change its tensors as soon as this returns
        sync.apply_s = time.perf_counter() - t0
        if sync.layerwise:
            self._colomem_layerwise_end()
        st.last_ack = {"version": int(version), **self._colomem_report(st, sync, model)}
        return st.last_ack

    def _colomem_coverage(self, sync: _SyncState) -> dict:
        if not sync.loaded:  # the model's load_weights returned nothing we can use: coverage unknown
            return {"complete": None, "nmissing": -1, "missing": []}
        missing = sorted(self._colomem_param_names() - set(sync.loaded))
        return {"complete": not missing, "nmissing": len(missing), "missing": missing[:16]}

    def _colomem_layerwise(self) -> bool:
        # Quantised checkpoints need vLLM's layerwise reload (process_weights_after_loading per layer);
        # unquantised weights load straight into the parameters, which is the fast path.
        cfg = getattr(self, "model_config", None)
        return getattr(cfg, "quantization", None) is not None

    def _colomem_layerwise_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with torch.device(self._colomem_device()):
            initialize_layerwise_reload(self._colomem_model())

    def _colomem_layerwise_end(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with torch.device(self._colomem_device()):
            finalize_layerwise_reload(self._colomem_model(), self.model_config)

    # -- checks -----------------------------------------------------------------------------------------
    @_rpc
    def colomem_param_info(self) -> dict:
        """{name: [shape, dtype]} of the model's parameters (vLLM's names: fused qkv_proj, gate_up_proj)."""
        return {n: [list(p.shape), dtype_name(p.dtype)]
                for n, p in self._colomem_model().named_parameters()}

    @_rpc
    def colomem_param_checksums(self, names: Optional[list] = None, sample: int = 8,
                                sample_words: int = CHECKSUM_SAMPLE_WORDS) -> dict:
        """tensor_checksum of the named parameters (or of `sample` spread over all of them)."""
        params = dict(self._colomem_model().named_parameters())
        if names is None:
            names = spread_sample(params, int(sample))
        unknown = [n for n in names if n not in params]
        if unknown:
            raise InvalidArgumentError(f"no parameter named {unknown[:4]} in the vLLM model")
        return {"checksums": finish_checksums({n: checksum_parts(params[n], sample_words) for n in names})}

    # -- pool backup (weights_backup="pool") ---------------------------------------------------------------
    def _colomem_pool(self, need: int):
        from colomem.pool import PinnedPool

        bk = self._colomem().backup
        if bk.pool is None or bk.pool.closed:
            bk.pool = PinnedPool(0, max_bytes=None)
        if sum(b.nbytes for b in bk.blocks) < need:
            bk.pool.reserve(need)  # pinned once, as one segment
        return bk.pool

    def _colomem_copy(self, direction: str, copies: list, timeout: float) -> float:
        from colomem import _torch

        device = self._colomem_device()
        engine = _torch.engine_for(device)
        _synchronize(device)  # kernels that still read or write the weights finish first
        t0 = time.perf_counter()
        tr = engine.submit(direction, copies, 0, 0, False)
        tr.wait(float(timeout))
        return time.perf_counter() - t0

    @_rpc
    def colomem_save_weights_to_pool(self, timeout: float = DEFAULT_COPY_TIMEOUT_S) -> dict:
        """Copies the bytes of every "weights" allocation into the worker's pinned pool (D2H, chunked).

        vLLM's cumem-backed parameters are foreign storages (they cannot be resized), so this copies raw
        bytes by address and leaves the tensors alone. Blocks are kept, so later cycles allocate nothing.
        """
        st = self._colomem()
        bk = st.backup
        layout = self._colomem_weight_allocations()
        if not layout:
            raise InvalidArgumentError("vLLM tagged no allocation 'weights'; start the LLM with "
                                       "enable_sleep_mode=True")
        if layout != bk.layout:  # first save, or vLLM re-allocated: size the blocks again
            self._colomem_free_blocks()
            pool = self._colomem_pool(sum(n for _, n in layout))
            bk.blocks = [pool.alloc(n) for _, n in layout]
            bk.layout = layout
        copies = [(blk.address, ptr, n) for blk, (ptr, n) in zip(bk.blocks, layout)]
        bk.saved = False
        bk.save_s = self._colomem_copy("d2h", copies, timeout)
        bk.saved = True
        nbytes = sum(n for _, n in layout)
        return {"nbytes": nbytes, "nallocs": len(layout), "seconds": bk.save_s,
                "pool": self._colomem_pool_stats()}

    @_rpc
    def colomem_restore_weights_from_pool(self, timeout: float = DEFAULT_COPY_TIMEOUT_S) -> dict:
        """Copies the saved bytes back to the same addresses (vLLM re-maps them where they were)."""
        bk = self._colomem().backup
        if not bk.saved:
            raise InvalidArgumentError("nothing saved in the pool: call colomem_save_weights_to_pool before "
                                       "sleeping")
        layout = self._colomem_weight_allocations()
        if layout != bk.layout:
            raise WeightCheckError("vLLM's weight allocations changed while asleep; the pool copy no longer "
                                   "matches them: sync the weights instead")
        copies = [(ptr, blk.address, n) for blk, (ptr, n) in zip(bk.blocks, layout)]
        bk.restore_s = self._colomem_copy("h2d", copies, timeout)
        return {"nbytes": sum(n for _, n in layout), "nallocs": len(layout), "seconds": bk.restore_s}

    @_rpc
    def colomem_drop_pool_copy(self) -> dict:
        """Forgets the saved copy (a full sync replaced the weights); keeps the blocks for the next save."""
        self._colomem().backup.saved = False
        return {"dropped": True}

    def _colomem_free_blocks(self) -> None:
        bk = self._colomem().backup
        for blk in bk.blocks:
            blk.release()
        bk.blocks, bk.layout, bk.saved = [], [], False

    def _colomem_pool_stats(self) -> dict:
        pool = self._colomem().backup.pool
        if pool is None or pool.closed:
            return {}
        s = pool.stats()
        return {k: s[k] for k in ("reserved_bytes", "in_use_bytes", "segments", "pin_seconds", "pinned")}

    # -- OOM at wake ----------------------------------------------------------------------------------------
    @_rpc
    def colomem_rollback_wake(self, tags: list, keep_weights: bool) -> dict:
        """Unmaps what a failed `wake_up(tags)` already mapped, so vLLM is fully asleep again.

        vLLM's wake_up maps allocation after allocation and stops at the first failure; the executor still
        counts the tags as asleep. With keep_weights (level-1 backups), an allocation whose CPU backup was
        already copied back and dropped gets a new backup before it is unmapped, so no weight is lost.
        """
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        alloc = CuMemAllocator.get_instance()
        released = 0
        for ptr, data in alloc.pointer_to_data.items():
            if data.tag not in tags or not _is_mapped(ptr):
                continue
            size = int(data.handle[1])
            if keep_weights and data.tag == "weights" and data.cpu_backup_tensor is None:
                backup = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                _cudart().cudaMemcpy(backup.data_ptr(), ptr, size)
                data.cpu_backup_tensor = backup
            unmap_and_release(data.handle)
            released += size
        torch.cuda.empty_cache()
        return {"released_bytes": released}

    # -- memory ---------------------------------------------------------------------------------------------
    @_rpc
    def colomem_memory(self) -> dict:
        """What this worker holds: vLLM's cumem allocations by tag, torch's allocator, the pinned pool."""
        out: dict = {"pid": os.getpid()}
        device = self._colomem_device()
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            out.update(free_bytes=int(free), total_bytes=int(total),
                       torch_allocated_bytes=int(torch.cuda.memory_allocated(device)),
                       torch_reserved_bytes=int(torch.cuda.memory_reserved(device)))
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            by_tag: dict = {}
            for data in CuMemAllocator.get_instance().pointer_to_data.values():
                by_tag[data.tag] = by_tag.get(data.tag, 0) + int(data.handle[1])
            out["cumem_bytes_by_tag"] = by_tag
        except Exception:  # noqa: BLE001  (no cumem allocator: sleep mode off, or not vLLM)
            out["cumem_bytes_by_tag"] = {}
        out["pool"] = self._colomem_pool_stats()
        out["pool_saved"] = bool(self._colomem().backup.saved)
        return out

    # -- baseline for runners/bench_sync.py: per-tensor CUDA IPC through torch.multiprocessing --------------
    @_rpc
    def colomem_apply_torch_ipc(self, entries: list) -> dict:
        """Loads tensors the trainer shared one by one with torch's `reduce_tensor` (CUDA IPC handles).

        entries: [{"name", "args": the rebuild_cuda_tensor arguments with classes and dtype as strings}].
        """
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        device = self._colomem_device()
        t0 = time.perf_counter()

        def tensors():
            for e in entries:
                a = list(e["args"])
                yield e["name"], rebuild_cuda_tensor(
                    torch.Tensor, tuple(a[0]), tuple(a[1]), int(a[2]), torch.storage.TypedStorage,
                    getattr(torch, a[3]), device.index, a[4], int(a[5]), int(a[6]), bool(a[7]), a[8],
                    int(a[9]), a[10], bool(a[11]))

        loaded = self._colomem_model().load_weights(tensors())
        _synchronize(device)
        return {"ntensors": len(entries), "loaded": len(loaded or ()), "apply_ms": (time.perf_counter() - t0) * 1e3}

    @_rpc
    def colomem_close(self) -> dict:
        """Detaches from the bridge and frees the pool (the engine is about to shut down)."""
        st = self._colomem()
        self._colomem_drop_importer(st)
        bk = st.backup
        if bk.pool is not None and not bk.pool.closed:
            bk.pool.close(force=True)
        st.backup = _PoolBackup()
        return {"closed": True}


# ----------------------------------------------------------------------- driver queries for the rollback
_libcuda = None
_CU_POINTER_ATTRIBUTE_MAPPED = 13   # cuda.h: CUpointer_attribute


def _is_mapped(ptr: int) -> bool:
    """Whether a device virtual address has physical memory mapped (CU_POINTER_ATTRIBUTE_MAPPED)."""
    import ctypes

    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        lib.cuPointerGetAttribute.restype = ctypes.c_int
        _libcuda = lib
    mapped = ctypes.c_int(0)  # the driver writes a boolean into the low byte
    rc = _libcuda.cuPointerGetAttribute(ctypes.byref(mapped), _CU_POINTER_ATTRIBUTE_MAPPED, ptr)
    return rc == 0 and bool(mapped.value & 0xFF)


def _cudart():
    from vllm.device_allocator.cumem import libcudart

    return libcudart


__all__ = ["ColomemWorkerExtension", "checksum_parts", "finish_checksums", "hashed_pick", "raise_if_error",
           "spread_sample", "tensor_checksum"]
