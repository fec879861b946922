"""The colocated GRPO loop: one GPU (or CPU) shared by the rollout engine and the trainer, taking turns.

One step (phases.CYCLE, each timed, each followed by a memory snapshot):

    offload trainer -> barrier -> wake weights -> sync -> check -> wake KV -> rollout -> [eval] -> sleep
        -> [score: rewards, advantages, batch] -> barrier -> reload trainer -> train

(eval: the held-out evaluation when one is due, colomem.runner.evaluation, which also says why it is there.)

Guarantees: transitions only in that order (PhaseMachine, PhaseOrderError otherwise); every phase and every
barrier bounded (Watchdog, BarrierTimeoutError); rollout, trainer and pool closed in `finally` whatever
happened; an out-of-memory while vLLM wakes or generates puts it back to sleep, reloads nothing and says
which knob to lower; metrics lines already written are never rewritten (MetricsWriter appends and flushes).

The phases, the awake window and the placement a step is built from are colomem.runner.phase_runner's; here
are the steps of a run around them: one step's work, checkpoints, a stop signal, progress lines, the summary.
"""
from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from colomem.engines.protocols import Rollout, Trainer
from colomem.errors import StaleWeightsError, is_oom

from .batch_width import widest_row
from .checkpoints import Checkpointer
from .evaluation import Evaluator
from .gc_pauses import PAUSES
from .heap_profile import HeapProfile
from .history import StepHistory, read_step_records
from .inrank import check_group_agrees, rollout_digest
from .loop_memory import oom_error
from .phase_runner import PhaseRunner
from .phases import CYCLE
from .placement import alternate
from .ranks import Ranks
from .reporters import Reporter
from .scoring import encode, run_bounded, score_step
from .timeline import (MetricsWriter, StepRecord, drop_step_timings, host_usage, peak_reserved, reset_peak, settle,
                       switch_metrics)


