#!/usr/bin/env python3
"""Where a GRPO step's training phase spends its time, and what a larger micro-batch or no recompute buys.

    python3 benchmarks/diag_train.py --config configs/grpo_1p5b_full.yaml --out DIR
    python3 benchmarks/diag_train.py --config configs/grpo_7b_lora.yaml --out DIR --variants mb4,mb8,mb4-nogc
    python3 benchmarks/diag_train.py --out DIR --rows 8 --completion-len 8 --rounds 2   # the harness on a CPU

The trainer is the one the runner builds for the run config (DeepSpeed on a GPU, the torch trainer on a CPU;
every runner flag works here and means the same), without a rollout engine: each step trains on a synthetic
batch of the job's shape (prompts_per_step x group_size rows, the task's prompt length, completions of
max_new_tokens, random token ids). One trainer, its variants interleaved round by round (A B C, A B C, ...):

  mb<N>        micro-batches of N rows (the config's gradient checkpointing)
  mb<N>-nogc   the same with gradient checkpointing off (no recompute of the forward in the backward)
  mb<N>-gc<K>  checkpointing every K-th decoder layer only (the others keep their activations)

Per variant: the train step's seconds (median and spread over the rounds, a warm-up step apart), the
allocator's peak, the executed matmul FLOPs and their rate against a bf16 GEMM measured in the same run
(`gemm_tflops`, the ceiling), and beside each variant's extra peak over checkpointing every layer the extra
the planner's probe predicts for it (`extra_peak_measured` / `extra_peak_predicted`). With --profile, one
profiled step of the config's variant and of the fastest: device time by kernel category (GEMM, attention,
elementwise, the optimizer, copies, communication) and the device's busy share of the step (well below 1:
the host cannot keep the device fed). With --cprofile, one step of the config's variant under cProfile (its
backward on the calling thread): where the host's time goes. A variant that runs out of memory is reported
as such and left out of the later rounds.

Writes DIR/diag_train.json and DIR/diag_train.md.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))   # a fallback: an installed colomem or PYTHONPATH's comes first

from colomem.engines.recompute import checkpointed_layers, disable_recompute, enable_recompute  # noqa: E402
from colomem.errors import ConfigError, is_oom  # noqa: E402
from colomem.runner.config import build_arg_parser, script_config  # noqa: E402
from colomem.runner.recompute_plan import probe as recompute_probe  # noqa: E402

# Kernel categories, by the first pattern a kernel's name contains (lower case), in this order.
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax_warp")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "cublas", "sm90_", "sm80_")),
    ("optimizer", ("adam", "multi_tensor", "multitensor")),
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy")),
    ("reduction", ("reduce", "logsumexp", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "index", "gather", "scatter")),
)


def say(msg: str) -> None:
    print(f"[diag_train] {msg}", flush=True)


def build_parser():
    p = build_arg_parser("The training phase of a run config's job, variant by variant")
    g = p.add_argument_group("training diagnosis")
    g.add_argument("--variants", default=None,
                   help="comma list of mb<N>, mb<N>-nogc, mb<N>-gc<K> (default: the config's micro-batch, 2x "
                        "and 4x it, each with the config's checkpointing and without)")
    g.add_argument("--rounds", type=int, default=3, help="timed steps of each variant, interleaved")
    g.add_argument("--rows", type=int, default=None, help="rows a step (default prompts_per_step x group_size)")
    g.add_argument("--completion-len", type=int, default=None, help="completion tokens (default max_new_tokens)")
    g.add_argument("--cprofile", action="store_true",
                   help="one step of the config's variant under cProfile (where the host's time goes)")
    g.add_argument("--profile", action="store_true",
                   help="one profiled step of the config's variant and of the fastest one")
    return p


RMB = "-rmb"


def parse_variants(text: Optional[str], micro_batch: int, rows: int,
                   checkpointing: bool) -> list[tuple[str, int, int]]:
    """[(name, micro_batch, every)]: every = 0 no recompute, K recompute every K-th decoder layer (1: all of
    them). A name may end in -rmb: that variant reduces ZeRO-2's gradients after every micro-batch
    (grad_reduction per_micro_batch; reduction_per_step). ConfigError on a bad name or a micro-batch that is
    not in [1, rows]."""
    if not text:
        sizes = [m for m in (micro_batch, 2 * micro_batch, 4 * micro_batch) if m <= rows] or [rows]
        text = ",".join([f"mb{m}" for m in sizes] + ([f"mb{m}-nogc" for m in sizes] if checkpointing else []))
    out = []
    for name in (v.strip() for v in text.split(",") if v.strip()):
        body, _, tail = name.removesuffix(RMB).partition("-")
        gc_every = tail[2:] if tail.startswith("gc") else ""
        if not body.startswith("mb") or not body[2:].isdigit() or not (
                tail in ("", "nogc") or (gc_every.isdigit() and int(gc_every) >= 1)):
            raise ConfigError(f"--variants: {name!r} is not mb<N>, mb<N>-nogc or mb<N>-gc<K> (each may end in "
                              f"{RMB})")
        n = int(body[2:])
        if not 1 <= n <= rows:
            raise ConfigError(f"--variants: {name!r} asks for micro-batches of {n} rows; a step has {rows}")
        every = 0 if tail == "nogc" else int(gc_every) if gc_every else int(checkpointing)
        out.append((name, n, every))
    if len({name for name, _, _ in out}) != len(out):
        raise ConfigError("--variants: a variant is named twice")
    return out


def reduction_per_step(name: str, default: bool) -> bool:
    """Whether variant `name` reduces a step's gradients once (the trainer's own choice unless it ends in
    -rmb: after every micro-batch)."""
    return False if name.endswith(RMB) else default


def synthetic_batch(rows: int, prompt_len: int, completion_len: int, vocab: int, seed: int):
    """A GRPO batch of the job's shape: random ids, every completion token counted, old logprobs near a
    uniform policy's (the loss depends on the weights), group-normalised-looking advantages."""
    from colomem.grpo.batch import GRPOBatch

    g = torch.Generator().manual_seed(seed)
    width = prompt_len + completion_len
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    comp = (torch.arange(width)[None, :] >= prompt_len).float().expand(rows, width).contiguous()
    old = torch.full((rows, width), -float(torch.log(torch.tensor(float(vocab))))) * comp
    adv = torch.randn(rows, generator=g)
    return GRPOBatch(input_ids=ids, attention_mask=attn, completion_mask=comp, advantages=adv, old_logprobs=old)


