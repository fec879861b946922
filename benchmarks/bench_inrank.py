#!/usr/bin/env python3
"""The in-rank vLLM engine (--engine in-rank) against the cross-process one (--engine cross-process), one GPU.

    python3 benchmarks/bench_inrank.py --out runs/inrank                  # default job 20 steps, 1.5B job 3 steps
    python3 benchmarks/bench_inrank.py --out runs/inrank --default-steps 40 --steps-1p5b 4

Each run is `torchrun --standalone --nproc-per-node 1 runners/grpo_colocated.py --engine <engine> ...` in a
fresh process, both engines under the same launcher and seed (its outputs under --out/<job>_<engine>/):
  default  the embedded default job (tiny Qwen2, successor task): the reward curves of both engines, step by
           step, and how many steps are bit-identical
  1p5b     configs/grpo_1p5b_full.yaml: step time and weight-sync time (medians over the steps after the
           first, which pays one-time pinning and the sync's first load through vLLM's load_weights)
The sync time is the runner's `sync` phase: cross-process, the bridge to the listener in vLLM's process;
in-rank, vLLM's worker in the rank reading the trainer's tensors. The run checks correctness first: every run
must end ok with the rollout using the trained weights (logprob gap below 0.05) before its times count.
Writes inrank_bench.json (top level: inrank_default_steps, inrank_default_reward_last5_mean,
crossproc_default_reward_last5_mean, inrank_1p5b_step_s, crossproc_1p5b_step_s, inrank_1p5b_sync_s,
crossproc_1p5b_sync_s) and prints a table. Time on one H200: about 400 s (4 runs; each 1.5B run ~2 min).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))   # a fallback: an installed colomem or PYTHONPATH's comes first

from colomem.runner.timeline import median as _median  # noqa: E402  (the runner's median: one figure per median)
from stage_deadline import bound_or_skip  # noqa: E402  (beside this script: its folder is first on sys.path)
ENGINES = {"inrank": "in-rank", "crossproc": "cross-process"}
JOBS = {"default": [], "1p5b": ["--config", "configs/grpo_1p5b_full.yaml"]}
DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
GAP_MAX = 0.05


def run_job(engine: str, job_args: list, steps: int, out: Path, timeout_s: float, extra: list) -> dict:
    """One runner process under torchrun (one rank); rc, wall time, and the log's tail."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "runners" / "grpo_colocated.py"), *job_args, "--backend", "gpu", "--engine", engine,
           "--steps", str(steps), "--out", str(out), "--no-progress", "--report-to", "none", *extra]
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    print(f"[bench] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with open(out / "run.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)      # torchrun, the runner and a cross-process engine's process
            p.wait()
            rc = "timeout"
    wall = time.perf_counter() - t0
    print(f"[bench]   rc={rc} in {wall:.0f} s", flush=True)
    return {"rc": rc, "wall_s": wall, "cmd": cmd, "log_tail": (out / "run.log").read_text(errors="replace")[-2500:]}


def figures(out: Path) -> dict:
    """The run's status, reward curve, step and sync medians (steps after the first), and its problems."""
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    steps = []
    if (out / "metrics.jsonl").is_file():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "phase_s" in rec and not rec.get("failed"):
                steps.append(rec)
    warm = steps[1:] if len(steps) > 1 else steps
    gaps = [s.get("train/rollout_logprob_gap") for s in steps]
    problems = []
    if summary.get("status") != "ok":
        problems.append(f"status {summary.get('status')}: {summary.get('error')}")
    if any(g is None or g >= GAP_MAX for g in gaps):
        problems.append(f"rollout logprob gap {max((g for g in gaps if g is not None), default=None)} >= {GAP_MAX}")
    return {"status": summary.get("status"), "steps_done": len(steps), "build_s": summary.get("build_s"),
            "rewards": [s.get("reward_mean") for s in steps],
            "reward_last5_mean": summary.get("reward_last5_mean"),
            "step_s": _median([s["step_s"] for s in warm]),
            "sync_s": _median([s["phase_s"].get("sync") for s in warm]),
            "switch_s": _median([s["switch_s"] for s in warm]),
            "first_sync_s": steps[0]["phase_s"].get("sync") if steps else None,
            "logprob_gap_max": max((g for g in gaps if g is not None), default=None), "problems": problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--default-steps", type=int, default=20)
    ap.add_argument("--steps-1p5b", type=int, default=3)
    ap.add_argument("--jobs", default="default,1p5b", help="comma list of: default, 1p5b")
    ap.add_argument("--run-timeout-s", type=float, default=240.0, help="bound of each run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    report: dict = {"runs": {}}
    for job in [j for j in args.jobs.split(",") if j]:
        steps = args.default_steps if job == "default" else args.steps_1p5b
        for key, engine in ENGINES.items():
            d = out / f"{job}_{key}"
            bound = bound_or_skip(f"{job}_{key}", args.run_timeout_s)   # ends before the gpu_run stage does
            if bound is None:
                continue
            run = run_job(engine, JOBS[job], steps, d, bound, [])
            report["runs"][f"{job}_{key}"] = {**run, **figures(d)}
            out.mkdir(parents=True, exist_ok=True)     # on disk after every run: a later cut keeps it
            (out / "inrank_bench.json").write_text(json.dumps(report, indent=2))
    runs = report["runs"]
    ok = lambda name: name in runs and not runs[name]["problems"]  # noqa: E731
    if ok("default_inrank") and ok("default_crossproc"):
        a, b = runs["default_inrank"]["rewards"], runs["default_crossproc"]["rewards"]
        report["inrank_default_steps"] = runs["default_inrank"]["steps_done"]
        report["inrank_default_reward_last5_mean"] = runs["default_inrank"]["reward_last5_mean"]
        report["crossproc_default_reward_last5_mean"] = runs["default_crossproc"]["reward_last5_mean"]
        report["default_identical_steps"] = sum(1 for x, y in zip(a, b) if x == y)
        report["default_reward_max_abs_diff"] = max((abs(x - y) for x, y in zip(a, b)), default=None)
    for key in ENGINES:
        name = f"1p5b_{key}"
        if ok(name):
            report[f"{key}_1p5b_step_s"] = runs[name]["step_s"]
            report[f"{key}_1p5b_sync_s"] = runs[name]["sync_s"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "inrank_bench.json").write_text(json.dumps(report, indent=2))
    print(f"\n| run | status | steps | step s | sync s | first sync s | reward last5 | problems |\n|{'---|' * 8}")
    for name, r in runs.items():
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
        print(f"| {name} | {r['status']} | {r['steps_done']} | {fmt(r['step_s'])} | {fmt(r['sync_s'])} | "
              f"{fmt(r['first_sync_s'])} | {fmt(r['reward_last5_mean'])} | {'; '.join(r['problems']) or '-'} |")
    for k in ("default_identical_steps", "default_reward_max_abs_diff"):
        print(f"{k}: {report.get(k)}")
    print(f"[bench] wrote {out / 'inrank_bench.json'}")
    return 0 if all(not r["problems"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