def rollout_seed(seed: int, step: int, rollout_group: int, seeding: str) -> Optional[int]:
    """The seed of step `step`'s rollout (prompt i then uses it + i * group size), or None: vLLM's own generator
    draws."""
    if seeding == "engine":
        return None
    # A hash, not a sum of strides: a step's completions take the seeds from this one on (one each), so the
    # ranges of two steps or two rollout groups must not overlap, whatever the batch size
    digest = hashlib.blake2b(f"{seed}:{step}:{rollout_group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2 ** 31 - 2 ** 24)


@dataclass
class RunResult:
    """A finished run: its output directory, its summary, and where its step records are: this rank's
    metrics file from the byte the run began writing at (the runner keeps numbers only, see history)."""
    out_dir: Path
    summary: dict
    metrics_path: Optional[Path] = None
    metrics_offset: int = 0

    @cached_property
    def records(self) -> list[StepRecord]:
        """This run's finished steps, read back from its metrics file (empty when it wrote none)."""
        return read_step_records(self.metrics_path, self.metrics_offset) if self.metrics_path else []


class ColocatedRunner(PhaseRunner):
    """Runs the steps of one colocated GRPO job on built engines (see run_job for the whole job)."""

    def __init__(self, cfg, *, rollout: Rollout, trainer: Trainer, pool, task, tokenizer, ranks: Ranks, reward_specs,
                 metric_specs=(), writer: Optional[MetricsWriter] = None, rank_writer: Optional[MetricsWriter] = None,
                 device: Optional[int] = None, grad_accum: int = 1, reporters: Sequence[Reporter] = (),
                 print_fn: Callable[[str], None] = print, shared: Any = None):
        super().__init__(cfg, rollout=rollout, trainer=trainer, pool=pool, ranks=ranks, writer=writer, device=device,
                         print_fn=print_fn, shared=shared)
        self.task, self.tokenizer = task, tokenizer
        self.reward_specs, self.metric_specs = list(reward_specs), list(metric_specs)
        self.rank_writer = rank_writer
        self.reporters = list(reporters)           # TensorBoard / wandb: rank 0 only
        self.stop_requested: Optional[str] = None  # a signal's name: finish this step, then stop
        self.stop_failure: Optional[str] = None    # the step a stop signal kept from finishing, and why
        self.grad_accum = grad_accum
        self.history = StepHistory()      # numbers only: each step's whole record goes to the metrics files
        self.heap: Optional[HeapProfile] = None     # COLOMEM_HEAP_PROFILE_EVERY: where the Python heap grows
        self.evaluator: Optional[Evaluator] = None       # held-out evaluation (set by run_job when asked for)
        self.max_new_tokens = cfg.grpo.max_new_tokens or task.max_new_tokens
        self.widest_row = widest_row(cfg.max_model_len, task, self.max_new_tokens)   # what the planner plans for
        self.checkpointer: Optional[Checkpointer] = None
        # colomem's offload keeps the trainer state readable in the pool: a checkpoint due after step k is
        # written right after step k+1's offload (no reload, no GPU memory); other switches save resident
        self.save_from_pool = cfg.switch == "colomem"
        self._save_due: Optional[int] = None
        self.final_checkpoint: dict[str, Any] = {}

    # -- one step -----------------------------------------------------------------------------------------
    def step(self, k: int) -> StepRecord:
        """One step; a step that fails still writes its line (phases so far, memory, `failed`, `error`)."""
        rec = StepRecord(step=k, rank=self.ranks.rank)
        t_step = time.perf_counter()
        try:
            return self._step(k, rec, t_step)
        except BaseException as e:
            rec.step_s = time.perf_counter() - t_step
            rec.metrics.setdefault("failed", self.machine.failed or self.machine.current or "score")
            rec.metrics["error"] = f"{type(e).__name__}: {e}"
            for w in (self.writer, self.rank_writer):
                if w is not None:
                    try:
                        w.write(rec.to_json())
                    except Exception:  # noqa: BLE001  (the original error matters more)
                        pass
            raise

    def _step(self, k: int, rec: StepRecord, t_step: float) -> StepRecord:
        cfg, ranks = self.cfg, self.ranks
        n_groups = cfg.prompts_per_step
        samples = self.task.samples(n_groups, seed=cfg.seed, step=k)
        gen_idx = ranks.generate_groups(n_groups)
        train_idx = ranks.train_groups(n_groups)
        prompt_ids = [self._encode(samples[i].prompt) for i in gen_idx]
        self._moved = set()
        drop_step_timings(self.rollout)
        if cfg.switch == "colomem" and cfg.rollout_sleep == "alternate":
            self.placement = alternate(self.placement, k)
            rec.metrics["placement/rollout_sleeps"] = int(self.placement.rollout_sleeps)

        if self.checkpointer is not None and self.checkpointer.writing is not None:
            with self.timed(rec, "checkpoint_wait"):      # the offload rewrites the copies it reads
                self._join_save(rec)
        with self.phase(rec, "offload"):
            self.offload_trainer()
        if self._save_due is not None:
            with self.timed(rec, "checkpoint"):
                self._save(rec, self._save_due)
        with self.phase(rec, "barrier_wake"):
            ranks.barrier(f"before wake, step {k}")
        def rollout() -> list:
            held = self.rollout.weight_version
            if held != self.version:
                raise StaleWeightsError(f"step {k}: the rollout holds weights version {held}, the trainer "
                                        f"is at {self.version}; refusing to generate")
            return self.rollout.generate(
                prompt_ids, n=cfg.grpo.group_size, max_new_tokens=self.max_new_tokens,
                temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, top_k=cfg.grpo.top_k,
                min_p=cfg.grpo.min_p, repetition_penalty=cfg.grpo.repetition_penalty,
                seed=rollout_seed(cfg.seed, k, ranks.rollout_group, cfg.rollout_seeding))
        work: list[tuple[str, Callable[[], Any]]] = [("rollout", rollout)]
        evaluator = self.evaluator
        if evaluator is not None and evaluator.due(self.version):
            # the only window where the rollout holds weights `version`
            work.append(("eval", lambda: evaluator.evaluate(self.rollout, self.version)))
        sync, done = self.awake_window(rec, k, work)
        completions = done["rollout"]
        # the shards of one in-rank engine must have generated the same completions (TP 1: nothing to compare)
        check_group_agrees(ranks, rollout_digest(gen_idx, completions), f"step {k}")
        alarm = self.alarm.observe(k, rec.memory.get("sleep", {}).get("driver_used"))
        if alarm:
            self.print(f"[colomem] ALARM step {k}: {alarm}")

        with self.timed(rec, "score"):
            batch, stats, shown = self._score(samples, gen_idx, train_idx, completions)

        with self.phase(rec, "barrier_train"):
            ranks.barrier(f"before reload, step {k}")
        try:
            with self.phase(rec, "reload"):
                self.reload_trainer()
            reset_peak(self.device)
            self.train_width = int(batch.input_ids.shape[1])
            with self.phase(rec, "train"), self.layer_timing(rec):
                train = self.trainer.train_step(batch)
                settle(self.device)      # the optimizer step's kernels are training, not the next sync
            rec.memory["train"]["peak_reserved"] = peak_reserved(self.device, self.engine_reserved())
            # train waited for state still reloading, or brought the optimizer state back inside the
            # optimizer step: switch costs, not training
            for key, phase in (("reload_wait_s", "reload_wait"), ("optimizer_reload_s", "reload_step")):
                spent = float(train.get(key) or 0.0)
                if spent > 0:
                    rec.phase_s["train"] -= spent
                    rec.phase_s[phase] = spent
        except BaseException as e:
            if is_oom(e):
                raise oom_error(self.cfg, self.placement, self.machine.failed or "train", k, e, None) from e
            raise
        self.version += 1
        self.rollout.expect_version(self.version)
        rec.step_s = time.perf_counter() - t_step - rec.phase_s.get("eval", 0.0)   # eval: no part of training

        rec.metrics.update(stats)
        rec.metrics.update({f"train/{n}": v for n, v in train.items()})
        rec.metrics["weight_version"] = self.version
        rec.metrics.update(switch_metrics(sync, self.trainer, self.rollout, self._moved))
        if self.shared is not None:
            rec.metrics.update(self.shared.metrics())
        rec.metrics.update(host_usage())
        rec.metrics.update(PAUSES.take())
        if alarm:
            rec.metrics["memory_alarm"] = alarm
        if shown:
            rec.metrics["samples"] = shown
        self.history.add(rec)
        line = rec.to_json()
        if self.writer is not None:
            self.writer.write(line)
        if self.rank_writer is not None:
            self.rank_writer.write(line)
        for r in self.reporters:
            r.log(k, line)
        if self._plan_after_step:
            self._plan(rec)
        if self.heap is not None:
            self.heap.after_step(k)
        return rec

    def _encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def _score(self, samples, gen_idx, train_idx, completions):
        """score_step, bounded by phase_timeout_s like every phase: rewards may call remote verifiers, and a
        call blocked in C (a socket read) cannot be interrupted, so it runs on a helper thread the step
        stops waiting for."""
        return run_bounded(lambda: score_step(self.cfg, self.tokenizer, self.ranks, self.reward_specs,
                                              self.metric_specs, samples, gen_idx, train_idx, completions),
                           self.cfg.phase_timeout_s, "the score phase (the reward functions)")

    # -- checkpoints --------------------------------------------------------------------------------------
    def _save(self, rec: StepRecord, done: int) -> None:
        """The checkpoint due after step `done`, from the pool's copies; with --save-background its files are
        written beside this step, and the next step's _join_save ends the write."""
        cp = self.checkpointer
        assert cp is not None
        self._save_due = None
        try:
            self.trainer.finish_offload()          # the save reads the pool's copies: they must be complete
            cp.save(done, self.version)
        except BaseException:
            rec.metrics["failed"] = "checkpoint"
            raise
        if cp.writing is not None:
            rec.metrics["checkpoint/started"] = done
        else:
            self._checkpoint_metrics(rec, done)

    def _join_save(self, rec: StepRecord) -> None:
        cp = self.checkpointer
        assert cp is not None and cp.writing is not None
        done = cp.writing
        try:
            cp.join()
        except BaseException:
            rec.metrics["failed"] = "checkpoint"
            raise
        self._checkpoint_metrics(rec, done)

    def _checkpoint_metrics(self, rec: StepRecord, done: int) -> None:
        cp = self.checkpointer
        assert cp is not None
        rec.metrics.update({"checkpoint/step": done, "checkpoint/seconds": cp.seconds[-1],
                            "checkpoint/write_seconds": cp.write_seconds[-1]})

    def _after_step(self, done: int, last: bool) -> None:
        """Saves now (the last step, or a signal), or marks the save for the next offload."""
        cp = self.checkpointer
        if cp is None or not cp.due(done, final=self.stop_requested is not None):
            return
        if self.save_from_pool and not last:
            self._save_due = done
            return
        cp.join()                        # before the offload below rewrites what it reads
        t0 = time.perf_counter()
        if self.save_from_pool:          # once more, so the state is read from the pool as in the run
            self.offload_trainer()
        offload_s = time.perf_counter() - t0
        cp.save(done, self.version, background=False)
        self.final_checkpoint = {"step": done, "offload_s": offload_s, "seconds": cp.seconds[-1]}

    # -- the run ------------------------------------------------------------------------------------------
    def run(self, steps: int, progress: bool = True, *, start: int = 0,
            checkpointer: Optional[Checkpointer] = None) -> None:
        bar = None
        if progress and self.ranks.is_main and sys.stderr.isatty():     # lines only when logging to a file
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=steps, desc="colocated GRPO", unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                bar = None
        say = (bar.write if bar is not None else self.print) if self.ranks.is_main else (lambda *_: None)
        PAUSES.install()
        PAUSES.take()                     # the steps count only their own pauses
        try:
            self.checkpointer = checkpointer
            say(f"[colomem] placement: {self.placement.label} ({self.placement.why})")
            for k in range(start, steps):
                try:
                    rec = self.step(k)
                except Exception as e:
                    if self.stop_requested is None or not self._stop_after_failed_step(k, start, e, say):
                        raise
                    break
                self._agree_on_stop(k + 1)
                self._after_step(k + 1, last=k + 1 == steps or self.stop_requested is not None)
                if self.stop_requested is not None:
                    say(f"[colomem] {self.stop_requested}: stopped after step {k + 1}")
                    break
                m = rec.metrics
                acc = f" acc {m['accuracy']:.2f}" if "accuracy" in m else ""
                ent = f"  entropy {m['train/entropy']:.2f}" if "train/entropy" in m else ""
                say(f"step {k + 1:3d}/{steps}  reward {m['reward_mean']:.3f}{acc}{ent}"
                    f"  | step {rec.step_s:.2f}s  rollout {rec.phase_s.get('rollout', 0):.2f}s  train "
                    f"{rec.phase_s.get('train', 0):.2f}s  switch {rec.switch_s:.3f}s "
                    f"({100 * rec.switch_s / max(rec.step_s, 1e-9):.1f}%)")
                if m.get("samples") and (k % 10 == 0 or k == steps - 1):
                    for s in m["samples"]:
                        say(f"    {s['prompt']!r} -> {s['completion']!r} (answer {s['answer']!r}, "
                            f"reward {s['reward']:.2f})")
                if bar is not None:
                    bar.set_postfix(reward=f"{m['reward_mean']:.3f}",
                                    switch=f"{100 * rec.switch_s / max(rec.step_s, 1e-9):.1f}%")
                    bar.update(1)
            if self.evaluator is not None and self.stop_requested is None:
                self.evaluator.after_run(self)          # the final weights, in a window of their own
            if self.checkpointer is not None:
                self.checkpointer.join()
        finally:
            PAUSES.remove()
            if bar is not None:
                bar.close()
            self._end_write(say)

    def _end_write(self, say) -> None:
        """After a failure: a checkpoint write still reading the trainer's copies ends before the trainer
        and its pool close; its own failure is reported, the run's is the one raised."""
        cp = self.checkpointer
        if cp is None or cp.writing is None:
            return
        try:
            cp.join()
        except Exception as e:  # noqa: BLE001 - the run's own error is already on its way
            say(f"[colomem] the checkpoint being written did not complete: {e}")

    def _agree_on_stop(self, done: int) -> None:
        """Every rank stops after the same step. A signal can reach one rank first (a scheduler's notice that
        reaches one node first; a launcher that stops its node's workers because a peer node died): the ranks
        that did not get it stop with it. A peer that died shows here, as BarrierTimeoutError, even when the
        signal came after the step's last collective."""
        if self.ranks.world_size == 1:
            return
        stop = self.ranks.any_true(self.stop_requested is not None, f"the stop check after step {done}")
        if stop and self.stop_requested is None:
            self.stop_requested = "a stop signal on another rank"

    # Phases a step can fail in with the trainer's state still that of the step before (nothing trained yet).
    _BEFORE_TRAINING = CYCLE[:CYCLE.index("reload")] + ("score",)   # score: timed outside the phase machine

    def _stop_after_failed_step(self, k: int, start: int, e: Exception, say) -> bool:
        """A stop signal arrived and then step k failed: a signal to the whole process group (a scheduler's
        stop) reaches vLLM's engine too, which ends the rollout. Before training the trainer's state is still
        step k's start: it is saved as step k (one rank; several would need every rank's part) and the run
        stops as interrupted. False when that does not hold (the failure is then the run's)."""
        phase = self.machine.failed or self.machine.current or "score"     # as the step's record names it
        if phase not in self._BEFORE_TRAINING:
            return False
        why = f"{phase}: {type(e).__name__}: {e}".splitlines()[0]
        saved = ""
        cp = self.checkpointer
        if cp is not None and k > start and self.ranks.world_size == 1 and not cp.saved_step(k):
            if self.trainer.offloaded and not self.save_from_pool:
                self.reload_trainer()
            cp.save(k, self.version, background=False)
            saved = f"; step {k} saved"
        self.stop_failure = f"step {k + 1} could not finish after {self.stop_requested} ({why}){saved}"
        say(f"[colomem] {self.stop_requested}: {self.stop_failure}; stopped after step {k} (the signal reached "
            "vLLM's engine too: a signal to the whole process group?)")
        return True

    def summary(self) -> dict:
        return {
            **self.history.summary(),
            "memory_alarms": self.alarm.alarms,
            "checkpoint_s": list(self.checkpointer.seconds) if self.checkpointer else [],
            "final_checkpoint": self.final_checkpoint or None,
            "weight_version": self.version,
            "placement": self.placement.to_dict(),
            **(self.evaluator.summary() if self.evaluator is not None else {}),
        }
