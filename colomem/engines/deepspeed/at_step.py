"""What a DeepSpeedTrainer brings back at (or for) the optimizer step, and the step itself: the hooks that
read the peak as the step starts and reload the optimizer state that waits for it (step_reload.py), and the
prefetch of Adam's moments held in mapped memory behind the forward and backward. A mixin of
DeepSpeedTrainer, which holds the state it reads.

How much of the moments to prefetch is measured, not guessed: at each step's start the hook reads how much
more could have been mapped there (`prefetch_room`), and the next reload prefetches the smallest room of the
last few steps less a margin (`prefetch_budget`). The first step after the moments moved brings all of them
back inside the step; the steps after it, only what did not fit.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from colomem._torch import mem_get_info
from colomem.swap import PendingReloads

from .step_reload import ReloadAtStep, StepStartPeak, alloc_retries, reload_figures
from .strategies import ColomemOffload

GiB = 1 << 30
# Left free at the step's start: a later step's forward and backward may reach a higher peak than the steps
# measured (longer completions), and an allocation that finds no room frees the allocator's cache and waits.
PREFETCH_MARGIN_BYTES = 4 * GiB
ROOM_STEPS = 4  # the steps whose smallest room sets the budget


def prefetch_room(free: int, peak_reserved: int, reserved_now: int, mapped_now: int) -> int:
    """Bytes of mapped moments that could have been on the device at the optimizer step's start: those
    mapped then, plus what the driver had left at the training's peak. The peak is the allocator's (its
    reserved bytes at most); memory it gave back since then (an allocation retry frees its cache) counts as
    taken, since it was at the peak."""
    return max(0, mapped_now + free - max(0, peak_reserved - reserved_now))


def prefetch_budget(rooms: list[int], margin: int) -> int:
    """The bytes to bring back before the next step: the smallest measured room less the margin (0 before
    any was measured)."""
    return max(0, min(rooms) - margin) if rooms else 0


class AtStepReload:
    _pending: PendingReloads
    _step_reload: Optional[ReloadAtStep]
    _start_peak: Optional[StepStartPeak]
    _strategies: dict
    device: torch.device
    engine: Any
    timeout_s: float
    finish_offload: Callable[..., float]  # DeferredOffload's
    reduce_per_step: bool
    steps: int
    prefetch_margin_bytes: int = PREFETCH_MARGIN_BYTES

    def _optimizer_step(self) -> dict[str, float]:
        """The optimizer step ending an update (train_on_batch's optimizer_step) and its figures: the reload
        it waited for, the peaks before it and as it started, and what came back inside it."""
        # the step reads the masters and moments: those still in the pool come back from inside it; those
        # still copying out (optimizer_out_until_step) free their memory first, before ZeRO's cast
        waited = self._pending.wait(self.timeout_s) + self.finish_offload()
        engine = self.engine
        hook = self._step_reload
        at_step = hook is not None and hook.armed
        # the forward and backward's own peak (the caller resets it before training), apart from the step's:
        # what must fit if the optimizer state stayed on the GPU until the step
        before = torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else 0
        start = self._step_start_peak()
        retries = alloc_retries(self.device)
        if self.reduce_per_step:         # the reduction ran as the update's block ended; the step is the boundary
            engine.set_gradient_accumulation_boundary(True)
        lr = float(engine.get_lr()[0])           # the rate this step uses (the step moves the scheduler on)
        engine.step()
        self.steps += 1
        out = {"lr": lr, "reload_wait_s": waited, "reserved_before_step_max": float(before),
               "optimizer_step_alloc_retries": float(alloc_retries(self.device) - retries)}
        if start is not None:            # with the gradients' cast: what fits beside it could come back early
            out["reserved_at_step_start_max"] = float(start.bytes)
            if start.room is not None:
                out["prefetch_room_bytes"] = float(start.room)
        colomem = self._strategies.get("colomem")
        if hook is not None and at_step and isinstance(colomem, ColomemOffload):
            out["optimizer_reload_s"] = hook.seconds
            out.update(reload_figures(colomem.late_stats()))
            if colomem.moments is not None:
                out["optimizer_prefetch_bytes"] = float(colomem.moments.prefetched)
        norm = engine.get_global_grad_norm()
        if norm is not None:
            out["grad_norm"] = float(norm)
        return out

    def wait_reload(self, timeout: Optional[float] = None) -> float:
        """Waits for the part of the last reload that overlap_reload left in flight (train_step calls this
        before the optimizer step; call it before reading the optimizer's state yourself). Returns the
        seconds it blocked: 0.0 when nothing was pending. With optimizer_reload "step", what waits for the
        optimizer step comes back here."""
        waited = self._pending.wait(self.timeout_s if timeout is None else timeout)
        if self._step_reload is not None:
            if self._step_reload.armed:
                waited += self.finish_offload(timeout)   # still copying out (optimizer_out_until_step)
            waited += self._step_reload.run()
        return waited

    def _step_start_peak(self) -> Optional[StepStartPeak]:
        """The hook reading the peak (and the room left beside it) as the optimizer step starts (CUDA only),
        registered once, before any ReloadAtStep (hooks run in the order they were registered)."""
        if self.device.type != "cuda":
            return None
        if getattr(self, "_start_peak", None) is None:
            dev = self.device
            self._start_peak = StepStartPeak(self.engine.optimizer, lambda: torch.cuda.max_memory_reserved(dev),
                                             room=self._room_now)
        return self._start_peak

    def _room_now(self) -> int:
        dev = self.device
        s = self._strategies.get("colomem")
        moments = getattr(s, "moments", None)
        # mapped, not resident: a prefetch nobody has waited for yet holds its memory all the same
        mapped = moments.mapped_bytes if moments is not None else 0
        return prefetch_room(mem_get_info(dev)[0], torch.cuda.max_memory_reserved(dev),
                             torch.cuda.memory_reserved(dev), mapped)

    def _reload_at_step(self, strategy: ColomemOffload) -> ReloadAtStep:
        self._step_start_peak()
        if self._step_reload is None:
            self._step_reload = ReloadAtStep(self.engine.optimizer, strategy.reload_late)
        return self._step_reload

    def _prefetch_moments(self, strategy: ColomemOffload) -> int:
        """After a reload that left the optimizer state for the step: queues as much of the mapped moments as
        the last steps left room for; returns the bytes queued."""
        peak = self._start_peak
        if strategy.moments is None or peak is None:
            return 0
        return strategy.prefetch_late(prefetch_budget(peak.rooms[-ROOM_STEPS:], self.prefetch_margin_bytes))


__all__ = ["AtStepReload", "PREFETCH_MARGIN_BYTES", "prefetch_budget", "prefetch_room"]
