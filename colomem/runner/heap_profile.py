"""Where the runner's Python heap grows, step after step: a diagnostic for long runs whose host memory
grows (the soak's `host/rss_bytes`).

With `COLOMEM_HEAP_PROFILE_EVERY=N` the runner traces its Python allocations (`tracemalloc`) and, every N
steps, writes one line to `heap_profile.jsonl` in the output directory: the bytes traced and the allocation
sites that grew most since the first profiled step, each with its file, line and growth. A leak in
Python code (a list appended to at every step, a cache without a bound) then names its own line. Memory
that C or C++ code allocates (CUDA, a library's own malloc) is not traced: a growing RSS with a flat
traced total points there. Tracing costs time (allocations get slower): it is for diagnosis, not for runs
that are being timed.
"""
from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path
from typing import Optional

ENV = "COLOMEM_HEAP_PROFILE_EVERY"
TOP = 15          # allocation sites per line
FRAMES = 4        # frames kept per allocation: the site and three callers


def every_from_env(environ=os.environ) -> int:
    """N from COLOMEM_HEAP_PROFILE_EVERY (0: off); a value that is not a whole number >= 0 is an error."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{ENV} must be a whole number of steps >= 0 (0: off), got {raw!r}")
    return n


class HeapProfile:
    """Traces the Python heap and writes the growth per allocation site every `every` steps."""

    def __init__(self, path: os.PathLike, every: int):
        self.path, self.every = Path(path), every
        self._base: Optional[tracemalloc.Snapshot] = None
        self._base_step: Optional[int] = None
        self._started_here = not tracemalloc.is_tracing()
        if self._started_here:
            tracemalloc.start(FRAMES)

    def after_step(self, step: int) -> None:
        """Called after every finished step; profiles every `every` steps (the first one is the baseline)."""
        if self.every <= 0 or (step + 1) % self.every:
            return
        snap = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        current, peak = tracemalloc.get_traced_memory()
        line: dict = {"step": step, "traced_bytes": current, "traced_peak_bytes": peak}
        if self._base is None:
            self._base, self._base_step = snap, step
            line["top"] = []
        else:
            diffs = snap.compare_to(self._base, "lineno")
            line["since_step"] = self._base_step
            line["top"] = [{"where": f"{d.traceback[0].filename}:{d.traceback[0].lineno}",
                            "size_diff_bytes": d.size_diff, "count_diff": d.count_diff, "size_bytes": d.size}
                           for d in diffs[:TOP] if d.size_diff > 0]
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._started_here and tracemalloc.is_tracing():
            tracemalloc.stop()
        self._base = None


def make(out: os.PathLike, environ=os.environ) -> Optional[HeapProfile]:
    """The run's HeapProfile when COLOMEM_HEAP_PROFILE_EVERY asks for one, else None."""
    every = every_from_env(environ)
    return HeapProfile(Path(out) / "heap_profile.jsonl", every) if every else None


__all__ = ["ENV", "HeapProfile", "every_from_env", "make"]
