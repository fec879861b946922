"""The three ways DeepSpeedTrainer moves an engine's GPU state out and back, behind one small protocol.

ColomemOffload    every storage the engine holds (state.collect_engine_state) into the pinned pool with two
                  SwapSets; the tensor objects, views and DeepSpeed's references stay the same, so nothing is
                  re-linked. Scratch buckets are dropped without a copy. The memory goes back to the driver.
DeepSpeedOffload  the baseline: DeepSpeed's own engine.offload_states() / reload_states().
ToOffload         the naive baseline: the same storages copied with .to("cpu") into fresh pageable memory,
                  synchronously, one at a time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol

import torch
from torch import Tensor

from colomem.errors import ColomemError, CudaOutOfMemoryError

from .mapped_moments import MappedMoments
from .state import (CATEGORIES, LATE_CATEGORIES, EngineState, release_cached_memory, storage_key,
                    storage_nbytes)


@dataclass
class Move:
    nbytes: int                  # bytes copied by the strategy
    seconds: float               # the move alone (collection included for colomem and to, not for deepspeed)
    state: Optional[EngineState] = None


class OffloadStrategy(Protocol):
    """What DeepSpeedTrainer calls on an offload method."""
    method: str

    def offload(self) -> Move:
        ...

    def reload(self) -> Move:
        ...

    def host_view(self, t: Tensor) -> Optional[Tensor]:
        """A CPU tensor over the offloaded copy of t (same layout), valid while offloaded; None: no such copy."""
        ...

    def close(self) -> None:
        ...


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    """A uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))



class ScratchBuffers:
    """Storages whose contents do not matter between steps: shrunk without a copy, re-grown empty."""

    def __init__(self):
        self._held: list[tuple[torch.UntypedStorage, int]] = []

    def release(self, items: Iterable[tuple[str, Tensor]]) -> int:
        n = 0
        for _, t in items:
            st = t.untyped_storage()
            size = st.nbytes()
            st.resize_(0)
            self._held.append((st, size))
            n += size
        return n

    def regrow(self) -> int:
        n, grown = 0, []
        try:
            for st, size in self._held:
                st.resize_(size)
                grown.append(st)
                n += size
        except torch.OutOfMemoryError as e:
            for st in grown:
                st.resize_(0)
            raise CudaOutOfMemoryError(f"re-growing DeepSpeed's gradient buckets ({n} bytes) ran out of GPU "
                                       f"memory: {e}") from e
        return n

    def forget(self) -> None:
        self._held = []

    def shrink_again(self) -> None:
        for st, _ in self._held:
            st.resize_(0)


def kept_part(items: Iterable[tuple[str, Tensor]], budget: int) -> set:
    """The storages of `items` (one category's) that stay on the GPU within `budget` bytes: whole ones, the
    largest first (ZeRO keeps a few large flat tensors: the most bytes that fit stay), by order among
    equals."""
    sizes: dict = {}
    for _, t in items:
        sizes.setdefault(storage_key(t), storage_nbytes(t))
    stay, used = set(), 0
    for key, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        if n and used + n <= budget:
            stay.add(key)
            used += n
    return stay


