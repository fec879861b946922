"""What the engines report about a phase switch: one weight sync (SyncStats), one trainer move (SwitchReport).

Both are plain dataclasses with `to_dict()`, so the runner writes them to metrics without knowing which
engine made them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class SyncStats:
    """One trainer -> rollout weight sync, as the producer saw it."""

    version: int
    nbytes: int = 0               # bytes of base weights sent
    ntensors: int = 0             # base tensors sent
    nbuckets: int = 0             # bridge messages
    seconds: float = 0.0          # wall time from the first byte packed to the last ACK
    apply_seconds: float = 0.0    # time vLLM's worker spent applying buckets (sum over buckets)
    bridge_seconds: float = 0.0   # bridge transport: from the first pack to the last ACK
    # ... of which (the bridge's own account): host time launching the packs' copies, their device time and
    # that of their checksums, host time blocked on a pack, and the worker's share (a bucket out -> its ACK)
    pack_issue_seconds: float = 0.0
    pack_copy_seconds: float = 0.0
    pack_checksum_seconds: float = 0.0
    pack_wait_seconds: float = 0.0
    ack_seconds: float = 0.0
    rpc_wait_seconds: float = 0.0  # an RPC-carried sync: after the last ACK, until the worker's RPC returned
    prefix_reset_seconds: float = 0.0  # an engine that stayed awake: dropping its prefix cache after new weights
    prefix_reset_early: bool = False   # that drop had started before the sync (retire_prefix_cache): only collected
    replayed_tensors: int = 0     # tensors placed by replaying recorded load_weights copies (load_plan)
    adapter_tensors: int = 0      # LoRA tensors handed to vLLM's LoRA manager (adapter mode)
    adapter_seconds: float = 0.0
    adapter_inplace: bool = False  # the adapter was copied into vLLM's slot in place (no files, same id)
    complete: Optional[bool] = None  # every vLLM parameter was written (None: not known)
    nmissing: int = 0             # vLLM parameters the sync did not write
    missing: tuple = ()           # the first few of them

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["missing"] = list(self.missing)
        d["gbps"] = round(self.gbps, 3)
        return d


@dataclass
class SwitchReport:
    """One offload or reload of a trainer: what moved, how long it took, what the driver saw."""
    method: str
    direction: str               # "offload" | "reload"
    seconds: float
    moved_bytes: int             # bytes copied (deepspeed: the drop/rise of torch's allocated bytes)
    freed_bytes: int             # offload: driver free memory gained; reload: driver memory taken
    free_bytes: int              # driver free memory after
    allocated_bytes: int         # torch allocated after
    reserved_bytes: int          # torch reserved after
    by_category: dict[str, int] = field(default_factory=dict)
    unlisted: list[tuple[str, int]] = field(default_factory=list)   # (name, bytes) only the walk found
    kept_bytes: int = 0          # storages that could not be resized (stay on the GPU)
    move_seconds: float = 0.0    # the move alone (without preparing the sync and empty_cache)
    collect_seconds: float = 0.0  # finding the storages (part of move_seconds for colomem and to)
    sync_seconds: float = 0.0    # offload: preparing the weights for the sync (views or staging)
    staged_bytes: int = 0        # offload: weights copied to host for the sync (merged LoRA, ZeRO-3 ranks)
    deferred_bytes: int = 0      # bytes still in flight on return (reload: overlap_reload, train_step waits;
    #                              offload: defer=True, finish_offload waits)
    wait_seconds: float = 0.0    # offload: what finish_offload() waited for the deferred part
    left_behind: str = ""        # offload: the largest CUDA tensors still alive when much stayed allocated
    #                              (the first such offload of a trainer)

    @property
    def gbps(self) -> float:
        """Bytes moved per second of the move itself."""
        t = self.move_seconds or self.seconds
        return self.moved_bytes / t / 1e9 if t > 0 else float("inf")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 3)
        return d


__all__ = ["SwitchReport", "SyncStats"]
