"""The colocated GRPO loop: one GPU (or CPU) shared by the rollout engine and the trainer, taking turns.

One step (phases.CYCLE, each timed, each followed by a memory snapshot):

    offload trainer -> barrier -> wake weights -> sync -> check -> wake KV -> rollout -> sleep
        -> [score: rewards, advantages, batch] -> barrier -> reload trainer -> train

Guarantees: transitions only in that order (PhaseMachine, PhaseOrderError otherwise); every phase and every
barrier bounded (Watchdog, BarrierTimeoutError); rollout, trainer and pool closed in `finally` whatever
happened; an out-of-memory while vLLM wakes or generates puts it back to sleep, reloads nothing and says
which knob to lower; metrics lines already written are never rewritten (MetricsWriter appends and flushes).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from colomem.engines.protocols import ASLEEP, Rollout, Trainer
from colomem.engines.reports import SyncStats
from colomem.errors import ColomemError, CudaOutOfMemoryError, InvalidArgumentError, StaleWeightsError, is_oom

from .phases import PhaseMachine, PhaseTimeoutError, Watchdog
from .ranks import Ranks
from .timeline import MemoryAlarm, MetricsWriter, StepRecord, median, memory_snapshot, memory_table, phase_table

log = logging.getLogger(__name__)


def _mean(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def default_out_dir() -> Path:
    return Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


@dataclass
class RunResult:
    out_dir: Path
    summary: dict
    records: list = field(default_factory=list)


class ColocatedRunner:
    """Runs the steps of one colocated GRPO job on built engines (see run_job for the whole job)."""

    def __init__(self, cfg, *, rollout: Rollout, trainer: Trainer, pool, task, tokenizer, ranks: Ranks, reward_specs,
                 metric_specs=(), writer: Optional[MetricsWriter] = None, rank_writer: Optional[MetricsWriter] = None,
                 device: Optional[int] = None, grad_accum: int = 1, print_fn: Callable[[str], None] = print):
        self.cfg = cfg
        self.rollout, self.trainer, self.pool = rollout, trainer, pool
        self.task, self.tokenizer, self.ranks = task, tokenizer, ranks
        self.reward_specs, self.metric_specs = list(reward_specs), list(metric_specs)
        self.writer, self.rank_writer = writer, rank_writer
        self.device = device
        self.grad_accum = grad_accum
        self.print = print_fn if ranks.is_main else (lambda *_: None)
        self.machine = PhaseMachine()
        self.watchdog = Watchdog(cfg.phase_timeout_s)
        self.alarm = MemoryAlarm(cfg.memory_alarm_mib * (1 << 20))
        self.version = 0                    # weights version: number of optimizer steps taken
        self.records: list[StepRecord] = []
        self.rollout_awake = False
        self.max_new_tokens = cfg.grpo.max_new_tokens or task.max_new_tokens

    # -- phases -------------------------------------------------------------------------------------------
    def _memory(self) -> dict:
        extra = 0
        if self.pool is None:
            try:
                extra = int(self.trainer.memory().get("pinned_pool", 0) or 0)   # a trainer that owns its pool
            except Exception:  # noqa: BLE001  (memory reporting must not break a step)
                extra = 0
        try:
            return memory_snapshot(self.device, self.pool, extra)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}

    @contextlib.contextmanager
    def phase(self, rec: StepRecord, name: str):
        self.machine.enter(name)
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
        t0 = time.perf_counter()
        try:
            yield
        finally:
            rec.phase_s[name] = time.perf_counter() - t0

    def _put_rollout_to_sleep(self) -> Optional[str]:
        """After a failure while vLLM may be awake: sleep again so its memory is free. Returns a note."""
        if not self.rollout_awake:
            return None
        if self.rollout.phase == ASLEEP:
            self.rollout_awake = False
            return "the rollout engine was already asleep"
        try:
            self.rollout.sleep()
            self.rollout_awake = False
            return "the rollout engine was put back to sleep"
        except Exception as e:  # noqa: BLE001  (reported; cleanup closes it anyway)
            return f"putting the rollout engine back to sleep failed too ({type(e).__name__}: {e})"

    def _oom_error(self, phase: str, step: int, e: BaseException, note: Optional[str]) -> CudaOutOfMemoryError:
        c = self.cfg
        if phase in ("wake_kv", "rollout"):
            knob = (f"lower --gpu-memory-utilization (now {c.gpu_memory_utilization}) or --max-model-len (now "
                    f"{c.max_model_len}) so the KV cache is smaller")
        elif phase in ("wake_weights", "sync", "check"):
            knob = ("the rollout weights did not fit next to what stays on the GPU while the trainer is offloaded: "
                    "use --switch colomem (offloads all trainer state), a larger --tensor-parallel-size, or a smaller "
                    "model; check the memory table for what stays resident")
        else:
            knob = (f"lower --micro-batch (now {c.micro_batch}), turn on --gradient-checkpointing, or lower "
                    f"--gpu-memory-utilization (now {c.gpu_memory_utilization}) so vLLM's sleeping leftovers are "
                    "smaller; `python -m colomem.budget` estimates what fits")
        parts = [f"step {step}: out of GPU memory in phase {phase!r}: {e}", knob]
        if note:
            parts.append(note + "; the trainer was not reloaded")
        return CudaOutOfMemoryError(". ".join(p.rstrip(".") for p in parts) + ".")

    # -- one step -----------------------------------------------------------------------------------------
    def step(self, k: int) -> StepRecord:
        """One step; a step that fails still writes its line (phases so far, memory, `failed`, `error`)."""
        rec = StepRecord(step=k, rank=self.ranks.rank)
        t_step = time.perf_counter()
        try:
            return self._step(k, rec, t_step)
        except BaseException as e:
            rec.step_s = time.perf_counter() - t_step
            rec.metrics["failed"] = self.machine.failed or self.machine.current or "score"
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

        with self.phase(rec, "offload"):
            self.trainer.offload()
        with self.phase(rec, "barrier_wake"):
            ranks.barrier(f"before wake, step {k}")
        current = "wake_weights"
        try:
            with self.phase(rec, "wake_weights"):
                self.rollout_awake = True
                self.rollout.wake_weights()
            current = "sync"
            with self.phase(rec, "sync"):
                sync = self.rollout.load_weights(self.trainer.named_weights(), self.version)
            current = "check"
            with self.phase(rec, "check"):
                self.rollout.check()
            current = "wake_kv"
            with self.phase(rec, "wake_kv"):
                self.rollout.wake_kv()
            current = "rollout"
            with self.phase(rec, "rollout"):
                held = self.rollout.weight_version
                if held != self.version:
                    raise StaleWeightsError(f"step {k}: the rollout holds weights version {held}, the trainer "
                                            f"is at {self.version}; refusing to generate")
                completions = self.rollout.generate(
                    prompt_ids, n=cfg.grpo.group_size, max_new_tokens=self.max_new_tokens,
                    temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p,
                    seed=(cfg.seed * 1_000_003 + k * 10_007 + ranks.rollout_group * 101) % (2 ** 31))
            current = "sleep"
            with self.phase(rec, "sleep"):
                self.rollout.sleep()
                self.rollout_awake = False
        except BaseException as e:
            note = self._put_rollout_to_sleep()
            if is_oom(e):
                raise self._oom_error(current, k, e, note) from e
            if note and isinstance(e, Exception):
                log.error("step %d failed in %s; %s", k, current, note)
            raise
        alarm = self.alarm.observe(k, rec.memory.get("sleep", {}).get("driver_used"))
        if alarm:
            self.print(f"[colomem] ALARM step {k}: {alarm}")

        with self.timed(rec, "score"):
            batch, stats, shown = self._score(samples, gen_idx, train_idx, completions)

        with self.phase(rec, "barrier_train"):
            ranks.barrier(f"before reload, step {k}")
        try:
            with self.phase(rec, "reload"):
                self.trainer.reload()
            with self.phase(rec, "train"):
                train = self.trainer.train_step(batch)
            wait = float(train.get("reload_wait_s") or 0.0)
            if wait > 0:    # train waited for state still reloading: a switch cost, not training
                rec.phase_s["train"] -= wait
                rec.phase_s["reload_wait"] = wait
        except BaseException as e:
            if is_oom(e):
                raise self._oom_error(self.machine.failed or "train", k, e, None) from e
            raise
        self.version += 1
        self.rollout.expect_version(self.version)
        rec.step_s = time.perf_counter() - t_step

        rec.metrics.update(stats)
        rec.metrics.update({f"train/{n}": v for n, v in train.items()})
        rec.metrics["weight_version"] = self.version
        rec.metrics.update(self._switch_details(sync))
        if alarm:
            rec.metrics["memory_alarm"] = alarm
        if shown:
            rec.metrics["samples"] = shown
        self.records.append(rec)
        line = rec.to_json()
        if self.writer is not None:
            self.writer.write(line)
        if self.rank_writer is not None:
            self.rank_writer.write(line)
        return rec

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _score(self, samples, gen_idx, train_idx, completions):
        """Rewards for the generated groups, advantages per group, this rank's batch, global statistics."""
        from colomem.grpo.advantages import group_advantages
        from colomem.grpo.batch import build_batch
        from colomem.grpo.rewards import compute_rewards, score

        cfg, n = self.cfg, self.cfg.grpo.group_size
        if len(completions) != len(gen_idx) or any(len(g) != n for g in completions):
            raise ColomemError(f"the rollout returned {len(completions)} groups (sizes "
                               f"{sorted({len(g) for g in completions})}) for {len(gen_idx)} prompts x n={n}")
        pos = {g: j for j, g in enumerate(gen_idx)}
        mine = list(train_idx)
        prompts, texts, metas, comps = [], [], [], []
        for i in mine:
            for c in completions[pos[i]]:
                prompts.append(samples[i].prompt)
                texts.append(self.tokenizer.decode(c.token_ids, skip_special_tokens=True))
                metas.append(samples[i].meta)
                comps.append(c)
        rewards, parts = compute_rewards(self.reward_specs, prompts, texts, metas)
        extras = {}
        for name, spec in self.metric_specs:
            extras[name] = score(spec, prompts, texts, metas)
        adv = group_advantages(rewards, n, scale_by_std=cfg.grpo.scale_rewards, eps=cfg.grpo.adv_eps)
        groups = [completions[pos[i]] for i in mine]
        batch = build_batch([self._encode(samples[i].prompt) for i in mine], groups, adv,
                            pad_id=self.tokenizer.pad_token_id, mask_truncated=cfg.grpo.mask_truncated,
                            rewards=rewards)
        # global statistics: sums over ranks (train groups partition all groups)
        flat = [r for r in rewards]
        lens = [len(c.token_ids) for c in comps]
        trunc = [1.0 if c.truncated else 0.0 for c in comps]
        g = [flat[j:j + n] for j in range(0, len(flat), n)]
        no_signal = sum(1.0 for grp in g if max(grp) == min(grp))
        vec = [len(flat), sum(flat), sum(r * r for r in flat), sum(lens), sum(trunc), len(g), no_signal]
        names_p = sorted(parts)
        names_e = sorted(extras)
        vec += [sum(parts[p]) for p in names_p] + [sum(extras[e]) for e in names_e]
        tot = self.ranks.sum(vec)
        cnt = max(tot[0], 1.0)
        mean = tot[1] / cnt
        stats = {"reward_mean": mean, "reward_std": math.sqrt(max(tot[2] / cnt - mean * mean, 0.0)),
                 "completion_len_mean": tot[3] / cnt, "truncated_frac": tot[4] / cnt,
                 "groups_no_signal": tot[6] / max(tot[5], 1.0), "samples_total": int(tot[0])}
        for j, p in enumerate(names_p):
            stats[f"reward/{p}"] = tot[7 + j] / cnt
        for j, e in enumerate(names_e):
            stats[e] = tot[7 + len(names_p) + j] / cnt
        shown = []
        if self.cfg.log_samples and self.ranks.is_main:
            for j in range(0, min(len(texts), self.cfg.log_samples * n), n):
                shown.append({"prompt": prompts[j], "completion": texts[j], "reward": rewards[j],
                              "answer": metas[j].get("answer")})
        return batch, stats, shown

    def _switch_details(self, sync: Optional[SyncStats]) -> dict:
        out: dict[str, Any] = {}
        if sync is not None:
            out.update({"sync/nbytes": sync.nbytes, "sync/ntensors": sync.ntensors, "sync/nbuckets": sync.nbuckets,
                        "sync/seconds": sync.seconds})
        for side, rep in (("offload", self.trainer.last_offload), ("reload", self.trainer.last_reload)):
            if rep is None:
                continue
            for k, v in rep.to_dict().items():
                if isinstance(v, (int, float, str, bool)) or v is None:
                    out[f"trainer_{side}/{k}"] = v
        for k, v in self.rollout.timings.items():
            if isinstance(v, (int, float)):
                out[f"rollout/{k}"] = v
        return out

    # -- the run ------------------------------------------------------------------------------------------
    def run(self, steps: int, progress: bool = True) -> None:
        bar = None
        if progress and self.ranks.is_main and sys.stderr.isatty():     # lines only when logging to a file
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=steps, desc="colocated GRPO", unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                bar = None
        say = (bar.write if bar is not None else self.print) if self.ranks.is_main else (lambda *_: None)
        try:
            for k in range(steps):
                rec = self.step(k)
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
        finally:
            if bar is not None:
                bar.close()

    def summary(self) -> dict:
        recs = self.records
        warm = recs[1:] if len(recs) > 1 else recs
        rewards = [r.metrics.get("reward_mean") for r in recs]
        acc = [r.metrics.get("accuracy") for r in recs]
        after_sleep = [r.memory.get("sleep", {}).get("driver_used") for r in recs]
        offl = [r.memory.get("offload", {}).get("reserved") for r in recs]
        phases = sorted({p for r in warm for p in r.phase_s})
        return {
            "steps_done": len(recs),
            "reward_first5_mean": _mean(rewards[:5]),
            "reward_last5_mean": _mean(rewards[-5:]),
            "accuracy_first5_mean": _mean(acc[:5]),
            "accuracy_last5_mean": _mean(acc[-5:]),
            "step_s_median": median([r.step_s for r in warm]),
            "switch_s_median": median([r.switch_s for r in warm]),
            "switch_overhead_fraction": median([r.switch_s / r.step_s for r in warm if r.step_s]),
            "phase_s_median": {p: median([r.phase_s.get(p) for r in warm]) for p in phases},
            "gpu_used_after_sleep_max": max([x for x in after_sleep if x is not None], default=None),
            "gpu_used_max": max([v.get("driver_used") or 0 for r in recs for v in r.memory.values()
                                 if isinstance(v, dict)], default=None) or None,
            "trainer_reserved_after_offload_max": max([x for x in offl if x is not None], default=None),
            "pinned_host_max": max([v.get("pinned_host") or 0 for r in recs for v in r.memory.values()
                                    if isinstance(v, dict)], default=None) or None,
            "memory_alarms": self.alarm.alarms,
            "weight_version": self.version,
        }


