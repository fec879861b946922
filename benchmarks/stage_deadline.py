"""How long a bench's next run may take inside the stage that launched it.

benchmarks/gpu_run.sh bounds each stage and kills it at its bound; a bench killed there loses the run in
progress and whatever it had not written. The stage passes its end as STAGE_DEADLINE_EPOCH (seconds since
the epoch), so a bench can bound each run to end before it, with time left to stop the run, read its figures
and write its report, and skip a run that would not have the time to be worth starting."""
from __future__ import annotations

import os
import time
from typing import Optional

FINISH_MARGIN_S = 30.0   # stopping a run (its vLLM engine process too), reading its figures, writing the report
MIN_RUN_S = 60.0         # less than this is no run of the colocated job (its start alone takes longer)


def deadline() -> Optional[float]:
    """The stage's end (epoch seconds) from STAGE_DEADLINE_EPOCH, None when unset or not a number."""
    raw = os.environ.get("STAGE_DEADLINE_EPOCH", "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None


def run_bound(requested_s: float, end: Optional[float] = None, now: Optional[float] = None) -> Optional[float]:
    """The bound for the next run: the requested one, shortened to end FINISH_MARGIN_S before the stage does;
    None when less than MIN_RUN_S would be left (skip the run). Without a deadline, the requested bound."""
    end = deadline() if end is None else end
    if end is None:
        return requested_s
    left = end - (time.time() if now is None else now) - FINISH_MARGIN_S
    if left < MIN_RUN_S:
        return None
    return min(requested_s, left)


def bound_or_skip(name: str, requested_s: float) -> Optional[float]:
    """run_bound for the run `name`, saying so when it is skipped."""
    bound = run_bound(requested_s)
    if bound is None:
        print(f"[bench] {name}: skipped, too little time left in the stage", flush=True)
    return bound
