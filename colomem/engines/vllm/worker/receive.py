"""Applying weights inside vLLM's worker: one bucket of a bridge version, or (in process) the trainer's
tensors themselves.

Each bucket goes through the model's LoadPlan (load_plan.py): names the plan knows are replayed as the
copies `load_weights` made the first time, a bucket layout seen before is one batched copy, and the rest goes
through `load_weights` (recorded when useful). The last bucket of a version reports which parameters the
version did not write, checksums of a sample of them (what later checks compare against) and totals.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from colomem.bridge import wire
from colomem.bridge.buckets import Entry, dtype_name
from colomem.errors import ColomemError, InvalidArgumentError, PeerError

from ..checks import checksum_parts, coverage, finish_checksums, spread_sample
from .state import SyncState, WorkerState, synchronize

if TYPE_CHECKING:
    from . import ColomemWorkerExtension

log = logging.getLogger(__name__)


def attached(worker: "ColomemWorkerExtension") -> WorkerState:
    """The worker's state, with a bridge attached (PeerError if none is)."""
    st = worker._colomem()
    if st.importer is None:
        raise PeerError("no bridge attached in this worker; the adapter must call colomem_attach first")
    return st


def start_version(worker: "ColomemWorkerExtension", st: WorkerState, version: int) -> SyncState:
    """A new version's sync state (vLLM's layerwise reload begun when the model needs it)."""
    sync = st.sync = SyncState(version=int(version), open=True)
    sync.layerwise = _layerwise(worker)
    if sync.layerwise:
        _layerwise_begin(worker)
    return sync


def apply_bucket(worker: "ColomemWorkerExtension", msg: dict) -> dict:
    """Loads one bucket. Returns its ACK only after the copies out of the buffer finished, so the trainer may
    refill it; the last bucket's ACK carries the version's report."""
    wire.validate_bucket(msg, entries=False)     # typed fields before anything reads them (PeerError)
    st = attached(worker)
    version, seq = msg["version"], msg["seq"]
    sync = st.sync
    if seq == 0:
        sync = start_version(worker, st, version)
    elif version != sync.version or seq != sync.next_seq:
        raise PeerError(f"bucket out of order: got version {version} seq {seq}, expected version "
                        f"{sync.version} seq {sync.next_seq}; the trainer restarted a sync midway: start "
                        f"the version again from its first bucket")
    model = worker._colomem_model()
    t0 = time.perf_counter()
    count = _load_bucket(worker, st, sync, model, msg)
    synchronize(worker._colomem_device())  # the buffer may be refilled as soon as this returns
    dt = time.perf_counter() - t0
    sync.ntensors += count
    sync.nbytes += int(msg.get("nbytes", 0))
    sync.apply_s += dt
    sync.next_seq = seq + 1
    ack = {"version": version, "seq": seq, "checksum": msg.get("checksum"), "ntensors": count,
           "apply_ms": dt * 1e3, "last": bool(msg.get("last"))}
    if msg.get("last"):
        sync.open = False
        if sync.layerwise:
            _layerwise_end(worker)
        ack.update(report(worker, st, sync, model))
    st.last_ack = ack
    return ack


def serve_version(worker: "ColomemWorkerExtension", importer: Any, first: dict, timeout: float) -> dict:
    """Applies one version arriving over the bridge socket, starting with the bucket `first`; ACKs each
    bucket once applied (the last ACK carries the version's report, also returned). A bucket that fails is
    refused with the exception itself, so the producer can raise the same class."""
    tag = first.get("tag")
    msg = first
    while True:
        try:
            ack = worker._colomem_apply(msg)
        except BaseException as exc:
            _refuse(importer, msg, exc)
            raise
        last = bool(msg.get("last"))
        importer.ack(msg, timeout=timeout, report=ack if last else None)
        if last:
            return ack
        msg = importer.receive(timeout, tag)


def _refuse(importer: Any, msg: dict, exc: BaseException) -> None:
    # The bridge turns the exception into the error payload of colomem.errors, and the producer raises it
    # as its class (a WeightCheckError here is a WeightCheckError in the trainer).
    try:
        importer.ack(msg, ok=False, error=exc, timeout=1.0)
    except ColomemError as ack_exc:  # the producer is gone: it learns from the closed socket instead
        log.debug("refusing bucket %s failed: %s", msg.get("seq"), ack_exc)