# ------------------------------------------------------------------------------------------------ the job
def _tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise InvalidArgumentError(f"the tokenizer of {path} has no EOS token; completions could never stop")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _rewards(cfg, task, reward_fns):
    from colomem.grpo.rewards import RewardSpec, resolve

    if reward_fns is not None:
        specs = [s if isinstance(s, RewardSpec) else RewardSpec(resolve(s)) for s in reward_fns]
    else:
        specs = [RewardSpec(resolve(name)) for name in (cfg.rewards or task.rewards)]
    metrics = [(name, RewardSpec(resolve(fn), name=name)) for name, fn in task.metrics.items()]
    return specs, metrics


def _grad_accum(cfg, world: int) -> int:
    rows = cfg.prompts_per_step // world * cfg.grpo.group_size
    micro = min(cfg.micro_batch, rows)
    need = math.ceil(rows / micro)
    if cfg.grad_accum is not None and cfg.grad_accum * cfg.micro_batch < rows:
        from colomem.errors import ConfigError
        raise ConfigError(f"invalid run config: grad_accum ({cfg.grad_accum}) x micro_batch ({cfg.micro_batch}) = "
                          f"{cfg.grad_accum * cfg.micro_batch} rows, but each rank trains on {rows} rows per step "
                          f"(prompts_per_step {cfg.prompts_per_step} / {world} ranks x group_size "
                          f"{cfg.grpo.group_size}); leave grad_accum unset to derive it")
    return cfg.grad_accum or need


