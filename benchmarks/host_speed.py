#!/usr/bin/env python3
"""How fast this machine is, in a few seconds: so that runs on two machines of one kind can be told apart.

    python3 benchmarks/host_speed.py --out DIR [--label start]

Machines lent as the same GPU kind have run the same GRPO job twice as slowly as each other, in both its
phases. The training phase at the benchmarks' micro-batch is host-bound (the CPU queues kernels more slowly
than the GPU runs them), the rollout partly so, so the host's speed matters as much as the GPU's. Measured:
  python_loop_s      a fixed pure-Python loop on one core (the interpreter's speed)
  launch_us          host time per launch of a tiny GPU kernel, 2,000 launches queued back to back (what a
                     host-bound phase pays per kernel)
  matmul_tflops      bf16 8192^3 matmuls, timed on the GPU (its clocks and power cap)
  h2d_gbs / d2h_gbs  1 GiB copies between pinned host memory and the GPU (the link)
  gpu_clocks         nvidia-smi's SM clock, its cap and the reasons it is held back (throttling)
and the load average. Without a GPU the GPU figures are null. Writes DIR/host_speed_<label>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

GiB = 1 << 30


def python_loop_s(n: int = 3_000_000) -> float:
    t = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i & 7
    return time.perf_counter() - t


def _gpu_figures(reps: int) -> dict:
    import torch

    from colomem.bench.transfer import cuda_time_ms, raw_peaks   # the transfer benchmark's own timing and ceilings

    dev = torch.device("cuda")
    x = torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    launches = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(2000):
            x.add_(1)
        launches.append((time.perf_counter() - t) / 2000 * 1e6)   # host time only: what the host can queue
        torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    a @ b                                                              # cuBLAS picks its kernel

    def matmuls():
        for _ in range(10):
            a @ b
    flops = [10 * 2 * 8192 ** 3 / (cuda_time_ms(matmuls) / 1e3) / 1e12 for _ in range(reps)]
    link = raw_peaks(GiB, reps)
    return {"launch_us": statistics.median(launches), "matmul_tflops": statistics.median(flops),
            "h2d_gbs": link["h2d"]["gbps"], "d2h_gbs": link["d2h"]["gbps"],
            "gpu_name": torch.cuda.get_device_name(dev)}


def gpu_clocks() -> dict:
    """nvidia-smi's view of the SM clock and what holds it back; {} without it."""
    base = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu")
    for fields in (base + ("clocks_event_reasons.active",), base):   # older drivers lack the reasons' name
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            continue
        if out:
            return dict(zip(fields, (v.strip() for v in out[0].split(","))))
    return {}


def measure(reps: int = 5) -> dict:
    import torch

    report: dict = {"python_loop_s": statistics.median(python_loop_s() for _ in range(reps)),
                    "loadavg": list(os.getloadavg()), "cpus": os.cpu_count(),
                    "launch_us": None, "matmul_tflops": None, "h2d_gbs": None, "d2h_gbs": None}
    if torch.cuda.is_available():
        report.update(_gpu_figures(reps))
        report["gpu_clocks"] = gpu_clocks()
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="start", help="names the file: host_speed_<label>.json")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    report = measure(a.reps)
    path = os.path.join(a.out, f"host_speed_{a.label}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
