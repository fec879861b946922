"""What a SwapSet's offload or reload hands back: its statistics, the handle of a copy in flight, and the
PendingReloads that gathers handles to wait for later. The handle is the one way a caller waits for a
copy, so everything about waiting (the timeout's meaning, a timed-out wait kept waitable) lives here."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from colomem.errors import InvalidArgumentError, TransferTimeoutError

if TYPE_CHECKING:
    from colomem.swap import SwapSet

DEFAULT_TIMEOUT_S = 300.0


def wait_seconds(timeout: Optional[float]) -> float:
    """A wait's timeout as the core takes it: None and inf (or any huge value) wait without bound; NaN,
    negative values and non-numbers are refused here, before any copy is waited on."""
    if timeout is None:
        return math.inf
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgumentError(f"timeout must be seconds (a number >= 0) or None for no bound, got "
                                   f"{timeout!r}")
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise InvalidArgumentError(f"timeout must be seconds >= 0 or None for no bound, got {timeout!r}")
    return t


@dataclass
class SwapStats:
    direction: str
    nbytes: int
    storages: int
    seconds: float          # host wall time from submit to completion
    device_ms: float = 0.0  # copy time on the device (CUDA events), when measured
    freed_bytes: int = 0    # driver-visible memory given back (offload with release=True)
    span_ms: float = 0.0    # swap(): device ms from the first copy's start to the last copy's end
    alloc_ms: float = 0.0   # reload: host ms spent re-growing the storages (the caching allocator's cudaMalloc)

    @property
    def gbps(self) -> float:
        t = self.device_ms / 1e3 if self.device_ms else self.seconds
        return self.nbytes / t / 1e9 if t > 0 else float("inf")


class SwapHandle:
    """An offload or reload in flight. `wait()` finishes it (an offload frees GPU memory only then).

    Several threads may wait on one handle: the copy is finished (storages shrunk or the set marked
    resident) exactly once, under the set's lock."""

    def __init__(self, swapset: "SwapSet", transfer, finish: Callable[[], SwapStats], t0: float, *,
                 advance: Optional[Callable[[float], None]] = None):
        self._set = swapset
        self._transfer = transfer
        self._finish = finish
        self._advance = advance  # an offload in pieces: waits piece by piece, freeing each (swap_pipeline.Release)
        self._t0 = t0
        self._stats: Optional[SwapStats] = None
        self._error: Optional[BaseException] = None  # finish() failed: every later wait raises it again

    def done(self) -> bool:
        return self._stats is not None or self._transfer.done()

    def wait(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> SwapStats:
        """Blocks up to `timeout` seconds (None or inf: no bound). TransferTimeoutError then, carrying this
        handle as `.handle`: the copy keeps running and nothing is lost, wait again."""
        seconds = wait_seconds(timeout)
        if self._stats is None and self._error is None:
            try:
                if self._advance is not None:
                    end = time.monotonic() + (0.0 if math.isinf(seconds) else seconds)
                    self._advance(seconds)
                    seconds = seconds if math.isinf(seconds) else max(0.0, end - time.monotonic())
                self._transfer.wait(seconds)
            except TransferTimeoutError as exc:
                setattr(exc, "handle", self)  # so the caller of a synchronous offload/reload can wait again
                raise
            with self._set._lock:
                if self._stats is None and self._error is None:
                    try:
                        self._stats = self._finish()
                    except BaseException as exc:
                        self._error = exc
                        raise
        if self._error is not None:
            raise self._error
        assert self._stats is not None  # set above whenever finish() raised nothing
        return self._stats


class PendingReloads:
    """Reloads started with ordered=False (state that is read late, e.g. an optimizer's, copied back while
    the forward and backward run). wait() before anything reads those tensors; a timeout keeps the handle,
    so waiting again loses nothing."""

    def __init__(self):
        self._handles: list[SwapHandle] = []

    def __bool__(self) -> bool:
        return bool(self._handles)

    def add(self, handle: SwapHandle) -> None:
        self._handles.append(handle)

    @property
    def nbytes(self) -> int:
        """Bytes still pending (a SwapHandle's set's; a handle that knows its own bytes, its own)."""
        total = 0
        for h in self._handles:
            own: Optional[int] = getattr(h, "nbytes", None)
            total += h._set.nbytes if own is None else own
        return total

    def wait(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> float:
        """Blocks until every pending reload finished; returns the seconds it blocked (0.0 when none)."""
        t0 = time.perf_counter()
        while self._handles:
            self._handles[0].wait(timeout)
            self._handles.pop(0)
        return time.perf_counter() - t0
