"""Group-normalised advantages: each completion is scored against the other completions of its prompt.

    A_i = (r_i - mean(group)) / (std(group) + eps)     scale_by_std=True  (GRPO)
    A_i =  r_i - mean(group)                           scale_by_std=False (Dr. GRPO's advantage; its loss
                                                                           also needs loss_norm="token")

std="population" (the default) divides the squared deviations by n, so a group of two rewards {0, 1} gives
advantages -+0.5/(0.5+eps); std="sample" divides by n - 1, as TRL and verl do (torch.std's default): the
advantages are then sqrt((n-1)/n) times the population ones (1/1.41 at n = 2, 0.94 at n = 8).
A group whose rewards are all equal carries no signal and gets exactly 0.
Rows are ordered group by group: prompt i, completion j -> row i * group_size + j.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from colomem.errors import InvalidArgumentError


STD_KINDS = ("population", "sample")


def group_advantages(rewards: Tensor | Sequence[float], group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-4, scorable: Optional[Sequence[bool]] = None,
                     std: str = "population") -> Tensor:
    """[B] rewards (B = groups * group_size) -> [B] float32 advantages.

    std: "population" (divide by n) or "sample" (by n - 1; a group of one has std 0).
    scorable: False for samples no reward function could score (a reward returned None, TRL's convention):
    they get advantage 0 and are left out of their group's mean and std (their reward value is ignored)."""
    if std not in STD_KINDS:
        raise InvalidArgumentError(f"std must be one of {STD_KINDS}, got {std!r}")
    if scorable is not None and not all(scorable):
        return _masked_advantages(rewards, group_size, scorable, scale_by_std=scale_by_std, eps=eps,
                                  sample=std == "sample")
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
        sample = std == "sample" and group_size > 1
        centred = centred / (g.std(dim=1, unbiased=sample, keepdim=True) + eps)
    return centred.flatten()


def _masked_advantages(rewards, group_size: int, scorable: Sequence[bool], *, scale_by_std: bool,
                       eps: float, sample: bool = False) -> Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    w = torch.as_tensor(list(scorable), dtype=torch.bool).flatten()
    if r.numel() != w.numel() or r.numel() % group_size:
        raise InvalidArgumentError(f"{r.numel()} rewards and {w.numel()} scorable flags for groups of {group_size}")
    r = torch.where(w, r, torch.zeros_like(r))
    if not torch.isfinite(r).all():
        raise InvalidArgumentError("rewards must be finite (got NaN or inf)")
    g, m = r.view(-1, group_size), w.view(-1, group_size).float()
    n = m.sum(dim=1, keepdim=True).clamp(min=1.0)
    mean = (g * m).sum(dim=1, keepdim=True) / n
    centred = (g - mean) * m
    first = torch.where(w.view(-1, group_size), g, torch.full_like(g, float("nan")))
    ref = first.nan_to_num(0.0).sum(dim=1, keepdim=True) / n      # all scorable values equal: no signal
    flat = (((g - ref).abs() * m).amax(dim=1, keepdim=True) == 0)
    centred = torch.where(flat, torch.zeros_like(centred), centred)
    if scale_by_std:
        dof = (n - 1.0).clamp(min=1.0) if sample else n      # over the scorable samples only
        std = (((g - mean) ** 2 * m).sum(dim=1, keepdim=True) / dof).sqrt()
        centred = centred / (std + eps)
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
