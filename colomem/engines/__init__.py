"""The two sides of a phase switch behind small protocols (docs/design.md, "Engines").

`SyncStats` is what every Rollout's `load_weights` returns. The engines themselves load on first use, so
importing this package never imports vLLM or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    bridge_seconds: float = 0.0   # socket/listener transports: from the first pack to the last ACK
    rpc_wait_seconds: float = 0.0  # socket transport: after the last ACK, until the worker's RPC returned
    replayed_tensors: int = 0     # tensors placed by replaying recorded load_weights copies (load_plan)
    adapter_tensors: int = 0      # LoRA tensors handed to vLLM's LoRA manager (adapter mode)
    adapter_seconds: float = 0.0
    complete: Optional[bool] = None  # every vLLM parameter was written (None: not known)
    nmissing: int = 0             # vLLM parameters the sync did not write
    missing: tuple = ()           # the first few of them

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


_LAZY = {
    "VLLMRollout": ("colomem.engines.vllm", "VLLMRollout"),
    "ColomemWorkerExtension": ("colomem.engines.vllm_worker", "ColomemWorkerExtension"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'colomem.engines' has no attribute {name!r}")


__all__ = ["SyncStats", *_LAZY]
