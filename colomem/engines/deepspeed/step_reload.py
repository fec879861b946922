"""The optimizer state brought back inside the optimizer step, for a trainer whose step does not fit otherwise.

ZeRO-1/2's step first flattens the bf16 gradients and casts them to fp32 (a copy of the gradients in the
model dtype, then one in fp32, beside the gradients themselves) and only then frees the gradients and runs
Adam. With Adam's moments already on the GPU, as a reload behind the forward and backward leaves them, that
moment is the step's peak: on a 7.6B-parameter full fine-tune it is ~156 GiB, more than one 141 GB GPU. The
very first step fits because the moments do not exist yet: Adam creates them after the gradients are freed.

Reloading the moments (and the masters, unless kept) from the pool at the inner optimizer's step, after that
conversion, gives every later step the first step's peak. The copy is then not hidden behind the forward
and backward: the price of fitting at all.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from colomem.errors import ColomemError

def inner_torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer a DeepSpeed optimizer wraps (ZeRO optimizers keep it as `.optimizer`)."""
    seen = 0
    while not isinstance(opt, torch.optim.Optimizer):
        nxt = getattr(opt, "optimizer", None)
        seen += 1
        if nxt is None or seen > 8:
            raise ColomemError(f"found no torch optimizer inside DeepSpeed's {type(opt).__name__}; reloading the "
                               "optimizer state at its step needs one (use optimizer_reload='overlap')")
        opt = nxt
    return opt


class ReloadAtStep:
    """A step pre-hook on the inner torch optimizer that calls `reload()` once per armed step.

    arm() after a reload that left the optimizer state in the pool; the next inner step brings it back before
    it reads a byte of it. `seconds` is the time the last one took (0.0 when nothing was outstanding)."""

    def __init__(self, optimizer: Any, reload: Callable[[], int]):
        self._reload = reload
        self._armed = False
        self.seconds = 0.0
        self.nbytes = 0
        self._handle: Optional[Any] = inner_torch_optimizer(optimizer).register_step_pre_hook(self._before_step)

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        self._armed = True
        self.seconds, self.nbytes = 0.0, 0

    def run(self) -> float:
        """Reloads now if armed (the hook, or a caller about to read the optimizer state); returns seconds."""
        if not self._armed:
            return 0.0
        t0 = time.perf_counter()
        self.nbytes = self._reload()
        self._armed = False
        self.seconds = time.perf_counter() - t0
        return self.seconds

    def _before_step(self, _optimizer, _args, _kwargs) -> None:
        self.run()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class StepStartPeak:
    """A step pre-hook that reads the allocator's peak reserved bytes as the inner optimizer's step starts:
    the forward and backward and ZeRO's gradient cast (the flattened copy, the fp32 one, the gradients still
    held), before Adam touches its state. Registered before any ReloadAtStep, it runs before the at-step
    reload brings the state back. What could come back before the step is what fits beside that peak."""

    def __init__(self, optimizer: Any, read: Callable[[], int], room: Optional[Callable[[], int]] = None):
        self.bytes = 0
        self.rooms: list[int] = []    # each step's room, from `room` (at_step.prefetch_room), oldest first
        self._read_peak = read        # torch.cuda.max_memory_reserved of the trainer's device
        self._read_room = room
        self._handle: Optional[Any] = inner_torch_optimizer(optimizer).register_step_pre_hook(self._read)

    @property
    def room(self) -> Optional[int]:
        return self.rooms[-1] if self.rooms else None

    def _read(self, _optimizer, _args, _kwargs) -> None:
        self.bytes = int(self._read_peak())
        if self._read_room is not None:
            self.rooms = (self.rooms + [int(self._read_room())])[-16:]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def reload_figures(stats: Any) -> dict[str, float]:
    """Where an at-step reload's time went, from its SwapStats (timed): the copies on the device and the
    host's re-growth of the storages; the rest of the hook's seconds is waiting for ZeRO's cast to end and
    the set's finish."""
    if stats is None:
        return {}
    # a SwapSet's reload re-grows storages (alloc_ms); a MappedSet's maps chunks (map_ms)
    grow_ms: Optional[float] = getattr(stats, "alloc_ms", None)
    if grow_ms is None:
        grow_ms = float(getattr(stats, "map_ms", 0.0))
    out = {"optimizer_reload_copy_s": stats.device_ms / 1e3, "optimizer_reload_regrow_s": grow_ms / 1e3}
    releases = getattr(stats, "cache_releases", None)  # a MappedSet's: torch's cache freed to map a chunk
    if releases is not None:
        out["optimizer_map_cache_releases"] = float(releases)
    return out


def alloc_retries(device: torch.device) -> int:
    """How often the caching allocator has freed its cache to retry an allocation on `device` so far (0 on
    the host): a step that made it do so waited there for every copy in flight."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


__all__ = ["ReloadAtStep", "StepStartPeak", "alloc_retries", "inner_torch_optimizer", "reload_figures"]
