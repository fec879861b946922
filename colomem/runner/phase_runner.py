"""The pieces a colocated step is made of, on built engines: each phase entered in the guarded order, bounded,
timed and followed by a memory snapshot; the rollout's awake window (wake weights -> sync -> check -> wake KV ->
the window's work -> sleep) with its cleanup after a failure; the trainer's part of the placement, and the
placement of every later step planned from what the first step measured.

A training step (colomem.runner.loop.ColocatedRunner) and the evaluation window after the last step
(colomem.runner.evaluation) are both built from these.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Optional, Sequence

from colomem.engines.protocols import ASLEEP, WEIGHTS_ONLY, Rollout, Trainer
from colomem.engines.recompute import set_checkpointed
from colomem.engines.reports import SyncStats
from colomem.errors import is_oom
from colomem.units import format_bytes, parse_bytes

from .batch_width import widened
from .loop_memory import first_placement, grow_sync_bucket, oom_error
from .phases import PhaseMachine, PhaseTimeoutError, Watchdog
from .kv_need import kv_layout, kv_shrink_hint, rollout_kv_need
from .placement import (MemoryFigures, Placement, choose, early_reload_room, figures_from_step, kv_hint,
                        micro_batch_fit, micro_batch_hint, micro_batch_tokens_fit, micro_batch_tokens_hint,
                        reload_at_step, state_to_plan, train_spare)
from .ranks import Ranks
from .recompute_plan import (RecomputeProbe, asleep_trade, micro_batch_rows, no_fit_reason, probe, recompute_fit,
                             recompute_hint)
from .status import StatusFile
from .timeline import (MemoryAlarm, MetricsWriter, StepRecord, gpu_free, gpu_total, memory_snapshot,
                       release_cache)

log = logging.getLogger(__name__)


class PhaseRunner:
    """The engines of one rank and the phases they go through (ColocatedRunner adds the steps around them)."""

    def __init__(self, cfg, *, rollout: Rollout, trainer: Trainer, pool, ranks: Ranks,
                 writer: Optional[MetricsWriter] = None, device: Optional[int] = None,
                 print_fn: Callable[[str], None] = print, shared: Any = None):
        self.cfg = cfg
        self.rollout, self.trainer, self.pool = rollout, trainer, pool
        # SharedBase: the trainer's base is the rollout's weights; the rollout then sleeps its KV cache only
        self.shared = shared
        self.ranks = ranks
        self.writer = writer
        self.device = device
        self.print = print_fn if ranks.is_main else (lambda *_: None)
        self.machine = PhaseMachine()
        self.watchdog = Watchdog(cfg.phase_timeout_s)
        self.alarm = MemoryAlarm(cfg.memory_alarm_mib * (1 << 20))
        self.version = 0                    # weights version: number of train steps (batches) taken
        self.rollout_awake = False
        # what moves between phases (colomem.runner.placement); measured on the first step when it may vary
        self.placement: Placement = first_placement(cfg)
        self._plan_after_step = cfg.placement_measured
        self.placement_figures: list[dict] = []
        self.reload_why = ""                # why the optimizer state comes back inside the optimizer step
        self._measured_at_step = False      # the measuring step brought the optimizer state back at its step
        self._moved: set[str] = set()       # what moved in this step: offload, reload, rollout (sleep / wake)
        self.micro_batch_grown: Optional[tuple[int, int]] = None    # (was, now) after --grow-micro-batch
        self.train_width = 0                # tokens per row of the last batch trained on
        self.widest_row = 0                 # tokens in the widest row the job can train on (0: not known)
        self.recompute_probe: Optional[RecomputeProbe] = None
        self.recompute_trimmed: Optional[tuple[int, int]] = None    # (checkpointed was, now): --trim-recompute
        self.recompute_extra = 0             # bytes the trimmed layers' activations take at the measured micro-batch
        self.status: Optional[StatusFile] = None   # <out>/status.json on rank 0 (set by run_job)

    # -- phases -------------------------------------------------------------------------------------------
    def _memory(self) -> dict:
        extra = 0
        if self.pool is None:
            try:
                extra = int(self.trainer.memory().get("pinned_pool", 0) or 0)   # a trainer that owns its pool
            except Exception:  # noqa: BLE001  (memory reporting must not break a step)
                extra = 0
        try:
            return memory_snapshot(self.device, self.pool, extra, self.engine_reserved())
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}

    def engine_reserved(self) -> int:
        """Bytes of this process's torch allocator that an in-process rollout engine holds (0 for an engine in
        a process of its own): not the trainer's, so the memory figures the planner reads leave them out."""
        try:
            return int(getattr(self.rollout, "reserved_in_caller", 0) or 0)
        except Exception:  # noqa: BLE001  (memory reporting must not break a step)
            return 0

    @contextlib.contextmanager
    def phase(self, rec: StepRecord, name: str):
        self.machine.enter(name)
        if self.status is not None:
            self.status.phase(rec.step, name)
        self.watchdog.start(f"phase {name!r} of step {rec.step}")
        t0 = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        except KeyboardInterrupt:
            if self.watchdog.fired:
                raise PhaseTimeoutError(
                    f"phase {name!r} of step {rec.step} ran past phase_timeout_s={self.cfg.phase_timeout_s:.0f} s "
                    "(stacks above); raise --phase-timeout-s if it is just slow") from None
            raise
        finally:
            self.watchdog.stop()
            rec.phase_s[name] = time.perf_counter() - t0
            self.machine.leave(ok)
            rec.memory[name] = self._memory()

    @contextlib.contextmanager
    def timed(self, rec: StepRecord, name: str):
        if self.status is not None:
            self.status.phase(rec.step, name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            rec.phase_s[name] = time.perf_counter() - t0

    # -- the awake window ---------------------------------------------------------------------------------
    def _put_rollout_to_sleep(self) -> Optional[str]:
        """After a failure while vLLM may be awake: sleep again so its memory is free. Returns a note."""
        if not self.rollout_awake:
            return None
        if self.rollout.phase == ASLEEP or (self.shared is not None and self.rollout.phase == WEIGHTS_ONLY):
            self.rollout_awake = False
            return "the rollout engine was already asleep"
        try:
            self._sleep_rollout()
            self.rollout_awake = False
            return "the rollout engine was put back to sleep"
        except Exception as e:  # noqa: BLE001  (reported; cleanup closes it anyway)
            return f"putting the rollout engine back to sleep failed too ({type(e).__name__}: {e})"

    def _weights_fit(self) -> bool:
        """Whether vLLM's weights fit in the GPU memory free now (beside an offload still copying out)."""
        need = self.rollout.wake_need(("weights",))
        free = gpu_free(self.device)
        return need is not None and (free is None or free >= need)

    def _finish_offload(self, rec: StepRecord) -> None:
        """Waits for what an overlapped offload left copying (nothing to do otherwise)."""
        if self.trainer.offload_pending:
            with self.timed(rec, "offload_wait"):
                self.trainer.finish_offload()

    def _start_deferred_offload(self, rec: StepRecord) -> None:
        """optim_out: the optimizer state's copy out, held back by offload_trainer until the rollout is
        awake (a no-op on a copy already started); counted in the offload phase. Nothing of the switch runs
        beside it then: the weights' and the KV cache's wake map fresh memory, which ran slower beside the
        copy, and a CUDA call that waits for the whole context (a kernel module loaded on first use, a
        cudaFree) would wait for all of it. The rollout leaves it seconds to finish before training."""
        if not (self.placement.optim_out and self.trainer.offload_pending):
            return
        t0 = time.perf_counter()
        self.trainer.start_offload()
        rec.phase_s["offload"] = rec.phase_s.get("offload", 0.0) + time.perf_counter() - t0

    def _finish_offload_during_rollout(self) -> None:
        """optim_out: the moments' copy out ends during the rollout, and their memory goes back to the driver
        then, in a thread (0.14 s of cudaFree on the 7.6B job, off the switch), where vLLM runs in its own
        process. With vLLM in this process the free's device-wide wait would stall its kernels: reload()
        ends it then, as it ends it when nothing ran it here."""
        if self.placement.optim_out and self.cfg.effective_engine == "cross-process" \
                and self.trainer.offload_pending:
            self.trainer.finish_offload(background=True)

    def _sleep_rollout(self) -> None:
        """The rollout's sleep: its KV cache only when the trainer reads its weights (a shared base)."""
        if self.shared is not None:
            self.rollout.sleep(keep_weights=True)
        else:
            self.rollout.sleep()

    def awake_window(self, rec: StepRecord, step: int,
                     work: Sequence[tuple[str, Callable[[], Any]]]) -> tuple[Optional[SyncStats], dict]:
        """wake_weights -> sync -> check -> wake_kv -> each (phase, fn) of work -> sleep, each a phase; after
        a failure vLLM is put back to sleep (an out-of-memory says which knob to lower). Returns the sync's
        stats and what each fn returned, by phase."""
        current = "wake_weights"
        done: dict[str, Any] = {}
        try:
            if self.trainer.offload_pending and self.rollout.phase == ASLEEP and not self._weights_fit():
                self._finish_offload(rec)
            with self.phase(rec, "wake_weights"):      # awake already when it does not sleep
                self.rollout_awake = True
                if self.rollout.phase == ASLEEP:
                    self.rollout.wake_weights()
                    self._moved.add("rollout")
                rec.metrics["rollout/woke"] = int("rollout" in self._moved)   # this window's rollout follows a wake
            current = "sync"
            with self.phase(rec, "sync"):
                merged = self.shared is not None and self.shared.merged_rollout
                named = (self.shared.merge_weights(self.trainer, self.pool) if merged
                         else self.trainer.named_weights())
                sync = self.rollout.load_weights(named, self.version)
            current = "check"
            with self.phase(rec, "check"):
                self.rollout.check()
                if self.shared is not None and not merged:    # nobody wrote into the base both sides read
                    self.shared.check()                         # (merged: after the restore, in sleep)
            current = "offload_wait"
            if not self.placement.optim_out:       # the KV cache needs the memory the optimizer state held
                self._finish_offload(rec)          # (optim_out: the plan counted it through the rollout)
            current = "wake_kv"
            with self.phase(rec, "wake_kv"):
                if self.rollout.phase == WEIGHTS_ONLY:
                    self.rollout.wake_kv()
            self._start_deferred_offload(rec)
            self._finish_offload_during_rollout()
            for name, fn in work:
                current = name
                with self.phase(rec, name):
                    done[name] = fn()
            current = "sleep"
            with self.phase(rec, "sleep"):
                if self.placement.rollout_sleeps:
                    self._sleep_rollout()
                    self.rollout_awake = False
                    self._moved.add("rollout")
                else:   # new weights come next: vLLM's prefix cache drops while the trainer trains
                    retire = getattr(self.rollout, "retire_prefix_cache", None)   # optional in the protocol
                    if retire is not None:
                        retire()
                if self.shared is not None:      # a merged rollout's base back as it was, before training
                    self.shared.after_rollout()
        except BaseException as e:
            note = self._put_rollout_to_sleep()
            if self.shared is not None:
                self._restore_shared_base()
            if is_oom(e):
                raise oom_error(self.cfg, self.placement, current, step, e, note) from e
            if note and isinstance(e, Exception):
                log.error("step %d failed in %s; %s", step, current, note)
            raise
        return sync, done

    def _restore_shared_base(self) -> None:
        """After a failed window: a merged base back as it was (the error that ended the window goes on)."""
        try:
            self.shared.restore_after_failure()
        except Exception as e:  # noqa: BLE001  (reported; the window's own error is the one raised)
            log.error("restoring the shared base after a failed rollout failed too: %s: %s", type(e).__name__, e)

    # -- placement ----------------------------------------------------------------------------------------
    def offload_trainer(self) -> None:
        """The trainer's part of the placement: what it does not keep goes to the pool."""
        p = self.placement
        if (p.trainer_moves or p.optim_out) and not self.trainer.offloaded:
            # overlapped: the optimizer state copies out behind the weights' wake, sync and check (optim_out:
            # and the rollout; reload_trainer waits for it); not in the step that measures for the planner
            # (what the trainer left after its offload must be complete)
            defer = p.optim_out or (self.cfg.overlap_offload and not self._plan_after_step)
            # optim_out: nothing waits for that copy before training, so it starts once the rollout is awake
            # (_start_deferred_offload): fresh memory mapped beside it ran ~10x slower
            self.trainer.offload(keep=p.offload_keep, defer=defer, hold=p.optim_out)
            self._moved.add("offload")
            self._measure_at_step()
        elif self.placement.rollout_sleeps:       # resident: its cached activations would crowd vLLM's wake
            release_cache(self.device)

    def reload_trainer(self) -> None:
        """The trainer back on the GPU (for training, an evaluation, the end of the run)."""
        if self.trainer.offloaded:
            self.trainer.reload()      # waits first for an offload still copying out (optim_out)
            self._moved.add("reload")

    @property
    def _optim_out_allowed(self) -> bool:
        """Whether the planner may send the optimizer state out behind the rollout: the trainer can defer an
        offload (the colomem method), and the job did not ask for the state back before the step."""
        return self.cfg.optimizer_reload != "overlap" and getattr(self.trainer, "defers_offload", False)

    def _plan(self, rec: StepRecord) -> None:
        """After the first step (everything moved): the placement of every later step, from its memory
        figures on every rank (the same placement everywhere: the one that fits on every GPU)."""
        self._plan_after_step = False
        self.alarm.restart(rec.step + 1)     # the floor after sleep is the new placement's from the next step
        c = self.cfg
        total = gpu_total(self.device)
        moved = dict(self.trainer.last_offload.by_category) if self.trainer.last_offload is not None else {}
        held = getattr(self.trainer, "state_bytes", None)        # after training: Adam's moments exist now
        now = held() if held is not None and not self.trainer.offloaded else {}
        by_cat = state_to_plan(moved, now)
        created = max(0, int(now.get("optim", 0) or 0) - int(moved.get("optim", 0) or 0))
        if self._measured_at_step:       # the moments were in the pool through its peak, as if created there
            created = int(now.get("optim", 0) or 0)
        mine = figures_from_step(rec.memory, by_cat, total or 0, optim_created=created,
                                 pre_step_peak=int(rec.metrics.get("train/reserved_before_step_max") or 0),
                                 step_start_peak=int(rec.metrics.get("train/reserved_at_step_start_max") or 0))
        if mine is not None:
            mine.kv_cache, mine.kv_need = self._kv_figures()
            mine = widened(mine, self.train_width, self.planned_width)
        every = self.ranks.exchange(mine.to_dict() if mine is not None else None)
        hint = micro_hint = recompute = ""
        if any(f is None for f in every):
            self.placement = Placement((), True, "no GPU memory figures (the CPU backend): everything moves")
            if self._measured_at_step and hasattr(self.trainer, "optimizer_reload"):   # no GPU peak to keep low
                self.trainer.optimizer_reload = "overlap"
        else:
            figs = [MemoryFigures(**f) for f in every]
            margin = parse_bytes(c.placement_margin) if c.placement_margin else None
            self.placement = choose(c.offload, c.rollout_sleep, figs, margin, self._optim_out_allowed)
            self.placement_figures = every
            self._choose_optimizer_reload(figs, margin)
            grown = grow_sync_bucket(c, self.rollout, self.placement, figs, int(rec.metrics.get("sync/nbytes") or 0),
                                     margin, self.print)
            rows = c.rows_per_rank(self.ranks.world_size) // c.grpo.mini_batches   # one optimizer step's
            # --trim-recompute first: recompute is work each step does twice, while a larger micro-batch only
            # saves the host work a micro-batch costs; --grow-micro-batch then takes what is left, each row
            # now also holding the activations of the layers no longer checkpointed
            taken, unit_extra = grown, 0.0
            if c.trims_recompute:
                recompute = self._recompute_hint(figs, margin, grown, rec.step + 2)
                if c.rollout_sleep == "auto" and not self.placement.rollout_sleeps and self.recompute_probe:
                    trade = self._asleep_trade(figs, margin, grown, rec)
                    recompute += f"; {trade}" if trade and recompute else trade
                taken += self.recompute_extra
                unit_extra = self.recompute_extra / (c.micro_batch if c.micro_batch_tokens is None
                                                     else c.micro_batch_tokens)
            # --grow-micro-batch takes what the hint would name; the hint stays for a trainer it cannot grow
            if c.grow_micro_batch:
                micro_hint = self._grow_micro_batch(figs, rows, margin, taken, rec.step + 2, unit_extra)
            # a grown micro-batch takes the free memory the KV cache and recompute hints would offer; trimmed
            # recompute takes what the KV cache hint would offer
            if not self.micro_batch_grown:
                if not micro_hint:          # --grow-micro-batch's "stays" line says more than the hint
                    micro_hint = (micro_batch_hint(self.placement, figs, c.micro_batch, rows, margin, taken=taken,
                                                   unit_extra=unit_extra)
                                  if c.micro_batch_tokens is None else
                                  micro_batch_tokens_hint(self.placement, figs, c.micro_batch_tokens, margin,
                                                          taken=taken, unit_extra=unit_extra))
                if not c.trims_recompute:
                    recompute = self._recompute_hint(figs, margin, grown)
            # the KV cache hints name a --gpu-memory-utilization: they say nothing to a run that sized the
            # cache itself (--kv-cache-bytes)
            sized = c.kv_cache_bytes is not None
            hint = (kv_hint(self.placement, figs, c.gpu_memory_utilization, margin, taken=grown)
                    if not (self.micro_batch_grown or self.recompute_trimmed or sized) else "")
            shrink = "" if sized else kv_shrink_hint(self.placement, figs, c.offload, c.rollout_sleep,
                                                     c.gpu_memory_utilization, margin, self._optim_out_allowed)
            hint = "; ".join(h for h in (shrink, hint) if h)
        if self.planned_width > self.train_width > 0 and self.placement_figures:
            self.print(f"[colomem] placement: planned for rows of up to {self.planned_width} tokens (the longest "
                       f"prompt plus the completion's most), not the measured step's {self.train_width}: its "
                       "training activations are counted at that width")
        self.print(f"[colomem] placement from step {rec.step + 2} on: {self.placement.label} ({self.placement.why})")
        if self.reload_why:
            self.print(f"[colomem] optimizer state: comes back inside the optimizer step ({self.reload_why})")
        if hint:
            self.print(f"[colomem] KV cache: {hint}")
        # in the order they were taken: a trim comes before the micro-batch that grew in what it left
        for line in ((recompute, micro_hint) if self.recompute_trimmed else (micro_hint, recompute)):
            if line:
                self.print(f"[colomem] training: {line}")
        if self.writer is not None:
            self.writer.write({"event": "placement", "from_step": rec.step + 1, **self.placement.to_dict(),
                               "kv_hint": hint, "micro_batch_hint": micro_hint, "recompute_hint": recompute,
                               "micro_batch_grown": list(self.micro_batch_grown) if self.micro_batch_grown else None,
                               "recompute_trimmed": list(self.recompute_trimmed) if self.recompute_trimmed else None,
                               "recompute_probe": self.recompute_probe.to_dict() if self.recompute_probe else None,
                               "optimizer_reload": getattr(self.trainer, "optimizer_reload", None),
                               "optimizer_reload_why": self.reload_why,
                               "bucket_bytes": getattr(self.rollout, "bucket_bytes", None),
                               "measured_width": self.train_width, "planned_width": self.planned_width,
                               "figures": self.placement_figures})

    @property
    def planned_width(self) -> int:
        """The row width the plan counts activations at (batch_width.py): the widest row the job can train on,
        or the measured step's rows when wider (or unknown); micro-batches cut by a token budget hold as many
        tokens whatever the width, so they plan at the measured one."""
        if self.cfg.micro_batch_tokens is not None:
            return self.train_width
        return max(self.train_width, self.widest_row)

    def _kv_figures(self) -> tuple[int, int]:
        """(the rollout engine's KV cache, the most the step's rollout holds) on this GPU; zeros when unknown."""
        cache = getattr(self.rollout, "kv_cache_bytes", None)
        path = getattr(self.rollout, "model_path", None)
        if not cache or not path:
            return 0, 0
        layout = kv_layout(path, self.cfg.trust_remote_code)
        if layout is None:
            return int(cache), 0
        c = self.cfg
        return int(cache), rollout_kv_need(c.rows_per_rank(self.ranks.world_size), c.max_model_len, layout[0],
                                           layout[1], c.tensor_parallel_size)

    def _measure_at_step(self) -> None:
        """optimizer_reload auto, the measuring step of a run whose optimizer state exists already (a resume):
        that state comes back inside the optimizer step, so the step peaks as a first step does; reloaded
        before it, a job that fits only that way (a 7.6B full fine-tune on one GPU) would run out of memory
        before the planner could choose. The plan then counts the state as absent from the measured peak."""
        if not self._plan_after_step or self.cfg.optimizer_reload != "auto" \
                or not hasattr(self.trainer, "optimizer_reload") or self.trainer.last_offload is None:
            return
        if int(self.trainer.last_offload.by_category.get("optim", 0) or 0) > 0:
            self.trainer.optimizer_reload = "step"
            self._measured_at_step = True

    def _grow_micro_batch(self, figs: list, rows: int, margin: Optional[int], taken: int,
                          from_step: int, unit_extra: float = 0.0) -> str:
        """--grow-micro-batch: the trainer's micro-batch (or token budget) raised to the largest the placement's
        free memory holds (placement.micro_batch_fit); what changed, or "" when nothing did. unit_extra: bytes a
        row (or token) holds beyond what the measuring step's peak shows (the layers --trim-recompute stopped
        checkpointing). Every rank sees every rank's figures, so all of them pick the same."""
        c = self.cfg
        tokens = c.micro_batch_tokens
        if tokens is None:
            name, now = "micro_batch", int(getattr(self.trainer, "micro_batch", c.micro_batch))
            new = micro_batch_fit(self.placement, figs, now, rows, margin, taken=taken, unit_extra=unit_extra)
        else:
            name, now = "micro_batch_tokens", int(getattr(self.trainer, "micro_batch_tokens", None) or tokens)
            new = micro_batch_tokens_fit(self.placement, figs, now, margin, taken=taken, unit_extra=unit_extra)
        if not hasattr(self.trainer, name):
            return ""
        flag = "--" + name.replace("_", "-")
        if new <= now:     # said, so that a user who asked for it knows it was weighed and why nothing changed
            spare = train_spare(self.placement, figs, margin, taken)
            if spare <= 0:
                return (f"{flag} stays {now} (--grow-micro-batch: nothing is left free while training beyond the "
                        "placement's margin, estimated from this step's training peak)")
            return (f"{flag} stays {now} (--grow-micro-batch: the {format_bytes(spare)} left free while training, "
                    "estimated from this step's training peak, holds no larger one"
                    + ("" if tokens is not None else f" that divides the step's {rows} rows") + ")")
        setattr(self.trainer, name, new)
        self.micro_batch_grown = (now, new)
        return (f"{flag} {now} -> {new} from step {from_step} on (--grow-micro-batch: the largest that "
                f"the memory this placement leaves free holds, estimated from this step's training peak)")

    def _recompute_hint(self, figs: list, margin: Optional[int], taken: int,
                        trim_from: Optional[int] = None) -> str:
        """With gradient checkpointing on: what the memory free while training would buy in recompute,
        measured on the trainer's model at the measuring step's width (recompute_plan.py). trim_from (with
        --trim-recompute): that setting is applied to the trainer's model from that step on, and the line says
        so; every rank applies the same one, the one that keeps the most layers checkpointed (a rank whose rows
        were wider needs more for each layer)."""
        if not self.cfg.gradient_checkpointing or not self.train_width:
            return ""                  # the same on every rank: the config, and each rank trained the step
        self.recompute_probe = pr = probe(self.trainer, self.planned_width)
        rows = micro_batch_rows(self.cfg, self.train_width)
        spare = train_spare(self.placement, figs, margin, taken)
        if trim_from is None:
            return recompute_hint(spare, pr, rows) if pr is not None else ""
        fit = recompute_fit(spare, pr, rows) if pr is not None else None
        fits = self.ranks.exchange(None if fit is None else (fit.checkpointed, fit.every, fit.extra, fit.flag))
        auto = self.cfg.trim_recompute == "auto"      # the default: say which it was
        if pr is None or any(f is None for f in fits):
            # said too: a default that keeps recomputing every layer costs each step its time
            kept = (f"the backward keeps recomputing {pr.checkpointed} of the {pr.layers} decoder layers"
                    if pr is not None else "the checkpointed layers stay as they are")
            return (f"{kept} (--trim-recompute{' auto' if auto else ''}: "
                    f"{no_fit_reason(spare, pr, rows, others_short=fit is not None)})")
        _, every, extra, flag = max(fits)
        model: Any = getattr(self.trainer, "model", None)          # the model the probe measured
        now = set_checkpointed(model, every)
        self.recompute_trimmed = (pr.checkpointed, now)
        # the same on every rank (a later --grow-micro-batch must pick the same): the most any rank's own
        # setting takes, at least what the chosen one, which checkpoints as many layers or more, takes there
        self.recompute_extra = max(f[2] for f in fits if f is not None)
        return (f"{flag} from step {trim_from} on (--trim-recompute{' auto' if auto else ''}: the backward "
                f"recomputes {now} of the {pr.layers} decoder layers instead of {pr.checkpointed}; the others keep "
                f"their activations, {format_bytes(extra)} of the {format_bytes(spare)} free while training"
                + ("; --trim-recompute false recomputes every one" if auto else "") + ")")

    def _asleep_trade(self, figs: list, margin: Optional[int], taken: int, rec: StepRecord) -> str:
        """Nothing moves: what vLLM asleep while training would take out of the recompute (asleep_trade)."""
        c, pr = self.cfg, self.recompute_probe
        asleep = choose(c.offload, "always", figs, margin, self._optim_out_allowed)
        rows = micro_batch_rows(self.cfg, self.train_width)
        took = sum(rec.phase_s.get(k, 0.0) for k in ("sleep", "wake_weights", "wake_kv"))
        return asleep_trade(train_spare(self.placement, figs, margin, taken), train_spare(asleep, figs, margin, taken),
                            pr, rows, took) if pr is not None else ""

    def _choose_optimizer_reload(self, figs: list, margin) -> None:
        """optimizer_reload auto: at the optimizer step when the step's peak would not fit with the optimizer
        state reloaded before it (the trainers' optimizer_reload option)."""
        if self.cfg.optimizer_reload != "auto" or not hasattr(self.trainer, "optimizer_reload"):
            return
        at_step, why = reload_at_step(self.placement, figs, margin)
        self.trainer.optimizer_reload = "step" if at_step else "overlap"
        early = early_reload_room(figs, margin) if at_step else 0
        if early >= 1 << 30:      # reported only: the state comes back whole inside the step
            why += (f"; beside the peak as the step starts ({format_bytes(max(f.step_start_peak for f in figs))}) "
                    f"{format_bytes(early)} of it would fit back before the step")
        self.reload_why = why


__all__ = ["PhaseRunner"]
