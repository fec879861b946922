"""The CPU trainer's optimizer state in memory colomem maps itself (`optimizer_state_memory="mapped"`).

TorchTrainer moves its AdamW state as one of its swap sets. With mapped memory, Adam's moments live in a
MappedOptimizerState from their first offload on (copied from their torch tensors straight to the pool, which
are freed once that copy ended), and leave and come back chunk by chunk, as the DeepSpeed trainer's do
(engines/deepspeed/mapped_moments.py). This class gives that state the few calls the trainer makes on a swap
set (offload, reload, their async forms, host_view, nbytes, close). The optimizer's other state (the step
counts) stays where it is. A load_state_dict() gives the optimizer new tensors: the mapped state lets go,
and the next offload moves the loaded ones the same way.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Optional

import torch

from colomem.mapped import CHUNK_BYTES_DEFAULT
from colomem.optim_mapped import MOMENTS, MappedOptimizerState, state_tensors
from colomem.swap_handles import DEFAULT_TIMEOUT_S
from colomem.swap_mapped import MappedStats


class _Moved:
    """A handle whose copy is already accounted for (nothing left to wait for)."""

    def __init__(self, direction: str, nbytes: int):
        self.stats = MappedStats(direction, nbytes, 0, 0.0)
        self.nbytes = nbytes

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> MappedStats:
        return self.stats


class _MoveOut:
    """The first offload: the moments' copy straight to the pool; wait() switches the optimizer to them."""

    def __init__(self, state: MappedOptimizerState):
        self.state = state
        self.nbytes = state.nbytes
        self.stats: Optional[MappedStats] = None

    def done(self) -> bool:
        return self.stats is not None

    def wait(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> MappedStats:
        if self.stats is None:
            t0 = time.perf_counter()
            n = self.state.finish_move(timeout)
            self.stats = MappedStats("d2h", n, self.state.set.memory.nchunks, time.perf_counter() - t0)
        return self.stats


class MappedOptimizerSet:
    """The moments of `optimizer` as a swap set named `name`, mapped in chunks of `chunk_bytes`."""

    def __init__(self, optimizer: torch.optim.Optimizer, pool: Any, name: str, *,
                 chunk_bytes: int = CHUNK_BYTES_DEFAULT):
        self.optimizer, self.pool, self.name, self.chunk_bytes = optimizer, pool, name, chunk_bytes
        self.state: Optional[MappedOptimizerState] = None

    def _live(self) -> Optional[MappedOptimizerState]:
        s = self.state
        return s if s is not None and s.active and not s.closed else None

    @property
    def nbytes(self) -> int:
        s = self._live()
        if s is not None:
            return s.nbytes
        return sum(t.numel() * t.element_size() for _, _, t in state_tensors(self.optimizer, MOMENTS))

    def offload_async(self) -> Any:
        s = self._live()
        if s is None:
            if self.state is not None and self.state.moving is not None:
                return _MoveOut(self.state)            # the move out of an earlier offload, still copying
            if not state_tensors(self.optimizer, MOMENTS):
                return _Moved("d2h", 0)              # before the first step there are none
            self.state = MappedOptimizerState(self.optimizer, pool=self.pool, name=self.name,
                                              chunk_bytes=self.chunk_bytes, move_out=True)
            return _MoveOut(self.state)
        return s.offload() if s.resident_bytes else _Moved("d2h", 0)

    def offload(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> MappedStats:
        return self.offload_async().wait(timeout)

    def reload_async(self, ordered: bool = False) -> Any:
        s = self._live()
        if s is None or s.set.resident:
            return _Moved("h2d", 0)
        return s.reload(ordered=ordered)

    def reload(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> MappedStats:
        h = self.reload_async(ordered=True)
        stats = h.wait(timeout)
        s = self._live()
        if s is not None:
            s.set.wait(timeout)                          # an earlier unordered reload it was queued behind
        return stats

    def host_view(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        s = self._live()
        return s.set.host_view(t) if s is not None else None

    def read_in_place(self) -> ContextManager[bool]:
        """state_dict() without bringing the moments back while all of them are in the pool
        (MappedOptimizerState.read_in_place); yields False, and changes nothing, otherwise."""
        s = self._live()
        return s.read_in_place() if s is not None else contextlib.nullcontext(False)

    def close(self) -> None:
        """The moments dropped with the trainer (it is closing): the mapped memory and pool blocks freed."""
        if self.state is not None:
            self.state.discard()
            self.state = None


__all__ = ["MappedOptimizerSet"]
