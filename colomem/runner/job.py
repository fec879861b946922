"""The whole colocated job around the loop: backend, model, tokenizer, rewards, engines, outputs, cleanup.

run_job(cfg) builds what the loop needs (checking what it can before any engine starts), runs the steps, and
writes metrics.jsonl, summary.json and the plots into the output directory whatever happens.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from colomem.engines.protocols import Checkpointable
from colomem.errors import ConfigError, InvalidArgumentError, NotAvailableError
from colomem.grpo.dataset_task import DatasetTask, template_characters

from . import checkpoints, evaluation, heap_profile
from .checkpoints import Checkpointer
from .final_model import save_final_model
from .loop import ColocatedRunner, RunResult
from .reporters import make_reporters
from .reporters import resolve as resolve_reporters
from .ranks import Ranks
from .status import StatusFile
from .timeline import MetricsWriter


def default_out_dir() -> Path:
    return Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


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

    fns = list(reward_fns) if reward_fns is not None else list(cfg.rewards or task.rewards)
    weights = cfg.reward_weights if cfg.reward_weights is not None else [1.0] * len(fns)
    if len(weights) != len(fns):        # the task's own rewards (no --rewards): known only now
        raise ConfigError(f"--reward-weights gives {len(weights)} weights for {len(fns)} reward functions "
                          f"({', '.join(map(_reward_label, fns))}): one each, in order")
    specs = [s if isinstance(s, RewardSpec) else RewardSpec(resolve(s), weight=w) for s, w in zip(fns, weights)]
    metrics = [(name, RewardSpec(resolve(fn), name=name)) for name, fn in task.metrics.items()]
    return specs, metrics


def _reward_label(fn) -> str:
    from colomem.grpo.rewards import RewardSpec, fn_name

    return fn.label if isinstance(fn, RewardSpec) else fn if isinstance(fn, str) else fn_name(fn)


def _grad_accum(cfg, world: int) -> int:
    rows = cfg.rows_per_rank(world)
    micro = min(cfg.micro_batch, rows)
    need = math.ceil(rows / micro)
    if cfg.grad_accum is not None and cfg.grad_accum * cfg.micro_batch < rows:
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

    from .backends import Engines, build_engines, close_engines, resolve_backend

    t_start = time.time()
    ranks = Ranks.from_env(tp=cfg.tensor_parallel_size if cfg.tensor_parallel_size > 1 else 1,
                           barrier_timeout_s=cfg.barrier_timeout_s,
                           backend="gloo" if cfg.backend == "cpu" else _dist_backend())
    say = print_fn if ranks.is_main else (lambda *_: None)
    # rank 0's default folder on every rank: ranks started a second apart would name two (a checkpoint's
    # rank files and its state.json must land in one)
    out = Path(out_dir or cfg.out or ranks.exchange(str(default_out_dir()))[0])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"output directory {str(out)!r} is a file (or lies below one); choose another --out") \
            from None
    except OSError as e:
        raise ConfigError(f"cannot create the output directory {str(out)!r}: {e.strerror}; choose another --out") \
            from None
    writer = rank_writer = None
    heap: Optional[heap_profile.HeapProfile] = None
    status: Optional[StatusFile] = None
    reporters: list = []
    engines: Optional[Engines] = None
    runner: Optional[ColocatedRunner] = None
    summary: dict[str, Any] = {"status": "error", "out_dir": str(out)}
    error: Optional[BaseException] = None
    try:
        try:                                          # a bad value is refused before anything is built
            every = heap_profile.every_from_env()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        backend, why = resolve_backend(cfg.backend)
        say(f"[colomem] {why}")
        steps = cfg.steps_for(backend)
        if steps != cfg.steps:
            say(f"[colomem] CPU run: {steps} steps instead of {cfg.steps} (cpu_steps; pass --steps N to choose)")
        task = _task(cfg)
        eval_plan = evaluation.plan(cfg, task)      # the eval dataset read and checked here too
        ranks.check_split(cfg.prompts_per_step)
        grad_accum = _grad_accum(cfg, ranks.world_size)
        ident = checkpoints.identity(cfg, backend, ranks.world_size)
        start, resume_from, resumed = _resume_point(cfg, ident, out, steps)
        if backend == "cpu":         # before a GPU-sized model is built or loaded into host memory
            _check_cpu_fits(cfg)
        t_inputs = time.perf_counter()
        model_path = _model_path(cfg, _alphabet(cfg, task, eval_plan), ranks, say)
        tokenizer, reward_specs, metric_specs = _bind(cfg, task, model_path, reward_fns, say)
        inputs_s = time.perf_counter() - t_inputs
        config_json = cfg.model_dump(mode="json")
        summary.update(backend=backend, switch=cfg.switch, world_size=ranks.world_size, model=model_path,
                       task=_task_label(cfg), steps=steps, config=config_json)
        if ranks.is_main:
            writer = MetricsWriter(out / "metrics.jsonl")
            writer.write({"event": "start", "time": t_start, "backend": backend, "steps": steps,
                          "world_size": ranks.world_size, "config": config_json})
            reporters = make_reporters(resolve_reporters(cfg.report_to), out, config_json)
            status = StatusFile(out / "status.json", steps)
        if ranks.world_size > 1:
            rank_writer = MetricsWriter(out / "ranks" / f"rank{ranks.rank}.jsonl")
        evaluator = evaluation.make_evaluator(
            eval_plan, cfg, tokenizer=tokenizer, ranks=ranks, reward_specs=reward_specs, metric_specs=metric_specs,
            max_new_tokens=cfg.grpo.max_new_tokens or task.max_new_tokens, writer=writer, reporters=reporters,
            say=say, out=out, start=start)
        say(f"[colomem] model {model_path}; task {_task_label(cfg)}; {steps} steps x {cfg.prompts_per_step} prompts x "
            f"{cfg.grpo.group_size} completions; switch={cfg.switch}; out {out}")
        schedule = cfg.lr_schedule(backend)
        if not schedule.is_constant:
            say(f"[colomem] {schedule.describe(cfg.lr)}")
        factory = engines_factory or (lambda c, b, m, t, r, g: build_engines(c, b, m, t, r, grad_accum=g))
        t_build = time.perf_counter()
        engines = factory(cfg, backend, model_path, tokenizer, ranks, grad_accum)
        summary["build_s"] = time.perf_counter() - t_build
        # where the wait before the first step went: the model (built or found in the cache) and tokenizer,
        # then each engine (a custom factory may not say)
        summary["startup_s"] = {"inputs": inputs_s, **getattr(engines, "build_parts_s", {})}
        device = ranks.local_rank if backend == "gpu" else None
        rollout, trainer = engines.require()
        checkpointer = None
        if (cfg.save_every or resume_from is not None) and not isinstance(trainer, Checkpointable):
            raise NotAvailableError(f"checkpoints: the {type(trainer).__name__} cannot save or load its state")
        if resume_from is not None and isinstance(trainer, Checkpointable):
            trainer.load_state(resume_from)
            say(f"[colomem] resumed from {resume_from} (step {start})")
        if isinstance(trainer, Checkpointable):     # every rank writes its part; also saves on a signal
            checkpointer = Checkpointer(out / "checkpoints", trainer, tokenizer, ident, cfg.save_every,
                                        cfg.keep_checkpoints, steps, ranks=ranks,
                                        merged=cfg.save_merged, log=say, background=cfg.save_background,
                                        timeout_s=cfg.phase_timeout_s)
        runner = ColocatedRunner(cfg, rollout=rollout, trainer=trainer, pool=engines.pool,
                                 task=task, tokenizer=tokenizer, ranks=ranks, reward_specs=reward_specs,
                                 metric_specs=metric_specs, writer=writer, rank_writer=rank_writer, device=device,
                                 reporters=reporters,
                                 grad_accum=grad_accum, print_fn=print_fn, shared=engines.shared)
        runner.version = resumed
        runner.evaluator = evaluator
        runner.status = status
        if every:
            name = "heap_profile.jsonl" if ranks.world_size == 1 else f"heap_profile.rank{ranks.rank}.jsonl"
            heap = runner.heap = heap_profile.HeapProfile(out / name, every)
            say(f"[colomem] tracing the Python heap every {every} steps into {out / name} (slower steps)")
        with _stop_on_signals(runner, say):
            runner.run(steps, progress=cfg.progress, start=start, checkpointer=checkpointer)
        if cfg.save_final and runner.stop_requested is None and isinstance(trainer, Checkpointable):
            last = runner.final_checkpoint.get("step") == steps       # it holds the model: linked, not written
            final = save_final_model(out, trainer, tokenizer, ranks, merged=cfg.save_merged, say=say,
                                     checkpoint=out / "checkpoints" / f"{checkpoints.PREFIX}{steps}" if last else None)
            if final is not None:
                summary["final_model"] = str(final)
        if engines.shared is not None:         # every byte of the shared base, once, as it was when shared
            summary["shared_base"] = {**engines.shared.summary(), "full_check_s": engines.shared.check_full()}
        summary["status"] = "ok" if runner.stop_requested is None else "interrupted"
        if runner.stop_requested is not None:
            summary["error"] = f"interrupted ({runner.stop_requested}) after step {start + runner.history.count}" + (
                f": {runner.stop_failure}" if runner.stop_failure else "")
    except BaseException as e:  # recorded, then raised again after cleanup
        # a peer that died inside a collective of the trainer: say so, naming this rank and the phase
        e = ranks.peer_failure(e, getattr(getattr(runner, "machine", None), "failed", None)) or e
        error = e
        if isinstance(e, KeyboardInterrupt):
            summary["status"] = "interrupted"     # Ctrl-C: the user stopped it, nothing failed
            summary["error"] = "interrupted (KeyboardInterrupt)"
        else:
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
        if status is not None:
            status.finish(summary["status"], summary.get("error"))
        if heap is not None:
            heap.close()
        for r in reporters:
            try:
                r.close()
            except Exception as e:  # noqa: BLE001 - a reporter must not hide the run's own outcome
                summary.setdefault("cleanup_errors", []).append(f"closing a metrics reporter failed: {e}")
        if ranks.is_main:
            _finish_outputs(cfg, out, runner, summary, say)
        ranks.close(timeout_s=5.0 if error is not None else 60.0)
    if error is not None:
        raise error
    mine = writer if ranks.is_main else rank_writer     # this rank's step lines
    if mine is None:
        return RunResult(out, summary)
    return RunResult(out, summary, Path(mine.path), mine.start)


@dataclass
class JobInputs:
    """What a run of a config trains on, built as run_job builds it: the task, the model directory, its
    tokenizer, the reward functions (summed into the reward) and the metric functions (logged only)."""
    task: Any
    model_path: str
    tokenizer: Any
    reward_specs: list
    metric_specs: list
    max_new_tokens: int


def job_inputs(cfg, *, say: Callable[[str], None] = print) -> JobInputs:
    """The inputs of a single-process run of `cfg`, without engines: another trainer (a peer baseline) run
    on them trains on the same model (the same cached directory of a config-built one), tokenizer, prompts
    and rewards as the runner."""
    task = _task(cfg)
    model_path = cfg.model
    if not model_path:
        from colomem.grpo.tiny_model import model_dir

        model_path = str(model_dir(cfg.model_shape, _alphabet(cfg, task, evaluation.plan(cfg, task)),
                                   seed=cfg.seed, dtype=cfg.dtype, log=say))
    tokenizer, reward_specs, metric_specs = _bind(cfg, task, model_path, None, say)
    return JobInputs(task, model_path, tokenizer, reward_specs, metric_specs,
                     cfg.grpo.max_new_tokens or task.max_new_tokens)


def _alphabet(cfg, task, eval_plan) -> str:
    """The config-built tokenizer's characters: the task's, those only the eval set holds, the chat
    template's (part of the model's cache key: the same config finds the same model)."""
    alphabet = eval_plan.alphabet(task.alphabet) if eval_plan else task.alphabet
    if not cfg.model:
        alphabet += template_characters(cfg.chat_template)
    return alphabet


def _bind(cfg, task, model_path: str, reward_fns, say):
    """(tokenizer, reward specs, metric specs) of the run; a dataset task is bound to the tokenizer, and the
    prompts' lengths are checked against max_model_len."""
    tokenizer = _tokenizer(model_path, cfg.trust_remote_code)
    if isinstance(task, DatasetTask):
        task.bind(tokenizer, chat_template=cfg.chat_template,
                  max_prompt_tokens=cfg.max_model_len - task.max_new_tokens, log=say)
    reward_specs, metric_specs = _rewards(cfg, task, reward_fns)
    _check_lengths(cfg, task, tokenizer)
    return tokenizer, reward_specs, metric_specs


