#!/usr/bin/env python3
"""Does a long copy on colomem's copy stream hold up short work queued on other streams of the process?

    python3 benchmarks/diag_queues.py --out DIR [--gib 24] [--reps 3]

The GPU feeds a process's streams through a few hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless
set); two streams that share one are served in order, so a stream behind a many-second copy's queued chunks
waits for all of them although nothing orders it after the copy. Each probe is a 64 MiB device-to-device copy
between two events on one stream, timed by the host from its launch to its end event: on 8 fresh side
streams, on the current stream, and on a side stream made to wait for the current one (the weight sync's
pack does that), 16 bytes copied to pinned host memory on a side stream, and the same stored there by a
kernel (colomem._torch.read_back_words). Measured idle, then while a --gib D2H copy runs on the engine's
stream, in a child per --variants (default: default,paced):
  default        the copy queued at once (every chunk and its event), the driver's default queues
  connections32  the same with CUDA_DEVICE_MAX_CONNECTIONS=32
  paced          the copy queued in 512 MiB pieces, at most two in flight (a thread queues the next)
Writes DIR/diag_queues.json: per child the copy's rate and per probe its latency (ms: median, max).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python3 benchmarks/diag_queues.py` measures the checkout's colomem

MiB, GiB = 1 << 20, 1 << 30
PROBE = 64 * MiB
PIECE = 512 * MiB
IN_FLIGHT = 2
PROBE_BOUND_S = 30.0
VARIANTS = {"default": ({}, False), "connections32": ({"CUDA_DEVICE_MAX_CONNECTIONS": "32"}, False),
            "paced": ({}, True)}
DEFAULT_VARIANTS = "default,paced"


def _probe_once(torch, stream, src, dst, after=None) -> float:
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_stream(after)
        dst.copy_(src, non_blocking=True)
        end = torch.cuda.Event()
        end.record(stream)
    from colomem.bridge.buffers import wait_event

    wait_event(end, PROBE_BOUND_S, "a probe")
    return (time.perf_counter() - t0) * 1e3


def _copy(eng, ops, paced: bool, done: threading.Event, errors: list) -> None:
    try:
        if not paced:
            eng.submit("d2h", ops).wait(120.0)
            return
        pieces = []
        for dst, src, n in ops:
            for off in range(0, n, PIECE):
                pieces.append((dst + off, src + off, min(PIECE, n - off)))
        flight: list = []
        for p in pieces:
            if len(flight) >= IN_FLIGHT:
                flight.pop(0).wait(120.0)
            flight.append(eng.submit("d2h", [p]))
        for t in flight:
            t.wait(120.0)
    except Exception as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(repr(exc))
    finally:
        done.set()


def child(gib: int, reps: int, paced: bool) -> dict:
    import torch
    from colomem import _torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    eng = _torch.engine_for(dev)
    n = gib * GiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    src = torch.ones(PROBE, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    sides = [torch.cuda.Stream(dev) for _ in range(8)]
    cur = torch.cuda.current_stream(dev)
    small_dev = torch.arange(2, dtype=torch.int64, device=dev)
    small_host = torch.empty(2, dtype=torch.int64, pin_memory=True)
    names = [f"side{i}" for i in range(len(sides))] + ["current", "side_after_current", "d2h_small",
                                                          "kernel_store"]

    def probe(name: str) -> float:
        if name == "d2h_small":     # 16 bytes copied to pinned memory (a copy engine), on a side stream
            return _probe_once(torch, sides[1], small_dev, small_host)
        if name == "kernel_store":  # the same stored by a kernel (colomem._torch.read_back_words)
            t0 = time.perf_counter()
            with torch.cuda.stream(sides[2]):
                _torch.read_back_words(small_dev, PROBE_BOUND_S)
            return (time.perf_counter() - t0) * 1e3
        if name == "current":
            return _probe_once(torch, cur, src, dst)
        if name == "side_after_current":
            return _probe_once(torch, sides[0], src, dst, after=cur)
        return _probe_once(torch, sides[int(name[4:])], src, dst)

    idle = {k: [probe(k) for _ in range(5)] for k in names}
    rows = []
    for _ in range(reps):
        torch.cuda.synchronize()
        done, errors = threading.Event(), []
        t0 = time.perf_counter()
        th = threading.Thread(target=_copy, args=(eng, [(host.data_ptr(), gpu.data_ptr(), n)], paced, done, errors))
        th.start()
        lat: dict = {k: [] for k in names}
        while not done.is_set():
            for k in names:
                lat[k].append(probe(k))
                if done.is_set():
                    break
            time.sleep(0.01)
        secs = time.perf_counter() - t0
        th.join()
        if errors:
            raise RuntimeError(errors[0])
        rows.append({"copy_s": secs, "copy_gbps": n / secs / 1e9,
                     "probes_ms": {k: {"median": statistics.median(v), "max": max(v), "n": len(v)}
                                   for k, v in lat.items() if v}})
    return {"gib": gib, "paced": paced, "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "idle_ms": {k: statistics.median(v) for k, v in idle.items()}, "reps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--child", choices=sorted(VARIANTS))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.child:
        res = child(a.gib, a.reps, VARIANTS[a.child][1])
        with open(os.path.join(a.out, f"{a.child}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    out: dict = {"command": " ".join(sys.argv)}
    for name in a.variants.split(","):
        env = VARIANTS[name][0]
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", a.out, "--gib", str(a.gib),
                            "--reps", str(a.reps), "--child", name], env={**os.environ, **env}, timeout=300)
        path = os.path.join(a.out, f"{name}.json")
        out[name] = json.load(open(path)) if r.returncode == 0 and os.path.exists(path) else {"rc": r.returncode}
        worst = {k: max((rep["probes_ms"][k]["max"] for rep in out[name]["reps"] if k in rep["probes_ms"]),
                        default=float("nan"))
                 for k in out[name].get("idle_ms", {})} if "reps" in out[name] else {}
        print(f"[diag_queues] {name}: copy GB/s {[round(r['copy_gbps'], 1) for r in out[name].get('reps', [])]}, "
              f"worst probe ms {json.dumps({k: round(v, 1) for k, v in worst.items()})}", flush=True)
        with open(os.path.join(a.out, "diag_queues.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
