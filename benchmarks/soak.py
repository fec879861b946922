"""The default job run long, watching for what grows step after step (GPU host, or --backend cpu).

    python3 benchmarks/soak.py --out DIR --steps 1000 --time-limit-s 240 [--backend cpu] [--heap-every N]
        [-- runner args]

Runs `python3 runners/grpo_colocated.py --steps N` as a subprocess in a session of its own and stops it (SIGTERM: the
step under way finishes) once --time-limit-s has passed since the job started, whichever comes first. Per
step, from the job's metrics.jsonl: the GPU memory in use after the rollout went to sleep (`driver_used`
after `sleep`: the floor of the step), the pinned pool's bytes, the runner's RSS and open file descriptors
(`host/rss_bytes`, `host/open_fds`); vLLM's EngineCore, when there is one, is sampled from outside by pid
(RSS and descriptors) as each step line arrives. Growth = median of the last 10 % of the steps minus the
median of the first 10 %, after a warm-up of --warmup-steps. Output: DIR/soak.json (soak_steps,
soak_seconds, soak_driver_used_growth_mib, soak_rss_growth_mib, soak_fd_growth, soak_pool_growth_mib, the
engine's growth, the RSS slopes over the second half of the steps (soak_rss_kib_per_step_second_half and the
engine's: a leak keeps its rate, a warm-up flattens), the per-step series) and DIR/soak.log. Every wait has a deadline; the job's process group
is killed at the end whatever happened.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from job_procs import Job, engine_pid, read_lines, rss_and_fds, step_lines  # noqa: E402

from colomem.runner.heap_profile import ENV as HEAP_ENV  # noqa: E402
from colomem.runner.timeline import read_jsonl  # noqa: E402

MIB = float(1 << 20)
GROWTH = ("median of the last 10 % of the steps minus the median of the first 10 % (at least one step each), "
          "after a warm-up of {w} steps")


class Tail:
    """The JSON lines appended to a file since the last read (a line still being written waits)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = path, 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *whole, self.rest = (self.rest + data).split(b"\n")
        out = []
        for line in whole:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