def prompt_tokens(inputs, seed: int, n: int) -> int:
    """The longest of the task's first step's prompts, in tokens (the runner pads a batch to it)."""
    samples = inputs.task.samples(n, seed=seed, step=0)
    return max(1, max(len(inputs.tokenizer(s.prompt)["input_ids"]) for s in samples))


def matmul_params(model) -> int:
    """Weights every token multiplies by: all Linear layers (LoRA's adapters included, the tied lm_head once)."""
    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n += m.weight.numel()
    return n


def step_flops(params: int, layer_params: int, trainable_share: float, tokens: int, every: int) -> float:
    """Matmul FLOPs of one step: the forward (2 per weight and token), the backward's gradients of the
    activations (2) and of the trainable weights (2 x their share), and the recompute of the checkpointed
    decoder layers' forward (every K-th layer: 1/K of `layer_params`)."""
    recompute = 2 * layer_params / every if every else 0.0
    return ((2 + 2 + 2 * trainable_share) * params + recompute) * tokens


def gemm_tflops(device: torch.device) -> float:
    """The device's bf16 GEMM rate now (8192^3, best of 5): the ceiling the training's rate is read against."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * 8192 ** 3 / best / 1e12


def category(name: str) -> str:
    low = name.lower()
    for cat, pats in CATEGORIES:
        if any(p in low for p in pats):
            return cat
    return "other"


def profile_summary(events: Any, wall_s: float, top: int = 25) -> dict:
    """Device time by category and the top kernels of one profiled step (key_averages of torch.profiler)."""
    kernels = []
    for e in events:
        t = float(getattr(e, "self_device_time_total", 0.0) or 0.0)  # microseconds
        if t > 0 and getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            kernels.append((e.key, t, int(e.count)))
    by_cat: dict[str, float] = {}
    for name, t, _ in kernels:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + t / 1e6
    busy = sum(by_cat.values())
    kernels.sort(key=lambda k: -k[1])
    return {"device_s": busy, "wall_s": wall_s, "busy_share": busy / wall_s if wall_s > 0 else 0.0,
            "by_category_s": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:160], "s": t / 1e6, "calls": c, "category": category(n)}
                            for n, t, c in kernels[:top]]}


def set_recompute(model, every: int) -> None:
    """No recompute (0), or checkpointing of every `every`-th decoder layer, as the trainers set it."""
    if every:
        enable_recompute(model, every)
    else:
        disable_recompute(model)


def trainer_module(trainer):
    """The Hugging Face model the trainer runs (the DeepSpeed engine's module, or the torch trainer's)."""
    engine = getattr(trainer, "engine", None)
    return engine.module if engine is not None else trainer.model


def build_trainer(cfg, model_path: str, rows: int):
    """The trainer the runner would build for cfg, without a pool (nothing moves here). The micro-batch loop
    is colomem's own (it marks DeepSpeed's accumulation boundary), so a variant may change the micro-batch."""
    if torch.cuda.is_available():
        from colomem.engines.deepspeed import DeepSpeedTrainer

        grad_accum = -(-rows // min(cfg.micro_batch, rows))
        return DeepSpeedTrainer(model_path, config=cfg.deepspeed_config(grad_accum), lora=cfg.lora, pool=None,
                                grpo=cfg.grpo)
    from colomem.engines.stand_ins import TorchTrainer

    return TorchTrainer(model_path, lr=cfg.lr, micro_batch=cfg.micro_batch, grpo=cfg.grpo, lora=cfg.lora,
                        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, seed=cfg.seed,
                        gradient_checkpointing=cfg.gradient_checkpointing)


def timed_step(trainer, batch, device: torch.device) -> tuple[float, int, dict]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    metrics = trainer.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return seconds, peak, metrics


def run(cfg, args, say=say, save=lambda result: None) -> dict:
    """save(result): called with what is measured so far, after the rounds and after each profile."""
    from colomem.runner.job import job_inputs

    inputs = job_inputs(cfg, say=say)
    rows = args.rows or cfg.prompts_per_step * cfg.grpo.group_size
    completion = args.completion_len or inputs.max_new_tokens
    prompt_len = prompt_tokens(inputs, cfg.seed, rows)
    variants = parse_variants(args.variants, cfg.micro_batch, rows, cfg.gradient_checkpointing)
    trainer = build_trainer(cfg, inputs.model_path, rows)
    device = trainer.device
    model = trainer_module(trainer)
    vocab = int(model.config.vocab_size)
    params = matmul_params(model)
    head = model.get_output_embeddings()
    layer_params = params - (head.weight.numel() if head is not None else 0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    share = min(1.0, trainable / params) if params else 1.0
    ceiling = gemm_tflops(device)
    # the planner's measure of what a layer that is not checkpointed keeps (recompute_plan.py), checked below
    # against the peaks each variant reached
    pr = recompute_probe(trainer, prompt_len + completion) if cfg.gradient_checkpointing else None
    out: dict[str, Any] = {"config": {"model_shape": cfg.model_shape, "lora": cfg.lora is not None,
                                      "zero_stage": cfg.zero_stage, "micro_batch": cfg.micro_batch,
                                      "gradient_checkpointing": cfg.gradient_checkpointing},
                           "backend": type(trainer).__name__, "rows": rows, "prompt_len": prompt_len,
                           "completion_len": completion, "matmul_params": params, "layer_params": layer_params,
                           "trainable_params": trainable, "gemm_tflops": ceiling,
                           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "recompute_probe": pr.to_dict() if pr is not None else None, "variants": {}}
    tokens = rows * (prompt_len + completion)
    res: dict[str, dict] = {name: {"micro_batch": mb, "recompute_every": every, "checkpointed_layers": None,
                                   "step_s": [], "peak_allocated": 0, "micro_batches": None, "oom": None}
                            for name, mb, every in variants}
    alive = list(variants)
    per_step = getattr(trainer, "reduce_per_step", None)      # DeepSpeed's gradient reduction, as configured
    try:
        for rnd in range(args.rounds + 1):               # round 0: each variant's warm-up step
            # each round starts one variant later: none always runs right after the same other one
            k = rnd % len(alive) if alive else 0
            for name, mb, every in alive[k:] + alive[:k]:
                r = res[name]
                trainer.micro_batch = mb
                if per_step is not None:
                    trainer.reduce_per_step = r["reduce_per_step"] = reduction_per_step(name, per_step)
                set_recompute(model, every)
                r["checkpointed_layers"] = checkpointed_layers(model)
                batch = synthetic_batch(rows, prompt_len, completion, vocab, seed=1000 * rnd + mb)
                try:
                    seconds, peak, metrics = timed_step(trainer, batch, device)
                except Exception as e:  # noqa: BLE001  (an out-of-memory variant is a result, not a failure)
                    if not is_oom(e):
                        raise
                    r["oom"] = f"{type(e).__name__}: {str(e)[:300]}"
                    alive.remove((name, mb, every))
                    trainer, model = after_oom(trainer, cfg, inputs.model_path, rows, device)
                    say(f"{name}: out of memory, left out of the later rounds")
                    continue
                r["peak_allocated"] = max(r["peak_allocated"], peak)
                r["micro_batches"] = int(metrics.get("micro_batches", 0))
                if rnd > 0:
                    r["step_s"].append(seconds)
                say(f"round {rnd} {name}: {seconds:.3f} s, peak {peak / 2**30:.1f} GiB")
        # what the rounds measured is written before any profiling: a profile cut by the stage's bound loses
        # only itself
        summarize(out, res, pr, cfg, params, layer_params, share, tokens, ceiling)
        save(out)
        if args.cprofile:
            name, mb, every = next((v for v in alive if v[0] == f"mb{cfg.micro_batch}"), alive[0])
            trainer.micro_batch = mb
            set_recompute(model, every)
            text = cprofiled_step(trainer, synthetic_batch(rows, prompt_len, completion, vocab, seed=5 + mb), device)
            res[name]["cprofile_top"] = text
            save(out)
        if args.profile:
            for name, mb, every in profiled(alive, res, f"mb{cfg.micro_batch}"):
                trainer.micro_batch = mb
                set_recompute(model, every)
                res[name]["profile"] = profiled_step(trainer, synthetic_batch(rows, prompt_len, completion, vocab,
                                                                              seed=7 + mb), device)
                save(out)
    finally:
        trainer.close()
    return out


def summarize(out: dict, res: dict, pr, cfg, params: int, layer_params: int, share: float, tokens: int,
              ceiling) -> None:
    """Each variant's medians, FLOP rate and peaks against the probe's prediction, into out["variants"]."""
    for name, r in res.items():
        if r["step_s"]:
            med = statistics.median(r["step_s"])
            flops = step_flops(params, layer_params, share, tokens, r["recompute_every"])
            r.update(step_s_median=med, step_s_min=min(r["step_s"]), step_s_max=max(r["step_s"]),
                     flops=flops, tflops=flops / med / 1e12,
                     of_gemm_ceiling=(flops / med / 1e12) / ceiling if ceiling else None)
        out["variants"][name] = r
    if pr is not None:
        for r in res.values():
            same = next((o for o in res.values() if o["micro_batch"] == r["micro_batch"]
                         and o["recompute_every"] == 1 and o["peak_allocated"]), None)
            if same is not None and r["peak_allocated"] and r["checkpointed_layers"] is not None:
                r["extra_peak_measured"] = r["peak_allocated"] - same["peak_allocated"]
                r["extra_peak_predicted"] = ((same["checkpointed_layers"] - r["checkpointed_layers"])
                                             * pr.per_layer_row * r["micro_batch"])
    base = res.get(f"mb{cfg.micro_batch}")
    if base is not None and base.get("step_s_median"):
        for r in res.values():
            if r.get("step_s_median"):
                r["speedup_vs_config"] = base["step_s_median"] / r["step_s_median"]


def profiled(alive: list, res: dict, config_name: str) -> list:
    """The variants worth a profiled step: the config's own and the fastest (by median step)."""
    timed = [v for v in alive if res[v[0]]["step_s"]]
    fastest = min(timed, key=lambda v: statistics.median(res[v[0]]["step_s"]), default=None)
    return [v for v in alive if v[0] == config_name or v is fastest]


