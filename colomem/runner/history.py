"""What a run keeps in memory of its finished steps: numbers only, for the summary, the end-of-run tables and
the plots.

A step's whole record (phase times, a memory snapshot after every phase, every metric, sample completions) is
written to metrics.jsonl as the step ends and not kept: a run of 100,000 steps would otherwise hold every one
of them, about 15 KB a step, in the runner's host memory. Here each step costs one float per column: its
step and switch times, each phase's time, the memory columns after each phase and the reward figures,
about half a kilobyte a step in flat arrays (NaN where a step had no such figure). The tables and plots read
these columns; whoever wants the whole records reads them back from the file (`read_step_records`).
"""
from __future__ import annotations

import math
import os
from array import array
from typing import Iterator, Optional

from .phases import ORDER, REPORT_ORDER, SWITCH_PHASES
from colomem.units import format_bytes

from .timeline import MEMORY_KEYS, StepRecord, median, read_jsonl

NAN = float("nan")
# the metrics the summary and the reward plot read, per step
METRICS = ("reward_mean", "reward_std", "accuracy")
FIRST = LAST = 5            # the summary's first-5 and last-5 means


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else NAN


def _values(col: array, skip: int = 0) -> list[float]:
    return [x for x in col[skip:] if not math.isnan(x)]


def _median(col: array, skip: int = 0) -> Optional[float]:
    return median(_values(col, skip))


