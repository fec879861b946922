"""How long Python's garbage collector held the process, step by step and phase by phase.

A collection holds the GIL: while it runs no other Python runs in the process, so an in-process vLLM engine's
scheduler (a Python loop between decode steps) waits, and so does the trainer's launch of its kernels. A
collection of the oldest generation walks every tracked object of the process, the trainer's modules and
the engine's included. The runner records what the collector took in each step (`host/gc_s`, the longest
single pause `host/gc_max_s`, `host/gc_full` collections of the oldest generation) and in each phase that
one ran in (`gc/<phase>_s`), so a slow or uneven phase can be told from one the collector interrupted.
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Optional


class GcPauses:
    """A gc.callbacks hook summing the collector's pauses: `total` over the process's run, and the step's
    figures that `take()` hands out and starts over."""

    def __init__(self) -> None:
        self.total = 0.0                  # seconds, since installed
        self._started: Optional[float] = None
        self._step_s = 0.0
        self._step_max = 0.0
        self._step_full = 0
        self._users = 0
        self._lock = threading.Lock()

    def _hook(self, phase: str, info: dict) -> None:
        # runs inside the collection, which holds the GIL: no other thread is between these two calls
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        took = time.perf_counter() - self._started
        self._started = None
        self.total += took
        self._step_s += took
        self._step_max = max(self._step_max, took)
        self._step_full += int(info.get("generation") == 2)

    def install(self) -> None:
        """Starts counting (nested installs count once; each needs its remove())."""
        with self._lock:
            self._users += 1
            if self._users == 1:
                gc.callbacks.append(self._hook)

    def remove(self) -> None:
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users == 0 and self._hook in gc.callbacks:
                gc.callbacks.remove(self._hook)

    @property
    def installed(self) -> bool:
        return self._users > 0

    def take(self) -> dict:
        """The pauses since the last take(): {} while not installed."""
        if not self.installed:
            return {}
        out = {"host/gc_s": self._step_s, "host/gc_max_s": self._step_max, "host/gc_full": self._step_full}
        self._step_s, self._step_max, self._step_full = 0.0, 0.0, 0
        return out


PAUSES = GcPauses()     # the process's one hook (gc.callbacks is process-wide)

__all__ = ["GcPauses", "PAUSES"]
