"""Ends vLLM's engine process when the trainer process that started it is gone.

A trainer killed outright (SIGKILL, the kernel's out-of-memory killer, a crash in C) runs no cleanup, and
vLLM's EngineCore does not watch the process that started it: the orphan goes on holding its GPU memory
(the KV cache, the weights) until someone kills it by hand, and the next run on that GPU runs out of memory.
So the worker (in the EngineCore itself with tensor_parallel_size 1) watches the trainer's pid from a daemon
thread; once the trainer is gone it asks the engine to shut down the way vLLM does (SIGTERM to its own
process, vLLM's handler) and, if the process is still there `grace_s` later, kills it (SIGKILL).

"Gone" also covers a pid that now belongs to another process (its start time changed) and a zombie (the
trainer died and its own parent has not reaped it yet).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

INTERVAL_S = 1.0                 # how often the trainer is looked for
GRACE_S = 10.0                   # vLLM's own shutdown, before the process is killed


def _proc_stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time) from /proc/<pid>/stat; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()    # the command name may hold spaces and parentheses
    return (fields[0], fields[19]) if len(fields) > 19 else None


def identity(pid: int) -> Optional[str]:
    """What tells this process apart from a later one with the same pid (its start time); None when it is
    gone or a zombie, or when there is no /proc to ask (then `alive` falls back to kill(pid, 0))."""
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return None
    return st[1]


def alive(pid: int, ident: Optional[str]) -> bool:
    """Whether `pid` is still the process `identity(pid)` described."""
    if os.path.isdir("/proc/self"):
        return ident is not None and identity(pid) == ident
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_this_process(grace_s: float) -> None:
    """vLLM's own shutdown first (its SIGTERM handler); SIGKILL if the process outlives `grace_s`."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


class TrainerWatch:
    """A daemon thread that calls `on_gone` once the trainer `pid` is gone (by default: ends this process)."""

    def __init__(self, pid: int, interval_s: float = INTERVAL_S, grace_s: float = GRACE_S,
                 on_gone: Optional[Callable[[], None]] = None):
        self.pid, self.interval_s, self.grace_s = int(pid), float(interval_s), float(grace_s)
        self.ident = identity(self.pid)
        self._on_gone = on_gone or (lambda: end_this_process(self.grace_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="colomem-trainer-watch", daemon=True)

    @property
    def watching(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> "TrainerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if alive(self.pid, self.ident):
                continue
            print(f"[colomem] the trainer process {self.pid} that started this vLLM engine is gone (killed?); "
                  f"shutting the engine down (pid {os.getpid()}) so its GPU memory is freed", file=sys.stderr,
                  flush=True)
            self._on_gone()
            return


__all__ = ["GRACE_S", "INTERVAL_S", "TrainerWatch", "alive", "end_this_process", "identity"]
