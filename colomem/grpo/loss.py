"""The GRPO objective: clipped policy ratio times group advantage, over completion tokens only.

    log_ratio_t = clamp(logp_t - old_logp_t, -c, c)                c = log_ratio_clamp (verl: 20), None: off
                  importance_level="sequence" (GSPO): the mean of the completion's log-ratios, on each token
    ratio_t     = exp(log_ratio_t)
    pg_t        = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
                  dual_clip c3 (verl clip_ratio_c): pg_t = min(pg_t, -c3 * A) where A < 0
                  times w_t, the rollout importance weight (is_weights: trainer / rollout engine, capped)
    kl_t        = exp(d_t) - d_t - 1,  d_t = clamp(ref_t - logp_t, -c, c)    (k3: >= 0, unbiased for KL)
                  kl_clamp: at most that; kl_ratio_correction (TRL use_bias_correction_kl): times ratio_t
    loss        = norm(pg) + kl_coef * norm(kl) - entropy_coef * norm(entropy)

Normalisation (`loss_norm`), the same for all three terms:
    "sequence"  mean over each completion's tokens, then mean over completions (the GRPO paper)
    "token"     sum over all completion tokens / number of completion tokens in the batch (DAPO)
Positions outside completion_mask (prompt, padding, masked truncations) are selected away with
torch.where before any exp, so they get exactly zero gradient, even where the old or reference logprobs
there are NaN or far off. A clamped log-ratio passes no gradient (as in verl): a token 20 nats away from the
old policy is noise to be capped, not a direction to follow.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from colomem.errors import InvalidArgumentError

from .batch import GRPOBatch
from .metrics import Value, read
from .selected_logprobs import selected_logprobs, selected_logprobs_and_entropy

# rows of logits turned into entropies at once: bounds the fp32 copy for big vocabularies
_CHUNK_ROWS = 4096


def _window_start(logits: Tensor, input_ids: Tensor) -> int:
    """The first token of input_ids the logits predict. logits may cover only the last K <= T positions (a
    forward with logits_to_keep=K): logits[:, k] belongs to position T - K + k and predicts the token after it,
    so the predicted tokens are T - K + 1 .. T - 1."""
    if logits.dim() != 3 or logits.shape[0] != input_ids.shape[0] or not 1 <= logits.shape[1] <= input_ids.shape[1]:
        raise InvalidArgumentError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}: "
                                   "expected [B, K, V] for the last K <= T positions of [B, T]")
    return input_ids.shape[1] - logits.shape[1] + 1


def _prediction_rows(logits: Tensor, input_ids: Tensor) -> tuple[Tensor, int]:
    """The logits that predict a token of input_ids, one row per predicted token, and the first such token."""
    first = _window_start(logits, input_ids)
    return logits[:, :-1, :].reshape(-1, logits.shape[-1]), first


def _place(values: Tensor, B: int, T: int, first: int) -> Tensor:
    """[B * (T - first)] per-token values -> [B, T], zero at the positions no logit predicts."""
    return torch.cat([values.new_zeros(B, first), values.view(B, T - first)], dim=1)


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """[B, K, V] logits of the last K <= T positions -> [B, T] logprobs of input_ids, aligned with input_ids
    (0 where no logit predicts the token: position 0, and the positions before the window when K < T).

    out[:, t] = log softmax(logit of position t - 1 / temperature)[input_ids[:, t]]; computed in fp32 chunks,
    and the backward keeps only the logits and a logsumexp per token (selected_logprobs.py), so no fp32 copy
    of the logits lives until the backward.
    """
    first = _window_start(logits, input_ids)
    B, T = input_ids.shape
    lp = selected_logprobs(logits, input_ids[:, first:], temperature)
    return torch.cat([lp.new_zeros(B, first), lp], dim=1)


def token_logprobs_and_entropy(logits: Tensor, input_ids: Tensor, temperature: float = 1.0, *,
                               grad: bool = False) -> tuple[Tensor, Tensor]:
    """token_logprobs and token_entropy from one pass over the logits; the entropy is a metric (no gradient)
    unless grad (an entropy bonus), and its backward keeps no fp32 copy of the logits either."""
    first = _window_start(logits, input_ids)
    B, T = input_ids.shape
    lp, ent = selected_logprobs_and_entropy(logits, input_ids[:, first:], temperature, grad=grad)
    zeros = lp.new_zeros(B, first)
    return torch.cat([zeros, lp], dim=1), torch.cat([zeros, ent], dim=1)


def token_entropy(logits: Tensor, temperature: float = 1.0, *, grad: bool = False,
                  input_ids: Optional[Tensor] = None) -> Tensor:
    """[B, K, V] -> [B, T] entropy of the next-token distribution predicting position t (0 where no logit
    predicts one). input_ids: the [B, T] tokens when the logits cover only the last K < T positions.

    grad=False (the metric): no graph. grad=True (the entropy bonus): differentiable; backward keeps each
    chunk's fp32 log-softmax, so this costs a [B, T, V] fp32 tensor after all (only when entropy_coef > 0)."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        ids = input_ids if input_ids is not None else logits.new_empty(logits.shape[:2], dtype=torch.long)
        pred, first = _prediction_rows(logits, ids)
        B, T = ids.shape
        parts = []
        for s in range(0, pred.shape[0], _CHUNK_ROWS):
            chunk = pred[s:s + _CHUNK_ROWS].float() / temperature
            logp = torch.log_softmax(chunk, dim=-1)
            parts.append(-(logp.exp() * logp).sum(-1))
        ent = torch.cat(parts) if parts else pred.new_zeros(0, dtype=torch.float32)
        return _place(ent, B, T, first)


