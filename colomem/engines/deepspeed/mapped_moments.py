"""Adam's moments of a DeepSpeed engine in memory colomem maps itself, for ColomemOffload.

With the moments in torch's allocator, each one (28.4 GiB on a 7.6B full fine-tune) comes back as one
allocation; the memory beside the forward and backward takes less than one, so on such a job all of them come
back inside the optimizer step, where nothing hides the copy. Held in a MappedOptimizerState they come back
a chunk at a time: as much as fits beside the step's peak behind the forward and backward (prefetch), the
rest inside the step.

The first offload that moves them copies them from their torch tensors straight to the pool (no GPU memory
beyond theirs); once that copy ended, the inner optimizer uses the mapped tensors and the old ones are freed.
A checkpoint load gives the optimizer new tensors: the mapped state lets go, and the next offload moves the
loaded ones the same way. The optimizer's own hooks bring everything back before a step or a state_dict().
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from colomem.mapped import CHUNK_BYTES_DEFAULT
from colomem.optim_mapped import MOMENTS, MappedOptimizerState, state_tensors
from colomem.swap_mapped import MappedHandle, MappedStats

from .state import storage_key


CHUNK_BYTES = CHUNK_BYTES_DEFAULT  # read when a MappedMoments is made (a test of a small model lowers it)


class MappedMoments:
    """The moments' half of a ColomemOffload's LATE part. `optimizer` returns the inner torch optimizer."""

    def __init__(self, optimizer: Callable[[], torch.optim.Optimizer], pool: Any, timeout_s: float, *,
                 chunk_bytes: Optional[int] = None):
        self._optimizer = optimizer
        self._chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self._pool = pool
        self._timeout = timeout_s
        self.state: Optional[MappedOptimizerState] = None
        self._pending: Optional[MappedHandle] = None  # the copy out in flight (the first one: the move out)
        self._held = False                            # an offload whose copy waits for start()
        self.last_stats: Optional[MappedStats] = None  # the last reload's (the step's figures read it)
        self.prefetched = 0                           # bytes the last prefetch() queued

    # -- what is where ---------------------------------------------------------------------------------------
    def _live(self) -> Optional[MappedOptimizerState]:
        s = self.state
        return s if s is not None and not s.closed else None

    def storages(self) -> set[int]:
        """Storage keys of the moments as the optimizer holds them now (its own tensors, or the mapped ones):
        the SwapSets leave these out."""
        return {storage_key(t) for _, _, t in state_tensors(self._optimizer(), MOMENTS)}

    def nbytes(self) -> int:
        s = self._live()
        if s is not None and s.active:
            return s.nbytes
        return sum(t.numel() * t.element_size() for _, _, t in state_tensors(self._optimizer(), MOMENTS))

    @property
    def pending_bytes(self) -> int:
        """Bytes still copying out (or held back) after offload(); 0 when none are."""
        return self.nbytes() if (self._pending is not None or self._held) else 0

    @property
    def outstanding(self) -> bool:
        """Some of the moments are in the pool or on their way there: the step must bring them back."""
        s = self._live()
        return self._pending is not None or self._held or (s is not None and s.active and not s.set.resident)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the moments on the device in mapped memory (outside torch's allocator)."""
        s = self._live()
        return s.resident_bytes if s is not None and s.active else 0

    @property
    def mapped_bytes(self) -> int:
        """Device memory the moments hold now, chunks still copying back included (what the driver counts)."""
        s = self._live()
        return s.set.memory.mapped_bytes if s is not None else 0

    def host_view(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The pool copy of one of the mapped moments while it is there (see MappedSet.host_view)."""
        s = self._live()
        return s.set.host_view(t) if s is not None and s.active else None

    # -- moving ----------------------------------------------------------------------------------------------
    def offload(self, hold: bool = False) -> None:
        """Starts the moments' copy out (hold: at start()); finish() waits for it and frees their memory."""
        if not state_tensors(self._optimizer(), MOMENTS):
            return  # before the first step there are none
        self._held = True
        if not hold:
            self.start()

    def start(self) -> None:
        if not self._held:
            return
        self._held = False
        s = self._live()
        if s is None or not s.active:
            self.state = MappedOptimizerState(self._optimizer(), pool=self._pool, name="deepspeed-trainer.moments",
                                              chunk_bytes=self._chunk_bytes, move_out=True)
            self._pending = self.state.moving
        elif s.resident_bytes:
            self._pending = s.offload()

    def finish(self, timeout: Optional[float] = None) -> int:
        """Waits for the copy out (starting it first when held); returns its bytes (0: none was pending). Each
        chunk's memory goes back to the driver as its copy ends."""
        self.start()
        if self._pending is None:
            return 0
        wait_s = self._timeout if timeout is None else timeout
        s = self.state
        assert s is not None
        try:
            if s.moving is not None:
                n = s.finish_move(wait_s)
            else:
                n = self._pending.wait(wait_s).nbytes
        except TimeoutError:
            raise  # still copying: a later call waits again
        except BaseException:
            # a failed copy: each chunk stays where its bytes are whole (a failed move out leaves the optimizer
            # its own tensors), and a later reload or offload goes on from there
            self._pending = None
            raise
        self._pending = None
        return n

    def prefetch(self, budget_bytes: int) -> int:
        """Queues the copy back of the leading chunks that fit in `budget_bytes`, unordered (behind the forward
        and backward: nothing waits for them until the step); returns the bytes queued. It stops early where
        the device has no free memory left (the measured room was smaller this time): the rest comes back at
        the step, and torch's cache stays for the forward and backward."""
        s = self._live()
        self.prefetched = 0
        if s is None or not s.active or budget_bytes <= 0 or self._pending is not None or self._held:
            return 0
        self.prefetched = s.reload(budget_bytes, ordered=False, up_to_room=True).nbytes
        return self.prefetched

    def reload_async(self) -> Optional[MappedHandle]:
        """Everything back, unordered (waiting for a copy out first): the handle to wait for before the step
        reads them; None when nothing is in the pool."""
        if not self.outstanding:
            return None
        self.finish()
        s = self._live()
        return s.reload(ordered=False) if s is not None and s.active else None

    def reload(self) -> int:
        """Everything back (waiting for a copy out first), waited for; returns the bytes this call copied."""
        self.finish()
        s = self._live()
        if s is None or not s.active:
            return 0
        s.reload(ordered=True, timing=True)
        stats = s.set.wait(self._timeout)
        self.last_stats = stats
        return stats.nbytes if stats is not None else 0

    def close(self) -> None:
        """For a closing trainer: the mapped memory and pool blocks freed, the moments dropped from the
        optimizer's state (a copy out still running is waited for first)."""
        self._held = False
        s = self._live()
        if s is not None:
            if self._pending is not None and s.moving is None:
                try:
                    self._pending.wait(self._timeout)
                except Exception:  # noqa: B036  (closing anyway: the set's close waits for its copies)
                    pass
            s.discard()
        self._pending = None
        self.state = None


__all__ = ["MappedMoments"]
