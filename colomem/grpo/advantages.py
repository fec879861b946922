"""Group-normalised advantages: each completion is scored against the other completions of its prompt.

    A_i = (r_i - mean(group)) / (std(group) + eps)     scale_by_std=True  (GRPO)
    A_i =  r_i - mean(group)                           scale_by_std=False (Dr. GRPO: no length/difficulty bias)

std is the population std (divide by n), so a group of two rewards {0, 1} gives advantages -+1/(0.5+eps)*0.5.
A group whose rewards are all equal carries no signal and gets exactly 0.
Rows are ordered group by group: prompt i, completion j -> row i * group_size + j.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from colomem.errors import InvalidArgumentError


def group_advantages(rewards: Tensor | Sequence[float], group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-4) -> Tensor:
    """[B] rewards (B = groups * group_size) -> [B] float32 advantages."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if group_size < 1:
        raise InvalidArgumentError(f"group_size must be >= 1, got {group_size}")
    if r.numel() % group_size:
        raise InvalidArgumentError(f"{r.numel()} rewards do not split into groups of {group_size}")
    if not torch.isfinite(r).all():
        raise InvalidArgumentError("rewards must be finite (got NaN or inf)")
    g = r.view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    # all-equal groups: centred is exactly 0 only up to rounding of the mean; force it
    flat = (g == g[:, :1]).all(dim=1, keepdim=True)
    centred = torch.where(flat, torch.zeros_like(centred), centred)
    if scale_by_std:
        centred = centred / (g.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.flatten()


def group_stats(rewards: Tensor | Sequence[float], group_size: int) -> dict[str, float]:
    """Reward statistics for the metrics: mean, std, and the share of groups with no signal."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    g = r.view(-1, group_size)
    flat = (g == g[:, :1]).all(dim=1)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "reward_max": float(r.max()),
        "reward_min": float(r.min()),
        "groups_no_signal": float(flat.float().mean()),
    }