def _mean(xs: list[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def _max(cols: list[array]) -> Optional[float]:
    vals = [x for c in cols for x in c if not math.isnan(x)]
    return max(vals) if vals else None


class StepHistory:
    """One column of floats per figure, one entry per finished step (NaN where the step had none)."""

    def __init__(self) -> None:
        self.count = 0
        self.steps = array("q")
        self.step_s = array("d")
        self.switch_s = array("d")
        self.phase_s: dict[str, array] = {}
        self.memory: dict[tuple[str, str], array] = {}
        self.metrics: dict[str, array] = {m: array("d") for m in METRICS}

    def _column(self, table: dict, key) -> array:
        col = table.get(key)
        if col is None:             # a figure first seen now: NaN for the steps before
            col = table[key] = array("d", [NAN]) * self.count
        return col

    def add(self, rec: StepRecord) -> None:
        self.steps.append(rec.step)
        self.step_s.append(float(rec.step_s))
        self.switch_s.append(float(rec.switch_s))
        for p, v in rec.phase_s.items():
            self._column(self.phase_s, p).append(_num(v))
        for p, snap in rec.memory.items():
            for k in MEMORY_KEYS:
                b = (snap or {}).get(k)
                if b is not None or (p, k) in self.memory:
                    self._column(self.memory, (p, k)).append(_num(b))
        for m in METRICS:
            self.metrics[m].append(_num(rec.metrics.get(m)))
        self.count += 1
        for table in (self.phase_s, self.memory):     # columns this step did not fill
            for col in table.values():
                if len(col) < self.count:
                    col.append(NAN)

    # -- the summary ----------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """The summary's figures over this run's steps; medians leave the first step out as warm-up when there
        are more."""
        skip = 1 if self.count > 1 else 0
        fractions = array("d", [sw / st if st else NAN for sw, st in zip(self.switch_s, self.step_s)])
        reward, acc = self.metrics["reward_mean"], self.metrics["accuracy"]
        return {
            "steps_done": self.count,
            "reward_first5_mean": _mean(_values(reward[:FIRST])),
            "reward_last5_mean": _mean(_values(reward[-LAST:])),
            "accuracy_first5_mean": _mean(_values(acc[:FIRST])),
            "accuracy_last5_mean": _mean(_values(acc[-LAST:])),
            "step_s_median": _median(self.step_s, skip),
            "switch_s_median": _median(self.switch_s, skip),
            "switch_overhead_fraction": _median(fractions, skip),
            "phase_s_median": {p: _median(col, skip) for p, col in sorted(self.phase_s.items())
                               if _values(col, skip)},
            "gpu_used_after_sleep_max": _int(_max([c for (p, k), c in self.memory.items()
                                                   if (p, k) == ("sleep", "driver_used")])),
            "gpu_used_max": _int(_max([c for (_, k), c in self.memory.items() if k == "driver_used"])) or None,
            "trainer_reserved_after_offload_max": _int(_max([c for (p, k), c in self.memory.items()
                                                             if (p, k) == ("offload", "reserved")])),
            "pinned_host_max": _int(_max([c for (_, k), c in self.memory.items() if k == "pinned_host"])) or None,
        }

    # -- the end-of-run tables ------------------------------------------------------------------------------
    def phase_table(self) -> str:
        """Markdown table: median seconds of each phase (first step left out as warm-up when there are more)."""
        if not self.count:
            return ""
        skip = 1 if self.count > 1 else 0
        step = _median(self.step_s, skip) or 0.0
        lines = ["| phase | median s | share of step |", "| --- | --- | --- |"]
        for phase in REPORT_ORDER:
            col = self.phase_s.get(phase)
            med = _median(col, skip) if col is not None else None
            if med is not None:
                lines.append(f"| {phase} | {med:.4f} | {100 * med / step if step else 0:.2f} % |")
        sw = _median(self.switch_s, skip) or 0.0
        lines.append(f"| **switch total** | {sw:.4f} | {100 * sw / step if step else 0:.2f} % |")
        lines.append(f"| **step** | {step:.4f} | 100 % |")
        return "\n".join(lines)

    def memory_table(self) -> str:
        """Markdown table: per phase, the median over steps of each memory column after that phase (columns
        never measured, e.g. the GPU ones on CPU, are left out)."""
        if not self.count:
            return ""
        names = {"allocated": "GPU allocated", "reserved": "GPU reserved", "driver_used": "GPU driver-used",
                 "pinned_host": "pool host memory"}
        keys = [k for k in MEMORY_KEYS if any(kk == k and _values(c) for (_, kk), c in self.memory.items())]
        if not keys:
            return "(no memory measured)"
        lines = ["| after phase | " + " | ".join(names[k] for k in keys) + " |", "| --- |" + " --- |" * len(keys)]
        for phase in ORDER:
            if not any(p == phase for p, _ in self.memory):
                continue
            cols = [_fmt(_median(self.memory[(phase, k)]) if (phase, k) in self.memory else None) for k in keys]
            lines.append(f"| {phase} | " + " | ".join(cols) + " |")
        return "\n".join(lines)

    # -- the plots ------------------------------------------------------------------------------------------
    def plot_rows(self) -> Iterator[dict]:
        """One small dict per step with what plots.plot_timeline and plot_rewards read."""
        for i in range(self.count):
            phases = {p: col[i] for p, col in self.phase_s.items() if not math.isnan(col[i])}
            switch = sum(phases.get(p, 0.0) for p in SWITCH_PHASES)
            row = {"step": self.steps[i], "phase_s": phases,
                   "switch_fraction": switch / self.step_s[i] if self.step_s[i] else None}
            for m, col in self.metrics.items():
                row[m] = None if math.isnan(col[i]) else col[i]
            yield row


def _fmt(n: Optional[float]) -> str:
    return "-" if n is None else format_bytes(n)


def _int(v: Optional[float]) -> Optional[int]:
    return None if v is None else int(v)


_DERIVED = ("switch_s", "switch_fraction")


def step_record(line: dict) -> StepRecord:
    """A StepRecord back from its metrics.jsonl line (the inverse of StepRecord.to_json)."""
    rest = {k: v for k, v in line.items()
            if k not in ("step", "rank", "time", "step_s", "phase_s", "memory") + _DERIVED}
    return StepRecord(step=int(line["step"]), rank=int(line.get("rank") or 0), started=line.get("time") or 0.0,
                      phase_s=dict(line.get("phase_s") or {}), memory=dict(line.get("memory") or {}),
                      metrics=rest, step_s=float(line.get("step_s") or 0.0))


def read_step_records(path: os.PathLike, offset: int = 0) -> list[StepRecord]:
    """The finished steps' records in a metrics file, from byte `offset` on (where one run began writing):
    step lines only, not the events (start, placement, eval, end) nor failed steps; a torn line is skipped."""
    try:
        lines = read_jsonl(path, offset)
    except FileNotFoundError:
        return []
    return [step_record(line) for line in lines
            if isinstance(line, dict) and "phase_s" in line and "step" in line and "event" not in line
            and not line.get("failed")]


__all__ = ["StepHistory", "read_step_records", "step_record"]
