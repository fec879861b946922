"""The GRPO objective: clipped policy ratio times group advantage, over completion tokens only.

    ratio_t  = exp(logp_t - old_logp_t)
    pg_t     = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3 estimator, >= 0, unbiased for KL)
    loss_t   = pg_t + kl_coef * kl_t

Normalisation (`loss_norm`):
    "sequence"  mean over each completion's tokens, then mean over completions (the GRPO paper)
    "token"     sum over all completion tokens / number of completion tokens in the batch (DAPO)
Positions outside completion_mask (prompt, padding, masked truncations) are selected away with
torch.where before any exp, so they get exactly zero gradient, even where the old or reference logprobs
there are NaN or far off.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from colomem.errors import InvalidArgumentError

from .batch import GRPOBatch

# rows of logits turned into logprobs at once: bounds the fp32 copy for big vocabularies
_CHUNK_ROWS = 4096


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """[B, T, V] logits -> [B, T] logprobs of input_ids, aligned with input_ids (position 0 = 0).

    out[:, t] = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]; computed in fp32 in row chunks
    (logsumexp + gather) so no [B, T, V] fp32 tensor is ever materialised.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise InvalidArgumentError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    B, T, V = logits.shape
    pred = logits[:, :-1, :].reshape(-1, V)
    target = input_ids[:, 1:].reshape(-1)
    parts = []
    for s in range(0, pred.shape[0], _CHUNK_ROWS):
        chunk = pred[s:s + _CHUNK_ROWS].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(1, target[s:s + _CHUNK_ROWS, None]).squeeze(1)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    lp = torch.cat(parts) if parts else pred.new_zeros(0, dtype=torch.float32)
    return torch.cat([lp.new_zeros(B, 1), lp.view(B, T - 1)], dim=1)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """[B, T, V] -> [B, T] entropy of the next-token distribution predicting position t (position 0 = 0)."""
    B, T, V = logits.shape
    pred = logits[:, :-1, :].reshape(-1, V)
    parts = []
    for s in range(0, pred.shape[0], _CHUNK_ROWS):
        chunk = pred[s:s + _CHUNK_ROWS].float() / temperature
        logp = torch.log_softmax(chunk, dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    ent = torch.cat(parts) if parts else pred.new_zeros(0, dtype=torch.float32)
    return torch.cat([ent.new_zeros(B, 1), ent.view(B, T - 1)], dim=1)


def masked_mean(values: Tensor, mask: Tensor, loss_norm: str) -> Tensor:
    """Normalise per-token values over the mask: "sequence" or "token" (see the module docstring)."""
    m = mask.to(values.dtype)
    v = torch.where(mask.bool(), values, torch.zeros_like(values))
    if loss_norm == "sequence":
        return (v.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean()
    if loss_norm == "token":
        return v.sum() / m.sum().clamp(min=1.0)
    raise InvalidArgumentError(f"loss_norm must be 'sequence' or 'token', got {loss_norm!r}")


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """k3 estimator of KL(policy || ref) per token: exp(r - p) - (r - p) - 1 (>= 0, zero when equal).

    With a mask, positions outside it are 0 and are zeroed *before* exp, so no inf/NaN reaches backward.
    """
    d = ref_logprobs - logprobs
    if mask is not None:
        d = torch.where(mask.bool(), d, torch.zeros_like(d))
    return torch.exp(d) - d - 1.0


def grpo_loss(logprobs: Tensor, batch: GRPOBatch, *, clip_eps: float, kl_coef: float = 0.0,
              clip_eps_high: Optional[float] = None, loss_norm: str = "sequence") -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss of `logprobs` ([B, T], aligned with batch.input_ids) and its metrics.

    old_logprobs None = on-policy (ratio 1 in value, gradient of the plain policy gradient). The returned
    loss is multiplied by batch.loss_weight (1.0 unless the batch is a micro-batch of a larger one).
    """
    if logprobs.shape != batch.input_ids.shape:
        raise InvalidArgumentError(f"logprobs {tuple(logprobs.shape)} do not match the batch "
                                   f"{tuple(batch.input_ids.shape)}")
    eps_lo = float(clip_eps)
    eps_hi = float(clip_eps if clip_eps_high is None else clip_eps_high)
    mask = batch.completion_mask.to(logprobs.device).bool()
    zeros = torch.zeros_like(logprobs)
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs.to(logprobs)
    log_ratio = torch.where(mask, logprobs - old, zeros)
    ratio = torch.exp(log_ratio)
    adv = batch.advantages.to(logprobs)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi) * adv
    pg = -torch.minimum(unclipped, clipped)

    kl = None
    if batch.ref_logprobs is not None:
        kl = kl_k3(logprobs, batch.ref_logprobs.to(logprobs), mask)
    elif kl_coef > 0:
        raise InvalidArgumentError("kl_coef > 0 needs batch.ref_logprobs (the reference model's logprobs)")
    pg_loss = masked_mean(pg, mask, loss_norm)
    unweighted = pg_loss + kl_coef * masked_mean(kl, mask, loss_norm) if kl is not None and kl_coef > 0 else pg_loss
    loss = unweighted * batch.loss_weight

    with torch.no_grad():
        n = mask.sum().clamp(min=1).float()
        lo = (ratio < 1.0 - eps_lo) & (adv < 0) & mask     # clipped below: pushing down stopped
        hi = (ratio > 1.0 + eps_hi) & (adv > 0) & mask     # clipped above: pushing up stopped
        metrics = {
            "loss": float(loss.detach()),     # weighted: the micro-batch values sum to the batch loss
            "pg_loss": float(pg_loss.detach()),   # this batch's own policy loss (not weighted)
            "clip_frac": float((lo | hi).sum() / n),
            "clip_frac_low": float(lo.sum() / n),
            "clip_frac_high": float(hi.sum() / n),
            "ratio_mean": float(torch.where(mask, ratio, zeros).sum() / n),
            "ratio_max": float(torch.where(mask, ratio, zeros).max()) if mask.any() else 1.0,
            "completion_tokens": float(mask.sum()),
        }
        if kl is not None:
            metrics["kl"] = float(torch.where(mask, kl, zeros).sum() / n)
    return loss, metrics