def growth(values: list, warmup: int) -> Optional[float]:
    """Median of the last tenth minus median of the first tenth of `values` after `warmup` (None values out)."""
    xs = [v for v in values[warmup:] if v is not None]
    if len(xs) < 2:
        return None
    k = max(1, len(xs) // 10)
    return statistics.median(xs[-k:]) - statistics.median(xs[:k])


def rate_per_step(steps: list, values: list, warmup: int) -> Optional[float]:
    """Least-squares slope (units a step) over the second half of the steps after `warmup`: a leak keeps its
    rate to the end, a warm-up (allocator arenas, caches filling) flattens; None with fewer than 4 points."""
    pts = [(x, v) for x, v in zip(steps[warmup:], values[warmup:]) if v is not None]
    pts = pts[len(pts) // 2:]
    if len(pts) < 4:
        return None
    xs, ys = [float(x) for x, _ in pts], [float(v) for _, v in pts]
    return statistics.linear_regression(xs, ys).slope


def series(lines: list[dict]) -> dict[str, list]:
    """Per step: GPU memory used and pool bytes after sleep, the runner's RSS and descriptors."""
    steps = [d for d in step_lines(lines) if not d.get("failed")]
    after_sleep = [(d.get("memory") or {}).get("sleep") or {} for d in steps]
    return {"step": [d["step"] for d in steps],
            "driver_used_bytes": [m.get("driver_used") for m in after_sleep],
            "pool_bytes": [m.get("pinned_host") for m in after_sleep],
            "rss_bytes": [d.get("host/rss_bytes") for d in steps],
            "open_fds": [d.get("host/open_fds") for d in steps],
            "step_s": [d.get("step_s") for d in steps],
            "time": [d.get("time") for d in steps]}


def summarize(s: dict, engine: dict, warmup: int, seconds: Optional[float]) -> dict:
    def mib(x: Optional[float]) -> Optional[float]:
        return None if x is None else x / MIB

    def kib(x: Optional[float]) -> Optional[float]:
        return None if x is None else x / 1024

    return {
        "soak_steps": len(s["step"]),
        "soak_seconds": seconds,
        "soak_driver_used_growth_mib": mib(growth(s["driver_used_bytes"], warmup)),
        "soak_rss_growth_mib": mib(growth(s["rss_bytes"], warmup)),
        "soak_fd_growth": growth(s["open_fds"], warmup),
        "soak_pool_growth_mib": mib(growth(s["pool_bytes"], warmup)),
        "engine_rss_growth_mib": mib(growth(engine.get("rss_bytes", []), warmup)),
        "engine_fd_growth": growth(engine.get("open_fds", []), warmup),
        "soak_rss_kib_per_step_second_half": kib(rate_per_step(s["step"], s["rss_bytes"], warmup)),
        "engine_rss_kib_per_step_second_half": kib(rate_per_step(engine.get("step", []),
                                                                 engine.get("rss_bytes", []), warmup)),
        "step_s_median": statistics.median([x for x in s["step_s"] if x]) if any(s["step_s"]) else None,
        "growth": GROWTH.format(w=warmup),
    }


def last_heap_profile(path: Path) -> Optional[dict]:
    """The job's last heap profile line (the Python allocation sites that grew most since the first), if any."""
    try:
        lines = read_jsonl(path)
    except OSError:
        return None
    return lines[-1] if lines else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--time-limit-s", type=float, default=240.0,
                   help="the job is stopped (SIGTERM) this long after it started, build included")
    p.add_argument("--stop-timeout-s", type=float, default=60.0, help="longest a stopped job may take to exit")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=("auto", "gpu", "cpu"))
    p.add_argument("--heap-every", type=int, default=0,
                   help="trace the job's Python heap and write where it grew every N steps (slower steps; "
                        "soak.json then carries the last profile's sites)")
    p.add_argument("runner_args", nargs="*", help="after --: more arguments for the job")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    job_out = a.out / "job"
    metrics = job_out / "metrics.jsonl"
    args = ["--backend", a.backend, "--steps", str(a.steps), "--out", str(job_out), "--no-progress", "--no-plots",
            "--report-to", "none", *a.runner_args]
    engine: dict[str, list] = {"step": [], "rss_bytes": [], "open_fds": []}
    stopped_by_time = False
    env = {**os.environ, HEAP_ENV: str(a.heap_every)} if a.heap_every > 0 else None
    with Job(args, a.out / "soak.log", env=env) as job:
        tail, epid = Tail(metrics), None
        deadline = job.t0 + a.time_limit_s
        while job.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            new = step_lines(tail.read())
            if new:
                if epid is None:
                    epid = engine_pid(job.pgid, job.pid)
                if epid is not None:      # the engine right after the step line: asleep, like the runner's sample
                    rss, fds = rss_and_fds(epid)
                    engine["step"].append(new[-1]["step"])
                    engine["rss_bytes"].append(rss)
                    engine["open_fds"].append(fds)
        if job.proc.poll() is None:
            stopped_by_time = True
            job.proc.send_signal(signal.SIGTERM)
        code = job.wait(a.stop_timeout_s)
    lines, bad = read_lines(metrics)
    s = series(lines)
    t = [x for x in s["time"] if x]
    seconds = (t[-1] - t[0]) if len(t) > 1 else None
    result = {
        **summarize(s, engine, a.warmup_steps, seconds),
        "steps_asked": a.steps,
        "time_limit_s": a.time_limit_s,
        "stopped_by_time_limit": stopped_by_time,
        "exit_code": code,
        "metrics_bad_lines": bad,
        "memory_alarms": [d.get("memory_alarm") for d in step_lines(lines) if d.get("memory_alarm")],
        "command": shlex.join(["python3", "benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "job_command": shlex.join(["python3", "runners/grpo_colocated.py", *args]),
        "heap_profile": last_heap_profile(job_out / "heap_profile.jsonl"),
        "series": s,
        "engine_series": engine,
    }
    (a.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    keys = ("soak_steps", "soak_seconds", "soak_driver_used_growth_mib", "soak_rss_growth_mib", "soak_fd_growth",
            "soak_pool_growth_mib", "engine_rss_growth_mib", "engine_fd_growth")
    print(json.dumps({k: result[k] for k in keys}))
    return 0 if code in (0, 130) and s["step"] else 1


if __name__ == "__main__":
    sys.exit(main())
