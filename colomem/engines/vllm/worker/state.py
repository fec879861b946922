"""What colomem keeps inside vLLM's worker between RPCs, and the device helpers every worker module uses."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..kv_tail import TailGeometry
from .load_plan import VersionRecord


@dataclass
class SyncState:
    """One version being received."""
    version: int = -1
    next_seq: int = 0
    loaded: set = field(default_factory=set)
    ntensors: int = 0
    nbytes: int = 0
    apply_s: float = 0.0
    layerwise: bool = False
    replayed: int = 0
    open: bool = False       # begun and not finished: a direct load's later chunks may join it
    # the load_weights calls recorded in this version (a new SyncState per version starts it empty)
    recorded: VersionRecord = field(default_factory=VersionRecord)


@dataclass
class PoolBackup:
    """weights_backup="pool": vLLM's weight allocations saved into a colomem pinned pool."""
    pool: Any = None
    blocks: list = field(default_factory=list)          # Block per saved allocation, kept between cycles
    layout: list = field(default_factory=list)          # [(device address, nbytes)] they were saved from
    saved: bool = False
    save_s: float = 0.0
    restore_s: float = 0.0


@dataclass
class KvRelease:
    """The KV-cache-only sleep (kv_release.py): vLLM's "kv_cache" allocations colomem unmapped."""
    released: list = field(default_factory=list)        # device addresses unmapped now (vLLM's table keeps them)
    nbytes: int = 0                                     # their bytes
    lent: dict = field(default_factory=dict)            # address -> AllocationData, out of vLLM's table during its sleep
    release_s: float = 0.0
    map_s: float = 0.0


@dataclass
class KvTail:
    """What a worker keeps while it holds vLLM's KV allocations (WorkerState.tail)."""
    geometry: Optional[TailGeometry] = None             # None: vLLM's own allocations, nothing held
    ranges: list = field(default_factory=list)          # MappedRange per layer allocation, in address order
    taken: dict = field(default_factory=dict)           # address -> vLLM's AllocationData, out of its table
    start: int = 0                                      # the lent tail's first chunk (0: nothing lent)
    scheduler: Any = None
    lent_bytes: int = 0


@dataclass
class WorkerState:
    importer: Any = None
    address: Optional[str] = None
    verify: str = "sampled"
    snapshot_k: int = 8
    fast_load: bool = True                               # replay recorded load_weights copies (load_plan)
    plan: Any = None                                     # LoadPlan of the model, made at the first sync
    sync: SyncState = field(default_factory=SyncState)
    backup: PoolBackup = field(default_factory=PoolBackup)
    last_ack: dict = field(default_factory=dict)
    listener: Any = None                                 # Listener while the bridge is served by a thread
    trainer_watch: Any = None                            # TrainerWatch: ends the engine if the trainer dies
    kv: KvRelease = field(default_factory=KvRelease)     # the KV cache released without the weights
    tail: KvTail = field(default_factory=KvTail)         # the KV cache's tail lent by chunks (kv_tail.py)


def torch_device(worker: Any) -> torch.device:
    """The device of vLLM's worker (its `device` attribute), else the current CUDA device, else the CPU."""
    dev = getattr(worker, "device", None)
    if isinstance(dev, torch.device):
        return dev
    if dev is not None:
        return torch.device(dev)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_copy(device: torch.device, direction: str, copies: list, timeout: float) -> float:
    """[(dst, src, nbytes)] through colomem's copy engine ("d2h" or "h2d"), after the device's queued work
    finished; returns the seconds it took."""
    from colomem import _torch

    engine = _torch.engine_for(device)
    synchronize(device)  # kernels that still read or write these bytes finish first
    t0 = time.perf_counter()
    engine.submit(direction, copies, 0, 0, False).wait(float(timeout))
    return time.perf_counter() - t0


__all__ = ["KvRelease", "KvTail", "PoolBackup", "SyncState", "WorkerState", "device_copy", "synchronize", "torch_device"]
