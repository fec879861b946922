"""PNG plots of a run from its per-step figures (metrics.jsonl records, or the runner's history rows): the
phase timeline and the reward curve."""
from __future__ import annotations

import os
from typing import Optional

from .phases import REPORT_ORDER as ORDER
from .phases import SWITCH_PHASES

COLORS = {"offload": "#d62728", "barrier_wake": "#7f7f7f", "wake_weights": "#ff7f0e", "sync": "#bcbd22",
          "check": "#e377c2", "wake_kv": "#ffbb78", "rollout": "#1f77b4", "eval": "#17becf", "sleep": "#9467bd",
          "score": "#aec7e8", "barrier_train": "#c7c7c7", "reload": "#8c564b", "reload_wait": "#c49c94", "reload_step": "#9c6b5e",
          "train": "#2ca02c"}


# The timeline draws one bar per step: a long run shows every k-th step, so the image stays readable (and
# a 1,000-step run does not make a picture hundreds of inches tall)
MAX_BARS = 80


def every_kth(rows: list, most: int = MAX_BARS) -> tuple[list, int]:
    """Every k-th of `rows` (about `most` of them) and k; the last row always in."""
    k = -(-len(rows) // most) if rows else 1
    if k <= 1:
        return rows, 1
    picked = rows[::k]
    if picked[-1] is not rows[-1]:
        picked.append(rows[-1])
    return picked, k


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_timeline(records: list[dict], path: os.PathLike, title: Optional[str] = None) -> Optional[str]:
    """Stacked horizontal bars, one per step: how long each phase took (switch phases hatched)."""
    steps = [r for r in records if "phase_s" in r and not r.get("failed")]
    if not steps:
        return None
    steps, k = every_kth(steps)
    if k > 1:
        title = f"{title or 'phase timeline (hatched: switch phases)'}; one step in {k}"
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, max(3.5, 0.22 * len(steps) + 1.5)),
                                  gridspec_kw={"width_ratios": [3, 1], "wspace": 0.35})
    seen = set()
    for r in steps:
        left = 0.0
        for p in ORDER:
            w = r["phase_s"].get(p)
            if not w:
                continue
            ax.barh(r["step"], w, left=left, color=COLORS.get(p, "#333"), edgecolor="none",
                    hatch="//" if p in SWITCH_PHASES else None, label=p if p not in seen else None)
            seen.add(p)
            left += w
    from matplotlib.ticker import MaxNLocator
    ax.set_xlabel("seconds within the step")
    ax.set_ylabel("step")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=1, frameon=False)
    ax.set_title(title or "phase timeline (hatched: switch phases)")
    frac = [100 * (r.get("switch_fraction") or 0) for r in steps]
    ax2.barh([r["step"] for r in steps], frac, color="#d62728")
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.invert_yaxis()
    ax2.set_xlabel("switch overhead, % of step")
    ax2.set_title("switch share")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return os.fspath(path)


def plot_rewards(records: list[dict], path: os.PathLike, title: Optional[str] = None) -> Optional[str]:
    """Mean reward per step with its spread over the samples, and accuracy when the task logs one."""
    steps = [r for r in records if r.get("reward_mean") is not None and not r.get("failed")]
    if not steps:
        return None
    plt = _plt()
    x = [r["step"] for r in steps]
    m = [r["reward_mean"] for r in steps]
    s = [r.get("reward_std") or 0.0 for r in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, m, color="#1f77b4", marker="o", ms=3, label="reward (mean)")
    ax.fill_between(x, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)], color="#1f77b4",
                    alpha=0.15, label="± std over samples")
    if any(r.get("accuracy") is not None for r in steps):
        ax.plot(x, [r.get("accuracy") for r in steps], color="#2ca02c", marker=".", ms=3, label="accuracy")
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "reward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.fspath(path)
