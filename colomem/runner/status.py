"""<out>/status.json: what the run is doing now, for a person or a supervisor watching a long job, and what
it was doing when it stopped.

Rewritten when the run starts, when each phase of a step starts, and when the run ends:

    {"pid": 1234, "state": "running", "step": 7, "steps": 40, "phase": "sync",
     "phase_started": 1733.0e6, "updated": 1733.0e6}

state: `starting` (engines being built), `running`, then `ok`, `error` (with `error`) or `interrupted`.
step is 0-based (the step under way), phase one of the step's phases (colomem.runner.phases). A run killed
outright (SIGKILL, the kernel's out-of-memory killer) leaves the file naming the phase it died in. Each
write goes to a temporary file renamed into place, so a reader never sees half a file. Only rank 0 writes it.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)


class StatusFile:
    """The run's status.json. A failed write (full disk) is reported once and stops the updates: the
    status is for watching the run, never a reason to fail it."""

    def __init__(self, path: os.PathLike, steps: int):
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self.fields: dict[str, Any] = {"pid": os.getpid(), "state": "starting", "step": None, "steps": int(steps),
                                       "phase": None, "phase_started": None}
        self._broken = False
        self._write()

    def phase(self, step: int, name: str) -> None:
        """Phase `name` of step `step` starts now."""
        now = time.time()
        self.fields.update(state="running", step=int(step), phase=name, phase_started=now)
        self._write(now)

    def finish(self, state: str, error: Optional[str] = None) -> None:
        """The run ended: `ok`, `error` or `interrupted`; the step and phase it was in stay."""
        self.fields["state"] = state
        if error:
            self.fields["error"] = error
        self._write()

    def _write(self, now: Optional[float] = None) -> None:
        if self._broken:
            return
        self.fields["updated"] = time.time() if now is None else now
        try:
            self._tmp.write_text(json.dumps(self.fields, default=str) + "\n")
            os.replace(self._tmp, self.path)
        except OSError as e:
            self._broken = True
            log.warning("cannot write %s (%s); the run goes on without updating it", self.path, e)


def read_status(path: os.PathLike) -> Optional[dict]:
    """The status a run wrote, or None when there is none yet (or it cannot be read)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


__all__ = ["StatusFile", "read_status"]
