#!/usr/bin/env python3
"""Trainer offload/reload: colomem vs DeepSpeed's offload_states()/reload_states() vs a .to() loop.

A Qwen2-1.5B-shaped full fine-tune (bf16, AdamW, gradient checkpointing, micro-batch 2 x 512) under ZeRO-2
and ZeRO-3, each in its own process (so no method inherits another's pinned memory). On one engine, after a
training step: `--cycles` offload/reload cycles with colomem (the pool is pinned once, before, and timed
separately), then with DeepSpeed's own calls, then `--to-cycles` with the .to() loop; a training step after
each method checks that training goes on. Correctness first, then time: the offload is the state move alone
(prepare_sync=False), timed with the device synchronized before and after.

    python3 benchmarks/bench_deepspeed_offload.py --out runs/bench-ds
Writes zero2.json, zero3.json and summary.json into --out and prints a table last. About 3 minutes on one
H200 (the FusedAdam JIT build, ~30 s, happens once per host; --torch-adam skips it and DeepSpeed's ZeRO-3
offload, which needs FusedAdam).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's colomem (parent and children)

GiB = 1 << 30
T0 = time.perf_counter()


def log(*a):
    print(f"[bench-ds {time.perf_counter() - T0:6.1f}s]", *a, flush=True)


# ------------------------------------------------------------------------------------------------ child
def ceiling(pool, nbytes: int) -> dict:
    """Pinned D2H / H2D of one big copy into a pool block: the ceiling the swaps are measured against."""
    import torch

    block = pool.alloc(nbytes)
    try:
        host = block.as_tensor(nbytes)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        out = {}
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            dst.copy_(src, non_blocking=True)        # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            out[f"{name}_gbps"] = round(3 * nbytes / (time.perf_counter() - t) / 1e9, 2)
        del dev, host
        torch.cuda.empty_cache()
        return out
    finally:
        block.release()


def make_batch(vocab: int, rows: int, width: int, step: int):
    import torch
    from colomem.grpo.batch import GRPOBatch

    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    comp = torch.zeros(rows, width)
    comp[:, width // 4:] = 1.0
    old = -torch.log(torch.tensor(float(vocab))) * comp
    return GRPOBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=comp,
                     advantages=torch.randn(rows, generator=g), old_logprobs=old)


def run_child(a) -> int:
    import torch

    import colomem
    from colomem.engines.deepspeed import DeepSpeedTrainer
    from colomem.grpo.config import GRPOConfig
    from colomem.grpo.tiny_model import SHAPES

    res: dict = {"stage": a.stage, "shape": a.shape, "micro_batch": a.micro_batch, "seq": a.seq,
                 "torch_adam": a.torch_adam, "errors": [], "methods": {}}
    out_path = Path(a.out) / f"zero{a.stage}.json"
    deadline = T0 + a.deadline_s
    trainer = pool = None
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        res["gpu"] = torch.cuda.get_device_name()
        res["torch"] = torch.__version__
        shape = {k: v for k, v in SHAPES[a.shape].items()}
        cfg = Qwen2Config(**shape, use_sliding_window=False, rms_norm_eps=1e-6)
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        res["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)

        pool = colomem.PinnedPool(0)                      # reserved (pinned) below, once, before any swap
        t = time.perf_counter()
        trainer = DeepSpeedTrainer(model, zero_stage=a.stage, lr=1e-5, micro_batch=a.micro_batch, grad_accum=1,
                                   torch_adam=a.torch_adam, gradient_checkpointing=True, pool=pool,
                                   grpo=GRPOConfig(log_entropy=False), offload="colomem", timeout_s=120)
        del model
        res["init_s"] = round(time.perf_counter() - t, 2)
        res["deepspeed"] = trainer.deepspeed_version

        def step(tag):
            r = trainer.train_step(make_batch(cfg.vocab_size, a.micro_batch, a.seq, len(res.setdefault("losses", []))))
            res["losses"].append(round(r["loss"], 6))
            res.setdefault("step_s", []).append(round(r["train_step_s"], 3))
            log(f"zero{a.stage} step ({tag}): loss {r['loss']:.6f} in {r['train_step_s']:.2f} s")

        step("warm-up")
        state = trainer.state()
        res["state_bytes"] = dict(state.sizes)
        need = state.nbytes()
        del state
        t = time.perf_counter()
        pool.reserve(need + 2 * GiB)                      # pinned once for the run, like a real job does
        res["pool_pin_s"] = round(time.perf_counter() - t, 3)
        res["pool_gib"] = round(pool.stats()["reserved_bytes"] / GiB, 2)
        res["ceiling"] = ceiling(pool, 2 * GiB)
        log(f"zero{a.stage}: state {need / GiB:.2f} GiB, pool pinned in {res['pool_pin_s']} s, "
            f"ceiling {res['ceiling']}")

        plan = [("colomem", a.cycles), ("deepspeed", a.cycles), ("to", a.to_cycles)]
        for method, cycles in plan:
            if method == "deepspeed" and a.stage == 3 and a.torch_adam:
                res["methods"][method] = {"skipped": "ZeRO-3 offload_states() needs FusedAdam (--torch-adam)"}
                continue
            if time.perf_counter() > deadline:
                res["methods"][method] = {"skipped": "deadline reached"}
                continue
            rows = []
            for c in range(cycles):
                if rows and time.perf_counter() > deadline:
                    break
                last = method == "colomem" and c == cycles - 1
                trainer.offload(method=method, prepare_sync=last)
                off = trainer.last_offload.to_dict()
                trainer.reload()
                rows.append({"offload": off, "reload": trainer.last_reload.to_dict()})
                log(f"zero{a.stage} {method} cycle {c}: offload {off['move_seconds']:.3f} s "
                    f"({off['gbps']:.1f} GB/s, freed {off['freed_bytes'] / GiB:.2f} GiB), reload "
                    f"{rows[-1]['reload']['move_seconds']:.3f} s ({rows[-1]['reload']['gbps']:.1f} GB/s)")
            res["methods"][method] = {"cycles": rows}
            step(f"after {method}")
    except BaseException as e:                # noqa: BLE001 - recorded, the parent reports it
        res["errors"].append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    finally:
        if trainer is not None:
            trainer.close()
        if pool is not None:
            pool.close(force=True)
        res["wall_s"] = round(time.perf_counter() - T0, 1)
        out_path.write_text(json.dumps(res, indent=1))
    sys.stdout.flush()
    os._exit(0 if not res["errors"] else 1)      # skip slow interpreter teardown of NCCL/engine threads


# ----------------------------------------------------------------------------------------------- parent
def summarize(results: dict) -> list[dict]:
    rows = []
    for stage, r in sorted(results.items()):
        for method, m in r.get("methods", {}).items():
            if "cycles" not in m or not m["cycles"]:
                rows.append({"stage": stage, "method": method, "note": m.get("skipped", "no data")})
                continue
            cyc = m["cycles"]
            off = [c["offload"]["move_seconds"] for c in cyc]
            rel = [c["reload"]["move_seconds"] for c in cyc]
            later = cyc[1:] or cyc
            rows.append({
                "stage": stage, "method": method,
                "moved_gb": round(cyc[0]["offload"]["moved_bytes"] / 1e9, 2),
                "offload_first_s": round(off[0], 3),
                "offload_later_s": round(statistics.median(off[1:] or off), 3),
                "reload_first_s": round(rel[0], 3),
                "reload_later_s": round(statistics.median(rel[1:] or rel), 3),
                "offload_gbps": round(statistics.median(c["offload"]["gbps"] for c in later), 1),
                "reload_gbps": round(statistics.median(c["reload"]["gbps"] for c in later), 1),
                "freed_gib": round(min(c["offload"]["freed_bytes"] for c in cyc) / GiB, 2),
                "left_allocated_mib": round(max(c["offload"]["allocated_bytes"] for c in cyc) / (1 << 20), 1),
            })
    return rows


def print_table(results: dict, rows: list[dict]) -> None:
    for stage, r in sorted(results.items()):
        c = r.get("ceiling", {})
        print(f"ZeRO-{stage}: {r.get('params_b')} B params, state {sum(r.get('state_bytes', {}).values()) / GiB:.2f}"
              f" GiB {r.get('state_bytes')}, pool pinned once in {r.get('pool_pin_s')} s, copy ceiling D2H "
              f"{c.get('d2h_gbps')} / H2D {c.get('h2d_gbps')} GB/s, losses {r.get('losses')}, "
              f"errors {r.get('errors') or 'none'}")
    hdr = ("stage", "method", "moved_gb", "offload_first_s", "offload_later_s", "reload_first_s", "reload_later_s",
           "offload_gbps", "reload_gbps", "freed_gib", "left_allocated_mib")
    width = {h: max(len(h), 9) for h in hdr}
    print(" | ".join(f"{h:>{width[h]}}" for h in hdr))
    for row in rows:
        if "note" in row:
            print(f"{row['stage']:>9} | {row['method']:>9} | {row['note']}")
            continue
        print(" | ".join(f"{row[h]:>{width[h]}}" for h in hdr))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default runs/bench-ds-<time>)")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--shape", default="qwen2-1.5b", help="colomem.grpo.tiny_model.SHAPES key")
    ap.add_argument("--cycles", type=int, default=3, help="offload/reload cycles for colomem and deepspeed")
    ap.add_argument("--to-cycles", type=int, default=2, help="cycles of the (slow) .to() loop")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--torch-adam", action="store_true", help="torch AdamW (no FusedAdam JIT build)")
    ap.add_argument("--budget-s", type=float, default=225.0, help="wall-clock budget for all stages")
    ap.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, default=200.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.out = a.out or f"runs/bench-ds-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.stage is not None:
        return run_child(a)

    stages = [int(s) for s in a.stages.split(",") if s]
    results: dict = {}
    for i, stage in enumerate(stages):
        left = a.budget_s - (time.perf_counter() - T0)
        # keep ~95 s for each later stage (start, engine, DeepSpeed's first offload); the child stops
        # starting new cycles at its deadline and leaves ~20 s to close
        deadline = left - 95 * (len(stages) - i - 1) - 20
        if deadline < 40:
            results[stage] = {"errors": ["skipped: budget spent"]}
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--stage", str(stage), "--out", a.out,
               "--shape", a.shape, "--cycles", str(a.cycles), "--to-cycles", str(a.to_cycles),
               "--micro-batch", str(a.micro_batch), "--seq", str(a.seq), "--deadline-s", str(round(deadline))]
        if a.torch_adam:
            cmd.append("--torch-adam")
        log(f"ZeRO-{stage}: {' '.join(cmd[1:])}")
        try:
            rc = subprocess.run(cmd, timeout=max(min(left - 5, deadline + 45), 30)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        p = Path(a.out) / f"zero{stage}.json"
        results[stage] = json.loads(p.read_text()) if p.exists() else {"errors": [f"no result (rc={rc})"]}
        results[stage]["rc"] = rc
    rows = summarize(results)
    summary = {"rows": rows, "stages": {str(k): v for k, v in results.items()},
               "wall_s": round(time.perf_counter() - T0, 1)}
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(results, rows)
    return 0 if all(not r.get("errors") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
