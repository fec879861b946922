#!/usr/bin/env python3
"""Why does vLLM decode slower after a sleep / wake beside a resident trainer? One engine, the conditions
interleaved (A B C D, B C D A, ...), the rollout of the 1.5B job timed under each:

  fresh        the engine as it started (after a warm-up rollout)
  sleep1       vLLM's level-1 sleep and wake (weights copied to the host and back, KV re-mapped)
  sleep2pool   level 2 with the weights restored from colomem's pinned pool (the runner's sleep)
  resident     level 1 with a trainer-sized allocation made in this process while vLLM slept and held
               through the rollout (the trainer resident beside vLLM, as in `--offload none`)
  unseeded     awake, no per-request seeds (vLLM's own generator, `--rollout-seeding engine`): what the
               sampler's draw per seeded request at every decode step costs
  nologprobs   awake, seeded, without the sampled tokens' logprobs: what returning them costs
  batched      awake, seeded, the seeded requests' noise drawn in one launch (seeded_noise="batched")

    python3 benchmarks/diag_decode.py --out OUT/diag_decode [--rounds 3] [--resident-gib 45] [--eager]
        [--conditions fresh,unseeded,nologprobs,batched,sleep1,sleep2pool,resident]

The model is Qwen2-1.5B-shaped with random weights (vLLM's dummy load): 32 prompts x 8 completions x 256 new
tokens, sampled at temperature 1 like the benchmark job, so every rollout does the same work. Writes
diag_decode.json: per condition the median rollout seconds, tokens/s and the spread, and each condition's
slowdown against `fresh` (`slowdown_<condition>`); a slowdown near 1.0 rules that cause out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.append(ROOT)    # a fallback: an installed colomem or PYTHONPATH's comes first
GiB = 1 << 30
CONDITIONS = ("fresh", "unseeded", "nologprobs", "batched", "sleep1", "sleep2pool", "resident")
AWAKE = ("fresh", "unseeded", "nologprobs", "batched")        # conditions that do not sleep before their rollout


def log(*a) -> None:
    print("[diag_decode]", *a, file=sys.stderr, flush=True)


def rollout(r, prompts: list, new_tokens: int, cond: str = "fresh") -> tuple[float, int]:
    t0 = time.perf_counter()
    out = r.generate(prompts, n=8, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0,
                     seed=None if cond == "unseeded" else 0, logprobs=cond != "nologprobs")
    seconds = time.perf_counter() - t0
    return seconds, sum(len(c.token_ids) for group in out for c in group)


def rotated(conditions: list, rnd: int) -> list:
    k = rnd % len(conditions)
    return list(conditions[k:]) + list(conditions[:k])


def run(a) -> dict:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    from transformers import Qwen2Config

    from bench_sync import SHAPES
    from colomem.engines.vllm import VLLMRollout

    d = tempfile.mkdtemp(prefix="diag-decode-")
    cfg = Qwen2Config(**SHAPES["1.5b"])
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 150000, (64,), generator=g).tolist() for _ in range(a.prompts)]
    res: dict = {"gpu": torch.cuda.get_device_name(), "enforce_eager": a.eager, "rounds": a.rounds,
                 "resident_gib": a.resident_gib, "runs": {c: [] for c in a.conditions}}
    r = VLLMRollout(d, gpu_memory_utilization=a.gpu_util, max_model_len=512, seed=0, enforce_eager=a.eager,
                    sleep_level=1, llm_kwargs=dict(load_format="dummy", skip_tokenizer_init=True))
    try:
        rollout(r, prompts, a.new_tokens)                      # warm-up: compile, graphs, allocator
        for rnd in range(a.rounds):
            # the order rotates from round to round (A B C, B C A, C A B): a condition that follows another's
            # aftermath (a freed 45 GiB, a wake) in one round follows a different one in the next
            order = rotated(a.conditions, rnd)
            res.setdefault("order", []).append(order)
            for cond in order:
                held = None
                if cond not in AWAKE:
                    r.sleep_level, r.weights_backup = (2, "pool") if cond == "sleep2pool" else (1, "vllm")
                    r.sleep()
                    if cond == "resident":
                        held = torch.empty(int(a.resident_gib * GiB), dtype=torch.uint8, device="cuda").fill_(1)
                        torch.cuda.synchronize()
                    r.wake()
                if cond == "batched" and r.set_seeded_noise("batched") != "batched":
                    log("the batched seeded draw could not be put in place: skipping that condition")
                    continue
                try:
                    seconds, tokens = rollout(r, prompts, a.new_tokens, cond)
                finally:
                    if cond == "batched":
                        r.set_seeded_noise("vllm")
                res["runs"][cond].append({"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
                                          "free_gib": torch.cuda.mem_get_info()[0] / GiB})
                log(f"round {rnd} {cond}: {seconds:.2f} s, {tokens / seconds:.0f} tok/s")
                del held
                torch.cuda.empty_cache()
    finally:
        r.close()
    base = None
    for cond in a.conditions:
        runs = res["runs"][cond]
        if not runs:
            continue
        s = [x["seconds"] for x in runs]
        res[cond] = {"seconds_median": statistics.median(s), "seconds_spread": [min(s), max(s)],
                     "tok_s_median": statistics.median(x["tok_s"] for x in runs)}
        if cond == "fresh":
            base = res[cond]["seconds_median"]
        elif base:
            res[f"slowdown_{cond}"] = res[cond]["seconds_median"] / base
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--resident-gib", type=float, default=45.0, help="the resident trainer's allocation")
    ap.add_argument("--gpu-util", type=float, default=0.3)
    ap.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="comma list, run in this order each round (fresh first: the others compare to it)")
    a = ap.parse_args(argv)
    a.conditions = [c for c in a.conditions.split(",") if c]
    unknown = sorted(set(a.conditions) - set(CONDITIONS))
    if unknown or not a.conditions or a.conditions[0] != "fresh":
        ap.error(f"--conditions: a comma list of {','.join(CONDITIONS)} starting with fresh (got {unknown or a.conditions})")
    os.makedirs(a.out, exist_ok=True)
    res = run(a)
    with open(os.path.join(a.out, "diag_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