def _dist_backend() -> str:
    try:
        import torch
        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:
        return "gloo"


def _task(cfg):
    """The built-in task, or the user's dataset (read and checked here, before any engine starts)."""
    if cfg.dataset:
        return DatasetTask(cfg.dataset, prompt_key=cfg.prompt_key, max_new_tokens=cfg.grpo.max_new_tokens)
    from colomem.grpo.tasks import make_task

    return make_task(cfg.task, cfg.task_options)


@contextlib.contextmanager
def _stop_on_signals(runner: ColocatedRunner, say):
    """SIGINT / SIGTERM finish the step under way (and its checkpoint), then the run stops as interrupted; a
    second signal interrupts at once. Only the main thread can take signals: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[signal.Signals, Any] = {}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if runner.watchdog.fired:                   # the phase watchdog's interrupt (interrupt_main): as before
            raise KeyboardInterrupt(name)
        if runner.stop_requested is not None:       # the second one: stop now
            for sig, h in previous.items():
                signal.signal(sig, h)
            raise KeyboardInterrupt(name)
        runner.stop_requested = name
        say(f"[colomem] {name}: finishing this step, then saving and stopping (again to stop at once)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def _resume_point(cfg, ident: dict, out: Path, steps: int) -> tuple[int, Optional[Path], int]:
    """(first step, checkpoint folder or None, weight version), checked before any engine starts."""
    if not cfg.resume:
        return 0, None, 0
    path = checkpoints.find(cfg.resume, out / "checkpoints")
    state = checkpoints.load_state(path, ident)
    if int(state["step"]) >= steps:
        raise ConfigError(f"checkpoint {str(path)!r} is at step {state['step']}, and --steps is {steps}: nothing "
                          "is left to run; raise --steps")
    return int(state["step"]), path, int(state["weight_version"])


def _check_cpu_fits(cfg) -> None:
    from colomem.grpo.tiny_model import SHAPES

    from .host_memory import check_cpu_fits, model_config

    if cfg.model:
        check_cpu_fits(model_config(cfg.model), f"the model {cfg.model}")
    elif SHAPES.get(cfg.model_shape, {}).get("vocab_size"):     # tiny takes its tokenizer's small vocabulary
        check_cpu_fits(SHAPES[cfg.model_shape], f"the config-built {cfg.model_shape} model")


def _task_label(cfg) -> str:
    """What the run trains on, for logs, summary and plots: the dataset's file name or the built-in task."""
    return f"dataset {Path(cfg.dataset).name}" if cfg.dataset else cfg.task


