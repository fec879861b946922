#!/usr/bin/env python3
"""Why the first reloads after a pool's creation run below the H2D peak: per-cycle figures, no warm-up dropped.

    python3 benchmarks/diag_reload.py --out DIR [--cycles 8]

Each measurement starts from fresh memory and reports every repetition, so a warm-up shows:
  raw_torch_pinned   one 4 GiB H2D copy from a fresh torch pin_memory buffer, repeated
  raw_pool_block     the same from a fresh colomem pool block (mmap + pre-fault + cudaHostRegister)
  raw_fresh_device   pool block -> a device buffer allocated anew (after empty_cache) for every copy
  raw_grown_device   the same into fresh device memory that nothing freed just before
  set_release        the 7B-shaped set: offload, reload, cycle after cycle (release=True, the default)
  set_keep           the same with release=False (the device memory stays with torch's allocator)
  set_after_pause    a fresh pool left idle 5 s before its first cycle (time-based warm-up?)
  set_warmed         a fresh pool whose pages the GPU read once at creation (warm_pool) before cycling
  set_gap            release=True with 0.5 s between offload and reload (does the driver finish something?)
Every set cycle also re-measures the raw H2D of a 4 GiB pinned buffer just before it (the ceiling then).
Writes DIR/diag_reload.json and prints a table of ratios to that ceiling.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `python3 benchmarks/diag_reload.py` measures the checkout's colomem

import colomem  # noqa: E402
from colomem.bench import transfer  # noqa: E402
from colomem.bench.shapes import SHAPES  # noqa: E402

GiB = 1 << 30


def h2d_ms(dst: torch.Tensor, src: torch.Tensor) -> float:
    return transfer.cuda_time_ms(lambda: dst.copy_(src, non_blocking=True))


def raw_series(reps: int) -> dict:
    out = {}
    dev = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    host = torch.empty(4 * GiB, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    out["raw_torch_pinned"] = [h2d_ms(dev, host) for _ in range(reps)]
    del host
    pool = colomem.PinnedPool(4 * GiB + (64 << 20))
    blk = pool.alloc(4 * GiB)
    src = blk.as_tensor(4 * GiB)
    out["raw_pool_block"] = [h2d_ms(dev, src) for _ in range(reps)]
    del dev
    fresh = []
    for _ in range(reps):
        torch.cuda.empty_cache()
        d = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
        fresh.append(h2d_ms(d, src))
        del d
    out["raw_fresh_device"] = fresh
    kept, grown = [], []
    for _ in range(3):  # fresh device memory that nothing freed just before (the allocator grows)
        d = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
        grown.append(h2d_ms(d, src))
        kept.append(d)
    out["raw_grown_device"] = grown
    del kept
    del src
    blk.release()
    pool.close()
    torch.cuda.empty_cache()
    return out


def warm_pool(pool: colomem.PinnedPool, chunk: int = 256 << 20) -> None:
    """The GPU reads every free byte of the pool once (H2D into a scratch buffer)."""
    blocks = []
    while pool.stats()["largest_free_block"] > 0:
        blocks.append(pool.alloc(pool.stats()["largest_free_block"]))
    scratch = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    for b in blocks:
        for off in range(0, b.nbytes, chunk):
            n = min(chunk, b.nbytes - off)
            scratch[:n].copy_(b.as_tensor(b.nbytes)[off:off + n], non_blocking=True)
    torch.cuda.synchronize()
    for b in blocks:
        b.release()


def set_series(tensors: dict, cycles: int, ceiling, *, release: bool = True, pause_s: float = 0.0,
               warm: bool = False, gap_s: float = 0.0) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    t0 = time.perf_counter()
    pool = colomem.PinnedPool(int(nbytes * 1.01) + (64 << 20))
    create_s = time.perf_counter() - t0
    warm_s = None
    if warm:
        t0 = time.perf_counter()
        warm_pool(pool)
        warm_s = time.perf_counter() - t0
    if pause_s:
        time.sleep(pause_s)
    s = colomem.SwapSet.from_tensors(tensors, pool, name="diag", release=release)
    rows = []
    for _ in range(cycles):
        peak_ms = ceiling()
        off = s.offload(timing=True)
        if gap_s:
            time.sleep(gap_s)
        inn = s.reload(timing=True)
        rows.append({"offload_ms": off.device_ms, "reload_ms": inn.device_ms, "alloc_ms": inn.alloc_ms,
                     "ceiling_ms": peak_ms})
    s.close()
    pool.close()
    return {"pool_create_s": create_s, "warm_s": warm_s, "cycles": rows,
            "reload_vs_ceiling": [(nbytes / r["reload_ms"]) / (4 * GiB / r["ceiling_ms"]) for r in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    res: dict = {"command": "python3 benchmarks/diag_reload.py " + " ".join(sys.argv[1:] if argv is None else argv),
                 "device": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    res.update(raw_series(a.reps))
    tensors = transfer.make_set(SHAPES["7b"], "cuda")
    dev = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    host = torch.empty(4 * GiB, dtype=torch.uint8, pin_memory=True)
    h2d_ms(dev, host)

    def ceiling() -> float:
        return h2d_ms(dev, host)

    for name, kw in (("set_release", {}), ("set_keep", {"release": False}), ("set_after_pause", {"pause_s": 5.0}),
                     ("set_warmed", {"warm": True}), ("set_gap", {"gap_s": 0.5})):
        print(f"[diag_reload] {name}", flush=True)
        res[name] = set_series(tensors, a.cycles, ceiling, **kw)
    with open(os.path.join(a.out, "diag_reload.json"), "w") as f:
        json.dump(res, f, indent=1)
    for k in ("raw_torch_pinned", "raw_pool_block", "raw_fresh_device", "raw_grown_device"):
        print(f"{k:18} ms per rep: " + " ".join(f"{v:6.1f}" for v in res[k]))
    for k in ("set_release", "set_keep", "set_after_pause", "set_warmed", "set_gap"):
        r = res[k]
        extra = f" (warm {r['warm_s']:.2f} s)" if r["warm_s"] is not None else ""
        print(f"{k:18} reload/ceiling per cycle: " + " ".join(f"{v:.3f}" for v in r["reload_vs_ceiling"]) + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
