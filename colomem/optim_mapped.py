"""An optimizer's state moved into memory colomem maps chunk by chunk (colomem.swap_mapped.MappedSet).

Adam's two moments are the largest thing a trainer holds that only the optimizer step reads. Held by torch's
caching allocator, each is one allocation: it leaves whole and comes back whole, and the memory left beside
the forward and backward (less than one moment on a 7B full fine-tune) cannot take part of one early. Moved
into a MappedSet, they leave and come back a chunk at a time, so part of them can come back behind the
backward and the rest at the step.

The optimizer keeps working on the same state dict: the moments' tensors are replaced, once, by tensors of
the same dtype and shape in the mapped memory. Three hooks on the torch optimizer keep it from reading
memory that is not mapped: before each step and before state_dict() the state is brought back in full (in
the current stream's order; a checkpoint of the offloaded state may read it in the pool instead,
read_in_place), and after load_state_dict() (which puts new tensors in the state) the mapped
copy is let go, so the loaded state is what the optimizer uses; map it again with a new MappedOptimizerState.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from colomem.errors import ColomemError
from colomem.mapped import CHUNK_BYTES_DEFAULT
from colomem.pool import PinnedPool
from colomem.swap_handles import DEFAULT_TIMEOUT_S
from colomem.swap_mapped import MappedHandle, MappedSet

MOMENTS = ("exp_avg", "exp_avg_sq")


def state_tensors(optimizer: torch.optim.Optimizer, keys: Sequence[str]) -> list[tuple[Any, str, torch.Tensor]]:
    """(param, key, tensor) for each non-empty state tensor named in `keys`, in the state's order. The state,
    not the param groups: ZeRO-3 puts a partition in its inner optimizer's groups only while it steps it."""
    out = []
    for p, st in optimizer.state.items():
        for k in keys:
            t = st.get(k)
            if isinstance(t, torch.Tensor) and t.numel():
                out.append((p, k, t))
    return out


