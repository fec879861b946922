#!/usr/bin/env python3
"""TRL's GRPOTrainer with vLLM colocated, on exactly the job a colomem run config describes (the peer baseline).

    python3 benchmarks/bench_trl.py --config configs/grpo_1p5b_full.yaml --steps 5 --out runs/trl
    python3 benchmarks/bench_trl.py --config configs/grpo_1p5b_full.yaml --trl-sleep --out runs/trl_sleep
    python3 benchmarks/bench_trl.py --no-vllm --steps 2 --out runs/trl_cpu        # the harness on a CPU

Every runner flag works here (`runners/grpo_colocated.py --help`) and means the same: the run config picks the
model (the same cached config-built directory), tokenizer, task prompts step by step, reward functions, batch
shape, optimizer and vLLM memory share. `use_vllm=True, vllm_mode="colocate"`: vLLM runs in this process on
the same GPU, the trainer stays resident, weights go to vLLM with `load_weights` per tensor every step. vLLM
sleep is off unless --trl-sleep (TRL's level 2 after every generation). CUDA graphs are on (TRL passes no
enforce_eager) unless --eager or an explicit --enforce-eager true. One colomem step = one generation of
prompts_per_step x group_size completions = num_iterations x mini_batches TRL optimizer steps (1 by default).

Writes metrics.jsonl (one record per step: step_s, switch_s, phase_s, memory, reward_mean, ...) and
summary.json (step_s_median over the steps after the first, switch_s_median, phase_s_median, ...), the same
names and meanings as the runner's, plus `trl`: the GRPOConfig used and what could not be matched.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))   # a fallback: an installed colomem or PYTHONPATH's comes first

from colomem.errors import ConfigError, NotAvailableError  # noqa: E402
from colomem.runner.config import build_arg_parser, script_config  # noqa: E402
from colomem.runner.phases import SWITCH_PHASES  # noqa: E402

TESTED_TRL = "1.16"
SKIPPED_RC = 3          # exit status of a run that could not start because TRL is missing


class TRLMissingError(NotAvailableError):
    """TRL (or one of its imports) is not installed: the baseline is skipped, not failed."""


def say(msg: str) -> None:
    print(f"[bench_trl] {msg}", flush=True)


def build_parser():
    p = build_arg_parser("TRL GRPOTrainer (vLLM colocate) on a colomem run config's job")
    g = p.add_argument_group("TRL baseline")
    g.add_argument("--trl-sleep", action="store_true",
                   help="vllm_enable_sleep_mode: vLLM sleeps (level 2) after each generation, weights re-pushed")
    g.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (enforce_eager)")
    g.add_argument("--no-vllm", action="store_true",
                   help="generate with transformers instead of vLLM (the CPU check of this harness)")
    return p


# ------------------------------------------------------------------------------------- the job, for TRL
def batch_shape(cfg) -> tuple[int, int, int]:
    """(per-device micro batch, gradient accumulation steps, steps_per_generation) so that one generation holds
    one colomem step's rows and each of its mini-batches is one optimizer step (the runner's _grad_accum)."""
    g = cfg.grpo
    rows = cfg.prompts_per_step * g.group_size
    per_update, left = divmod(rows, g.mini_batches)
    micro = min(cfg.micro_batch, per_update)
    if left or per_update % micro:
        raise ConfigError(f"TRL needs whole micro-batches: {rows} rows per step in {g.mini_batches} mini-batch(es) "
                          f"of micro_batch {micro}; choose a micro_batch that divides {per_update}")
    accum = per_update // micro
    return micro, accum, accum * g.mini_batches


def trl_settings(cfg, *, steps: int, max_new_tokens: int, use_vllm: bool, sleep: bool, cuda: bool,
                 out: Path) -> tuple[dict, list]:
    """GRPOConfig keyword arguments for the job of `cfg`, and notes on what differs from the runner."""
    g = cfg.grpo
    refused = [f"{name}={val!r}" for name, val, default in (
        ("dual_clip", g.dual_clip, None), ("kl_clamp", g.kl_clamp, None), ("old_logprobs", g.old_logprobs, "policy"))
        if val != default]
    if refused:
        raise ConfigError(f"TRL's GRPOTrainer has no equivalent of {', '.join(refused)}; leave them at their defaults")
    micro, accum, per_generation = batch_shape(cfg)
    schedule = cfg.lr_schedule("gpu" if cuda else "cpu")      # in optimizer steps, as TRL counts them
    kw: dict[str, Any] = dict(
        output_dir=str(out / "trl"), max_steps=steps * g.num_iterations * g.mini_batches,
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum, steps_per_generation=per_generation,
        num_generations=g.group_size, num_iterations=g.num_iterations, shuffle_dataset=False,
        max_completion_length=max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or 0,
        min_p=g.min_p or None, repetition_penalty=g.repetition_penalty, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm or 0.0, lr_scheduler_type=schedule.name, warmup_steps=schedule.warmup,
        seed=cfg.seed, data_seed=cfg.seed,
        bf16=cfg.dtype == "bfloat16", fp16=cfg.dtype == "float16", model_init_kwargs={"dtype": cfg.dtype},
        gradient_checkpointing=cfg.gradient_checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
        beta=g.kl_coef, epsilon=g.clip_eps, epsilon_high=g.clip_high, use_bias_correction_kl=g.kl_ratio_correction,
        loss_type="dapo" if g.loss_norm == "token" else "grpo", scale_rewards="group" if g.scale_rewards else "none",
        mask_truncated_completions=g.mask_truncated, importance_sampling_level=g.importance_level,
        entropy_coef=g.entropy_coef, vllm_importance_sampling_correction=use_vllm and g.is_correction != "none",
        trust_remote_code=cfg.trust_remote_code, use_cpu=not cuda, report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=not cfg.progress, dataloader_num_workers=0)
    if schedule.name == "cosine_with_min_lr":
        kw["lr_scheduler_kwargs"] = {"min_lr_rate": schedule.min_lr_rate}
    if kw["vllm_importance_sampling_correction"]:
        kw.update(vllm_importance_sampling_mode=f"{g.is_correction}_{g.is_mode}",
                  vllm_importance_sampling_clip_max=g.is_cap)
    if use_vllm:
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=cfg.gpu_memory_utilization,
                  vllm_max_model_length=cfg.max_model_len, vllm_tensor_parallel_size=cfg.tensor_parallel_size,
                  vllm_enable_sleep_mode=sleep)
    if cuda:        # the runner's own DeepSpeed config (ZeRO stage, bf16, FusedAdam AdamW, clipping)
        ds = cfg.deepspeed_config(grad_accum=accum).model_copy(update={"micro_batch": micro})
        kw["deepspeed"] = ds.build_ds_config(int(os.environ.get("WORLD_SIZE", "1")))
    notes = ["group std: TRL divides by n - 1; the runner by n unless std=sample" if g.std == "population" else None,
             f"log-ratio clamp: the runner clamps at +-{g.log_ratio_clamp:g} before exp, TRL does not"
             if g.log_ratio_clamp else None,
             "vLLM: in this process, one request per completion (n=1), max_num_batched_tokens 4096, logprobs "
             "returned (TRL's fixed settings); the runner's engine is its own process, n=group_size per prompt"
             if use_vllm else "no vLLM: transformers' generate",
             None if cuda else "no GPU: no DeepSpeed, torch AdamW on the CPU"]
    return kw, [n for n in notes if n]


def prompts_dataset(task, cfg, steps: int):
    """The runner's prompts in its order: step k's rows are task.samples(prompts_per_step, seed, step=k)
    (TRL's sampler walks an unshuffled dataset in order); every meta field is a column for the rewards."""
    from datasets import Dataset

    rows = [{"prompt": s.prompt, **s.meta} for k in range(steps)
            for s in task.samples(cfg.prompts_per_step, seed=cfg.seed, step=k)]
    return Dataset.from_list(rows), sorted({k for r in rows for k in r} - {"prompt"})


def task_reward(inputs, meta_keys: list[str], sink: list, eos_id: int) -> Callable:
    """A TRL reward function that scores with the runner's reward and metric functions; each call's
    statistics (named as the runner's step metrics) go to `sink`."""
    from colomem.grpo.rewards import compute_rewards, score

    def reward(prompts, completions, completion_ids=None, **columns):
        metas = [{k: columns[k][i] for k in meta_keys if k in columns} for i in range(len(completions))]
        total, parts = compute_rewards(inputs.reward_specs, list(prompts), list(completions), metas)
        scored = [r for r in total if r is not None]
        mean = sum(scored) / max(len(scored), 1)
        stats = {"reward_mean": mean, "reward_std": statistics.pstdev(scored) if scored else 0.0,
                 "samples_total": len(completions), "unscorable_frac": 1.0 - len(scored) / max(len(total), 1)}
        stats.update({f"reward/{k}": sum(v or 0.0 for v in vals) / len(vals) for k, vals in parts.items()})
        for name, spec in inputs.metric_specs:
            vals = score(spec, list(prompts), list(completions), metas)
            stats[name] = sum(v or 0.0 for v in vals) / len(vals)
        if completion_ids is not None:
            lens = [len(ids) for ids in completion_ids]
            stats["completion_len_mean"] = sum(lens) / len(lens)
            stats["truncated_frac"] = sum(1.0 for ids in completion_ids if len(ids) >= inputs.max_new_tokens
                                          and ids[-1] != eos_id) / len(lens)
        sink.append(stats)
        return total                       # None: not scorable (TRL's convention as well)

    reward.__name__ = "+".join(s.label for s in inputs.reward_specs)
    return reward


# ------------------------------------------------------------------------------------------ the clock
def make_clock(writer, *, updates_per_step: int, device: Optional[int]):
    """A TrainerCallback timing each colomem-sized step (on_step_begin of its first optimizer step to
    on_step_end of its last) and its phases, from wrappers around TRL's generation, sync, sleep and reward
    calls. A phase's time is its own, nested timed calls taken out; train = the step's remainder."""
    import torch
    from transformers import TrainerCallback

    from colomem.runner.timeline import memory_snapshot, peak_reserved, reset_peak

    cuda = device is not None and torch.cuda.is_available()

    class StepClock(TrainerCallback):
        def __init__(self):
            self.records: list[dict] = []
            self.rewards: list[dict] = []          # the reward function's statistics, one per generation
            self.phase_s: dict[str, float] = defaultdict(float)
            self.memory: dict[str, dict] = {}
            self._stack: list[float] = []
            self._updates = 0
            self._t0 = self._started = self._last_end = None
            self._pending: Optional[dict] = None
            self.train_called = self.first_begin = None

        def _sync(self):
            if cuda:
                torch.cuda.synchronize(device)     # the GPU work of a phase counts in that phase

        def timed(self, phase, fn, snapshot: Optional[str] = None):
            def run(*args, **kwargs):
                name = phase(kwargs) if callable(phase) else phase
                self._stack.append(0.0)
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._sync()
                    dt = time.perf_counter() - t0
                    self.phase_s[name] += dt - self._stack.pop()
                    if self._stack:
                        self._stack[-1] += dt
                    if snapshot:
                        self.memory[snapshot] = memory_snapshot(device)
            return run

        def instrument(self, trainer) -> None:
            for attr in ("_generate", "_calculate_rewards"):
                if not hasattr(trainer, attr):
                    raise NotAvailableError(f"this TRL has no GRPOTrainer.{attr} to time (written against TRL "
                                            f"{TESTED_TRL}); install trl=={TESTED_TRL}.0")
            trainer._generate = self.timed("rollout", trainer._generate)
            trainer._calculate_rewards = self.timed("score", trainer._calculate_rewards)
            vg = getattr(trainer, "vllm_generation", None)
            if vg is None:
                return
            vg.sync_weights = self.timed("sync", vg.sync_weights)
            llm = vg.llm
            llm.generate = self.timed("rollout", llm.generate, snapshot="rollout")
            llm.sleep = self.timed("sleep", llm.sleep, snapshot="sleep")
            wake = {("weights",): "wake_weights", ("kv_cache",): "wake_kv"}
            llm.wake_up = self.timed(lambda kw: wake.get(tuple(kw.get("tags") or ()), "wake_weights"), llm.wake_up)

        def on_step_begin(self, args, state, control, **kw):
            if self.first_begin is None:
                self.first_begin = time.perf_counter()
            if self._updates % updates_per_step == 0:
                self._sync()
                self.phase_s, self.memory = defaultdict(float), {}
                reset_peak(device)
                self._started, self._t0 = time.time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self._updates += 1
            if self._updates % updates_per_step:
                return
            self._sync()
            end = time.perf_counter()
            step_s = end - self._t0
            phases = {p: v for p, v in self.phase_s.items()}
            phases["train"] = max(step_s - sum(phases.values()), 0.0)
            self.memory["train"] = {**memory_snapshot(device), "peak_reserved": peak_reserved(device)}
            switch = sum(phases.get(p, 0.0) for p in SWITCH_PHASES)
            rec = {"step": len(self.records), "rank": 0, "time": self._started, "step_s": step_s, "switch_s": switch,
                   "switch_fraction": switch / step_s if step_s else None, "phase_s": phases, "memory": self.memory,
                   "between_steps_s": None if self._last_end is None else self._t0 - self._last_end,
                   "optimizer_steps": updates_per_step}
            for stats in self.rewards:
                rec.update(stats)
            self.rewards.clear()
            self._last_end = end
            self._flush()
            self._pending = rec

        def on_log(self, args, state, control, logs=None, **kw):
            if self._pending is not None:          # TRL's own figures of the step (its step_time among them)
                self._pending.update({f"trl/{k}": v for k, v in (logs or {}).items()
                                      if isinstance(v, (int, float)) and not isinstance(v, bool)})
                self._flush()

        def on_train_end(self, args, state, control, **kw):
            self._flush()

        def _flush(self):
            if self._pending is not None:
                self.records.append(self._pending)
                writer.write(self._pending)
                self._pending = None

    return StepClock()


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def step_summary(records: list[dict]) -> dict:
    """The runner's summary fields over these records: medians over the steps after the first (the first
    pays one-time costs: CUDA graph warm-up, allocator growth), the first on its own, all in the total."""
    warm = records[1:] if len(records) > 1 else records
    phases = sorted({p for r in warm for p in r["phase_s"]})
    rewards, acc = [r.get("reward_mean") for r in records], [r.get("accuracy") for r in records]
    used = [v.get("driver_used") for r in records for v in r["memory"].values() if isinstance(v, dict)]
    return {"steps_done": len(records),
            "reward_first5_mean": _mean(rewards[:5]), "reward_last5_mean": _mean(rewards[-5:]),
            "accuracy_first5_mean": _mean(acc[:5]), "accuracy_last5_mean": _mean(acc[-5:]),
            "step_s_median": _median([r["step_s"] for r in warm]),
            "switch_s_median": _median([r["switch_s"] for r in warm]),
            "switch_overhead_fraction": _median([r["switch_s"] / r["step_s"] for r in warm if r["step_s"]]),
            "phase_s_median": {p: _median([r["phase_s"].get(p) for r in warm]) for p in phases},
            "step_s_spread": [min(r["step_s"] for r in warm), max(r["step_s"] for r in warm)] if warm else None,
            "first_step_s": records[0]["step_s"] if records else None,
            "steps_wall_s": sum(r["step_s"] for r in records),
            "gpu_used_max": max([u for u in used if u is not None], default=None)}


# ------------------------------------------------------------------------------------------ the run
def _vllm_eager() -> None:
    """TRL builds its colocated LLM without enforce_eager; this adds it (vLLM's own option)."""
    import trl.generation.vllm_generation as vllm_generation

    base = vllm_generation.LLM

    def eager_llm(*args, **kwargs):
        kwargs.setdefault("enforce_eager", True)
        return base(*args, **kwargs)
    vllm_generation.LLM = eager_llm


def run(cfg, ns, out: Path, summary: dict, writer) -> None:
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise TRLMissingError(f"TRL is not importable ({type(e).__name__}: {e}); pip install "
                                f"trl=={TESTED_TRL}.0 to run this baseline") from None
    import torch

    from colomem.engines.deepspeed.config import distributed_env
    from colomem.runner.job import job_inputs

    if not trl.__version__.startswith(TESTED_TRL + "."):
        say(f"TRL {trl.__version__}: this harness times GRPOTrainer internals of TRL {TESTED_TRL}")
    cuda = torch.cuda.is_available()
    use_vllm = not ns.no_vllm
    if use_vllm and not cuda:
        raise NotAvailableError("no CUDA device: TRL's colocated vLLM needs a GPU; --no-vllm runs this harness on "
                                "the CPU (transformers' generate, torch AdamW)")
    if cuda:            # colocate mode and DeepSpeed start torch.distributed: rank 0 of 1 unless torchrun set it
        os.environ.update(distributed_env())
    eager = use_vllm and (ns.eager or (cfg.explicitly_set("enforce_eager") and cfg.enforce_eager))
    steps = cfg.steps_for("gpu" if cuda else "cpu")
    inputs = job_inputs(cfg, say=say)
    dataset, meta_keys = prompts_dataset(inputs.task, cfg, steps)
    kwargs, notes = trl_settings(cfg, steps=steps, max_new_tokens=inputs.max_new_tokens, use_vllm=use_vllm,
                                 sleep=ns.trl_sleep, cuda=cuda, out=out)
    summary.update(backend="gpu" if cuda else "cpu", world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   model=inputs.model_path, task=cfg.task if not cfg.dataset else Path(cfg.dataset).name,
                   steps=steps, config=cfg.model_dump(mode="json"),
                   trl={"version": trl.__version__, "use_vllm": use_vllm, "vllm_mode": "colocate" if use_vllm else None,
                        "vllm_sleep": bool(use_vllm and ns.trl_sleep), "vllm_enforce_eager": eager,
                        "deepspeed_zero_stage": cfg.zero_stage if cuda else None,
                        "optimizer_steps_per_step": cfg.grpo.num_iterations * cfg.grpo.mini_batches,
                        "grpo_config": kwargs, "not_matched": notes})
    writer.write({"event": "start", "time": time.time(), "backend": summary["backend"], "steps": steps,
                  "world_size": summary["world_size"], "config": summary["config"], "trl": summary["trl"]})
    say(f"TRL {trl.__version__}; model {inputs.model_path}; {steps} steps x {cfg.prompts_per_step} prompts x "
        f"{cfg.grpo.group_size} completions; vLLM {'colocate' if use_vllm else 'off'}"
        f"{', sleep level 2' if use_vllm and ns.trl_sleep else ''}{', eager' if eager else ''}; out {out}")
    if eager:
        _vllm_eager()
    tokenizer = inputs.tokenizer
    tokenizer.padding_side = "left"          # TRL's own default for the tokenizers it loads
    peft_config = None
    if cfg.lora is not None:
        from colomem.engines.lora import build_lora_config

        peft_config = build_lora_config(cfg.lora)
    clock = make_clock(writer, updates_per_step=summary["trl"]["optimizer_steps_per_step"],
                       device=int(os.environ.get("LOCAL_RANK", "0")) if cuda else None)
    reward = task_reward(inputs, meta_keys, clock.rewards, tokenizer.eos_token_id)
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=inputs.model_path, reward_funcs=[reward], args=GRPOConfig(**kwargs),
                          train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                          callbacks=[clock])
    summary["trainer_init_s"] = time.perf_counter() - t0
    if cfg.gradient_checkpointing and cfg.checkpoint_every > 1:
        # the runner's --checkpoint-every on TRL's model too: every enable of its trainer keeps every K-th layer
        from colomem.engines.recompute import keep_checkpointing_every

        keep_checkpointing_every(trainer.model, cfg.checkpoint_every)
    if cfg.torch_compile:
        # the runner's --torch-compile on TRL's model too: the same parts of its decoder layers compiled
        from colomem.engines.compile import compile_decoder_layers

        summary["trl"]["compiled_parts"] = compile_decoder_layers(trainer.model, "cuda" if cuda else "cpu")
    clock.instrument(trainer)
    t_train = time.perf_counter()
    try:
        trainer.train()
    finally:
        summary["train_wall_s"] = time.perf_counter() - t_train
        if clock.first_begin is not None:   # DeepSpeed's engine starts inside train(), before the first step
            summary["train_setup_s"] = clock.first_begin - t_train
            summary["build_s"] = summary["trainer_init_s"] + summary["train_setup_s"]
        summary.update(step_summary(clock.records))
        from colomem.engines.recompute import checkpointed_layers

        summary["trl"]["checkpointed_layers"] = checkpointed_layers(trainer.model)
    if len(clock.records) != steps:
        raise RuntimeError(f"TRL ran {len(clock.records)} steps of the {steps} asked for")


def main(argv: Optional[list[str]] = None) -> int:
    ns, cfg, out = script_config(build_parser(), argv, "runs/trl")
    from colomem.runner.timeline import MetricsWriter

    (out / "metrics.jsonl").unlink(missing_ok=True)        # one run per folder: no earlier run's steps
    writer = MetricsWriter(out / "metrics.jsonl")
    summary: dict[str, Any] = {"status": "error", "out_dir": str(out), "peer": "trl"}
    t_start, rc = time.time(), 1
    try:
        run(cfg, ns, out, summary, writer)
        summary["status"], rc = "ok", 0
    except TRLMissingError as e:
        summary.update(status="skipped", error=str(e))
        rc = SKIPPED_RC
        say(str(e))
    except BaseException as e:  # recorded in the summary, then raised again
        summary["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        summary["wall_s"] = time.time() - t_start
        writer.write({"event": "end", "time": time.time(), "status": summary["status"], "error": summary.get("error")})
        writer.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        if summary.get("step_s_median") is not None:
            say(f"{summary['status']}: {summary['steps_done']} steps, step {summary['step_s_median']:.2f} s median "
                f"after the first ({summary['first_step_s']:.2f} s), switch {summary['switch_s_median']:.3f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
