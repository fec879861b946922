"""Which rows go into which micro-batch: by a row count, or by a token budget (dynamic micro-batches).

A micro-batch is padded to its longest row, so rows of about one length belong together: sorted longest
first, rows of 1000 tokens do not make 50-token rows 1000 wide. With a token budget (max_tokens) a
micro-batch takes rows, longest first, while rows x its width stays within the budget: many short rows go
together, long rows go few at a time, and every forward holds about the same number of positions, so
activation memory is bounded by the budget rather than by the longest row times a row count (verl's
use_dynamic_bsz / ppo_max_token_len_per_gpu). The loss weights make the summed gradient the same whatever
rows go together (step.split_micro_batches).

Ranks that average their gradients must run the same number of micro-batches (each backward may reduce
gradients: a rank with one fewer would leave the others waiting); `count` asks for at least that many, and
the largest micro-batches are halved until there are.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from colomem.errors import InvalidArgumentError


def micro_batch_rows(lengths: Tensor, micro_batch: int, *, max_tokens: Optional[int] = None,
                     by_length: bool = True, count: Optional[int] = None) -> list[Tensor]:
    """Row indices of each micro-batch, for rows of `lengths` (tokens each, prompt + completion).

    micro_batch: at most that many rows each (without max_tokens). max_tokens: instead, at most that many
    positions (rows x the micro-batch's longest row) each; a row longer than the budget goes alone. by_length:
    rows longest first (max_tokens implies it); False: in order. count: at least that many micro-batches
    (at most one per row), for ranks that must step together."""
    if micro_batch < 1:
        raise InvalidArgumentError(f"micro_batch must be >= 1, got {micro_batch}")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidArgumentError(f"micro_batch_tokens must be >= 1, got {max_tokens}")
    lengths = lengths.detach().to("cpu", torch.long).flatten()
    B = lengths.numel()
    order = (torch.sort(lengths, descending=True, stable=True).indices if by_length or max_tokens is not None
             else torch.arange(B))
    if max_tokens is None:
        groups = [order[s:s + micro_batch] for s in range(0, B, micro_batch)]
    else:
        groups, start = [], 0
        for i in range(1, B + 1):
            # sorted longest first: the group's width is its first row's length
            if i == B or (i - start + 1) * max(int(lengths[order[start]]), 1) > max_tokens:
                groups.append(order[start:i])
                start = i
    if count is not None:
        if count > B:
            raise InvalidArgumentError(f"{count} micro-batches asked of {B} rows: every micro-batch needs a row")
        while len(groups) < count:
            k = max(range(len(groups)), key=lambda j: (len(groups[j]), -j))
            half = (len(groups[k]) + 1) // 2
            groups[k:k + 1] = [groups[k][:half], groups[k][half:]]
    return groups


def padded_positions(lengths: Tensor, groups: list[Tensor]) -> int:
    """Positions the micro-batches forward: each group's rows times its longest row."""
    lengths = lengths.detach().to("cpu", torch.long).flatten()
    return sum(len(g) * int(lengths[g].max()) for g in groups if len(g))


__all__ = ["micro_batch_rows", "padded_positions"]