class MappedOptimizerState:
    """The optimizer's state tensors named `keys` (default: Adam's moments) moved into one MappedSet.

    move_out=False: the state is copied into mapped memory now (on the current stream; for a moment both
    copies are on the device) and the optimizer uses the mapped tensors at once. move_out=True: the state's
    bytes copy straight to the pool (no GPU memory beyond theirs, the state offloaded from the start):
    `moving` is the copy's handle, and the optimizer keeps its old tensors until finish_move() waited for
    it, then uses the mapped ones (its old tensors' memory is freed then).

    Raises ColomemError when the optimizer has none of them yet (Adam makes its state at its first step:
    map after it) or when they are not on one device."""

    def __init__(self, optimizer: torch.optim.Optimizer, keys: Sequence[str] = MOMENTS,
                 pool: Optional[PinnedPool] = None, *, chunk_bytes: int = CHUNK_BYTES_DEFAULT,
                 name: str = "optimizer state", move_out: bool = False):
        found = state_tensors(optimizer, keys)
        if not found:
            raise ColomemError(f"{type(optimizer).__name__} has no state named {', '.join(keys)} yet; it is made "
                               "by the first optimizer step, so map the state after that step")
        devices = {t.device for _, _, t in found}
        if len(devices) > 1:
            raise ColomemError(f"the optimizer's state is on several devices ({sorted(map(str, devices))}); a "
                               "mapped state lives on one")
        self.optimizer = optimizer
        self.keys = tuple(keys)
        self._refs = [(p, k) for p, k, _ in found]
        items = [(f"{i}.{k}", t) for i, (_, k, t) in enumerate(found)]
        self.active = False
        self.closed = False
        self._in_place = False                 # state_dict() leaves the state in the pool (read_in_place)
        self._hooks: list = []
        self.moving: Optional[MappedHandle] = None
        self._old: list[torch.Tensor] = []
        if move_out:
            self.set, self.moving = MappedSet.moving_out(items, pool, name=name, chunk_bytes=chunk_bytes)
            self._old = [t for _, _, t in found]
            return
        self.set = MappedSet(items, pool, name=name, chunk_bytes=chunk_bytes)
        del found, items  # the old tensors go with their last reference: their memory back to the allocator
        self._install()

    def _install(self) -> None:
        """The optimizer uses the mapped tensors from now on; hooks keep it from reading unmapped memory."""
        for (p, k), new in zip(self._refs, self.set.tensors):
            self.optimizer.state[p][k] = new
        self.active = True
        opt = self.optimizer
        self._hooks = [opt.register_step_pre_hook(self._before_read),
                       opt.register_state_dict_pre_hook(self._before_state_dict),
                       opt.register_load_state_dict_post_hook(self._after_load)]

    def finish_move(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> int:
        """Waits for a move_out copy (nothing to do otherwise), then makes the optimizer use the mapped
        tensors and frees its old ones; returns the bytes moved (0 when none was moving). On a timeout the copy
        goes on: call again. If the copy failed, the optimizer keeps its old tensors and this state is let go."""
        h = self.moving
        if h is None:
            return 0
        try:
            stats = h.wait(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self.moving, self._old = None, []
            self._let_go()
            raise
        self.moving = None
        self._install()
        for t in self._old:  # nobody reads them any more: their memory goes back at once, even if referenced
            st = t.untyped_storage()
            if st.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0:
                st.resize_(0)
        self._old = []
        return stats.nbytes

    @property
    def nbytes(self) -> int:
        return self.set.nbytes

    @property
    def resident_bytes(self) -> int:
        return self.set.resident_bytes

    def offload(self, *, timing: bool = False) -> MappedHandle:
        """Queues the state's copy out (after the current stream's work); wait() on the handle frees each
        chunk as its copy ends."""
        self._check_active()
        return self.set.offload(timing=timing)

    def reload(self, budget_bytes: Optional[int] = None, *, ordered: bool = True, timing: bool = False,
               up_to_room: bool = False) -> MappedHandle:
        """Brings back the chunks in the pool, at most `budget_bytes` of them (None: all); see
        MappedSet.reload."""
        self._check_active()
        return self.set.reload(budget_bytes, ordered=ordered, timing=timing, up_to_room=up_to_room)

    def ensure_resident(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
        """The whole state back before anything reads it: on a GPU in the current stream's order (work queued
        after this call sees every byte), on the host waited for here."""
        if not self.active or self.set.resident:
            return
        self.set.reload(ordered=True)
        if self.set.device.type != "cuda":
            self.set.wait(timeout)

    @contextlib.contextmanager
    def read_in_place(self) -> Iterator[bool]:
        """Inside, state_dict() leaves the state where it is when all of it is in the pool with nothing
        copying: its reader takes each mapped tensor's bytes from its host view (set.host_view), as a
        checkpoint of an offloaded trainer does, instead of bringing the whole state back to the device first.
        Yields whether it does; when it does not, state_dict() brings the state back as always."""
        self._in_place = (self.active and not self.closed and self.moving is None and self.set.pending is None
                          and self.set.resident_bytes == 0)
        try:
            yield self._in_place
        finally:
            self._in_place = False

    def close(self) -> None:
        """Brings the state back into torch tensors the optimizer then owns, and frees the mapped memory."""
        if self.closed:
            return
        if self.moving is not None:
            self.finish_move(DEFAULT_TIMEOUT_S)
        self.ensure_resident()
        self.set.wait(DEFAULT_TIMEOUT_S)
        for (p, k), t in zip(self._refs, self.set.tensors):
            self.optimizer.state[p][k] = t.clone()
        self._let_go()

    def discard(self) -> None:
        """Lets the state go without bringing it back: the moments leave the optimizer's state (a later step
        would start them from zero) and the mapped memory is freed. For an optimizer that is being closed."""
        if self.closed:
            return
        if self.moving is not None:
            try:
                self.finish_move(DEFAULT_TIMEOUT_S)
            except Exception:  # noqa: B036  (the old tensors stay the optimizer's: nothing mapped to let go of)
                return
        for p, k in self._refs:
            self.optimizer.state.get(p, {}).pop(k, None)
        self._let_go()

    # -- hooks -----------------------------------------------------------------------------------------------
    def _before_read(self, *_args: Any) -> None:
        self.ensure_resident()

    def _before_state_dict(self, *_args: Any) -> None:
        if not self._in_place:
            self.ensure_resident()

    def _after_load(self, *_args: Any) -> None:
        """load_state_dict() put new tensors in the state: the mapped ones are no longer the optimizer's. A
        state dict read from this optimizer in the same process holds the mapped tensors themselves, and torch
        loads a tensor already of the right dtype and device as it is: those are cloned out of the mapped
        memory before it goes."""
        lo = self.set.memory.range.ptr
        hi = lo + self.set.memory.range.reserved_bytes
        aliased = [(st, k) for st in self.optimizer.state.values() for k, t in st.items()
                   if isinstance(t, torch.Tensor) and lo <= t.data_ptr() < hi]
        if aliased:
            self.ensure_resident()
            self.set.wait(DEFAULT_TIMEOUT_S)
            for st, k in aliased:
                st[k] = st[k].clone()
        self._let_go()

    def _let_go(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.active = False
        self.set.close()
        self.closed = True

    def _check_active(self) -> None:
        if self.moving is not None:
            raise ColomemError("the optimizer state is still moving out to the pool; finish_move() first")
        if not self.active:
            raise ColomemError("this mapped optimizer state was let go (closed, or the optimizer loaded a state "
                               "dict); map the optimizer's state again")


__all__ = ["MOMENTS", "MappedOptimizerState", "state_tensors"]
