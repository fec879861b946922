"""One GRPO optimisation step, shared by every Trainer (plain torch on CPU, DeepSpeed on GPU).

    for mb in split_micro_batches(batch, micro_batch, cfg.loss_norm, ...):
        loss, metrics = compute_loss(model, mb, cfg)      # loss already carries mb.loss_weight
        backward(loss)                                    # torch: loss.backward()
                                                          # DeepSpeed: engine.backward(loss, scale_wrt_gas=False)
    gradients averaged over the ranks, optimizer step

The micro-batch losses are weighted by their share of the whole optimisation batch over *all* ranks
(sequences for loss_norm="sequence", completion tokens for "token"), times the number of ranks the trainer
averages the gradients over. So after that average the gradient equals one rank training on every rank's rows
at once, whatever the split into ranks and micro-batches: each rank's own token count would weight a rank
with few tokens as much as one with many (accumulate_gradients sums the counts over the ranks first).
That is why DeepSpeed must not scale again by the accumulation steps (scale_wrt_gas=False).
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import Tensor

from colomem.errors import InvalidArgumentError

from .batch import GRPOBatch
from .config import GRPOConfig
from .loss import grpo_loss, rollout_is_weights, token_logprobs, token_logprobs_and_entropy
from .metrics import MetricAccumulator, optional, read
from .micro_batches import micro_batch_rows

RefLogprobsFn = Callable[[GRPOBatch], Tensor]


def _hf_model(model):
    """The transformers model under a DeepSpeed engine (.module) and a peft wrapper (get_base_model())."""
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


_KEEPS_LOGITS: dict[type, bool] = {}


def _takes_logits_to_keep(model) -> bool:
    cls = type(_hf_model(model))
    if cls not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    return _KEEPS_LOGITS[cls]


def _forward_logits(model, batch: GRPOBatch) -> Tensor:
    """[B, K, V] logits of the last K positions: from the one before batch.loss_from when the model can leave
    the rest out (transformers' logits_to_keep: the lm_head and the log-softmax skip the prompts), else all T."""
    kw = {}
    T = batch.input_ids.shape[1]
    if batch.loss_from is not None and batch.loss_from > 1 and _takes_logits_to_keep(model):
        kw["logits_to_keep"] = T - batch.loss_from + 1
    # right padding needs no mask for a causal model (GRPOBatch.right_padded)
    mask = None if batch.right_padded else batch.attention_mask
    out = model(input_ids=batch.input_ids, attention_mask=mask, use_cache=False, **kw)
    return out.logits if hasattr(out, "logits") else out[0]


def policy_logprobs(model, batch: GRPOBatch, temperature: float = 1.0) -> Tensor:
    """Forward + token_logprobs: [B, T] logprobs of batch.input_ids under `model`."""
    return token_logprobs(_forward_logits(model, batch), batch.input_ids, temperature)


def compute_loss(model, batch: GRPOBatch, cfg: GRPOConfig, ref_logprobs_fn: Optional[RefLogprobsFn] = None, *,
                 lazy: bool = False) -> tuple[Tensor, dict[str, Any]]:
    """GRPO loss of `model` on `batch` (one forward). With cfg.kl_coef > 0 and no batch.ref_logprobs,
    ref_logprobs_fn(batch) supplies them (e.g. peft_reference_fn: the LoRA base with adapters off).

    The ratio's old policy: old_logprobs="policy" the trainer's own logprobs before the first update on this
    batch (batch.first_logprobs, or this forward's when there is a single update), "rollout" the rollout
    engine's (batch.old_logprobs). is_correction weights the policy term by first / rollout logprobs. lazy: the
    metrics left on the device (colomem.grpo.metrics), else floats read at once."""
    if cfg.kl_coef > 0 and batch.ref_logprobs is None:
        if ref_logprobs_fn is None:
            raise InvalidArgumentError("kl_coef > 0 but the batch has no ref_logprobs and no ref_logprobs_fn "
                                       "was given; use LoRA (free reference) or set kl_coef to 0")
        with torch.no_grad():
            batch = replace(batch, ref_logprobs=ref_logprobs_fn(batch).detach())
    rollout_lp = batch.old_logprobs
    mask = batch.completion_mask.bool()
    needs_rollout = cfg.old_logprobs == "rollout" or cfg.is_correction != "none"
    if needs_rollout and rollout_lp is None:
        raise InvalidArgumentError("old_logprobs='rollout' and is_correction need the rollout engine's logprobs of "
                                   "the sampled tokens, and this batch has none")
    if needs_rollout and rollout_lp is not None and bool(torch.isnan(rollout_lp[mask]).any()):
        raise InvalidArgumentError("old_logprobs='rollout' and is_correction need the rollout engine's logprob of "
                                   "every sampled token, and some are NaN; use old_logprobs='policy' and "
                                   "is_correction='none'")
    # None = this forward's own logprobs, detached (a single update per batch: ratio 1 in value)
    batch = replace(batch, old_logprobs=batch.first_logprobs if cfg.old_logprobs == "policy" else rollout_lp)
    logits = _forward_logits(model, batch)
    # the entropy (a bonus in the loss, or a metric) from the logprobs' own pass over the logits
    ent: Optional[Tensor] = None
    if cfg.log_entropy or cfg.entropy_coef > 0:
        logprobs, ent = token_logprobs_and_entropy(logits, batch.input_ids, cfg.temperature,
                                                   grad=cfg.entropy_coef > 0)
    else:
        logprobs = token_logprobs(logits, batch.input_ids, cfg.temperature)
    mask = mask.to(logits.device)
    is_w: Optional[Tensor] = None
    is_metrics: dict[str, float] = {}
    if cfg.is_correction != "none" and rollout_lp is not None:
        trainer_lp = batch.first_logprobs if batch.first_logprobs is not None else logprobs.detach()
        is_w, is_metrics = rollout_is_weights(trainer_lp.to(logprobs), rollout_lp.to(logprobs), mask,
                                              level=cfg.is_correction, mode=cfg.is_mode, cap=cfg.is_cap,
                                              log_ratio_clamp=cfg.log_ratio_clamp, lazy=True)
    loss, metrics = grpo_loss(logprobs, batch, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                              clip_eps_high=cfg.clip_eps_high, loss_norm=cfg.loss_norm,
                              importance_level=cfg.importance_level, dual_clip=cfg.dual_clip,
                              log_ratio_clamp=cfg.log_ratio_clamp, kl_clamp=cfg.kl_clamp,
                              kl_ratio_correction=cfg.kl_ratio_correction, is_weights=is_w,
                              entropy=ent if cfg.entropy_coef > 0 else None, entropy_coef=cfg.entropy_coef,
                              lazy=True)
    metrics.update(is_metrics)
    with torch.no_grad():
        if rollout_lp is not None:
            # how far the rollout engine's logprobs are from the trainer's: ~0 when the sync delivered the
            # trainer's weights (bf16 numerics aside); large when the rollout generated with other weights.
            # Against the weights the rollout had: the first pass when the batch is reused
            mine = batch.first_logprobs.to(logprobs) if batch.first_logprobs is not None else logprobs.detach()
            gap = (mine - rollout_lp.to(logprobs)).abs()
            ok = mask & ~torch.isnan(gap)
            count = ok.sum()
            metrics["rollout_logprob_gap"] = optional(torch.where(ok, gap, torch.zeros_like(gap)).sum()
                                                      / count.clamp(min=1), count > 0)
        if cfg.log_entropy and ent is not None:
            e = ent.detach()
            metrics["entropy"] = torch.where(mask, e, torch.zeros_like(e)).sum() / mask.sum().clamp(min=1)
    return loss, (metrics if lazy else read(metrics))


def split_micro_batches(batch: GRPOBatch, micro_batch: int, loss_norm: str = "sequence", *,
                        total_tokens: Optional[float] = None, total_rows: Optional[float] = None,
                        world_size: int = 1, by_length: bool = True, max_tokens: Optional[int] = None,
                        count: Optional[int] = None) -> list[GRPOBatch]:
    """Micro-batches of at most micro_batch rows (or, with max_tokens, of at most that many positions), each
    with its loss_weight. Which rows go together: micro_batches.micro_batch_rows (by_length: longest first, so
    each micro-batch pads little; count: at least that many micro-batches, for ranks that step together).

    The weight is the micro-batch's share of the optimisation batch: its completion tokens / total_tokens
    ("token") or its rows / total_rows ("sequence"), times world_size. total_*: the counts over every rank
    (default: this batch's own, the one-rank case); world_size: the ranks the trainer averages the gradients
    over, so the weights of all ranks' micro-batches sum to world_size and the averaged gradient is the whole
    batch's, whatever rows go together."""
    if loss_norm not in ("sequence", "token"):
        raise InvalidArgumentError(f"loss_norm must be 'sequence' or 'token', got {loss_norm!r}")
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    B = len(batch)
    tokens = float(batch.completion_mask.sum()) if total_tokens is None else float(total_tokens)
    rows = float(B) if total_rows is None else float(total_rows)
    groups = micro_batch_rows(batch.attention_mask.sum(dim=1), micro_batch, max_tokens=max_tokens,
                              by_length=by_length, count=count)
    out = []
    for g in groups:
        mb = batch.select(g.to(batch.input_ids.device))
        if loss_norm == "token" and tokens > 0:
            share = float(mb.completion_mask.sum()) / tokens
        else:           # sequence norm, or no completion token anywhere (the loss is 0 either way)
            share = len(mb) / rows
        out.append(replace(mb, loss_weight=batch.loss_weight * share * world_size))
    return out


def micro_batch_count(batch: GRPOBatch, micro_batch: int, max_tokens: Optional[int], *, world_size: int = 1,
                      process_group=None, device=None) -> Optional[int]:
    """How many micro-batches every rank runs when a token budget makes the count differ between ranks: the
    most any rank needs (one all-reduce, every rank calls it). None when the ranks agree anyway."""
    if max_tokens is None or world_size <= 1:
        return None
    import torch.distributed as dist

    n = len(micro_batch_rows(batch.attention_mask.sum(dim=1), micro_batch, max_tokens=max_tokens))
    t = torch.tensor([n], dtype=torch.int64, device=device if device is not None else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
    return int(t.item())


def global_counts(batch: GRPOBatch, *, world_size: int = 1, process_group=None,
                  device=None) -> tuple[float, float]:
    """(completion tokens, rows) of `batch` summed over the ranks of process_group (one all-reduce; every
    rank must call it). world_size 1: this batch's own counts, no communication. device: where the count
    tensor lives for the reduction (a CUDA device for NCCL)."""
    local = (float(batch.completion_mask.sum()), float(len(batch)))
    if world_size <= 1:
        return local
    import torch.distributed as dist

    t = torch.tensor(local, dtype=torch.float64, device=device if device is not None else "cpu")
    dist.all_reduce(t, group=process_group)
    tokens, rows = t.tolist()
    return float(tokens), float(rows)


def accumulate_gradients(model, batch: GRPOBatch, cfg: GRPOConfig, *, micro_batch: int,
                         backward: Callable[[Tensor], None], ref_logprobs_fn: Optional[RefLogprobsFn] = None,
                         before_micro: Optional[Callable[[bool], None]] = None, device=None,
                         world_size: int = 1, process_group=None,
                         micro_batch_tokens: Optional[int] = None) -> dict[str, float]:
    """Forward/backward every micro-batch of `batch` (this rank's rows); the caller averages the gradients
    over the ranks and steps the optimizer afterwards. micro_batch_tokens: micro-batches by a token budget
    instead of micro_batch rows (every rank then runs as many as the rank that needs most).

    The one micro-batch loop of every Trainer. backward(loss) gets each micro-batch's loss, already weighted
    by its share of the batch over all ranks (torch: loss.backward(); DeepSpeed: engine.backward(loss,
    scale_wrt_gas=False)). world_size / process_group: the ranks the trainer averages the gradients over
    (every rank calls this with its own rows: the token and row counts are summed over them first).
    before_micro(is_last) runs before each micro-batch's forward (DeepSpeed: set_gradient_accumulation_boundary,
    so the gradients are reduced at the last one whatever the batch size). device: where each micro-batch
    goes (non-blocking). Returns this rank's metrics: weighted means, the summed `loss` (this rank's part of
    the batch loss times world_size: its mean over the ranks is the batch loss), `micro_batches`."""
    acc = MetricAccumulator()
    tokens, rows = global_counts(batch, world_size=world_size, process_group=process_group, device=device)
    count = micro_batch_count(batch, micro_batch, micro_batch_tokens, world_size=world_size,
                              process_group=process_group, device=device)
    micro = split_micro_batches(batch, micro_batch, cfg.loss_norm, total_tokens=tokens, total_rows=rows,
                                world_size=world_size, max_tokens=micro_batch_tokens, count=count)
    # every micro-batch's copy to the device queued before the first forward: a copy from pageable host memory
    # holds the host until it is staged, which between two micro-batches would delay queueing the next forward
    placed = [mb.to(device, non_blocking=True) for mb in micro] if device is not None else micro
    for i, mb in enumerate(placed):
        if before_micro is not None:
            before_micro(i == len(micro) - 1)
        # the metrics stay on the device until the update ends: a read here would stop the host from
        # queueing the backward until the forward's kernels are done
        loss, metrics = compute_loss(model, mb, cfg, ref_logprobs_fn, lazy=True)
        backward(loss)
        acc.add(metrics, mb.loss_weight / batch.loss_weight)
    out = acc.result()
    out["micro_batches"] = float(len(micro))
    # the share of the forwarded positions that were padding (what sorting rows by length keeps small)
    shaped = sum(mb.input_ids.numel() for mb in micro)
    real = float(batch.attention_mask.sum())
    out["padded_fraction"] = 1.0 - real / shaped if shaped else 0.0
    return out


def split_mini_batches(batch: GRPOBatch, mini_batches: int) -> list[GRPOBatch]:
    """`mini_batches` consecutive row slices of near-equal size (one optimizer step each; verl's
    ppo_mini_batch_size as a count per rank). Rows stay in order: group by group."""
    B = len(batch)
    if mini_batches < 1:
        raise InvalidArgumentError(f"mini_batches must be >= 1, got {mini_batches}")
    if B < mini_batches:
        raise InvalidArgumentError(f"mini_batches={mini_batches} but this rank trains on {B} rows; every "
                                   "mini-batch needs a row: fewer mini-batches or more prompts per step")
    if mini_batches == 1:
        return [batch]
    cuts = [i * B // mini_batches for i in range(mini_batches + 1)]
    return [batch.select(slice(a, b)) for a, b in zip(cuts, cuts[1:])]


@torch.no_grad()
def with_first_logprobs(model, batch: GRPOBatch, cfg: GRPOConfig, *, micro_batch: int,
                        ref_logprobs_fn: Optional[RefLogprobsFn] = None, device=None,
                        micro_batch_tokens: Optional[int] = None, world_size: int = 1,
                        process_group=None) -> GRPOBatch:
    """`batch` with first_logprobs: the model's logprobs before any update on it (one forward without a graph,
    micro-batch by micro-batch), the old policy of every later update; and with the reference logprobs when
    the KL needs them, so reusing the batch does not run the reference again."""
    need_ref = cfg.kl_coef > 0 and batch.ref_logprobs is None and ref_logprobs_fn is not None
    B, T = batch.input_ids.shape
    first = torch.zeros(B, T, dtype=torch.float32)
    ref = torch.zeros(B, T, dtype=torch.float32) if need_ref else None
    # as many forwards on every rank (ZeRO-3 gathers each layer's weights from all ranks in every forward)
    count = micro_batch_count(batch, micro_batch, micro_batch_tokens, world_size=world_size,
                              process_group=process_group, device=device)
    for rows in micro_batch_rows(batch.attention_mask.sum(dim=1), micro_batch, max_tokens=micro_batch_tokens,
                                 count=count):
        mb = batch.select(rows.to(batch.input_ids.device))
        if device is not None:
            mb = mb.to(device, non_blocking=True)
        w = mb.input_ids.shape[1]           # select trimmed the trailing padding: write back into [B, T]
        first[rows, :w] = policy_logprobs(model, mb, cfg.temperature).float().cpu()
        if ref is not None and ref_logprobs_fn is not None:
            ref[rows, :w] = ref_logprobs_fn(mb).float().cpu()
    mask = batch.completion_mask.cpu() > 0
    dev = batch.input_ids.device
    first = torch.where(mask, first, torch.zeros_like(first)).to(dev)
    if ref is not None:
        batch = replace(batch, ref_logprobs=torch.where(mask, ref, torch.zeros_like(ref)).to(dev))
    return replace(batch, first_logprobs=first)


_UPDATE_SUMS = ("reload_wait_s", "optimizer_reload_s", "micro_batches")


def combine_updates(per_update: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of several optimizer steps on one batch: means (max for *_max, min for *_min, sums for
    the reload wait and the micro-batch count)."""
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for m in per_update for k in m)
    for k in keys:
        vals = [m[k] for m in per_update if k in m]
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith("_min"):
            out[k] = min(vals)
        elif k in _UPDATE_SUMS:
            out[k] = float(sum(vals))
        else:
            out[k] = float(sum(vals) / len(vals))
    return out


def train_on_batch(model, batch: GRPOBatch, cfg: GRPOConfig, *, micro_batch: int,
                   backward: Callable[[Tensor], None], optimizer_step: Callable[[], dict[str, float]],
                   ref_logprobs_fn: Optional[RefLogprobsFn] = None,
                   before_micro: Optional[Callable[[bool], None]] = None, device=None, world_size: int = 1,
                   process_group=None, micro_batch_tokens: Optional[int] = None,
                   accumulation: Optional[Callable[[], ContextManager]] = None) -> dict[str, float]:
    """Every optimizer step a Trainer takes on one batch (its train_step): cfg.num_iterations passes over the
    batch (TRL num_iterations, verl ppo_epochs), each split into cfg.mini_batches mini-batches (verl
    ppo_mini_batch_size), one accumulate_gradients + optimizer_step() per mini-batch.

    With more than one update the old policy of the clipped ratio is the batch's first-pass logprobs (before
    any of these updates), so later updates see ratios away from 1 and the clip bounds how far they go.
    optimizer_step(): the trainer's own (average the gradients over the ranks, clip, step, zero them); its
    metrics join the update's. accumulation(): a context each update's micro-batches run in, left before its
    optimizer_step (DeepSpeed: engine.coalesce_grad_reduction, one gradient reduction per update). Returns the
    updates' combined metrics and `optimizer_steps`. The model trains in training mode, as Hugging Face's and
    TRL's trainers train it: from_pretrained leaves it in eval mode, where transformers checkpoints no layer
    (gradient checkpointing would do nothing) and the model's own dropout would not apply."""
    model.train()
    if cfg.num_iterations * cfg.mini_batches > 1 and batch.first_logprobs is None:
        batch = with_first_logprobs(model, batch, cfg, micro_batch=micro_batch, ref_logprobs_fn=ref_logprobs_fn,
                                    device=device, micro_batch_tokens=micro_batch_tokens, world_size=world_size,
                                    process_group=process_group)
    minis = split_mini_batches(batch, cfg.mini_batches)
    per_update = []
    for _ in range(cfg.num_iterations):
        for mb in minis:
            with accumulation() if accumulation is not None else nullcontext():
                m = accumulate_gradients(model, mb, cfg, micro_batch=micro_batch, backward=backward,
                                         ref_logprobs_fn=ref_logprobs_fn, before_micro=before_micro, device=device,
                                         world_size=world_size, process_group=process_group,
                                         micro_batch_tokens=micro_batch_tokens)
            m.update(optimizer_step())
            per_update.append(m)
    out = combine_updates(per_update)
    if "completion_tokens" in out:         # this rank's batch, not the mean of its mini-batches
        out["completion_tokens"] = float(batch.completion_mask.sum())
    out["optimizer_steps"] = float(len(per_update))
    return out


def peft_reference_fn(model, temperature: float = 1.0) -> RefLogprobsFn:
    """Reference logprobs of a peft model with its adapters disabled (the frozen base: a free reference)."""
    inner = getattr(model, "module", model)     # a DeepSpeed engine wraps the peft model in .module
    if not hasattr(inner, "disable_adapter"):
        raise InvalidArgumentError("peft_reference_fn needs a peft model (with disable_adapter())")

    def ref(batch: GRPOBatch) -> Tensor:
        with torch.no_grad(), inner.disable_adapter():
            return policy_logprobs(inner, batch, temperature)
    return ref


def frozen_reference_fn(ref_model, temperature: float = 1.0) -> RefLogprobsFn:
    """Reference logprobs from a separate frozen model (full fine-tuning with kl_coef > 0)."""
    def ref(batch: GRPOBatch) -> Tensor:
        with torch.no_grad():
            return policy_logprobs(ref_model, batch, temperature)
    return ref