def run_job(cfg, *, reward_fns=None, engines_factory=None, print_fn: Callable[[str], None] = print,
            out_dir: Optional[os.PathLike] = None) -> RunResult:
    """The whole colocated job: backend, model, engines, steps, outputs (metrics.jsonl, timeline.png,
    rewards.png, summary.json in the output directory). Cleanup runs whatever happens; an error is recorded
    in summary.json and raised again.

    engines_factory(cfg, backend, model_path, tokenizer, ranks, grad_accum) -> Engines replaces the
    built-in backends (tests use it to inject faults)."""
    from colomem.grpo.tasks import make_task

    from .backends import Engines, build_engines, close_engines, resolve_backend

    t_start = time.time()
    ranks = Ranks.from_env(tp=cfg.tensor_parallel_size if cfg.tensor_parallel_size > 1 else 1,
                           barrier_timeout_s=cfg.barrier_timeout_s,
                           backend="gloo" if cfg.backend == "cpu" else _dist_backend())
    say = print_fn if ranks.is_main else (lambda *_: None)
    out = Path(out_dir or cfg.out or default_out_dir())
    out.mkdir(parents=True, exist_ok=True)
    writer = rank_writer = None
    engines: Optional[Engines] = None
    runner: Optional[ColocatedRunner] = None
    summary: dict[str, Any] = {"status": "error", "out_dir": str(out)}
    error: Optional[BaseException] = None
    try:
        backend, why = resolve_backend(cfg.backend)
        say(f"[colomem] {why}")
        steps = cfg.steps_for(backend)
        if steps != cfg.steps:
            say(f"[colomem] CPU run: {steps} steps instead of {cfg.steps} (cpu_steps; pass --steps N to choose)")
        task = make_task(cfg.task, cfg.task_options)
        ranks.check_split(cfg.prompts_per_step)
        grad_accum = _grad_accum(cfg, ranks.world_size)
        model_path = _model_path(cfg, task, ranks, say)
        tokenizer = _tokenizer(model_path, cfg.trust_remote_code)
        reward_specs, metric_specs = _rewards(cfg, task, reward_fns)
        _check_lengths(cfg, task, tokenizer)
        summary.update(backend=backend, switch=cfg.switch, world_size=ranks.world_size, model=model_path,
                       task=cfg.task, steps=steps, config=cfg.model_dump(mode="json"))
        if ranks.is_main:
            writer = MetricsWriter(out / "metrics.jsonl")
            writer.write({"event": "start", "time": t_start, "backend": backend, "steps": steps,
                          "world_size": ranks.world_size, "config": cfg.model_dump(mode="json")})
        if ranks.world_size > 1:
            rank_writer = MetricsWriter(out / "ranks" / f"rank{ranks.rank}.jsonl")
        say(f"[colomem] model {model_path}; task {cfg.task}; {steps} steps x {cfg.prompts_per_step} prompts x "
            f"{cfg.grpo.group_size} completions; switch={cfg.switch}; out {out}")
        factory = engines_factory or (lambda c, b, m, t, r, g: build_engines(c, b, m, t, r, grad_accum=g))
        t_build = time.perf_counter()
        engines = factory(cfg, backend, model_path, tokenizer, ranks, grad_accum)
        summary["build_s"] = time.perf_counter() - t_build
        device = ranks.local_rank if backend == "gpu" else None
        runner = ColocatedRunner(cfg, rollout=engines.rollout, trainer=engines.trainer, pool=engines.pool,
                                 task=task, tokenizer=tokenizer, ranks=ranks, reward_specs=reward_specs,
                                 metric_specs=metric_specs, writer=writer, rank_writer=rank_writer, device=device,
                                 grad_accum=grad_accum, print_fn=print_fn)
        runner.run(steps, progress=cfg.progress)
        summary["status"] = "ok"
    except BaseException as e:  # recorded, then raised again after cleanup
        error = e
        summary["error"] = f"{type(e).__name__}: {e}"
    finally:
        if runner is not None:
            summary.update(runner.summary())
        if engines is not None:
            errs = close_engines(engines, log_fn=lambda m: say(f"[colomem] {m}"))
            if errs:
                summary["cleanup_errors"] = errs
        summary["wall_s"] = time.time() - t_start
        if writer is not None:
            try:
                writer.write({"event": "end", "time": time.time(), "status": summary["status"],
                              "error": summary.get("error")})
            except Exception:  # noqa: BLE001
                pass
            writer.close()
        if rank_writer is not None:
            rank_writer.close()
        if ranks.is_main:
            _finish_outputs(cfg, out, runner, summary, say)
        ranks.close(timeout_s=5.0 if error is not None else 60.0)
    if error is not None:
        raise error
    return RunResult(out, summary, runner.records if runner else [])


