"""The plan of every step after the measuring one: from the GPU memory figures the first step left on every
rank, the placement (colomem.runner.placement), when the optimizer state comes back, the weight bridge's
buckets, the recompute trimmed (--trim-recompute) and the micro-batch grown (--grow-micro-batch) in the memory
left free, whether vLLM sleeps while training when both would fit awake (colomem.runner.sleep_trade), the
hints for what the user could change, and the lines and the placement event that say so.

It is held apart from the phases (colomem.runner.phase_runner) because it runs once, after the first step,
and only reads what that step measured: each function takes what it needs and returns what it decided, and
the runner keeps what later steps read. Every rank sees every rank's figures, so every rank decides the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from colomem.engines.recompute import set_checkpointed
from colomem.units import format_bytes, parse_bytes

from .batch_width import widened
from .kv_need import kv_layout, kv_shrink_hint, rollout_kv_need
from .loop_memory import grow_sync_bucket
from .placement import (MemoryFigures, Placement, choose, early_reload_room, figures_from_step, fits, keep_part_fit,
                        kv_hint, kv_release_fit, micro_batch_fit, micro_batch_hint, micro_batch_tokens_fit,
                        micro_batch_tokens_hint, reload_at_step, state_to_plan, train_spare)
from .ranks import Ranks
from .recompute_plan import (RecomputeProbe, asleep_trade, micro_batch_rows, no_fit_reason, probe, recompute_fit,
                             recompute_hint)
from .sleep_trade import SLEEP_PHASES, SleepTrade, recompute_cost, weigh_rollout_sleep
from .timeline import StepRecord, gpu_total


@dataclass(frozen=True)
class RecomputeLine:
    """What weighing the recompute gave: the line to print ("" when there is nothing to say), the probe it
    measured, (checkpointed was, now) when --trim-recompute applied a setting, and the bytes the layers it
    stopped checkpointing keep at the measured micro-batch, which a later --grow-micro-batch must leave them."""
    line: str = ""
    probe: Optional[RecomputeProbe] = None
    trimmed: Optional[tuple[int, int]] = None
    extra: int = 0


@dataclass(frozen=True)
class LaterPlan:
    """What plan_later_steps decided: the placement later steps follow, and the placement event as written
    to the metrics file (everything else it decided, and the figures it decided from, are in that event)."""
    placement: Placement
    event: dict = field(default_factory=dict)
    restore_on_device: bool = False     # a merged rollout's restore source held in GPU memory (restore_copy_fits)


def planned_width(cfg: Any, train_width: int, widest_row: int) -> int:
    """The row width the plan counts activations at (batch_width.py): the widest row the job can train on,
    or the measured step's rows when wider (or unknown); micro-batches cut by a token budget hold as many
    tokens whatever the width, so they plan at the measured one."""
    if cfg.micro_batch_tokens is not None:
        return train_width
    return max(train_width, widest_row)


def optim_out_allowed(cfg: Any, trainer: Any) -> bool:
    """Whether the planner may send the optimizer state out behind the rollout: the trainer can defer an
    offload (the colomem method), and the job did not ask for the state back before the step."""
    return cfg.optimizer_reload != "overlap" and getattr(trainer, "defers_offload", False)


def kv_figures(cfg: Any, rollout: Any, world_size: int) -> tuple[int, int]:
    """(the rollout engine's KV cache, the most the step's rollout holds) on this GPU; zeros when unknown."""
    cache = getattr(rollout, "kv_cache_bytes", None)
    path = getattr(rollout, "model_path", None)
    if not cache or not path:
        return 0, 0
    layout = kv_layout(path, cfg.trust_remote_code)
    if layout is None:
        return int(cache), 0
    return int(cache), rollout_kv_need(cfg.rows_per_rank(world_size), cfg.max_model_len, layout[0], layout[1],
                                       cfg.tensor_parallel_size)


def step_figures(cfg: Any, trainer: Any, rollout: Any, world_size: int, rec: StepRecord, device: Optional[int],
                 measured_at_step: bool, train_width: int, width: int) -> Optional[MemoryFigures]:
    """This rank's memory figures from the measuring step `rec` (None without GPU figures: the CPU backend),
    its activations counted at `width` tokens a row. measured_at_step: that step brought the optimizer state
    back inside the optimizer step, so the state counts as absent from its peak."""
    moved = dict(trainer.last_offload.by_category) if trainer.last_offload is not None else {}
    held = getattr(trainer, "state_bytes", None)        # after training: Adam's moments exist now
    now = held() if held is not None and not trainer.offloaded else {}
    by_cat = state_to_plan(moved, now)
    created = max(0, int(now.get("optim", 0) or 0) - int(moved.get("optim", 0) or 0))
    if measured_at_step:       # the moments were in the pool through its peak, as if created there
        created = int(now.get("optim", 0) or 0)
    mine = figures_from_step(rec.memory, by_cat, gpu_total(device) or 0, optim_created=created,
                             pre_step_peak=int(rec.metrics.get("train/reserved_before_step_max") or 0),
                             step_start_peak=int(rec.metrics.get("train/reserved_at_step_start_max") or 0))
    if mine is not None:
        mine.kv_cache, mine.kv_need = kv_figures(cfg, rollout, world_size)
        mine.rollout_weights = int(getattr(rollout, "weights_bytes", None) or 0)
        mine = widened(mine, train_width, width)
    return mine


def restore_copy_fits(placement: Placement, figs: list, margin: Optional[int], taken: int, nbytes: int) -> bool:
    """Whether a merged rollout's restore source (nbytes, held through both phases) fits in GPU memory beside
    the placement and the `taken` bytes already given out, on every GPU: then the base comes back from it in
    milliseconds instead of over the host link each step."""
    return nbytes > 0 and fits(placement, figs, margin, taken + nbytes)


def plan_later_steps(cfg: Any, *, trainer: Any, rollout: Any, ranks: Ranks, rec: StepRecord,
                     device: Optional[int], measured_at_step: bool, train_width: int, widest_row: int,
                     say: Callable[[str], None], restore_bytes: int = 0) -> LaterPlan:
    """After the first step (everything moved): the placement of every later step, from its memory figures on
    every rank (the same placement everywhere: the one that fits on every GPU), and what else the memory it
    leaves free is given to. Sets what it decides on the trainer and the rollout, says it through `say`.
    restore_bytes: the GPU bytes a merged rollout's restore source would take there (a shared LoRA base),
    given after the recompute trim (which saves more a step) and before a grown micro-batch."""
    c = cfg
    width = planned_width(c, train_width, widest_row)
    mine = step_figures(c, trainer, rollout, ranks.world_size, rec, device, measured_at_step, train_width, width)
    every = ranks.exchange(mine.to_dict() if mine is not None else None)
    hint = micro_hint = ""
    recompute = RecomputeLine()
    trade: Optional[SleepTrade] = None
    grown_micro: Optional[tuple[int, int]] = None
    figures: list[dict] = []
    reload_why = ""
    restore_on_device = False
    if any(f is None for f in every):
        placement = Placement((), True, "no GPU memory figures (the CPU backend): everything moves")
        if measured_at_step and hasattr(trainer, "optimizer_reload"):   # no GPU peak to keep low
            trainer.optimizer_reload = "overlap"
    else:
        figs = [MemoryFigures(**f) for f in every]
        margin = parse_bytes(c.placement_margin) if c.placement_margin else None
        optim_out = optim_out_allowed(c, trainer)
        placement = with_kept_part(c, trainer, choose(c.offload, c.rollout_sleep, figs, margin, optim_out), figs,
                                   margin)
        figures = every
        grown = grow_sync_bucket(c, rollout, placement, figs, int(rec.metrics.get("sync/nbytes") or 0), margin, say)
        pr = recompute_probe(c, trainer, train_width, width) if c.trims_recompute else None
        if c.trims_recompute and c.rollout_sleep == "auto" and not placement.rollout_sleeps:
            # whether vLLM asleep while training saves more recompute than its sleep and wake cost: decided
            # before the trim, which then fits the placement taken (a sleeping one only where the bucket
            # grown for nothing moving fits beside it too)
            trade = weigh_rollout_sleep(c, ranks, placement, figs, margin, grown, pr, rec, optim_out, train_width)
            if trade is not None:
                placement = trade.placement(placement)
        reload_why = choose_optimizer_reload(c, trainer, placement, figs, margin)
        rows = c.rows_per_rank(ranks.world_size) // c.grpo.mini_batches   # one optimizer step's
        # --trim-recompute first: recompute is work each step does twice, while a larger micro-batch only
        # saves the host work a micro-batch costs; --grow-micro-batch then takes what is left, each row
        # now also holding the activations of the layers no longer checkpointed
        taken, unit_extra = grown, 0.0
        if c.trims_recompute:
            recompute = recompute_line_of(pr, c, trainer, ranks, placement, figs, margin, grown,
                                          train_width=train_width, width=width, trim_from=rec.step + 2)
            # unweighed (no timing): what vLLM asleep would take out of the recompute, the choice left open;
            # otherwise what the layers still recomputed cost
            said = (asleep_line(c, placement, figs, margin, grown, recompute.probe, train_width, rec.phase_s, optim_out)
                    if trade is None and c.rollout_sleep == "auto" and not placement.rollout_sleeps
                    and recompute.probe else "")
            if trade is None and not said and recompute.probe:
                said = recompute_cost(rec.metrics, recompute.trimmed[1] if recompute.trimmed
                                      else recompute.probe.checkpointed)
            if said:
                line = recompute.line + (f"; {said}" if recompute.line else said)
                recompute = RecomputeLine(line, recompute.probe, recompute.trimmed, recompute.extra)
            taken += recompute.extra
            unit_extra = recompute.extra / (c.micro_batch if c.micro_batch_tokens is None else c.micro_batch_tokens)
        if restore_copy_fits(placement, figs, margin, taken, restore_bytes):
            restore_on_device = True
            taken += restore_bytes
        # --grow-micro-batch takes what the hint would name; the hint stays for a trainer it cannot grow
        if c.grow_micro_batch:
            micro_hint, grown_micro = grow_micro_batch(c, trainer, placement, figs, rows, margin, taken, rec.step + 2,
                                                       unit_extra)
        if not grown_micro:      # a grown micro-batch's bytes are not counted in `taken`: the whole sleep then
            placement = partial_release(c, placement, figs, margin, taken)
        # a grown micro-batch takes the free memory the KV cache and recompute hints would offer; trimmed
        # recompute takes what the KV cache hint would offer
        if not grown_micro:
            if not micro_hint:          # --grow-micro-batch's "stays" line says more than the hint
                micro_hint = (micro_batch_hint(placement, figs, c.micro_batch, rows, margin, taken=taken,
                                               unit_extra=unit_extra)
                              if c.micro_batch_tokens is None else
                              micro_batch_tokens_hint(placement, figs, c.micro_batch_tokens, margin,
                                                      taken=taken, unit_extra=unit_extra))
            if not c.trims_recompute:
                recompute = recompute_line(c, trainer, ranks, placement, figs, margin, grown,
                                           train_width=train_width, width=width)
        # the KV cache hints name a --gpu-memory-utilization: they say nothing to a run that sized the
        # cache itself (--kv-cache-bytes)
        sized = c.kv_cache_bytes is not None
        hint = (kv_hint(placement, figs, c.gpu_memory_utilization, margin,
                        taken=grown + (restore_bytes if restore_on_device else 0))
                if not (grown_micro or recompute.trimmed or sized) else "")
        shrink = "" if sized else kv_shrink_hint(placement, figs, c.offload, c.rollout_sleep,
                                                 c.gpu_memory_utilization, margin, optim_out)
        hint = "; ".join(h for h in (shrink, hint) if h)
    if width > train_width > 0 and figures:
        say(f"[colomem] placement: planned for rows of up to {width} tokens (the longest prompt plus the "
            f"completion's most), not the measured step's {train_width}: its training activations are counted "
            "at that width")
    say(f"[colomem] placement from step {rec.step + 2} on: {placement.label} ({placement.why})")
    if trade is not None:
        say(f"[colomem] rollout sleep: {trade.line(rec.step + 2)}")
    if reload_why:
        say(f"[colomem] optimizer state: comes back inside the optimizer step ({reload_why})")
    if restore_on_device:
        say(f"[colomem] shared base: the merged rollout's base comes back from a copy in GPU memory from step "
            f"{rec.step + 2} on ({format_bytes(restore_bytes)}, free beside this placement), not over the host link")
    if hint:
        say(f"[colomem] KV cache: {hint}")
    # in the order they were taken: a trim comes before the micro-batch that grew in what it left
    for line in ((recompute.line, micro_hint) if recompute.trimmed else (micro_hint, recompute.line)):
        if line:
            say(f"[colomem] training: {line}")
    event = {"event": "placement", "from_step": rec.step + 1, **placement.to_dict(),
             "kv_hint": hint, "micro_batch_hint": micro_hint, "recompute_hint": recompute.line,
             "micro_batch_grown": list(grown_micro) if grown_micro else None,
             "recompute_trimmed": list(recompute.trimmed) if recompute.trimmed else None,
             "recompute_probe": recompute.probe.to_dict() if recompute.probe else None,
             "rollout_sleep_trade": trade.to_dict(rec.step + 2) if trade is not None else None,
             "optimizer_reload": getattr(trainer, "optimizer_reload", None),
             "optimizer_reload_why": reload_why,
             "bucket_bytes": getattr(rollout, "bucket_bytes", None),
             "measured_width": train_width, "planned_width": width,
             "restore_copy_bytes": restore_bytes if restore_on_device else 0,
             "figures": figures}
    return LaterPlan(placement, event, restore_on_device)


def with_kept_part(cfg: Any, trainer: Any, placement: Placement, figs: list, margin: Optional[int]) -> Placement:
    """--offload auto: of the first category the placement moves, the whole tensors that fit beside the awake
    rollout stay on the GPU too (placement.keep_part_fit), where the trainer can keep part of a category (its
    colomem offload; not Adam's moments in memory colomem maps itself, which move whole). Not where the job
    brings the optimizer state back inside the optimizer step (--optimizer-reload step): what stayed would sit
    through training's peak."""
    if cfg.offload != "auto" or cfg.optimizer_reload == "step" or not getattr(trainer, "keeps_part", False):
        return placement
    cat, nbytes = keep_part_fit(placement, figs, margin)
    if not nbytes or (cat == "optim" and cfg.optimizer_state_memory == "mapped"):
        return placement
    whole = max(int(f.state.get(cat, 0)) for f in figs)
    why = (f"{placement.why}; of its {format_bytes(whole)} of {cat}, whole tensors up to {format_bytes(nbytes)} "
           "stay too, the room beside the awake rollout, so less crosses the link each way")
    return replace(placement, keep_part=(cat, nbytes), why=why)


def partial_release(cfg: Any, placement: Placement, figs: list, margin: Optional[int], taken: int) -> Placement:
    """--kv-release auto / tail / layers: a rollout the planner puts to sleep for training releases only the part of its
    KV cache training needs (placement.kv_release_fit), with what else the plan gave out (`taken`) counted."""
    if cfg.kv_release == "all" or cfg.rollout_sleep != "auto" or not placement.rollout_sleeps:
        return placement
    part = kv_release_fit(placement, figs, margin, taken, weights_stay=bool(cfg.shared_base))
    if not part:
        return placement
    cache = max(f.kv_cache for f in figs)
    why = (f"{placement.why}; while training it releases {format_bytes(part)} of its "
           f"{format_bytes(cache)} KV cache, what training needs beside the margin, and keeps its weights and the "
           "rest mapped" + (", lent as the tail of every layer's cache, mapped back as the rollout needs it"
                            if cfg.lends_kv_tail else "") + " (--kv-release all: the whole sleep)")
    return replace(placement, kv_release=part, why=why)


def choose_optimizer_reload(cfg: Any, trainer: Any, placement: Placement, figs: list,
                            margin: Optional[int]) -> str:
    """optimizer_reload auto: at the optimizer step when the step's peak would not fit with the optimizer
    state reloaded before it (the trainers' optimizer_reload option). Returns why it comes back inside the
    optimizer step ("" when it does not, or the choice was not the planner's)."""
    if cfg.optimizer_reload != "auto" or not hasattr(trainer, "optimizer_reload"):
        return ""
    at_step, why = reload_at_step(placement, figs, margin)
    trainer.optimizer_reload = "step" if at_step else "overlap"
    early = early_reload_room(figs, margin) if at_step else 0
    if early >= 1 << 30:      # reported only: the state comes back whole inside the step
        why += (f"; beside the peak as the step starts ({format_bytes(max(f.step_start_peak for f in figs))}) "
                f"{format_bytes(early)} of it would fit back before the step")
    return why


def grow_micro_batch(cfg: Any, trainer: Any, placement: Placement, figs: list, rows: int, margin: Optional[int],
                     taken: int, from_step: int, unit_extra: float = 0.0) -> tuple[str, Optional[tuple[int, int]]]:
    """--grow-micro-batch: the trainer's micro-batch (or token budget) raised to the largest the placement's
    free memory holds (placement.micro_batch_fit). Returns the line ("" for a trainer without the setting) and
    (was, now) when it changed. unit_extra: bytes a row (or token) holds beyond what the measuring step's peak
    shows (the layers --trim-recompute stopped checkpointing). Every rank sees every rank's figures, so all of
    them pick the same."""
    tokens = cfg.micro_batch_tokens
    if tokens is None:
        name, now = "micro_batch", int(getattr(trainer, "micro_batch", cfg.micro_batch))
        new = micro_batch_fit(placement, figs, now, rows, margin, taken=taken, unit_extra=unit_extra)
    else:
        name, now = "micro_batch_tokens", int(getattr(trainer, "micro_batch_tokens", None) or tokens)
        new = micro_batch_tokens_fit(placement, figs, now, margin, taken=taken, unit_extra=unit_extra)
    if not hasattr(trainer, name):
        return "", None
    flag = "--" + name.replace("_", "-")
    if new <= now:     # said, so that a user who asked for it knows it was weighed and why nothing changed
        spare = train_spare(placement, figs, margin, taken)
        if spare <= 0:
            return (f"{flag} stays {now} (--grow-micro-batch: nothing is left free while training beyond the "
                    "placement's margin, estimated from this step's training peak)"), None
        return (f"{flag} stays {now} (--grow-micro-batch: the {format_bytes(spare)} left free while training, "
                "estimated from this step's training peak, holds no larger one"
                + ("" if tokens is not None else f" that divides the step's {rows} rows") + ")"), None
    setattr(trainer, name, new)
    return (f"{flag} {now} -> {new} from step {from_step} on (--grow-micro-batch: the largest that "
            f"the memory this placement leaves free holds, estimated from this step's training peak)"), (now, new)


def recompute_probe(cfg: Any, trainer: Any, train_width: int, width: int) -> Optional[RecomputeProbe]:
    """The probe recompute_line weighs, of the trainer's model at the planned `width` (recompute_plan.py); None
    without gradient checkpointing or a trained batch (nothing to weigh) or where it cannot run."""
    if not cfg.gradient_checkpointing or not train_width:
        return None
    return probe(trainer, width)


def recompute_line(cfg: Any, trainer: Any, ranks: Any, placement: Placement, figs: list, margin: Optional[int],
                   taken: int, *, train_width: int, width: int, trim_from: Optional[int] = None) -> RecomputeLine:
    """With gradient checkpointing on: what the memory free while training would buy in recompute, measured
    on the trainer's model at the planned `width` (recompute_plan.py). trim_from (with --trim-recompute): that
    setting is applied to the trainer's model from that step on, and the line says so; every rank applies the
    same one, the one that keeps the most layers checkpointed (a rank whose rows were wider needs more for each
    layer). ranks: exchanged with only when trimming."""
    return recompute_line_of(recompute_probe(cfg, trainer, train_width, width), cfg, trainer, ranks, placement,
                             figs, margin, taken, train_width=train_width, width=width, trim_from=trim_from)


def recompute_line_of(pr: Optional[RecomputeProbe], cfg: Any, trainer: Any, ranks: Any, placement: Placement,
                      figs: list, margin: Optional[int], taken: int, *, train_width: int, width: int,
                      trim_from: Optional[int] = None) -> RecomputeLine:
    """recompute_line from the probe `pr` already taken (recompute_probe)."""
    if not cfg.gradient_checkpointing or not train_width:
        return RecomputeLine()      # the same on every rank: the config, and each rank trained the step
    rows = micro_batch_rows(cfg, train_width)
    spare = train_spare(placement, figs, margin, taken)
    if trim_from is None:
        return RecomputeLine(recompute_hint(spare, pr, rows) if pr is not None else "", pr)
    fit = recompute_fit(spare, pr, rows) if pr is not None else None
    fits = ranks.exchange(None if fit is None else (fit.checkpointed, fit.every, fit.extra, fit.flag))
    auto = cfg.trim_recompute == "auto"      # the default: say which it was
    if pr is None or any(f is None for f in fits):
        # said too: a default that keeps recomputing every layer costs each step its time
        kept = (f"the backward keeps recomputing {pr.checkpointed} of the {pr.layers} decoder layers"
                if pr is not None else "the checkpointed layers stay as they are")
        return RecomputeLine(f"{kept} (--trim-recompute{' auto' if auto else ''}: "
                             f"{no_fit_reason(spare, pr, rows, others_short=fit is not None)})", pr)
    _, every, extra, flag = max(fits)
    model: Any = getattr(trainer, "model", None)          # the model the probe measured
    now = set_checkpointed(model, every)
    # the same on every rank (a later --grow-micro-batch must pick the same): the most any rank's own
    # setting takes, at least what the chosen one, which checkpoints as many layers or more, takes there
    most = max(f[2] for f in fits if f is not None)
    return RecomputeLine(
        f"{flag} from step {trim_from} on (--trim-recompute{' auto' if auto else ''}: the backward "
        f"recomputes {now} of the {pr.layers} decoder layers instead of {pr.checkpointed}; the others keep "
        f"their activations, {format_bytes(extra)} of the {format_bytes(spare)} free while training"
        + ("; --trim-recompute false recomputes every one" if auto else "") + ")",
        pr, (pr.checkpointed, now), most)


def asleep_line(cfg: Any, placement: Placement, figs: list, margin: Optional[int], taken: int, pr: RecomputeProbe,
                train_width: int, phase_s: dict, optim_out: bool) -> str:
    """Nothing moves: what vLLM asleep while training would take out of the recompute (asleep_trade), against
    the sleep and wake the measuring step took (`phase_s`, its phases' seconds)."""
    asleep = choose(cfg.offload, "always", figs, margin, optim_out)
    rows = micro_batch_rows(cfg, train_width)
    took = sum(phase_s.get(k, 0.0) for k in SLEEP_PHASES)
    return asleep_trade(train_spare(placement, figs, margin, taken), train_spare(asleep, figs, margin, taken),
                        pr, rows, took)


__all__ = ["LaterPlan", "RecomputeLine", "asleep_line", "choose_optimizer_reload", "grow_micro_batch", "kv_figures",
           "optim_out_allowed", "partial_release", "plan_later_steps", "planned_width", "recompute_line",
           "recompute_line_of", "recompute_probe", "step_figures", "with_kept_part"]
