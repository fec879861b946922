"""bench_grpo's table of runs: one markdown row per run (job, mode, placement, step and switch figures, memory)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable


def _fmt(x, spec=".3f", scale=1.0, suffix=""):
    return "-" if x is None else f"{x * scale:{spec}}{suffix}"


def _config_shape(cfg: str, config_path: Callable[[str], Path]) -> str:
    """The model shape a config names (for a run stopped before it wrote its summary)."""
    try:
        import yaml

        return str(yaml.safe_load(config_path(cfg).read_text()).get("model_shape", "?"))
    except (KeyError, OSError, ImportError, AttributeError):
        return "?"


def table(runs: dict, config_path: Callable[[str], Path]) -> str:
    """The runs of a bench as a markdown table, one row each (config_path: a config's file, by its name)."""
    head = ("| job | mode | placement | step s (spread) | first step s | switch s | switch share | offload s | reload s "
            "| wake+sync+check s | sleep s | GPU used, both asleep | trainer left after offload "
            "| GPU used in rollout / train | status |")
    lines = [head, "|" + " --- |" * 15]
    for name in sorted(runs):
        r = runs[name].get("result", {})
        ph = r.get("phase_s") or {}
        wake = sum(ph.get(p) or 0 for p in ("wake_weights", "sync", "check", "wake_kv")) if ph else None
        cfg, _, mode = name.partition("_")
        shape = r.get("model_shape") or _config_shape(cfg, config_path)
        lines.append(
            f"| {shape} {cfg} | {mode} | {(r.get('placement') or {}).get('label', '-')} | "
            f"{_fmt(r.get('step_s'), '.2f')} ({'-'.join(_fmt(x, '.2f') for x in r.get('step_s_spread') or [])}) | "
            f"{_fmt(r.get('first_step_s'), '.2f')} | {_fmt(r.get('switch_s'), '.3f')} | "
            f"{_fmt(r.get('switch_overhead_fraction'), '.2f', 100, ' %')} | {_fmt(ph.get('offload'))} | "
            f"{_fmt(ph.get('reload'))} | {_fmt(wake)} | {_fmt(ph.get('sleep'))} | "
            f"{_fmt(r.get('gpu_used_both_asleep_gib'), '.2f', 1, ' GiB')} | "
            f"{_fmt(r.get('trainer_reserved_after_offload_gib'), '.2f', 1, ' GiB')} | "
            f"{_fmt(r.get('gpu_used_in_rollout_gib'), '.1f')} / {_fmt(r.get('gpu_used_in_train_gib'), '.1f')} GiB | "
            f"{r.get('status') or runs[name].get('rc')} |")
    return "\n".join(lines)


__all__ = ["table"]