def _clamp(x: Tensor, bound: Optional[float]) -> Tensor:
    return x if bound is None else torch.clamp(x, -float(bound), float(bound))


def masked_mean(values: Tensor, mask: Tensor, loss_norm: str) -> Tensor:
    """Normalise per-token values over the mask: "sequence" or "token" (see the module docstring)."""
    m = mask.to(values.dtype)
    v = torch.where(mask.bool(), values, torch.zeros_like(values))
    if loss_norm == "sequence":
        return (v.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean()
    if loss_norm == "token":
        return v.sum() / m.sum().clamp(min=1.0)
    raise InvalidArgumentError(f"loss_norm must be 'sequence' or 'token', got {loss_norm!r}")


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Optional[Tensor] = None, *,
          log_ratio_clamp: Optional[float] = None, max_value: Optional[float] = None) -> Tensor:
    """k3 estimator of KL(policy || ref) per token: exp(r - p) - (r - p) - 1 (>= 0, zero when equal).

    With a mask, positions outside it are 0 and are zeroed *before* exp, so no inf/NaN reaches backward.
    log_ratio_clamp: r - p clamped to +-that first (verl: 20; without it a log-ratio of 28 gives 1.4e12);
    max_value: the estimate capped at that (verl: 10)."""
    d = ref_logprobs - logprobs
    if mask is not None:
        d = torch.where(mask.bool(), d, torch.zeros_like(d))
    d = _clamp(d, log_ratio_clamp)
    kl = torch.exp(d) - d - 1.0
    return kl if max_value is None else torch.clamp(kl, max=float(max_value))


def rollout_is_weights(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, level: str,
                       mode: str, cap: float, log_ratio_clamp: Optional[float] = None, lazy: bool = False
                       ) -> tuple[Tensor, dict[str, Any]]:
    """Importance weights for the rollout engine / trainer mismatch (TRL's vllm_importance_sampling_correction,
    verl's rollout_is): w = pi_trainer_old / pi_rollout, per token (level "token") or one per completion
    (level "sequence": the product over its tokens, exp of the summed log-ratios), then capped: "truncate"
    min(w, cap), "mask" w where w <= cap, else 0. Constants (no gradient); [B, T], 0 outside the mask.

    Metrics over the completion tokens ("token") or the completions with a token ("sequence"): the applied
    weights' is_weight_mean/min/max, and is_truncated_frac or is_masked_frac, the share above the cap (lazy:
    left on the device as 0-d tensors, colomem.grpo.metrics)."""
    if level not in ("token", "sequence") or mode not in ("truncate", "mask"):
        raise InvalidArgumentError(f"importance weights: level {level!r} (token|sequence), mode {mode!r} "
                                   "(truncate|mask)")
    with torch.no_grad():
        m = mask.bool()
        d = torch.where(m, trainer_logprobs.detach() - rollout_logprobs.to(trainer_logprobs), 0.0)
        units = m
        if level == "sequence":
            d = d.sum(dim=1, keepdim=True)
            units = m.any(dim=1, keepdim=True)
        w = torch.exp(_clamp(d, log_ratio_clamp))
        over = (w > cap) & units
        w = torch.clamp(w, max=cap) if mode == "truncate" else torch.where(over, torch.zeros_like(w), w)
        n = units.sum().clamp(min=1).float()
        any_unit, one = units.any(), torch.ones_like(n)
        metrics: dict[str, Value] = {       # 1 for min / max where no unit counts (a where, not a read)
            "is_weight_mean": torch.where(units, w, 0.0).sum() / n,
            "is_weight_min": torch.where(any_unit, torch.where(units, w, float("inf")).min(), one),
            "is_weight_max": torch.where(any_unit, torch.where(units, w, float("-inf")).max(), one),
            ("is_truncated_frac" if mode == "truncate" else "is_masked_frac"): over.sum() / n,
        }
        w = torch.where(m, w.expand_as(m), torch.zeros_like(trainer_logprobs))
    return w, (metrics if lazy else read(metrics))


