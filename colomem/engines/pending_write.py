"""A trainer's checkpoint files, prepared now and written later, possibly in a thread while training goes on.

A trainer's prepare_save() does on the caller's thread everything that needs the GPU, the process group or
this moment's training state (ZeRO-3's gathers, copies of resident tensors to the host, the RNG states,
the counters) and returns a PendingWrite that holds only host tensors and plain values. Its write() is file
I/O alone: safe in a background thread, where a 100 GB trainer file no longer stops the run (torch.save and
safetensors release the GIL while they write).

Host tensors that are views of the pool's copies (an offloaded trainer's state) are not copied: the pool
keeps those bytes until the trainer's next offload or its close, so both first wait for such a write
(WriteGuard). Every other tensor a PendingWrite holds is its own copy.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from colomem.errors import PhaseOrderError, TransferTimeoutError


def host_copy(t: Any) -> Any:
    """A contiguous host tensor of t's values that nobody else writes (t itself is left as it is)."""
    return t.detach().to("cpu", copy=True).contiguous()


class PendingWrite:
    """Writes (callables doing file I/O only) run once, in order, by write(), into the folder `path`;
    `reads_pool`: some read views of the trainer's pool copies (its next offload or close waits for this
    write)."""

    def __init__(self, writes: list[Callable[[], None]], *, reads_pool: bool, path: Path):
        self._writes = list(writes)
        self.reads_pool = reads_pool
        self.what = f"the checkpoint write into {str(path)!r}"
        self.started = False
        self.error: Optional[BaseException] = None
        self.seconds = 0.0
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def write(self) -> None:
        """Writes every file (once); raises what a write raised (OSError for a full disk, ...)."""
        if self.started:
            raise PhaseOrderError(f"{self.what}: write() was already called")
        self.started = True
        t0 = time.perf_counter()
        try:
            for w in self._writes:
                w()
        except BaseException as e:
            self.error = e
            raise
        finally:
            self._writes = []               # the host tensors go as soon as the files are written
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def drop(self) -> None:
        """Gives up a write never started (its files stay unwritten), so the trainer may go on."""
        if not self.started:
            self.started = True
            self._writes = []
            self._done.set()

    def wait(self, timeout: Optional[float]) -> None:
        """Until write() ended (its error is the writer's to handle); TransferTimeoutError after `timeout`."""
        if not self.started:
            raise PhaseOrderError(f"{self.what} was prepared but neither written nor dropped: call its write() "
                                  "(or drop()) before the trainer moves its state again")
        if not self._done.wait(timeout):
            raise TransferTimeoutError(f"{self.what} still runs after {timeout:g} s; the disk may be slow or "
                                       "full. Raise the timeout, or save less often")


class WriteGuard:
    """The pending writes that read a trainer's pool copies; the trainer calls wait() before it rewrites or
    frees those copies."""

    def __init__(self) -> None:
        self._pending: list[PendingWrite] = []

    def track(self, w: PendingWrite) -> PendingWrite:
        if w.reads_pool:
            self._pending = [p for p in self._pending if not p.done] + [w]
        return w

    def wait(self, timeout: Optional[float]) -> float:
        """Waits for every tracked write; returns the seconds waited."""
        t0 = time.perf_counter()
        for w in list(self._pending):
            w.wait(timeout)
        self._pending = []
        return time.perf_counter() - t0


__all__ = ["PendingWrite", "WriteGuard", "host_copy"]