class ColomemOffload:
    """Two SwapSets over what the engine holds (re-collected at each offload) + dropped scratch: what the
    forward and backward read, and what only the optimizer step reads (LATE: fp32 masters, Adam moments),
    which reload(pending) copies back while the forward and backward run, and offload(defer_late=True)
    leaves copying while the rollout's weights wake and sync (finish_late() ends it). `keep`: categories left
    on the GPU (the placement planner's choice); the rest moves."""
    method = "colomem"

    def __init__(self, collect: Callable[[], EngineState], pool, device: torch.device, timeout_s: float,
                 moments: Optional[MappedMoments] = None):
        from colomem.swap import SwapSet

        self._collect = collect
        self._state: Optional[EngineState] = None
        self._scratch = ScratchBuffers()
        self._timeout = timeout_s
        self._keep: tuple[str, ...] = ()     # categories the next offload leaves on the GPU
        self._keep_part: tuple[str, int] = ("", 0)   # and of this category, whole tensors up to these bytes
        # Adam's moments in memory colomem maps itself (mapped_moments.py): they move with the LATE part but
        # not in its SwapSet
        self.moments = moments
        early = tuple(c for c in CATEGORIES if c not in LATE_CATEGORIES)

        def items(cats):
            def get():
                if self._state is None:
                    return []
                out = self._state.swap_items([c for c in cats if c not in self.keep])
                if self._keep_part[0] in cats:
                    stay = kept_part(self._state.groups.get(self._keep_part[0], ()), self._keep_part[1])
                    out = [(n, t) for n, t in out if storage_key(t) not in stay]
                if self.moments is not None:
                    mapped = self.moments.storages()
                    out = [(n, t) for n, t in out if storage_key(t) not in mapped]
                return out
            return get
        # release=True: the memory goes back to the driver inside the timed move, as with the baselines
        self.swapset = SwapSet.from_tensors(items(early), pool, name="deepspeed-trainer", device=device,
                                            release=device.type == "cuda")
        # offloaded first; with release, its pieces' memory goes back while the later pieces copy (where the
        # allocator's unmaps do not wait for copies in flight: expandable segments), not after all of them
        self._late_items = items(LATE_CATEGORIES)
        self.late = SwapSet.from_tensors(self._late_items, pool, name="deepspeed-trainer.optimizer",
                                         device=device, release=device.type == "cuda")
        self._late_pending: Any = None                                # its SwapHandle while a deferred offload runs
        self._late_held = 0                                           # its bytes while deferred, not started yet

    @property
    def keep(self) -> tuple[str, ...]:
        return self._keep

    @keep.setter
    def keep(self, keep: tuple[str, ...]) -> None:
        """A new placement: the kept blocks of the old layout go back first (_new_layout)."""
        keep = tuple(keep)
        if set(keep) != set(self._keep):
            self._new_layout()
        self._keep = keep

    @property
    def keep_part(self) -> tuple[str, int]:
        return self._keep_part

    @keep_part.setter
    def keep_part(self, part: tuple[str, int]) -> None:
        """(category, bytes): of a category not kept whole, whole tensors up to `bytes` stay on the GPU too
        (("", 0): none). A new part is a new layout, as a new keep is (_new_layout)."""
        part = (str(part[0]), int(part[1])) if part and part[1] > 0 else ("", 0)
        if part != self._keep_part:
            self._new_layout()
        self._keep_part = part

    def _new_layout(self) -> None:
        """Both sets move other tensors from now on: the blocks they kept for the old layout go back to the
        pool first (the first set's offload would otherwise grow the pool beside them)."""
        self.swapset.release_kept_blocks()
        self.late.release_kept_blocks()

    @property
    def pending_bytes(self) -> int:
        """Bytes of the LATE part still copying (or held back) after offload(defer_late=True); 0 when none is."""
        own = self.late.nbytes if self._late_pending is not None else self._late_held
        return own + (self.moments.pending_bytes if self.moments is not None else 0)

    def _moments_move(self) -> bool:
        return self.moments is not None and "optim" not in self.keep

    def offload(self, defer_late: bool = False, hold_late: bool = False) -> Move:
        """defer_late: the LATE part is still copying on return (its bytes are not in the Move's); its GPU
        memory is freed by finish_late(). hold_late: it starts copying only at start_late() (or
        finish_late()), not beside what the caller does first."""
        t0 = time.perf_counter()
        state = self._state = self._collect()
        self._scratch.release(state.scratch)
        nbytes = 0
        try:
            if defer_late:
                # the rest first: its wait would otherwise queue behind the whole deferred copy on the same
                # copy engine (even with nothing of it to move), and the offload would not return before it
                nbytes += self.swapset.offload(self._timeout).nbytes
                # what the process holds cached goes back now, while nothing copies: a cudaFree (of cuBLAS's
                # workspaces too) waits for every copy in flight, so done after the deferred copy started it
                # would wait for all of it (the caller does not release again while the copy runs)
                release_cached_memory()
                if hold_late:
                    held = {storage_key(t): storage_nbytes(t) for _, t in self._late_items()}
                    self._late_held = sum(held.values())
                else:
                    self._late_pending = self.late.offload_async()
                if self._moments_move():
                    assert self.moments is not None
                    self.moments.offload(hold=hold_late)
            else:
                nbytes += self.late.offload(self._timeout).nbytes
                if self._moments_move():
                    assert self.moments is not None
                    self.moments.offload()
                    nbytes += self.moments.finish(self._timeout)
                nbytes += self.swapset.offload(self._timeout).nbytes
        except BaseException:
            self._late_held = 0
            if self._late_pending is not None:   # the deferred part ends before it is rolled back
                self._late_pending = None
                try:
                    self.late.wait_pending(self._timeout)
                except ColomemError:
                    pass
            if self.moments is not None:
                try:
                    self.moments.reload()
                except ColomemError:
                    pass
            for s in (self.late, self.swapset):   # all or nothing: the engine stays trainable
                if s.state == "offloaded":
                    s.reload(self._timeout)
            self._scratch.regrow()
            self._scratch.forget()
            raise
        return Move(nbytes, time.perf_counter() - t0, state)

    def start_late(self) -> None:
        """Starts the LATE part's copy an offload(hold_late=True) held back (nothing to do otherwise). If it
        cannot start, the part stays on the GPU, whole (a reload then has nothing of it to bring back)."""
        if self._late_held:
            self._late_held = 0
            self._late_pending = self.late.offload_async()
        if self.moments is not None:
            self.moments.start()

    def finish_late(self, timeout: Optional[float] = None) -> int:
        """Waits for the LATE part an offload(defer_late=True) left copying, starting it first when held (its
        storages shrink then; the caller empties the cache); returns its bytes. On a timeout it goes on and a
        later call waits again."""
        self.start_late()
        n = 0
        if self._late_pending is not None:
            n = self._late_pending.wait(self._timeout if timeout is None else timeout).nbytes
            self._late_pending = None
        if self.moments is not None:
            n += self.moments.finish(timeout)
        return n

    def reload(self, pending=None, late: bool = True) -> Move:
        """pending: a colomem.swap.PendingReloads to start the LATE part in (its wait() must come before
        the optimizer step); None: everything is back when this returns. late=False: the LATE part stays in
        the pool until reload_late() (called inside the optimizer step, once the gradients are flattened)."""
        t0 = time.perf_counter()
        self._scratch.regrow()
        try:
            nbytes = self.swapset.reload(self._timeout).nbytes
        except BaseException:
            self._scratch.shrink_again()      # all or nothing: the set rolled its storages back too
            raise
        try:
            if not late:
                pass
            elif pending is None:
                nbytes += self.late.reload(self._timeout).nbytes
                if self.moments is not None:
                    nbytes += self.moments.reload()
            else:
                pending.add(self.late.reload_async(ordered=False))
                back = self.moments.reload_async() if self.moments is not None else None
                if back is not None:
                    pending.add(back)
        except BaseException:
            self.swapset.offload(self._timeout)   # e.g. no GPU memory for the late part: offloaded again
            self._scratch.shrink_again()
            raise
        self._scratch.forget()
        self._state = None
        return Move(nbytes, time.perf_counter() - t0)

    @property
    def late_outstanding(self) -> bool:
        """The LATE part is in the pool, or on its way there (offload(defer_late=True)), after a
        reload(late=False)."""
        return self._state is None and (self.late.state == "offloaded" or self._late_pending is not None
                                        or self._late_held > 0
                                        or (self.moments is not None and self.moments.outstanding))

    def reload_late(self) -> int:
        """Brings the LATE part back (synchronously) after a reload(late=False), waiting first for a deferred
        offload of it; returns its bytes, 0 when it was not outstanding."""
        if not self.late_outstanding:
            return 0
        self.finish_late()
        n = 0
        if self.late.state == "offloaded":
            n = self.late.reload(self._timeout, timing=True).nbytes     # timed: the step's figures read it
        if self.moments is not None:
            n += self.moments.reload()
        return n

    def prefetch_late(self, budget_bytes: int) -> int:
        """After a reload(late=False): queues the copy back of as much of the moments held in mapped memory
        as fits in `budget_bytes`, behind the forward and backward; the rest comes back at reload_late().
        Returns the bytes queued (0 without mapped moments)."""
        if self.moments is None or self._state is not None or self.pending_bytes:
            return 0  # still copying out (optimizer_out_until_step): nothing to bring back early yet
        return self.moments.prefetch(budget_bytes)

    def late_stats(self) -> Any:
        """The last at-step reload's figures: the mapped moments' when they moved, else the LATE set's."""
        if self.moments is not None and self.moments.last_stats is not None:
            return self.moments.last_stats
        return self.late.last_stats

    def host_view(self, t: Tensor) -> Optional[Tensor]:
        """A CPU tensor over the pool copy of t (same dtype, shape, strides; either set, or the mapped moments),
        valid while offloaded."""
        view = self.swapset.host_view(t)
        if view is None:
            view = self.late.host_view(t)
        if view is None and self.moments is not None:
            view = self.moments.host_view(t)
        return view

    def host_storage(self, t: Tensor) -> Optional[Tensor]:
        """The pool copy of t's whole storage (uint8, either set), valid while offloaded."""
        raw = self.swapset.host_storage(t)
        return raw if raw is not None else self.late.host_storage(t)

    def offloaded_items(self) -> Optional[list[tuple[str, str, Tensor]]]:
        """(category, name, tensor) of the engine's state at the last offload, kept categories included (they
        are still on the GPU: host_storage gives None for them); None while resident."""
        if self._state is None:
            return None
        return [(c, n, t) for c in CATEGORIES for n, t in self._state.groups.get(c, ())]

    def close(self) -> None:
        if self._late_pending is not None:      # a deferred offload finishes before its set closes
            self._late_pending = None
            self.late.wait_pending(self._timeout)
        if self.moments is not None:
            self.moments.close()
        for s in (self.swapset, self.late):
            if s.state == "offloaded":
                s.discard()
            s.close()


