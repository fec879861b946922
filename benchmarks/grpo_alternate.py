"""The figures of a run with `--rollout-sleep alternate`: the trainer resident, vLLM asleep through the training
of every even step and awake through that of every odd one, so both layouts run in one process, in turn.

A step's rollout follows the previous step's layout (it woke, or it stayed awake through the training), its
training follows its own (beside a sleeping or an awake vLLM). Each layout's step is put together from the
medians of its parts: its rollout, its training, its own switch phases (the wake, the sleep and the release of
the trainer's cache before the wake for the sleeping layout; the prefix cache's drop for the other), and what
every step does alike (the sync, the check, the scoring)."""
from __future__ import annotations

from typing import Optional

from colomem.runner.timeline import median

OWN = ("rollout", "train", "wake_weights", "wake_kv", "sleep", "offload")   # the phases that differ between the layouts


def alternate_figures(steps: list) -> Optional[dict]:
    """{"still": {...}, "resident": {...}, "speedup_vs_resident": resident step / still step, "steps": rows}
    from a run's step lines (metrics.jsonl), the first step left out; None for a run that did not alternate."""
    rows = [r for r in steps[1:] if "placement/rollout_sleeps" in r and "rollout/woke" in r]
    if not rows:
        return None
    ph = lambda r, p: float(r["phase_s"].get(p) or 0.0)  # noqa: E731

    def of(pred, key):
        return median([key(r) for r in rows if pred(r)])
    rollout_awake = of(lambda r: not r["rollout/woke"], lambda r: ph(r, "rollout"))
    rollout_woke = of(lambda r: r["rollout/woke"], lambda r: ph(r, "rollout"))
    train_beside = of(lambda r: not r["placement/rollout_sleeps"], lambda r: ph(r, "train"))
    train_asleep = of(lambda r: r["placement/rollout_sleeps"], lambda r: ph(r, "train"))
    wake = of(lambda r: r["rollout/woke"], lambda r: ph(r, "wake_weights") + ph(r, "wake_kv"))
    # a sleeping step's sleep and offload (the trainer's cache released before the next wake); an awake
    # step's "sleep" phase is its prefix cache's drop, its offload nothing
    sleep = of(lambda r: r["placement/rollout_sleeps"], lambda r: ph(r, "sleep") + ph(r, "offload"))
    stay = of(lambda r: not r["placement/rollout_sleeps"], lambda r: ph(r, "sleep") + ph(r, "offload"))
    common = median([r["step_s"] - sum(ph(r, p) for p in OWN) for r in rows])
    parts = (rollout_awake, rollout_woke, train_beside, train_asleep, wake, sleep, stay, common)
    out: dict = {"steps": [{"step": r["step"], "sleeps": r["placement/rollout_sleeps"], "woke": r["rollout/woke"],
                            "rollout_s": ph(r, "rollout"), "train_s": ph(r, "train"), "step_s": r["step_s"]}
                           for r in rows]}
    if any(x is None for x in parts):
        return out          # too few steps of one kind
    out["still"] = {"rollout_s": rollout_awake, "train_s": train_beside, "stay_s": stay, "common_s": common,
                    "step_s": rollout_awake + train_beside + stay + common}
    out["resident"] = {"rollout_s": rollout_woke, "train_s": train_asleep, "wake_s": wake, "sleep_s": sleep,
                       "common_s": common, "step_s": rollout_woke + train_asleep + wake + sleep + common}
    out["speedup_vs_resident"] = out["resident"]["step_s"] / out["still"]["step_s"]
    return out


__all__ = ["alternate_figures"]
