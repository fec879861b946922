"""A MappedSet's transfer in flight (colomem.swap_mapped): its handle and its figures.

An offload's wait() unmaps each chunk as its copy ends, so the memory goes back chunk by chunk while later
chunks still copy; a reload's marks each chunk on the device as its copy ends. A failed copy leaves the chunks
from it on where their bytes are whole (an offload's on the device, a reload's in the pool).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from colomem.swap_coalesce import Transfers, _done, _settle
from colomem.swap_handles import DEFAULT_TIMEOUT_S, wait_seconds

if TYPE_CHECKING:
    from colomem.swap_mapped import MappedSet

DEVICE, POOL = "device", "pool"


@dataclass
class MappedStats:
    direction: str
    nbytes: int
    chunks: int
    seconds: float          # host wall time from the call to the end of the wait
    map_ms: float = 0.0     # reload: host ms spent mapping chunks (most of it behind the copies)
    device_ms: float = 0.0  # device ms from the first copy's start to the last copy's end, when timed
    cache_releases: int = 0  # reload: times a chunk found no memory until torch's cached blocks were freed


class MappedHandle:
    """An offload or reload in flight. wait() finishes it: an offload's chunks are unmapped as their copies
    end (so the memory goes back chunk by chunk while later chunks still copy)."""

    def __init__(self, s: "MappedSet", direction: str, chunks: list[int], parts: list, token: Optional[int],
                 t0: float, map_ms: float, timing: bool, cache_releases: int = 0):
        self.s, self.direction, self.chunks, self.parts = s, direction, chunks, parts
        self.cache_releases = cache_releases
        self.nbytes = sum(s.memory.chunk_span(i)[1] for i in chunks)
        self._token, self._t0, self._map_ms, self._timing = token, t0, map_ms, timing
        self._settled = 0  # chunks whose outcome was applied, in order
        self.stats: Optional[MappedStats] = None
        # An earlier reload this ordered one was queued behind: finished first by wait().
        self.before: Optional[MappedHandle] = None
        self.filling = False  # MappedSet.moving_out's copy: a failure leaves the set without whole bytes
        self._error: Optional[BaseException] = None  # a copy failed: every later wait raises it again

    def done(self) -> bool:
        return self.stats is not None

    def wait(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> MappedStats:
        """Waits up to `timeout` seconds (None or inf: no bound). TransferTimeoutError if copies still run then
        (they keep running: wait again)."""
        seconds = wait_seconds(timeout)
        deadline = time.monotonic() + seconds
        with self.s._lock:
            if self._error is not None:
                raise self._error
            if self.before is not None:
                self.before.wait(timeout)
                self.before = None
            while self._settled < len(self.parts):
                k = self._settled
                left = seconds if seconds == float("inf") else max(0.0, deadline - time.monotonic())
                try:
                    self.parts[k].wait(left)
                except Exception as exc:
                    if isinstance(exc, TimeoutError):
                        raise
                    self._fail(k)
                    self._error = exc
                    raise
                self._apply(k)
                self._settled = k + 1
            if self.stats is None:
                self._finish()
            return self.stats  # type: ignore[return-value]

    def _apply(self, k: int) -> None:
        i = self.chunks[k]
        if self.direction == "d2h":
            self.s.memory.unmap(i, 1)  # its copy ended: nothing queued reads it any more
            self.s._where[i] = POOL
        else:
            self.s._where[i] = DEVICE

    def _fail(self, k: int) -> None:
        """Copy k failed: chunks before it are settled; those from it on stay where their bytes are whole (an
        offload's on the device, a reload's in the pool, unmapped once their queued copies ended)."""
        rest = self.parts[k:]
        _settle(rest)
        if self.filling:
            self.s._broken = "its first copy out failed"
        if self.direction == "h2d":
            for j, p in enumerate(rest):
                i = self.chunks[k + j]
                self.s._where[i] = POOL
                self.s._unmap_when_quiet(i, p)
        self._settled = len(self.parts)
        if all(_done(p) for p in rest):
            self._end_token()
        self.stats = MappedStats(self.direction, 0, 0, time.perf_counter() - self._t0)
        self.s._pending = None

    def _finish(self) -> None:
        self._end_token()
        device_ms = 0.0
        if self._timing and self.parts:
            device_ms = Transfers(self.parts, self.nbytes).elapsed_ms()
        self.stats = MappedStats(self.direction, self.nbytes, len(self.chunks), time.perf_counter() - self._t0,
                                 self._map_ms, device_ms, self.cache_releases)
        if self.s._pending is self:
            self.s._pending = None

    def _end_token(self) -> None:
        if self._token is not None:
            self.s._pool._copies.end(self._token)
            self._token = None


__all__ = ["DEVICE", "MappedHandle", "MappedStats", "POOL"]