def grpo_loss(logprobs: Tensor, batch: GRPOBatch, *, clip_eps: float, kl_coef: float = 0.0,
              clip_eps_high: Optional[float] = None, loss_norm: str = "sequence",
              importance_level: str = "token", dual_clip: Optional[float] = None,
              log_ratio_clamp: Optional[float] = None, kl_clamp: Optional[float] = None,
              kl_ratio_correction: bool = False, is_weights: Optional[Tensor] = None,
              entropy: Optional[Tensor] = None, entropy_coef: float = 0.0,
              lazy: bool = False) -> tuple[Tensor, dict[str, Any]]:
    """Clipped GRPO loss of `logprobs` ([B, T], aligned with batch.input_ids) and its metrics (formulas: the
    module docstring; the options are GRPOConfig's, of the same names).

    old_logprobs None = on-policy (ratio 1 in value, gradient of the plain policy gradient). is_weights: the
    rollout importance weights ([B, T], rollout_is_weights) on the policy term; entropy: [B, T] per-token
    entropy with its graph, for entropy_coef > 0. The returned loss is multiplied by batch.loss_weight (1.0
    unless the batch is a micro-batch of a larger one). lazy: the metrics as 0-d tensors, not read from the
    device (colomem.grpo.metrics: a MetricAccumulator reads a step's at once), else floats.
    """
    if logprobs.shape != batch.input_ids.shape:
        raise InvalidArgumentError(f"logprobs {tuple(logprobs.shape)} do not match the batch "
                                   f"{tuple(batch.input_ids.shape)}")
    if importance_level not in ("token", "sequence"):
        raise InvalidArgumentError(f"importance_level must be 'token' or 'sequence', got {importance_level!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise InvalidArgumentError(f"dual_clip must be > 1 (a ratio above 1 + clip_eps_high), got {dual_clip}")
    eps_lo = float(clip_eps)
    eps_hi = float(clip_eps if clip_eps_high is None else clip_eps_high)
    mask = batch.completion_mask.to(logprobs.device).bool()
    zeros = torch.zeros_like(logprobs)
    old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs.to(logprobs)
    log_ratio = torch.where(mask, logprobs - old, zeros)
    if importance_level == "sequence":     # GSPO: one ratio per completion, the geometric mean of its tokens'
        per_row = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(mask, per_row.expand_as(log_ratio), zeros)
    with torch.no_grad():
        clamped = (log_ratio.abs() > log_ratio_clamp) & mask if log_ratio_clamp is not None else None
    ratio = torch.exp(_clamp(log_ratio, log_ratio_clamp))
    adv = batch.advantages.to(logprobs)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi) * adv
    pg = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:          # A < 0 and a ratio far above 1: the loss stops growing at -c3 * A
        pg = torch.where(adv < 0, torch.minimum(pg, -float(dual_clip) * adv), pg)
    if is_weights is not None:
        pg = pg * is_weights.to(logprobs)

    kl = None
    if batch.ref_logprobs is not None:
        kl = kl_k3(logprobs, batch.ref_logprobs.to(logprobs), mask, log_ratio_clamp=log_ratio_clamp,
                   max_value=kl_clamp)
        if kl_ratio_correction:        # the samples come from the old policy: weight the estimate by the ratio
            kl = kl * ratio
    elif kl_coef > 0:
        raise InvalidArgumentError("kl_coef > 0 needs batch.ref_logprobs (the reference model's logprobs)")
    if entropy_coef > 0 and entropy is None:
        raise InvalidArgumentError("entropy_coef > 0 needs the per-token entropy (token_entropy(..., grad=True))")
    pg_loss = masked_mean(pg, mask, loss_norm)
    unweighted = pg_loss + kl_coef * masked_mean(kl, mask, loss_norm) if kl is not None and kl_coef > 0 else pg_loss
    if entropy is not None and entropy_coef > 0:
        unweighted = unweighted - entropy_coef * masked_mean(entropy.to(logprobs), mask, loss_norm)
    loss = unweighted * batch.loss_weight

    with torch.no_grad():
        n = mask.sum().clamp(min=1).float()
        lo = (ratio < 1.0 - eps_lo) & (adv < 0) & mask     # clipped below: pushing down stopped
        hi = (ratio > 1.0 + eps_hi) & (adv > 0) & mask     # clipped above: pushing up stopped
        in_mask = torch.where(mask, ratio, zeros)
        metrics: dict[str, Value] = {
            "loss": loss.detach(),     # weighted: the micro-batch values sum to the batch loss
            "pg_loss": pg_loss.detach(),   # this batch's own policy loss (not weighted)
            "clip_frac": (lo | hi).sum() / n,
            "clip_frac_low": lo.sum() / n,
            "clip_frac_high": hi.sum() / n,
            "ratio_mean": in_mask.sum() / n,
            # 1 where no token counts (read nothing here: a where, not an if)
            "ratio_max": torch.where(mask.any(), in_mask.max(), torch.ones_like(n)) if ratio.numel() else 1.0,
            "completion_tokens": mask.sum(),
        }
        if dual_clip is not None:
            metrics["clip_frac_dual"] = ((ratio > dual_clip) & (adv < 0) & mask).sum() / n
        if clamped is not None:
            metrics["log_ratio_clamped_frac"] = clamped.sum() / n
        if kl is not None:
            metrics["kl"] = torch.where(mask, kl, zeros).sum() / n
    return loss, (metrics if lazy else read(metrics))
