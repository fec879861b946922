#!/usr/bin/env python3
"""Does the weight sync wait for an optimizer state still copying out behind it?

    python3 benchmarks/diag_behind.py --out DIR [--moments-gib 40] [--reps 3] [--set 7b]

The runner's "optimizer state out behind the rollout" starts the Adam moments' copy to the pool, returns,
and syncs the resident weights to vLLM while it runs. Here: a --set-shaped bf16 set resident on the GPU (the
weights), two fp32 tensors of --moments-gib together in a SwapSet (the moments), a bridge of 512 MiB buckets
and a consumer process that copies every bucket out and ACKs (benchmarks/bench_sync_inloop.py's). Interleaved,
--reps times each:
  alone            the sync with nothing copying
  behind           the moments' offload_async(), then at once the sync (the runner's order)
  behind_torch     the same, the packs by torch's per-tensor copies instead of the core's batched call
  behind_nocheck   the same, the bridge without checksums (no read-back of the sum to the host)
and the moments' copy alone (its wall clock). Per run: the sync's wall time, BridgeStats' parts and the first
buckets' waits. A child repeats it all under expandable_segments:True (`expandable`). Writes
DIR/diag_behind.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's colomem
sys.path.insert(0, HERE)                   # bench_sync_inloop's consumer

import torch  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
BUCKET = 512 * MiB
MODES = ("alone", "behind", "behind_torch", "behind_nocheck")


def _sync(bridge, sources, version: list, torch_pack: bool) -> dict:
    from colomem.bridge import buckets

    real = buckets.source_kind
    if torch_pack:
        buckets.source_kind = lambda src, dev: buckets.TORCH
    try:
        version[0] += 1
        t0 = time.perf_counter()
        st = bridge.sync(sources, version=version[0], tag=f"t:{version[0]}")
        wall = time.perf_counter() - t0
    finally:
        buckets.source_kind = real
    return {"wall_ms": wall * 1e3, "pack_wait_ms": st.pack_wait_seconds * 1e3,
            "pack_copy_ms": st.pack_copy_seconds * 1e3, "pack_issue_ms": st.pack_issue_seconds * 1e3,
            "ack_ms": st.ack_seconds * 1e3, "first_waits_ms": [round(b["wait_ms"], 2) for b in st.buckets[:4]],
            "max_wait_ms": max(b["wait_ms"] for b in st.buckets), "buckets": len(st.buckets)}


def run(a) -> dict:
    import colomem
    from colomem.bench.shapes import SHAPES
    from colomem.bench.transfer import make_set
    from colomem.bridge import WeightBridge

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    weights = make_set(SHAPES[a.set], dev)
    sources = list(weights.items())
    half = a.moments_gib * GiB // 8   # two fp32 tensors
    moments = {"exp_avg": torch.ones(half, device=dev), "exp_avg_sq": torch.full((half,), 2.0, device=dev)}
    pool = colomem.PinnedPool(a.moments_gib * GiB + 64 * MiB, pin=True)
    swap = colomem.SwapSet.from_tensors(moments, pool, device=dev, release=True)
    bridges = {True: WeightBridge(bucket_bytes=BUCKET, buffers=2, device=dev, checksum="sampled", timeout=60),
               False: WeightBridge(bucket_bytes=BUCKET, buffers=2, device=dev, checksum="none", timeout=60)}
    kids = {k: subprocess.Popen([sys.executable, os.path.join(HERE, "bench_sync_inloop.py"), "--consumer",
                                 b.address], stdout=subprocess.PIPE, text=True) for k, b in bridges.items()}
    version = [0]
    out: dict = {m: [] for m in MODES}
    out["copy_alone_ms"] = []
    try:
        for b in bridges.values():
            b.wait_for_importers(1, 60)
            _sync(b, sources, version, False)          # warm-up: the consumer compiles its ranges
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            swap.offload_async().wait(120)
            out["copy_alone_ms"].append((time.perf_counter() - t0) * 1e3)
            swap.reload()
            for mode in MODES:
                torch.cuda.synchronize()
                handle = swap.offload_async() if mode != "alone" else None
                row = _sync(bridges[mode != "behind_nocheck"], sources, version, mode == "behind_torch")
                if handle is not None:
                    t0 = time.perf_counter()
                    handle.wait(120)
                    row["copy_left_ms"] = (time.perf_counter() - t0) * 1e3
                    swap.reload()
                out[mode].append(row)
                print(f"[diag_behind] {mode}: {json.dumps({k: v for k, v in row.items()})}", flush=True)
        assert bool((moments["exp_avg"] == 1).all()) and bool((moments["exp_avg_sq"] == 2).all())
    finally:
        for b in bridges.values():
            b.close()
        for k in kids.values():
            try:
                k.wait(30)
            except subprocess.TimeoutExpired:
                k.kill()
        if swap.state != "resident":
            swap.reload()
        swap.close()
        pool.close(force=True)
    out["median"] = {m: {k: statistics.median(r[k] for r in out[m]) for k in ("wall_ms", "pack_wait_ms", "ack_ms")}
                     for m in MODES}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--moments-gib", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", default="7b")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"command": " ".join(sys.argv), "default": run(a)}
    torch.cuda.empty_cache()       # the child needs the memory this process's allocator still caches
    if not a.child:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        sub = os.path.join(a.out, "expandable")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", sub, "--moments-gib",
                            str(a.moments_gib), "--reps", str(a.reps), "--set", a.set, "--child"], env=env, timeout=400)
        p = os.path.join(sub, "diag_behind.json")
        res["expandable"] = json.load(open(p))["default"] if r.returncode == 0 and os.path.exists(p) else {"rc": r.returncode}
    with open(os.path.join(a.out, "diag_behind.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"[diag_behind] medians: {json.dumps(res['default']['median'])}", flush=True)
    if "median" in res.get("expandable", {}):
        print(f"[diag_behind] medians, expandable segments: {json.dumps(res['expandable']['median'])}", flush=True)


if __name__ == "__main__":
    main()
