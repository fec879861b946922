"""The pieces a colocated step is made of, on built engines: each phase entered in the guarded order, bounded,
timed and followed by a memory snapshot; the rollout's awake window (wake weights -> sync -> check -> wake KV ->
the window's work -> sleep) with its cleanup after a failure; the trainer's part of the placement. After the
first step it hands that step's record to colomem.runner.train_memory_plan, which plans every later step, and
keeps what the plan decided.

A training step (colomem.runner.loop.ColocatedRunner) and the evaluation window after the last step
(colomem.runner.evaluation) are both built from these.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Optional, Sequence

from colomem.engines.layer_timing import LayerForwardTimer
from colomem.engines.protocols import ASLEEP, WEIGHTS_ONLY, Rollout, Trainer
from colomem.engines.reports import SyncStats
from colomem.errors import is_oom

from .gc_pauses import PAUSES
from .loop_memory import first_placement, oom_error
from .phases import PhaseMachine, PhaseTimeoutError, Watchdog
from .placement import Placement
from .ranks import Ranks
from .status import StatusFile
from .timeline import MemoryAlarm, MetricsWriter, StepRecord, gpu_free, memory_snapshot, release_cache
from .train_memory_plan import plan_later_steps

log = logging.getLogger(__name__)


def _gc_in_phase(rec: StepRecord, name: str, gc0: float) -> None:
    """What the collector held the process for inside a phase that began when PAUSES.total was gc0."""
    if PAUSES.total > gc0:
        rec.metrics[f"gc/{name}_s"] = rec.metrics.get(f"gc/{name}_s", 0.0) + PAUSES.total - gc0


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
        self._measured_at_step = False      # the measuring step brought the optimizer state back at its step
        self._moved: set[str] = set()       # what moved in this step: offload, reload, rollout (sleep / wake)
        self.train_width = 0                # tokens per row of the last batch trained on
        self.widest_row = 0                 # tokens in the widest row the job can train on (0: not known)
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
        gc0 = PAUSES.total
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
            _gc_in_phase(rec, name, gc0)
            self.machine.leave(ok)
            rec.memory[name] = self._memory()

    @contextlib.contextmanager
    def timed(self, rec: StepRecord, name: str):
        if self.status is not None:
            self.status.phase(rec.step, name)
        t0 = time.perf_counter()
        gc0 = PAUSES.total
        try:
            yield
        finally:
            rec.phase_s[name] = time.perf_counter() - t0
            _gc_in_phase(rec, name, gc0)

    @contextlib.contextmanager
    def layer_timing(self, rec: StepRecord):
        """Around the measuring step's training, with gradient checkpointing: its decoder layers' forwards
        timed (colomem.engines.layer_timing), into the step's metrics, so the plan can weigh what recomputing a
        layer costs a step. Later steps train without the hooks."""
        model = getattr(self.trainer, "model", None)     # not in the Trainer protocol: a trainer may hold none
        if not (self._plan_after_step and self.cfg.gradient_checkpointing) or not hasattr(model, "modules"):
            yield
            return
        with LayerForwardTimer(model) as timer:
            yield
        try:
            times = timer.result()
        except Exception as e:  # noqa: BLE001  (a timing is not worth a failed step: the plan goes without it)
            if is_oom(e):
                raise
            log.warning("the decoder layers' forwards could not be timed (%s); the plan weighs no recompute "
                        "time", e)
            times = None
        if times is not None:
            rec.metrics.update(times.metrics())

    # -- the awake window ---------------------------------------------------------------------------------
    def _put_rollout_to_sleep(self) -> Optional[str]:
        """After a failure while vLLM may be awake: sleep again so its memory is free. Returns a note."""
        if not self.rollout_awake:
            return None
        keeps_weights = self.shared is not None or bool(self.placement.kv_release)   # its sleep leaves them mapped
        if self.rollout.phase == ASLEEP or (keeps_weights and self.rollout.phase == WEIGHTS_ONLY):
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

    def _finish_offload_during_rollout(self, tail: bool = False) -> None:
        """optim_out, or a lent KV tail (tail): the copy out ends during the rollout, and its memory goes back
        to the driver then, in a thread (0.14 s of cudaFree on the 7.6B job, off the switch), where vLLM runs
        in its own process (the tail then grows into it as the rollout needs). With vLLM in this process the
        free's device-wide wait would stall its kernels: reload() ends it then, as it ends it when nothing ran
        it here; a lent tail that finds no memory to grow into ends it first, on the engine's thread between
        two scheduling steps (rollout.set_kv_room), where that wait costs the rollout little."""
        if not ((self.placement.optim_out or tail) and self.trainer.offload_pending):
            return
        if self.cfg.effective_engine == "cross-process":
            self.trainer.finish_offload(background=True)
        elif tail:     # the engine's thread ends it, between two steps, if the tail needs the memory
            set_room = getattr(self.rollout, "set_kv_room", None)
            if set_room is not None:
                set_room(lambda: self.trainer.finish_offload())

    def _kv_tail_lent(self) -> bool:
        """Whether the rollout's released KV is a lent tail (optional in the Rollout protocol)."""
        return bool(getattr(self.rollout, "kv_tail_lent", False))

    def _sleep_rollout(self) -> None:
        """The rollout's sleep: its KV cache only when the trainer reads its weights (a shared base), only
        the part of it training needs where the plan says so (placement.kv_release), else the whole sleep."""
        part = self.placement.kv_release
        if part:
            self.rollout.sleep(keep_weights=True, kv_bytes=part)
        elif self.shared is not None:
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
            # the KV cache needs the memory the optimizer state held; not so with optim_out (the plan counted it
            # through the rollout) or a lent KV tail (it maps back only as the rollout's blocks run short)
            tail = self._kv_tail_lent()
            if not (self.placement.optim_out or tail):
                self._finish_offload(rec)
            current = "wake_kv"
            with self.phase(rec, "wake_kv"):
                if self.rollout.phase == WEIGHTS_ONLY:
                    self.rollout.wake_kv()
            self._start_deferred_offload(rec)
            self._finish_offload_during_rollout(tail)
            for name, fn in work:
                current = name
                with self.phase(rec, name):
                    done[name] = fn()
            current = "sleep"
            if tail and hasattr(self.rollout, "set_kv_room"):
                self.rollout.set_kv_room(None)     # the hook ends with the rollout (reload() ends the copy)
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
            part = {"keep_part": p.keep_part} if p.keep_part[1] else {}   # a trainer that can keep a part
            self.trainer.offload(keep=p.offload_keep, defer=defer, hold=p.optim_out, **part)
            self._moved.add("offload")
            self._measure_at_step()
        elif self.placement.rollout_sleeps:       # resident: its cached activations would crowd vLLM's wake
            release_cache(self.device)

    def reload_trainer(self) -> None:
        """The trainer back on the GPU (for training, an evaluation, the end of the run)."""
        if self.trainer.offloaded:
            self.trainer.reload()      # waits first for an offload still copying out (optim_out)
            self._moved.add("reload")

    def _plan(self, rec: StepRecord) -> None:
        """After the first step (everything moved): the placement of every later step and what the memory it
        leaves free goes to (train_memory_plan.py), from that step's figures on every rank; kept here is the
        placement later steps follow, and the plan's event goes to the metrics file."""
        self._plan_after_step = False
        self.alarm.restart(rec.step + 1)     # the floor after sleep is the new placement's from the next step
        plan = plan_later_steps(self.cfg, trainer=self.trainer, rollout=self.rollout, ranks=self.ranks, rec=rec,
                                device=self.device, measured_at_step=self._measured_at_step,
                                train_width=self.train_width, widest_row=self.widest_row, say=self.print,
                                restore_bytes=self.shared.restore_copy_bytes() if self.shared is not None else 0)
        self.placement = plan.placement
        if plan.restore_on_device:
            self.shared.hold_restore_on_device()
        if self.writer is not None:
            self.writer.write(plan.event)

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


__all__ = ["PhaseRunner"]