def after_oom(trainer, cfg, model_path: str, rows: int, device: torch.device):
    """(trainer, model) to go on with after a step ran out of memory. A DeepSpeed engine that failed inside its
    backward holds half-filled gradient buckets and reduction flags no public call resets, so the next step
    would fail or train on a mix: it is closed and built again (the weights do not matter here). The CPU
    trainer only drops the gradients the failed step left."""
    if device.type == "cuda":
        trainer.close()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
        trainer = build_trainer(cfg, model_path, rows)
        return trainer, trainer_module(trainer)
    model = trainer_module(trainer)
    for p in model.parameters():
        p.grad = None
    return trainer, model


def profiled_step(trainer, batch, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    # the device's kernels only on a GPU: recording every host op of a DeepSpeed step slows it several-fold
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        seconds, _, _ = timed_step(trainer, batch, device)
    return profile_summary(prof.key_averages(), seconds)


def cprofiled_step(trainer, batch, device: torch.device, top: int = 45) -> str:
    """One step under cProfile: the host functions by their own time and by their total. A GPU-bound step
    spends its host time waiting (a synchronize, a tensor's item); a host-bound one in Python and launches."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    # the backward on this thread (autograd runs a GPU's backward on a thread of its own otherwise, which
    # cProfile does not see): the gradient hooks' Python shows up under their own names
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        seconds, _, _ = timed_step(trainer, batch, device)
        prof.disable()
    buf = io.StringIO()
    buf.write(f"one step under cProfile: {seconds:.3f} s\n")
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def table(result: dict) -> str:
    lines = ["| variant | step s (min-max) | peak GiB | TFLOP/s | of GEMM | vs config | busy | top category |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for name, r in result["variants"].items():
        if r.get("oom"):
            lines.append(f"| {name} | out of memory | | | | | | |")
            continue
        if not r.get("step_s"):
            continue
        prof = r.get("profile") or {}
        top = next(iter((prof.get("by_category_s") or {}).items()), None)
        lines.append(f"| {name} | {r['step_s_median']:.3f} ({r['step_s_min']:.3f}-{r['step_s_max']:.3f}) | "
                     f"{r['peak_allocated'] / 2**30:.1f} | {r['tflops']:.1f} | {num(r.get('of_gemm_ceiling'), '.2f')} | "
                     f"{num(r.get('speedup_vs_config'), '.2f')} | {num(prof.get('busy_share'), '.2f')} | "
                     f"{f'{top[0]} {top[1]:.2f} s' if top else '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ns, cfg, out = script_config(build_parser(), argv, "runs/diag_train")

    def save(result: dict) -> None:
        (out / "diag_train.json").write_text(json.dumps(result, indent=1))
        (out / "diag_train.md").write_text(table(result))
        for name, r in result["variants"].items():
            if r.get("cprofile_top"):
                (out / f"cprofile_{name}.txt").write_text(r["cprofile_top"])

    result = run(cfg, ns, save=save)      # written by save() as each part was measured
    print(table(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
