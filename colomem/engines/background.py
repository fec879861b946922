"""One piece of a trainer's work run in a thread of its own while the caller goes on: the end of a deferred
offload (wait for its copy, give its memory back to the driver) while the rollout runs in vLLM's process.

The trainer keeps the handle and collects it (`result`) before it touches its state again, so the thread's
work and the trainer's own never overlap; an error raised in the thread is raised again there.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Optional

from colomem.errors import TransferTimeoutError


class Background:
    """Runs `fn()` in a daemon thread named `name`; `result(timeout)` waits for it and returns its value or
    raises what it raised."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._name = name

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as e:  # noqa: BLE001 - raised again by result() in the caller's thread
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: Optional[float]) -> Any:
        """Waits up to `timeout` s (None: without bound) for the thread; TransferTimeoutError after that (the
        thread goes on, and a later call waits again)."""
        bounded = timeout is not None and math.isfinite(timeout)
        self._thread.join(timeout if bounded else None)      # (join refuses an infinite timeout)
        if self._thread.is_alive():
            raise TransferTimeoutError(f"{self._name} did not finish within {timeout:g} s; the GPU may be hung "
                                       "or heavily shared. Raise the trainer's timeout or check the device")
        if self._error is not None:
            raise self._error
        return self._value


class BackgroundSlot:
    """At most one Background of an owner at a time, collected before the owner touches what it works on."""

    def __init__(self):
        self.running: Optional[Background] = None

    @property
    def busy(self) -> bool:
        return self.running is not None

    def start(self, fn: Callable[[], Any], name: str) -> None:
        if self.running is not None:
            raise RuntimeError(f"{name}: the slot's last piece of work was not collected")
        self.running = Background(fn, name)

    def collect(self, timeout: Optional[float]) -> float:
        """Waits for the running piece (raising what it raised); returns the seconds waited, 0.0 when none
        runs. On a timeout it stays running and a later call waits again."""
        bg = self.running
        if bg is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            bg.result(timeout)
        finally:
            if bg.done:
                self.running = None
        return time.perf_counter() - t0


__all__ = ["Background", "BackgroundSlot"]
