"""Held-out evaluation: greedy completions of fixed prompts through the run's own rollout engine, scored with
the run's rewards.

When. The weights are evaluated at versions 0 (the initial weights: the baseline the run improves on), every
`eval_every` training steps, and after the last step. An evaluation is logged at `step` = its weights
version = the training steps done, so in TensorBoard `eval/*` at step k sits next to the training reward of
step k, whose rollout sampled with the same weights. With `--eval-dataset` and no `--eval-every`: the initial
and the final weights only.

Where. The rollout engine holds weights version k only in the awake window of step k (0-based), so the
evaluation after k steps is that step's `eval` phase, between `rollout` and `sleep`: no switch of its own.
The evaluation after the last step gets a short window after the run (offload -> barrier_wake ->
wake_weights -> sync -> check -> wake_kv -> eval -> sleep -> barrier_train -> reload), so the final weights are
the ones evaluated; it comes after the final checkpoint, so an evaluation that fails never costs the last
checkpoint. Neither is switch or training time: the step's time leaves its eval phase out, and the
final window is no step (its phase times are in its metrics line, under `cycle_s`).

What. The first `--eval-prompts` rows of `--eval-dataset` in file order, read exactly like `--dataset` (the
same prompt key, chat template and length filter); without one, a fixed sample of the built-in task drawn
from a seed stream of its own (never the training prompts' stream). The same prompts every time, one greedy
completion each (temperature 0: two evaluations of the same weights give the same completions), at most the
run's max_new_tokens long.

Metrics (metrics.jsonl line {"event": "eval", "step": k, ...}, the reporters, summary.json's `eval_first` and
`eval_last`): eval/reward_mean (the run's rewards, summed as in training, over the completions they could
score), eval/accuracy (the task's accuracy metric; otherwise, when every reward lies in [0, 1], the fraction
of completions that scored 1), eval/<metric> (the task's other metrics), eval/reward/<fn> (each reward
function, when there are several), eval/completion_len, eval/truncated_frac, eval/unscorable_frac, eval/n,
eval/seconds.

Several ranks. Each rank's rollout engine generates its share of the prompts (Ranks.generate_groups, a prompt
being a group of one), each rank scores the ones it would train on (train_groups: a partition), and the sums
are reduced over the ranks like the training statistics: every rank gets the same numbers, rank 0 writes
them. Every rank must agree on when an evaluation is due (it is collective), so what decides it is the same
on every rank.

Resume. A resumed run does not evaluate its first step's weights again when the output's metrics.jsonl
already holds that evaluation (the run that saved the checkpoint evaluated them after its last step).
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from colomem.errors import ColomemError, StaleWeightsError
from colomem.grpo.dataset_task import DatasetTask
from colomem.grpo.tasks import Sample

from .scoring import encode, run_bounded
from .timeline import StepRecord, read_jsonl

DATASET_CAP = 512          # eval rows when --eval-prompts is unset: an evaluation stays a small part of a run
TASK_PROMPTS = 64          # prompts drawn from a built-in task when --eval-prompts is unset
EPS = 1e-6                 # a reward this close to 1 counts as the maximum (float sums of weighted parts)


class EvalPlan:
    """What to evaluate on, known before any engine starts: the eval dataset (already read and checked) or
    the built-in task to draw from."""

    def __init__(self, cfg, task, dataset: Optional[DatasetTask]):
        self.cfg, self.task, self.dataset = cfg, task, dataset

    def alphabet(self, train_alphabet: str) -> str:
        """The config-built model's tokenizer alphabet: the training one, plus what only the eval set holds
        (unchanged when it holds nothing new, so adding an evaluation does not change the model)."""
        if self.dataset is None:
            return train_alphabet
        extra = sorted(set(self.dataset.alphabet) - set(train_alphabet))
        return train_alphabet + "".join(extra)

    def samples(self, tokenizer, max_new_tokens: int, log: Callable[[str], None]) -> list[Sample]:
        """The fixed eval prompts, rendered (a dataset through the tokenizer and its chat template)."""
        cfg, k = self.cfg, self.cfg.eval_prompts
        if self.dataset is None:
            rng = random.Random(f"eval:{self.task.name}:{cfg.seed}")     # not the stream training draws from
            return [self.task.sample(rng) for _ in range(k or TASK_PROMPTS)]
        ds = self.dataset
        ds.bind(tokenizer, chat_template=cfg.chat_template, max_prompt_tokens=cfg.max_model_len - max_new_tokens,
                log=log)
        if k is None and len(ds) > DATASET_CAP:
            log(f"[colomem] eval: the first {DATASET_CAP} of {len(ds)} prompts (--eval-prompts K for another "
                "count)")
            k = DATASET_CAP
        elif k is not None and k > len(ds):
            log(f"[colomem] eval: --eval-prompts {k}, but the eval dataset has {len(ds)} usable prompts; "
                "evaluating on all of them")
        return ds.head(k)


def plan(cfg, task) -> Optional[EvalPlan]:
    """The evaluation this run asks for, or None. Reads the eval dataset now, so a bad one is a ConfigError
    before any engine starts."""
    if cfg.eval_dataset is None and cfg.eval_every is None:
        return None
    dataset = None
    if cfg.eval_dataset is not None:
        dataset = DatasetTask(cfg.eval_dataset, prompt_key=cfg.prompt_key, max_new_tokens=cfg.grpo.max_new_tokens,
                              label="eval dataset")
    return EvalPlan(cfg, task, dataset)


def evaluated_before(metrics_path: Path, step: int) -> bool:
    """Whether metrics.jsonl already holds an evaluation at `step` (what a resumed run must not repeat)."""
    if not metrics_path.is_file():
        return False
    return any(r.get("event") == "eval" and r.get("step") == step for r in read_jsonl(metrics_path))


class Evaluator:
    """Runs the evaluations of one run on every rank (they are collective); rank 0's writer and reporters
    log them."""

    def __init__(self, cfg, samples: Sequence[Sample], *, tokenizer, ranks, reward_specs, metric_specs,
                 max_new_tokens: int, writer=None, reporters: Sequence[Any] = (),
                 say: Callable[[str], None] = print, done: Sequence[int] = (),
                 completions_dir: Optional[Path] = None):
        if not samples:
            raise ValueError("an evaluation needs prompts")
        self.cfg, self.samples, self.tokenizer, self.ranks = cfg, list(samples), tokenizer, ranks
        self.reward_specs, self.metric_specs = list(reward_specs), list(metric_specs)
        self.max_new_tokens = max_new_tokens
        self.writer, self.reporters, self.say = writer, list(reporters), say
        self.every: Optional[int] = cfg.eval_every
        self.completions_dir = completions_dir     # every completion of every evaluation, one file each
        self.done = set(done)                      # weights versions evaluated already
        self.prompt_ids = [encode(tokenizer, s.prompt) for s in self.samples]
        # rows per generate call: what a training rollout already generates at once, so memory stays as in
        # training (the CPU stand-in keeps every step's logits; vLLM batches by itself anyway)
        self.chunk = max(1, cfg.prompts_per_step * cfg.grpo.group_size)
        self.results: list[dict] = []              # this run's eval lines (samples left out)
        self.last_completions: list[str] = []      # this rank's decoded completions of the last evaluation

    # -- when -------------------------------------------------------------------------------------------
    def due(self, version: int) -> bool:
        """In the awake window of the step that starts at `version`: is an evaluation of it due?"""
        if version in self.done:
            return False
        return version == 0 or bool(self.every and version % self.every == 0)

    # -- one evaluation ---------------------------------------------------------------------------------
    def evaluate(self, rollout, version: int, *, log: bool = True) -> dict:
        """Greedy completions of the eval prompts with the weights `rollout` holds (which must be `version`),
        scored and reduced over the ranks; returns the metrics line (written and reported when `log`)."""
        t0 = time.perf_counter()
        if rollout.weight_version != version:
            raise StaleWeightsError(f"evaluation of weights version {version}: the rollout holds version "
                                    f"{rollout.weight_version}; refusing to evaluate other weights")
        gen = self.ranks.generate_groups(len(self.samples))
        comps = self._generate(rollout, [self.prompt_ids[i] for i in gen], version)
        stats, shown = run_bounded(lambda: self._score(gen, comps, version), self.cfg.phase_timeout_s,
                                   "the evaluation's reward functions")
        stats["eval/seconds"] = time.perf_counter() - t0
        self.done.add(version)
        line = {"event": "eval", "step": version, "time": time.time(), **stats}
        if shown:
            line["samples"] = shown
        if log:
            self.log(line)
        return line

    def _generate(self, rollout, prompt_ids: list[list[int]], version: int) -> list:
        out: list = []
        for j in range(0, len(prompt_ids), self.chunk):        # a rank may have no prompt at all: no call
            groups = rollout.generate(prompt_ids[j:j + self.chunk], n=1, max_new_tokens=self.max_new_tokens,
                                      temperature=0.0, top_p=1.0, seed=(self.cfg.seed + version) % (2 ** 31),
                                      repetition_penalty=self.cfg.grpo.repetition_penalty)
            if len(groups) != len(prompt_ids[j:j + self.chunk]) or any(len(g) != 1 for g in groups):
                raise ColomemError(f"the rollout returned {len(groups)} groups for "
                                   f"{len(prompt_ids[j:j + self.chunk])} eval prompts x n=1")
            out.extend(g[0] for g in groups)
        return out

    def _score(self, gen: list[int], comps: list, version: int) -> tuple[dict, list]:
        from colomem.grpo.rewards import compute_rewards, score

        pos = {g: j for j, g in enumerate(gen)}
        mine = self.ranks.train_groups(len(self.samples))
        prompts = [self.samples[i].prompt for i in mine]
        texts = [self.tokenizer.decode(comps[pos[i]].token_ids, skip_special_tokens=True) for i in mine]
        metas = [self.samples[i].meta for i in mine]
        mine_comps = [comps[pos[i]] for i in mine]
        # the names are fixed by the configuration, not by what was scored: every rank sums the same vector
        names_p = sorted({s.label for s in self.reward_specs})
        names_e = sorted(name for name, _ in self.metric_specs)
        scored: list[Optional[float]] = []
        parts: dict[str, list[Optional[float]]] = {p: [] for p in names_p}
        extras: dict[str, list[Optional[float]]] = {e: [] for e in names_e}
        if mine:                               # a reward function is never called on an empty batch
            scored, parts = compute_rewards(self.reward_specs, prompts, texts, metas)
            extras = {name: score(spec, prompts, texts, metas) for name, spec in self.metric_specs}
        vals = [r for r in scored if r is not None]
        vec = [float(len(mine)), float(len(vals)), sum(vals), sum(r * r for r in vals),
               float(sum(len(c.token_ids) for c in mine_comps)), float(sum(1 for c in mine_comps if c.truncated)),
               float(sum(1 for r in vals if r >= 1.0 - EPS)),
               float(sum(1 for r in vals if not -EPS <= r <= 1.0 + EPS))]
        vec += [sum(v or 0.0 for v in parts.get(p, [])) for p in names_p]
        vec += [sum(v or 0.0 for v in extras[e]) for e in names_e]
        tot = self.ranks.sum(vec)
        n, n_scored = tot[0], tot[1]
        cnt, sc = max(n, 1.0), max(n_scored, 1.0)
        mean = tot[2] / sc
        stats: dict[str, Any] = {
            "eval/n": int(n), "eval/reward_mean": mean if n_scored else None,
            "eval/reward_std": math.sqrt(max(tot[3] / sc - mean * mean, 0.0)) if n_scored else None,
            "eval/completion_len": tot[4] / cnt, "eval/truncated_frac": tot[5] / cnt,
            "eval/unscorable_frac": 1.0 - n_scored / cnt}
        if len(names_p) > 1:
            for j, p in enumerate(names_p):
                stats[f"eval/reward/{p}"] = tot[8 + j] / cnt
        for j, e in enumerate(names_e):
            stats[f"eval/{e}"] = tot[8 + len(names_p) + j] / cnt
        if "eval/accuracy" not in stats and n_scored and tot[7] == 0:
            # no accuracy metric of the task: with rewards in [0, 1], the share of completions that scored 1
            stats["eval/accuracy"] = tot[6] / sc
        self.last_completions = texts
        if self.completions_dir is not None:
            self._write_completions(version, mine, prompts, texts, mine_comps, scored, metas)
        shown = []
        if self.cfg.log_samples and self.ranks.is_main:
            for j in range(min(len(texts), self.cfg.log_samples)):
                shown.append({"prompt": prompts[j], "completion": texts[j], "reward": scored[j],
                              "answer": metas[j].get("answer")})
        return stats, shown

    def _write_completions(self, version: int, mine, prompts, texts, comps, scored, metas) -> None:
        """<out>/evals/step-<k>.jsonl (step-<k>.rank<R>.jsonl with several ranks): each eval prompt this
        rank scored, its greedy completion (text and token ids) and reward, to read or compare later."""
        import json

        assert self.completions_dir is not None
        self.completions_dir.mkdir(parents=True, exist_ok=True)
        tail = f".rank{self.ranks.rank}" if self.ranks.world_size > 1 else ""
        path = self.completions_dir / f"step-{version}{tail}.jsonl"
        with open(path, "w") as f:
            for j, i in enumerate(mine):
                row = {"index": i, "prompt": prompts[j], "completion": texts[j],
                       "token_ids": list(comps[j].token_ids), "reward": scored[j] if scored else None,
                       "answer": metas[j].get("answer")}
                f.write(json.dumps(row, default=str) + "\n")

    def log(self, line: dict) -> None:
        self.results.append({k: v for k, v in line.items() if k not in ("event", "samples", "time")})
        if self.writer is not None:
            self.writer.write(line)
        for r in self.reporters:
            r.log(line["step"], line)
        acc = line.get("eval/accuracy")
        rew = line.get("eval/reward_mean")
        self.say(f"[colomem] eval after step {line['step']}: reward "
                 f"{'-' if rew is None else f'{rew:.3f}'}{'' if acc is None else f'  accuracy {acc:.3f}'}  "
                 f"({line['eval/n']} prompts, {line['eval/seconds']:.2f} s)")

    # -- the window after the last step -----------------------------------------------------------------
    def after_run(self, runner) -> None:
        """The evaluation of the final weights, in an awake window of its own (the trainer offloaded and
        reloaded around it, as the placement says); the runner's phase guards, watchdog and out-of-memory rollback as in a step."""
        version = runner.version
        if version in self.done:
            return
        rec = StepRecord(step=version, rank=runner.ranks.rank)
        with runner.phase(rec, "offload"):       # a final checkpoint saved from the pool may have done it
            runner.offload_trainer()
        with runner.phase(rec, "barrier_wake"):
            runner.ranks.barrier(f"before wake, evaluation after step {version}")
        _, done = runner.awake_window(rec, version, [("eval", lambda: self.evaluate(runner.rollout, version,
                                                                                   log=False))])
        line = done["eval"]
        with runner.phase(rec, "barrier_train"):
            runner.ranks.barrier(f"before reload, evaluation after step {version}")
        with runner.phase(rec, "reload"):
            runner.reload_trainer()
        line["cycle_s"] = dict(rec.phase_s)         # a dict: the reporters take no phase/* of a non-step
        self.log(line)

    def summary(self) -> dict:
        return {"eval_first": self.results[0] if self.results else None,
                "eval_last": self.results[-1] if self.results else None}


def make_evaluator(eval_plan: Optional[EvalPlan], cfg, *, tokenizer, ranks, reward_specs, metric_specs,
                   max_new_tokens: int, writer, reporters, say, out: Path, start: int) -> Optional[Evaluator]:
    """The run's Evaluator (None without evaluation). Collective when resumed: rank 0 reads what was
    evaluated before and tells the others, so every rank decides alike."""
    if eval_plan is None:
        return None
    samples = eval_plan.samples(tokenizer, max_new_tokens, say)
    done: list[int] = []
    if start > 0:
        seen = evaluated_before(out / "metrics.jsonl", start) if ranks.is_main else False
        if ranks.exchange(seen)[0]:
            done = [start]
    return Evaluator(cfg, samples, tokenizer=tokenizer, ranks=ranks, reward_specs=reward_specs,
                     metric_specs=metric_specs, max_new_tokens=max_new_tokens, writer=writer, reporters=reporters,
                     say=say, done=done, completions_dir=out / "evals")


__all__ = ["DATASET_CAP", "TASK_PROMPTS", "EvalPlan", "Evaluator", "evaluated_before", "make_evaluator", "plan"]
