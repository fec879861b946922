#!/usr/bin/env python3
"""The loop's weight sync after the trainer's offload: a bridge sync read from a set's pool copies, against
the host-to-device peak measured in the same run.

    python benchmarks/bench_sync_inloop.py --out DIR [--sets 1.5b,7b] [--reps 7] [--buckets loop,512MiB]

Per set (Qwen2-1.5B- and 7B-shaped bf16 tensors, colomem.bench.shapes): the tensors go into a SwapSet that
is offloaded into a PinnedPool, as the trainer's are when everything moves; the sync's sources are the set's
host views (SwapSet.host_view), as the DeepSpeed adapter's resolve_sync hands them to the bridge. A second
process maps the bridge's buffers and copies every bucket out along raw ranges (BridgeImporter.copy_out, what
vLLM's worker does from its third sync on) on its default stream, then ACKs over the socket (the listener
transport). Bucket sizes: `loop` is the one `--bucket-bytes auto` grows to for a sync from host copies
(colomem.runner.sync_bucket_plan.sync_bucket_target: a few buckets, so copies pipeline with the consumer), the others
as given; two buffers each. The same sync from the
tensors reloaded to the GPU is timed beside (`resident`), for what reading host memory costs.

Every configuration is checked first (the consumer's tensors against the set's, word sums per tensor), then
timed: median, min and max wall time of --reps syncs after one warm-up, GB/s of payload bytes, and the ratio to
the H2D peak (one large pinned copy, colomem.bench.transfer.raw_peaks). BridgeStats says where the time
went (the packs' device time, launch time, the consumer's ACK time, bytes by source kind). Writes
DIR/bench_sync_inloop.json: top level `sync_inloop_vs_peak` (the worst set, loop bucket), then per set.
On a machine without a GPU (--device cpu) it runs the same plumbing with host buffers and no ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)   # a fallback: an installed colomem or PYTHONPATH's comes first

import torch  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
LINE_TIMEOUT_S = 120.0  # the consumer's answer to a check sync


# -- the consumer process ------------------------------------------------------------------------------------
def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() % 2 == 0 else t.view(torch.uint8)


def word_sums(parts: dict) -> dict:
    """{name: int64 sum of its 16-bit words}; a split tensor's parts add up to the whole tensor's sum."""
    out: dict = {}
    for (name, _), t in parts.items():
        out[name] = out.get(name, 0) + (int(_words(t).to(torch.int64).sum()) if t.numel() else 0)
    return out


def consumer(address: str) -> None:
    """Applies every sync into its own tensors; after a sync tagged check:* prints their word sums."""
    from colomem.bridge import BridgeImporter
    from diag_bridge import ranges_for          # this folder's: the consumer's raw copies of a bucket

    imp = BridgeImporter.connect(address, timeout=60)
    dev = imp.device
    dst: dict = {}       # (name, part) -> tensor, made on first sight
    compiled: dict = {}  # (buffer, layout) -> ranges
    while True:
        try:
            msg = imp.receive(timeout=LINE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the producer closed the bridge: done
            print(json.dumps({"bye": str(exc)}), flush=True)
            break
        tag = msg.get("tag")
        while True:
            verify = "sampled" if msg.get("checksum") is not None else "none"   # a producer may send none
            imp.copy_out(msg, ranges_for(msg, dst, compiled, dev), verify=verify)
            imp.ack(msg)
            if msg.get("last"):
                break
            msg = imp.receive(timeout=LINE_TIMEOUT_S, tag=tag)
        if str(tag).startswith("check:"):
            print(json.dumps({"tag": tag, "sums": word_sums(dst)}), flush=True)
    imp.close()


# -- the producer ----------------------------------------------------------------------------------------------
def loop_bucket(nbytes: int) -> int:
    """The bucket `--bucket-bytes auto` grows to for a sync read from the pool's host copies when the placement
    leaves the memory (colomem.runner.sync_bucket_plan.sync_bucket_target)."""
    from colomem.runner.sync_bucket_plan import sync_bucket_target

    return sync_bucket_target(nbytes, from_host=True)


def read_line(child: subprocess.Popen, timeout: float) -> dict:
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"the consumer process said nothing within {timeout:g} s")
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the consumer process ended (rc {child.poll()})")
    return json.loads(line)


def stats_row(st) -> dict:
    moved = st.local_bytes + st.pinned_bytes
    return {"pack_copy_ms": st.pack_copy_seconds * 1e3, "pack_issue_ms": st.pack_issue_seconds * 1e3,
            "pack_checksum_ms": st.pack_checksum_seconds * 1e3, "pack_wait_ms": st.pack_wait_seconds * 1e3,
            "ack_ms": st.ack_seconds * 1e3, "messages": st.messages,
            "pack_gbps": moved / st.pack_copy_seconds / 1e9 if st.pack_copy_seconds else None,
            "pinned_bytes": st.pinned_bytes, "local_bytes": st.local_bytes, "torch_bytes": st.torch_bytes}


def median_rows(rows: list) -> dict:
    out = {}
    for k, v in rows[0].items():
        vals = [r[k] for r in rows if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)]
        if len(vals) == len(rows):
            out[k] = round(statistics.median(vals), 3)
    return out


def time_config(bridge, child, sources, want: dict, reps: int, version: list, peak) -> dict:
    """Checks one sync's bytes, then times `reps` after a warm-up."""
    nbytes = sum(t.numel() * t.element_size() for _, t in sources)
    version[0] += 1
    bridge.sync(sources, version=version[0], tag=f"check:{version[0]}")
    sums = read_line(child, LINE_TIMEOUT_S)["sums"]
    bad = [n for n, s in want.items() if sums.get(n) != s]
    if bad:
        raise AssertionError(f"the consumer's tensors differ from the set's: {bad[:5]}")
    walls, rows = [], []
    for rep in range(reps + 1):
        version[0] += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        st = bridge.sync(sources, version=version[0], tag=f"t:{version[0]}")
        wall = time.perf_counter() - t0
        if rep:  # the first one warms up
            walls.append(wall)
            rows.append(stats_row(st))
    med = statistics.median(walls)
    gbps = nbytes / med / 1e9
    return {"nbytes": nbytes, "ms_median": round(med * 1e3, 3), "ms_min": round(min(walls) * 1e3, 3),
            "ms_max": round(max(walls) * 1e3, 3), "reps": len(walls), "gbps": round(gbps, 2),
            "vs_h2d_peak": round(gbps / peak, 3) if peak else None, "verified": True, **median_rows(rows),
            "buckets_last": st.buckets}