def _dist_backend() -> str:
    try:
        import torch
        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:
        return "gloo"


def _model_path(cfg, task, ranks: Ranks, say) -> str:
    if cfg.model:
        return cfg.model
    from colomem.grpo.tiny_model import model_dir

    if ranks.is_main:
        path = model_dir(cfg.model_shape, task.alphabet, seed=cfg.seed, dtype=cfg.dtype, log=say)
    ranks.barrier("model built")           # the others then find it in the cache
    if not ranks.is_main:
        path = model_dir(cfg.model_shape, task.alphabet, seed=cfg.seed, dtype=cfg.dtype, log=lambda *_: None)
    return str(path)


def _check_lengths(cfg, task, tokenizer) -> None:
    sample = task.samples(8, seed=cfg.seed, step=0)
    longest = max(len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"]) for s in sample)
    new = cfg.grpo.max_new_tokens or task.max_new_tokens
    if longest + new > cfg.max_model_len:
        from colomem.errors import ConfigError
        raise ConfigError(f"invalid run config: max_model_len ({cfg.max_model_len}) is shorter than a prompt "
                          f"({longest} tokens) plus max_new_tokens ({new}); raise --max-model-len")


def _finish_outputs(cfg, out: Path, runner: Optional[ColocatedRunner], summary: dict, say) -> None:
    import json

    files = {"metrics": str(out / "metrics.jsonl"), "summary": str(out / "summary.json")}
    if runner is not None and runner.records:
        say("\nphase times (median over steps after the first):\n" + phase_table(runner.records))
        say("\nmemory after each phase (median over steps):\n" + memory_table(runner.records))
        if cfg.plots:
            try:
                from .plots import plot_rewards, plot_timeline
                recs = [r.to_json() for r in runner.records]
                title = f"{cfg.model_shape if not cfg.model else Path(cfg.model).name}, switch={cfg.switch}"
                if plot_timeline(recs, out / "timeline.png", title=f"phase timeline ({title})"):
                    files["timeline_png"] = str(out / "timeline.png")
                if plot_rewards(recs, out / "rewards.png", title=f"reward ({cfg.task}, {title})"):
                    files["rewards_png"] = str(out / "rewards.png")
            except Exception as e:  # noqa: BLE001  (plots are not worth losing the summary for)
                summary["plot_error"] = f"{type(e).__name__}: {e}"
    summary["files"] = files
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    os.replace(tmp, out / "summary.json")
    first, last = summary.get("reward_first5_mean"), summary.get("reward_last5_mean")
    if first is not None:
        frac = summary.get("switch_overhead_fraction")
        say(f"\n[colomem] {summary['status']}: {summary['steps_done']} steps; reward first 5 {first:.3f} -> last 5 "
            f"{last:.3f}; switch overhead {100 * (frac or 0):.2f}% of the step; outputs in {out}")
    else:
        say(f"\n[colomem] {summary['status']}: no step finished; outputs in {out}")
    if summary.get("error"):
        say(f"[colomem] error: {summary['error']}")