def load_direct(worker: "ColomemWorkerExtension", named: list, version: int, first: bool = True,
                last: bool = True) -> dict:
    """The trainer's (name, tensor) pairs straight into the model (vLLM's engine in the trainer's process):
    the recorded copies read the trainer's memory, no bucket in between. A version may come in several calls,
    `first` to `last`, so that the trainer need not hold all of its tensors at once. The last call returns the
    same report as a bridge sync's last bucket, the others {"partial": True, "version": version}."""
    st = worker._colomem()
    model, device = worker._colomem_model(), worker._colomem_device()
    version = int(version)
    if first:
        sync = start_version(worker, st, version)
    else:
        sync = st.sync
        if not sync.open or sync.version != version:
            now = f"version {sync.version} is" if sync.open else "no version is"
            raise PeerError(f"a later chunk of weight version {version} came while {now} being loaded; the "
                            f"trainer restarted or abandoned a sync midway: send the version again from its "
                            f"first chunk")
    plan = _plan(st, sync, model, first)
    t0 = time.perf_counter()
    ready: list = []
    try:
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
        sync.ntensors += _load_rest(plan, sync, model, ready)
        synchronize(device)  # the trainer may change or free these tensors as soon as this returns
    except BaseException:
        sync.open = False    # half loaded: no later chunk may complete it
        raise
    sync.apply_s += time.perf_counter() - t0
    if not last:
        return {"partial": True, "version": version}
    sync.open = False
    if sync.layerwise:
        _layerwise_end(worker)
    st.last_ack = {"version": version, **report(worker, st, sync, model)}
    return st.last_ack


def report(worker: "ColomemWorkerExtension", st: WorkerState, sync: SyncState, model: torch.nn.Module) -> dict:
    """What a finished version reports: coverage, snapshot checksums, totals, the load plan."""
    out = coverage(worker._colomem_param_names(), sync.loaded)
    params = dict(model.named_parameters())
    sample = spread_sample(params, st.snapshot_k)
    out["snapshot"] = finish_checksums({n: checksum_parts(params[n]) for n in sample})
    out.update(total_tensors=sync.ntensors, total_bytes=sync.nbytes, total_apply_ms=sync.apply_s * 1e3,
               replayed_tensors=sync.replayed)
    if st.plan is not None:
        out["load_plan"] = st.plan.summary()
    return out


def _load_bucket(worker: "ColomemWorkerExtension", st: WorkerState, sync: SyncState, model: torch.nn.Module,
                 msg: dict) -> int:
    """Puts one bucket's tensors into the model: recorded copies for names the plan knows, the model's
    load_weights (recording it) for the rest. Returns the tensors completed by this bucket."""
    plan = _plan(st, sync, model, msg.get("seq") == 0)
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
        plan.compile(key, seen, worker._colomem_device())  # every entry replayed: next time, raw copies
    return count + _load_rest(plan, sync, model, ready)


def _plan(st: WorkerState, sync: SyncState, model: torch.nn.Module, new_version: bool) -> Optional[Any]:
    """The model's LoadPlan (None without fast_load); re-made at a version's start if parameters moved."""
    if not st.fast_load or sync.layerwise:
        return None
    from .load_plan import LoadPlan

    if st.plan is None or (new_version and not st.plan.still_valid()):
        st.plan = LoadPlan(model)  # first sync, or the model's parameters moved: record again
    return st.plan


def _load_rest(plan: Optional[Any], sync: SyncState, model: Any, ready: list) -> int:
    """Whole tensors the plan cannot replay go through the model's load_weights (recorded when useful)."""
    if not ready:
        return 0
    if plan is not None and any(n not in plan.refused for n, _ in ready):
        loaded = plan.record(model.load_weights, ready, sync.recorded)
    else:
        loaded = model.load_weights(iter(ready))
    if loaded:
        sync.loaded.update(loaded)
    return len(ready)


def _layerwise(worker: "ColomemWorkerExtension") -> bool:
    # Quantised checkpoints need vLLM's layerwise reload (process_weights_after_loading per layer);
    # unquantised weights load straight into the parameters, which is the fast path.
    cfg = getattr(worker, "model_config", None)
    return getattr(cfg, "quantization", None) is not None


def _layerwise_begin(worker: "ColomemWorkerExtension") -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with torch.device(worker._colomem_device()):
        initialize_layerwise_reload(worker._colomem_model())


def _layerwise_end(worker: "ColomemWorkerExtension") -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    with torch.device(worker._colomem_device()):
        finalize_layerwise_reload(worker._colomem_model(), getattr(worker, "model_config", None))


def pick_address(address: Any, mine: str, rank: Any) -> str:
    """A bridge address, or the one of {GPU UUID: address} on this worker's GPU `mine` (tensor parallel: one
    trainer bridge per GPU, each worker maps the one on its own GPU, whatever CUDA_VISIBLE_DEVICES numbers
    it)."""
    if isinstance(address, str):
        return address
    if not isinstance(address, dict) or not address:
        raise InvalidArgumentError(f"address must be a socket path or a {{GPU UUID: path}} dict, got {address!r}")
    for uuid, path in address.items():
        if str(uuid).lower() == str(mine).lower():
            return str(path)
    raise PeerError(f"no trainer bridge on this worker's GPU {mine} (rank {rank}); the trainer offered "
                    f"{sorted(address)}: every GPU of the engine needs a trainer rank")


def detach(st: WorkerState) -> None:
    """Stops the listener, forgets the load plan and closes the importer (unmapping the bridge's buffers)."""
    if st.listener is not None:
        listener, st.listener = st.listener, None
        listener.stop()
    st.plan = None
    if st.importer is not None:
        try:
            st.importer.close()
        finally:
            st.importer = None


__all__ = ["apply_bucket", "attached", "detach", "load_direct", "pick_address", "report", "serve_version",
           "start_version"]
