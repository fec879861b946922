"""GRPOBatch: prompts + sampled completions as padded tensors, with the masks the loss needs.

Layout of one row (right padding):  [ prompt tokens | completion tokens | pad ... ]
- attention_mask   1 on prompt and completion tokens, 0 on padding
- completion_mask  1 on the completion tokens that get loss, 0 on the prompt and the padding
- old_logprobs     at position t: log p(input_ids[t] | input_ids[:t]) under the rollout policy (0 elsewhere)

A completion cut at max_new_tokens (finish="length") keeps all of its tokens in the mask and gets no EOS
appended: the model is judged on what it actually sampled. `mask_truncated=True` drops such rows from the
loss instead (their advantage still counts in their group's statistics).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from colomem.errors import InvalidArgumentError

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Completion:
    """One sampled completion. `token_ids` include the EOS/stop token when finish == "stop"."""
    token_ids: list[int]
    logprobs: Optional[list[float]] = None     # per token of token_ids, under the rollout policy
    finish: str = "length"                     # "stop" (EOS or stop token) | "length" (cut at max_new_tokens)

    def __post_init__(self):
        if self.finish not in FINISH_REASONS:
            raise InvalidArgumentError(f"Completion.finish must be one of {FINISH_REASONS}, got {self.finish!r}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise InvalidArgumentError(f"Completion has {len(self.token_ids)} tokens but "
                                       f"{len(self.logprobs)} logprobs")

    @property
    def truncated(self) -> bool:
        return self.finish == "length"


@dataclass
class GRPOBatch:
    """One optimisation batch, already padded, on any device (contract: docs/design.md)."""
    input_ids: Tensor                       # [B, T] prompt + completion, right-padded
    attention_mask: Tensor                  # [B, T] 1 on real tokens
    completion_mask: Tensor                 # [B, T] 1 on completion tokens that count (prompt, padding: 0)
    advantages: Tensor                      # [B] group-normalised
    old_logprobs: Optional[Tensor] = None   # [B, T] the rollout engine's, aligned with input_ids, or None
    ref_logprobs: Optional[Tensor] = None   # [B, T] for the KL term, or None
    # [B, T] the trainer's own logprobs before the first update on this batch (set by the step when it reuses
    # the batch, num_iterations or mini_batches > 1): the ratio's old policy, and the IS correction's numerator
    first_logprobs: Optional[Tensor] = None
    # Share of the full optimisation batch this (micro-)batch stands for; grpo_loss multiplies by it so the
    # summed gradients of the micro-batches equal the gradient of the whole batch (see step.split_micro_batches).
    loss_weight: float = 1.0
    rewards: Optional[Tensor] = field(default=None, repr=False)   # [B] raw rewards, for metrics only
    # The first position any row's loss reads (its first completion token), when known on the host: a forward
    # needs logits only from the position before it on (logits_to_keep), so long prompts cost no lm_head and
    # no log-softmax. select() sets it; None: every position's logits.
    loss_from: Optional[int] = None
    # Every row is [real tokens | padding] (True: build_batch makes them so; None: not known yet, found by
    # select()). A causal model then needs no padding mask: a real token attends only to real tokens before
    # it, and the padding's outputs get no loss. The forward leaves the mask out, so attention takes its
    # causal kernel, nothing reads the mask back, and a compiled model sees one form of input whether or not
    # a batch has padding (each form is a graph of its own).
    right_padded: Optional[bool] = None

    def __post_init__(self):
        if self.input_ids.dim() != 2:
            raise InvalidArgumentError(f"input_ids must be [B, T], got shape {tuple(self.input_ids.shape)}")
        shape = tuple(self.input_ids.shape)
        for name in ("attention_mask", "completion_mask", "old_logprobs", "ref_logprobs", "first_logprobs"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise InvalidArgumentError(f"GRPOBatch.{name} has shape {tuple(t.shape)}, expected {shape}")
        if tuple(self.advantages.shape) != shape[:1]:
            raise InvalidArgumentError(f"GRPOBatch.advantages has shape {tuple(self.advantages.shape)}, "
                                       f"expected ({shape[0]},)")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum().item())

    def _map(self, fn) -> "GRPOBatch":
        kw: dict[str, Any] = {}
        for name in ("input_ids", "attention_mask", "completion_mask", "advantages", "old_logprobs",
                     "ref_logprobs", "first_logprobs", "rewards"):
            t = getattr(self, name)
            kw[name] = None if t is None else fn(t)
        return replace(self, **kw)

    def to(self, device, non_blocking: bool = False) -> "GRPOBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def select(self, rows: Sequence[int] | Tensor | slice) -> "GRPOBatch":
        """Rows of the batch (e.g. one rank's share); trailing all-padding columns are trimmed."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, dtype=torch.long, device=self.input_ids.device)
        sub = self._map(lambda t: t[rows])
        if len(sub) == 0:
            return sub
        lengths = sub.attention_mask.sum(dim=1)
        right = self.right_padded
        if right is None:       # found in the same read from the device as the width
            width, flag = torch.stack([lengths.max(), _right_padded(sub.attention_mask, lengths)]).tolist()
            right = bool(flag)
        else:
            width = int(lengths.max().item())
        width = max(int(width), 1)
        sub = sub._map(lambda t: t[:, :width] if t.dim() == 2 else t)
        return replace(sub, loss_from=first_loss_position(sub.completion_mask), right_padded=right)


def _right_padded(attention_mask: Tensor, lengths: Tensor) -> Tensor:
    """0-dim tensor (on the mask's device): every row of [B, T] attention_mask is `lengths` ones, then zeros."""
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return attention_mask.ne(0).eq(cols < lengths[:, None]).all().to(lengths.dtype)


def is_right_padded(attention_mask: Tensor) -> bool:
    """Whether every row of [B, T] attention_mask is ones then zeros (one read from the device)."""
    return bool(_right_padded(attention_mask, attention_mask.ne(0).sum(dim=1)))


def first_loss_position(completion_mask: Tensor) -> Optional[int]:
    """The first column of [B, T] completion_mask with a token that gets loss (None: there is none)."""
    cols = completion_mask.ne(0).any(dim=0)
    return int(cols.to(torch.int8).argmax().item()) if bool(cols.any()) else None


def build_batch(prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[Completion]],
                advantages: Tensor | Sequence[float], *, pad_id: int, mask_truncated: bool = False,
                rewards: Tensor | Sequence[float] | None = None, device=None) -> GRPOBatch:
    """Flatten groups (prompt i, completion j -> row i * n + j) into a right-padded GRPOBatch.

    old_logprobs are filled when every completion carries logprobs, else left None (the loss then treats
    the batch as on-policy). `advantages` (and `rewards`) are in the same row order, one per completion.
    """
    if len(prompt_ids) != len(completions):
        raise InvalidArgumentError(f"{len(prompt_ids)} prompts but {len(completions)} completion groups")
    rows: list[tuple[Sequence[int], Completion]] = []
    for i, (p, group) in enumerate(zip(prompt_ids, completions)):
        if len(p) == 0:
            raise InvalidArgumentError(f"prompt {i} is empty; every prompt needs at least one token")
        rows.extend((p, c) for c in group)
    adv = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if adv.numel() != len(rows):
        raise InvalidArgumentError(f"{adv.numel()} advantages for {len(rows)} completions")
    if not rows:
        raise InvalidArgumentError("build_batch needs at least one completion")

    width = max(len(p) + len(c.token_ids) for p, c in rows)
    B = len(rows)
    input_ids = torch.full((B, width), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.long)
    completion_mask = torch.zeros((B, width), dtype=torch.float32)
    have_lp = all(c.logprobs is not None for _, c in rows)
    old = torch.zeros((B, width), dtype=torch.float32) if have_lp else None
    for b, (p, c) in enumerate(rows):
        lp, lc = len(p), len(c.token_ids)
        input_ids[b, :lp] = torch.as_tensor(list(p), dtype=torch.long)
        if lc:
            input_ids[b, lp:lp + lc] = torch.as_tensor(list(c.token_ids), dtype=torch.long)
        attention_mask[b, :lp + lc] = 1
        if not (mask_truncated and c.truncated):
            completion_mask[b, lp:lp + lc] = 1.0
        if old is not None and lc:
            old[b, lp:lp + lc] = torch.as_tensor(c.logprobs, dtype=torch.float32)
    rew = None if rewards is None else torch.as_tensor(rewards, dtype=torch.float32).flatten()
    batch = GRPOBatch(input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask,
                      advantages=adv, old_logprobs=old, rewards=rew, right_padded=True)
    return batch.to(device) if device is not None else batch
