#!/usr/bin/env python3
"""Where the time of a bridge sync goes, without vLLM: a producer process and a consumer process on one GPU.

    python benchmarks/diag_bridge.py --out DIR [--reps 5] [--bucket 1GiB] [--buffers 2]

The producer sends a Qwen2-7B-shaped bf16 set (15.2 GB) over the socket transport; for each mode the
consumer does a different part of the work, so the differences isolate each cost:
  ack        receive + ACK only (pack on the producer + the protocol)
  verify     + the sampled checksum of every bucket
  copy       + copying every entry out of the mapped buffer into its own tensors (no verify)
  full       verify + copy (what vLLM's worker does, minus load_weights)
  ranges     verify + the same copies as raw ranges computed once per bucket layout (BridgeImporter.copy_out:
             what vLLM's worker does from the third sync on)
  local      the copies alone, in the consumer, from a local buffer of the same size (no IPC, no producer)
Writes DIR/diag_bridge.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)   # a fallback: an installed colomem or PYTHONPATH's comes first
MODES = ("ack", "verify", "copy", "full", "ranges")


def ranges_for(msg: dict, dst: dict, compiled: dict, device="cuda") -> torch.Tensor:
    """Raw (destination, offset in the bucket, bytes) copies of a bucket's entries into `dst`'s tensors (made
    on `device` on first sight), computed once per bucket layout."""
    from colomem.bridge.buckets import BucketMessage, dtype_from_name
    from colomem._torch import ranges_tensor

    key = (msg["buffer"], msg["layout"])
    if key not in compiled:
        ops = []
        for e in BucketMessage.from_dict(msg).entries:
            d = dst.get((e.name, e.part))
            if d is None:
                d = dst[(e.name, e.part)] = torch.empty(e.numel, dtype=dtype_from_name(e.dtype), device=device)
            if e.nbytes:
                ops.append((d.data_ptr(), e.offset, e.nbytes))
        compiled[key] = ranges_tensor(ops)
    return compiled[key]


def apply_ranges(imp, msg: dict, dst: dict, compiled: dict, t: dict) -> None:
    """verify + copies as raw ranges (BridgeImporter.copy_out), timed."""
    t0 = time.perf_counter()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    imp.copy_out(msg, ranges_for(msg, dst, compiled), verify="sampled")
    ev1.record()
    ev1.synchronize()
    t["copy_ms"] += (time.perf_counter() - t0) * 1e3
    t["gpu_copy_ms"] += ev0.elapsed_time(ev1)


def apply_views(imp, msg: dict, mode: str, dst: dict, t: dict) -> None:
    """The mode's share of the work through views of the bucket's entries, timed."""
    t0 = time.perf_counter()
    if mode in ("verify", "full"):
        imp.verify(msg, "sampled")
    t1 = time.perf_counter()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for e, view in imp.entries(msg, verify="none"):
        if mode in ("copy", "full"):
            d = dst.get((e.name, e.part))
            if d is None:
                d = dst[(e.name, e.part)] = torch.empty_like(view)
            d.copy_(view, non_blocking=True)
    ev1.record()
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    t["verify_ms"] += (t1 - t0) * 1e3
    t["copy_ms"] += (t2 - t1) * 1e3
    t["wait_ms"] += (t3 - t2) * 1e3
    t["gpu_copy_ms"] += ev0.elapsed_time(ev1)


def consumer(address: str) -> None:
    from colomem.bridge import BridgeImporter

    imp = BridgeImporter.connect(address, timeout=60)
    dst: dict = {}
    compiled: dict = {}
    out = sys.stdout
    while True:
        try:
            first = imp.receive(timeout=120)
        except Exception as exc:  # noqa: BLE001 - the producer closed: done
            print(json.dumps({"bye": str(exc)}), file=out, flush=True)
            break
        tag = first.get("tag")
        mode = tag.split(":")[0]
        t = {"mode": mode, "verify_ms": 0.0, "copy_ms": 0.0, "wait_ms": 0.0, "gpu_copy_ms": 0.0, "buckets": 0}
        msg = first
        while True:
            if mode == "ranges":
                apply_ranges(imp, msg, dst, compiled, t)
            else:
                apply_views(imp, msg, mode, dst, t)
            t["buckets"] += 1
            imp.ack(msg)
            if msg.get("last"):
                break
            msg = imp.receive(timeout=120, tag=tag)
        print(json.dumps(t), file=out, flush=True)
    # the copies alone, local buffer -> local tensors, same entries
    if dst:
        size = max(1 << 30, max(d.numel() * d.element_size() for d in dst.values()))
        buf = torch.empty(size, dtype=torch.uint8, device="cuda")
        pairs = []
        for (name, part), d in dst.items():
            n = d.numel() * d.element_size()
            off = (len(pairs) * 4096) % (size - n) if n < size else 0
            pairs.append((d, buf[off:off + n].view(d.dtype).view(d.shape)))
        ms = []
        for _ in range(4):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            e1.record()
            torch.cuda.synchronize()
            ms.append(e0.elapsed_time(e1))
        print(json.dumps({"mode": "local", "gpu_copy_ms": statistics.median(ms[1:])}), file=out, flush=True)
    imp.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--bucket", default="1GiB")
    ap.add_argument("--buffers", type=int, default=2)
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.consumer:
        consumer(a.consumer)
        return 0
    from colomem.bench.shapes import SHAPES
    from colomem.bench.transfer import make_set
    from colomem.bridge import WeightBridge

    os.makedirs(a.out, exist_ok=True)
    items = list(make_set(SHAPES["7b"], "cuda").items())
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    bridge = WeightBridge(bucket_bytes=a.bucket, buffers=a.buffers, checksum="sampled", timeout=60)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--out", a.out, "--consumer",
                              bridge.address], stdout=subprocess.PIPE, text=True)
    res: dict = {"nbytes": nbytes, "bucket": a.bucket, "buffers": a.buffers, "modes": {}}
    try:
        bridge.wait_for_importers(1, 60)
        for mode in MODES:
            walls, side = [], []
            for rep in range(a.reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                st = bridge.sync(items, version=len(walls) + 100 * MODES.index(mode), tag=f"{mode}:{rep}")
                wall = (time.perf_counter() - t0) * 1e3
                line = json.loads(child.stdout.readline())
                if rep:
                    walls.append(wall)
                    side.append({**line, "pack_wait_ms": st.pack_wait_seconds * 1e3, "ack_ms": st.ack_seconds * 1e3,
                                 "messages": st.messages})
            med = {k: statistics.median(s[k] for s in side) for k in side[0] if isinstance(side[0][k], (int, float))}
            res["modes"][mode] = {"wall_ms_median": statistics.median(walls), "walls": walls, **med}
            print(f"{mode:7} wall {statistics.median(walls):7.1f} ms  " +
                  "  ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)
        bridge.close()
        for line in child.stdout:
            d = json.loads(line)
            if d.get("mode") == "local":
                res["modes"]["local"] = d
                print(f"local   gpu copy {d['gpu_copy_ms']:.1f} ms (the consumer's copies without IPC)", flush=True)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
        bridge.close()
    with open(os.path.join(a.out, "diag_bridge.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
