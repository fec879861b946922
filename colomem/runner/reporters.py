"""Where a run's metrics go besides metrics.jsonl: TensorBoard (torch.utils.tensorboard) and Weights & Biases
(its own client; offline with WANDB_MODE=offline). The same numbers as each metrics.jsonl line: the step's
metrics as they are, phase seconds as `phase/<name>`, memory after each phase as `memory/<phase>/<column>`.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Optional, Protocol

from colomem.errors import ConfigError

CHOICES = ("auto", "tensorboard", "wandb", "none")
_NOT_METRICS = ("step", "rank", "time", "phase_s", "memory")


class Reporter(Protocol):
    def log(self, step: int, record: dict) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The numeric values of one metrics line, flattened to TensorBoard-style tags."""
    out: dict[str, float] = {}
    for k, v in record.items():         # the step's metrics sit at the top level of a line
        if k in _NOT_METRICS:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    for k, v in (record.get("phase_s") or {}).items():
        out[f"phase/{k}"] = float(v)
    for phase, cols in (record.get("memory") or {}).items():
        for col, v in (cols or {}).items() if isinstance(cols, dict) else ():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"memory/{phase}/{col}"] = float(v)
    return out


class TensorBoardReporter:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._w = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, record: dict) -> None:
        for tag, v in scalars(record).items():
            self._w.add_scalar(tag, v, global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbReporter:
    def __init__(self, out: Path, config: dict):
        import wandb

        self._run = wandb.init(project="colomem", dir=str(out), config=config, name=out.name)

    def log(self, step: int, record: dict) -> None:
        self._run.log(scalars(record), step=step)

    def close(self) -> None:
        self._run.finish()


def resolve(report_to: list[str]) -> list[str]:
    """The reporters a `--report-to` list asks for; `auto` = tensorboard when it is installed. ConfigError for
    one that is asked for by name and not installed (found before the run starts)."""
    bad = [r for r in report_to if r not in CHOICES]
    if bad:
        raise ConfigError(f"--report-to: unknown {bad}; choose from {', '.join(CHOICES)}")
    if "none" in report_to:
        return []
    wanted: list[str] = []
    for r in report_to:
        name = "tensorboard" if r == "auto" else r
        if r == "auto" and importlib.util.find_spec("tensorboard") is None:
            continue
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"--report-to {name}: the {name} package is not installed (pip install {name}), "
                              "or leave it out")
        if name not in wanted:
            wanted.append(name)
    return wanted


def make_reporters(names: list[str], out: Path, config: Optional[dict[str, Any]] = None) -> list[Reporter]:
    reporters: list[Reporter] = []
    for name in names:
        if name == "tensorboard":
            reporters.append(TensorBoardReporter(out / "tensorboard"))
        elif name == "wandb":
            reporters.append(WandbReporter(out, config or {}))
    return reporters


__all__ = ["CHOICES", "Reporter", "TensorBoardReporter", "WandbReporter", "make_reporters", "resolve", "scalars"]