def run_set(name: str, a, peak, res: dict) -> None:
    import colomem
    from colomem.bench.shapes import SHAPES
    from colomem.bench.transfer import fingerprint, make_set
    from colomem.bridge import WeightBridge
    from colomem.units import format_bytes, parse_bytes

    dev = torch.device(a.device)
    tensors = make_set(SHAPES[name], dev)
    want = dict(zip(tensors, fingerprint(tensors)))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out = res.setdefault(name, {"nbytes": nbytes, "tensors": len(tensors), "configs": {}})
    pool = colomem.PinnedPool(nbytes + 64 * MiB, pin=dev.type == "cuda")
    swap = colomem.SwapSet.from_tensors(tensors, pool, device=dev)
    version = [0]
    try:
        for spec in a.buckets.split(","):
            bucket = loop_bucket(nbytes) if spec == "loop" else parse_bytes(spec)
            label = f"loop ({format_bytes(bucket)})" if spec == "loop" else spec
            bridge = WeightBridge(bucket_bytes=bucket, buffers=2, device=dev, checksum="sampled", timeout=60)
            child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--consumer", bridge.address],
                                     stdout=subprocess.PIPE, text=True)
            try:
                bridge.wait_for_importers(1, 60)
                swap.offload()
                views = [(n, swap.host_view(t)) for n, t in tensors.items()]
                if any(v is None for _, v in views):
                    raise RuntimeError("a tensor of the set has no host view after the offload")
                row = time_config(bridge, child, views, want, a.reps, version, peak)
                del views
                swap.reload()
                if a.resident:
                    row["resident"] = {k: v for k, v in time_config(bridge, child, list(tensors.items()), want,
                                                                    a.reps, version, peak).items()
                                       if k != "buckets_last"}
                out["configs"][label] = {"bucket_bytes": bucket, **row}
                print(f"{name} {label}: {row['ms_median']} ms, {row['gbps']} GB/s, {row['vs_h2d_peak']} of the "
                      f"H2D peak (pack {row.get('pack_gbps')} GB/s)", flush=True)
            finally:
                if swap.state != "resident":
                    swap.reload()
                bridge.close()
                try:
                    child.wait(30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
    finally:
        swap.close()
        pool.close(force=True)
        del tensors
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def headline(res: dict) -> dict:
    """The worst set at the loop's bucket, and at each set's best bucket."""
    top: dict = {}
    loop = {n: next((c for k, c in r["configs"].items() if k.startswith("loop")), None) for n, r in res.items()}
    vals = [c["vs_h2d_peak"] for c in loop.values() if c and c["vs_h2d_peak"] is not None]
    if vals and len(vals) == len(res):
        top["sync_inloop_vs_peak"] = min(vals)
    best = [max(c["vs_h2d_peak"] for c in r["configs"].values()) for r in res.values()
            if r["configs"] and all(c["vs_h2d_peak"] is not None for c in r["configs"].values())]
    if best and len(best) == len(res):
        top["sync_inloop_best_bucket_vs_peak"] = min(best)
    for n, c in loop.items():
        if c:
            top[f"sync_inloop_{n}_ms_median"] = c["ms_median"]
    return top


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for bench_sync_inloop.json")
    ap.add_argument("--sets", default="1.5b,7b", help="colomem.bench.shapes names, comma-separated")
    ap.add_argument("--buckets", default="loop,512MiB,1GiB", help="bucket sizes ('loop': the loop's auto size)")
    ap.add_argument("--reps", type=int, default=7, help="timed syncs per configuration (after one warm-up)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-resident", dest="resident", action="store_false",
                    help="skip timing the same sync from the tensors on the GPU")
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.consumer:
        consumer(a.consumer)
        return 0
    if not a.out:
        ap.error("--out is required")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    out: dict = {"command": "python benchmarks/bench_sync_inloop.py " + " ".join(argv or sys.argv[1:]),
                 "device": a.device, "errors": []}
    peak = None
    if a.device != "cpu":
        from colomem.bench.transfer import raw_peaks

        peaks = raw_peaks(1 * GiB, 5)
        peak = peaks["h2d"]["gbps"]
        out.update(gpu=torch.cuda.get_device_name(), h2d_peak_gbps=round(peak, 2),
                   d2h_peak_gbps=round(peaks["d2h"]["gbps"], 2))
        print(f"H2D peak {peak:.1f} GB/s", flush=True)
    res: dict = {}
    path = os.path.join(a.out, "bench_sync_inloop.json")
    for name in a.sets.split(","):
        try:
            run_set(name, a, peak, res)
        except Exception as exc:  # noqa: BLE001 - recorded; the other sets still run
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"ERROR {name}: {type(exc).__name__}: {exc}", flush=True)
        out.update(headline(res), sets=res, wall_s=round(time.perf_counter() - t0, 1))
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "sets"}), flush=True)
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