class ToOffload:
    """The naive baseline: each storage copied with .to('cpu') into new pageable memory and back."""
    method = "to"

    def __init__(self, collect: Callable[[], EngineState], device: torch.device):
        self._collect = collect
        self._device = device
        self._held: list[tuple[torch.UntypedStorage, int, Tensor]] = []
        self._scratch = ScratchBuffers()

    def offload(self) -> Move:
        t0 = time.perf_counter()
        state = self._collect()
        self._scratch.release(state.scratch)
        try:
            for _, t in state.swap_items():
                st = t.untyped_storage()
                host = _bytes_of(st, self._device).to("cpu", copy=True)
                self._held.append((st, st.nbytes(), host))
                st.resize_(0)
        except BaseException:
            self._restore()
            self._scratch.regrow()
            self._scratch.forget()
            raise
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        return Move(sum(h.numel() for _, _, h in self._held), time.perf_counter() - t0, state)

    def _restore(self) -> int:
        n, done = 0, []
        try:
            for st, size, host in self._held:
                st.resize_(size)
                _bytes_of(st, self._device).copy_(host)
                done.append(st)
                n += size
        except torch.OutOfMemoryError as e:
            for st in done:
                st.resize_(0)
            raise CudaOutOfMemoryError(f"reload (.to loop) ran out of GPU memory after {n} bytes: {e}") from e
        self._held = []
        return n

    def reload(self) -> Move:
        t0 = time.perf_counter()
        self._scratch.regrow()
        try:
            n = self._restore()
        except BaseException:
            self._scratch.shrink_again()
            raise
        self._scratch.forget()
        return Move(n, time.perf_counter() - t0)

    def host_view(self, t: Tensor) -> Optional[Tensor]:
        return None

    def close(self) -> None:
        self._held = []


class DeepSpeedOffload:
    """The baseline: DeepSpeed's own engine.offload_states() / reload_states() (pinned buffers it caches).
    nbytes: how much torch's allocated memory fell (offload) or rose (reload), i.e. what DeepSpeed moved."""
    method = "deepspeed"

    def __init__(self, engine, collect: Callable[[], EngineState]):
        self._engine = engine
        self._collect = collect

    def offload(self) -> Move:
        state = self._collect()       # what there was to move, for the report (not timed)
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        self._engine.offload_states()
        torch.cuda.synchronize()
        return Move(max(0, before - torch.cuda.memory_allocated()), time.perf_counter() - t0, state)

    def reload(self) -> Move:
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        self._engine.reload_states()
        torch.cuda.synchronize()
        return Move(max(0, torch.cuda.memory_allocated() - before), time.perf_counter() - t0)

    def host_view(self, t: Tensor) -> Optional[Tensor]:
        return None

    def close(self) -> None:
        pass