def _model_path(cfg, alphabet: str, ranks: Ranks, say) -> str:
    if cfg.model:
        return cfg.model
    from colomem.grpo.tiny_model import model_dir

    if ranks.is_main:
        path = model_dir(cfg.model_shape, alphabet, seed=cfg.seed, dtype=cfg.dtype, log=say)
    ranks.barrier("model built")           # the others then find it in the cache
    if not ranks.is_main:
        path = model_dir(cfg.model_shape, alphabet, seed=cfg.seed, dtype=cfg.dtype, log=lambda *_: None)
        # a node that does not share rank 0's cache builds the model itself, but with torch.distributed
        # started, Hugging Face writes the weights on rank 0 only: what is left here has no config or weights
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(
                f"rank {ranks.rank}: the config-built model in {path} has no config.json or weights (the cache is "
                "not shared with rank 0's node, and only rank 0 writes a model). Put COLOMEM_CACHE on a filesystem "
                "every node shares, or build the model on each node first (the same command with --prepare-only, "
                "without torchrun), after deleting that directory")
    return str(path)


def _check_lengths(cfg, task, tokenizer) -> None:
    sample = task.samples(8, seed=cfg.seed, step=0)
    longest = max(len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"]) for s in sample)
    new = cfg.grpo.max_new_tokens or task.max_new_tokens
    if longest + new > cfg.max_model_len:
        raise ConfigError(f"invalid run config: max_model_len ({cfg.max_model_len}) is shorter than a prompt "
                          f"({longest} tokens) plus max_new_tokens ({new}); raise --max-model-len")


def _finish_outputs(cfg, out: Path, runner: Optional[ColocatedRunner], summary: dict, say) -> None:
    import json

    files = {"metrics": str(out / "metrics.jsonl"), "summary": str(out / "summary.json")}
    if runner is not None and runner.history.count:
        say("\nphase times (median over steps after the first):\n" + runner.history.phase_table())
        say("\nmemory after each phase (median over steps):\n" + runner.history.memory_table())
        if cfg.plots:
            try:
                from .plots import plot_rewards, plot_timeline
                recs = list(runner.history.plot_rows())
                title = f"{cfg.model_shape if not cfg.model else Path(cfg.model).name}, switch={cfg.switch}"
                if plot_timeline(recs, out / "timeline.png", title=f"phase timeline ({title})"):
                    files["timeline_png"] = str(out / "timeline.png")
                if plot_rewards(recs, out / "rewards.png", title=f"reward ({_task_label(cfg)}, {title})"):
                    files["rewards_png"] = str(out / "rewards.png")
            except Exception as e:  # noqa: BLE001  (plots are not worth losing the summary for)
                summary["plot_error"] = f"{type(e).__name__}: {e}"
    if (out / "tensorboard").is_dir():
        files["tensorboard"] = str(out / "tensorboard")
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
