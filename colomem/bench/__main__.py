"""Transfer microbenchmark: python -m colomem.bench [--out DIR] [--sets 7b,1.5b] [--quick] [--only small|wall].

On a GPU: raw pinned peaks (each direction, both at once), torch baselines, colomem offload / reload /
bidirectional swap of Qwen2-7B- and 1.5B-shaped bf16 parameter sets, 16 GB pool creation, a chunk sweep, and
a set of many small tensors moved per tensor, in staging chunks and on slabs (--only small: that part alone,
with the peaks it is compared against; --only wall: each set's offload and reload by the wall clock, the
pipelined reload against growing every storage first, against the best of the raw and chunked peaks).
Correctness is checked before any number is reported; ratios are against the peaks of the same run.
Without a GPU it runs the host path on a small set and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time

import torch

import colomem
from colomem import _torch, swap_coalesce, swap_pipeline, swap_slab
from colomem.bench import mapped as bench_mapped
from colomem.bench import transfer
from colomem.bench.shapes import SHAPES

GB = 1e9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m colomem.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out", help="directory for transfer.json (and transfer.png)")
    ap.add_argument("--sets", default="7b,1.5b", help="comma list of: " + ",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions after warm-up")
    ap.add_argument("--peak-gib", type=float, default=4.0, help="buffer size for the raw peak copies")
    ap.add_argument("--pool-gb", type=float, default=16.0, help="pool size for the creation timing (GB)")
    ap.add_argument("--chunks-mib", default="4,16,64,256", help="chunk sizes for the sweep ('' to skip)")
    ap.add_argument("--no-reload-variants", dest="reload_variants", action="store_false",
                    help="skip timing the reload with other chunk and small-copy sizes")
    ap.add_argument("--skip-slow-baselines", action="store_true", help="skip .cpu() and per-tensor pinning")
    ap.add_argument("--gap-s", type=float, default=0.5,
                    help="also time cycles with this pause between offload and reload, in a fresh pool (0: skip)")
    ap.add_argument("--small-tensors", type=int, default=20000,
                    help="tensors in the small-tensor set, timed per tensor, coalesced and on slabs (0: skip)")
    ap.add_argument("--only", choices=["small", "wall"], default=None,
                    help="small: only the raw peaks and the small-tensor set; wall: only the raw peaks and each "
                    "set's offload and reload by the wall clock, the pipelined reload against growing every "
                    "storage first (short GPU runs)")
    ap.add_argument("--prime", action="store_true",
                    help="with --only wall: before each set's first cycle, map and fill expandable memory of the "
                    "set's size once and give it back (does the process's first re-growth cost the first cycle?)")
    ap.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run)")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def log(*a):
    print(f"[bench {time.strftime('%H:%M:%S')}]", *a, flush=True)


MiB = 1 << 20
# name -> (chunk bytes, small-copy bytes): the default (64 MiB, 1 MiB) and its neighbours
RELOAD_VARIANTS = {"default": (64 * MiB, 1 * MiB), "chunk16": (16 * MiB, 1 * MiB), "chunk256": (256 * MiB, 1 * MiB),
                   "small8": (64 * MiB, 8 * MiB), "nochunk": (1 << 40, 1 * MiB)}


def run_gpu(a) -> dict:
    res: dict = {"mode": "cuda", "device": torch.cuda.get_device_name(), "sets": {}}
    peak_bytes = int((0.25 if a.quick else a.peak_gib) * (1 << 30))
    log(f"raw pinned peaks with {peak_bytes / GB:.1f} GB buffers")
    res["peak"] = transfer.raw_peaks(peak_bytes, a.reps)
    if a.only == "small":
        res["small_tensors"] = small_tensors(2000 if a.quick else (a.small_tensors or 20000), a.reps)
        return res
    if a.only == "wall":
        res["chunk_sweep_gbps"] = transfer.chunk_sweep(peak_bytes, [64, 256], 3)
        res["wall"] = {key: wall_clock(key, SHAPES["tiny" if a.quick else key], a.reps, prime=a.prime)
                       for key in a.sets.split(",") if key}
        return res
    if a.chunks_mib:
        log("chunk sweep")
        res["chunk_sweep_gbps"] = transfer.chunk_sweep(peak_bytes, [int(c) for c in a.chunks_mib.split(",")], 3)
    pool_bytes = int((1.0 if a.quick else a.pool_gb) * GB)
    log(f"pool creation, {pool_bytes / GB:.0f} GB")
    res["pool_create"] = transfer.pool_creation(pool_bytes, prefault="touch")  # the default
    res["pool_create_populate"] = transfer.pool_creation(pool_bytes, prefault="populate")
    for key in [k for k in a.sets.split(",") if k]:
        shape = SHAPES["tiny" if a.quick else key]
        log(f"set {key}: {len(shape.tensors())} tensors, {shape.nbytes() / GB:.2f} GB")
        tensors = transfer.make_set(shape, "cuda")
        r = {"colomem": transfer.colomem_swaps(tensors, a.reps)}
        if a.gap_s > 0:
            log(f"  again with {a.gap_s:g} s between offload and reload (the other engine's phase)")
            r["colomem_gap"] = transfer.colomem_swaps(tensors, a.reps, gap_s=a.gap_s)
        for run in (r["colomem"], r.get("colomem_gap")):
            if run and not (run["correct_after_first_cycle"] and run["correct_after_all_cycles"]):
                raise SystemExit(f"set {key}: bytes changed across offload/reload; refusing to report timings")
        log(f"  colomem offload {r['colomem']['offload_gbps']:.1f} GB/s, reload {r['colomem']['reload_gbps']:.1f} GB/s")
        if a.reload_variants and not a.quick:
            log("  reload with other chunk / small-copy sizes")
            r["reload_variants"] = transfer.reload_variants(tensors, RELOAD_VARIANTS, 3)
        slow = 0 if a.skip_slow_baselines else 1
        if slow:
            log("  torch baselines (.cpu() per tensor, per-tensor pin_memory: slow by design)")
        r["torch"] = transfer.torch_baselines(tensors, slow, a.reps)
        del tensors
        torch.cuda.empty_cache()
        log("  bidirectional swap (two sets of this shape)")
        r["bidir"] = transfer.colomem_bidir(shape, a.reps)
        if not r["bidir"]["correct"]:
            raise SystemExit(f"set {key}: bidirectional swap changed bytes; refusing to report timings")
        res["sets"][key] = r
    if a.small_tensors:
        res["small_tensors"] = small_tensors(2000 if a.quick else a.small_tensors, a.reps)
    return res


# the wall bench's variants, in the order run: name -> (SwapSet keywords, (first piece bytes, piece growth,
# pieces cut by size) or None for the pipeline's own). The default (pipelined, re-grown in expandable segments)
# runs first and last (A ... A: drift over the run shows as A against A); the others: every storage grown
# before the first copy, pipelined in torch's default segments, the pieces cut in the set's order with x4
# growth (the embedding alone in front of the first copy, the output head alone after the last), and a smaller
# first piece.
WALL_VARIANTS = {"pipelined": ({}, None), "grow_first": ({"pipeline": False, "expandable": False}, None),
                 "pipelined_plain": ({"expandable": False}, None), "set_order": ({}, (64 * MiB, 4, False)),
                 "first16": ({}, (16 * MiB, 2, True)), "pipelined_again": ({}, None)}
# The set held in memory colomem maps itself (colomem/bench/mapped.py): name -> chunk bytes. Run between the
# SwapSet variants and the default's second run.
WALL_MAPPED = {"mapped": 256 * MiB, "mapped64": 64 * MiB}


@contextlib.contextmanager
def piece_sizes(sizes):
    """The pipeline's first piece, growth and cut by size for the duration (None: unchanged)."""
    if sizes is None:
        yield
        return
    saved = swap_pipeline.FIRST_PIECE_BYTES, swap_pipeline.PIECE_GROWTH, swap_pipeline.BY_SIZE
    swap_pipeline.FIRST_PIECE_BYTES, swap_pipeline.PIECE_GROWTH, swap_pipeline.BY_SIZE = sizes
    try:
        yield
    finally:
        swap_pipeline.FIRST_PIECE_BYTES, swap_pipeline.PIECE_GROWTH, swap_pipeline.BY_SIZE = saved


def prime_expandable(nbytes: int) -> float:
    """Maps `nbytes` of torch's expandable segments, fills them and gives them back to the driver; returns the
    seconds it took. The process's first re-growth then lands where one has been before."""
    t0 = time.perf_counter()
    with _torch.expandable_segments(torch.device("cuda")):
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    del block
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def wall_clock(key: str, shape, reps: int, prime: bool = False) -> dict:
    """One set's cycles by the wall clock, each of WALL_VARIANTS in turn. In a process started with
    expandable segments all of them use them. prime: expandable memory of the set's size mapped and filled
    once before the first cycle (prime_expandable)."""
    tensors = transfer.make_set(shape, "cuda")
    log(f"set {key}: {len(shape.tensors())} tensors, {shape.nbytes() / GB:.2f} GB, by the wall clock")
    if prime:
        log(f"  primed {shape.nbytes() / GB:.2f} GB of expandable memory in {prime_expandable(shape.nbytes()):.3f} s")
    out = {}
    order = [n for n in WALL_VARIANTS if n != "pipelined_again"] + list(WALL_MAPPED) + ["pipelined_again"]
    for name in order:
        if name in WALL_MAPPED:
            run = bench_mapped.mapped_swaps(tensors, reps, WALL_MAPPED[name])
            beyond = (f"mapping {run['reload_alloc_ms_median']:.2f} ms; beyond the copies: offload "
                      f"{run['offload_around_ms_median']:.2f} ms, reload {run['reload_around_ms_median']:.2f} ms")
        else:
            kw, sizes = WALL_VARIANTS[name]
            with piece_sizes(sizes):
                run = transfer.colomem_swaps(tensors, reps, **kw)
            beyond = (f"re-growth {run['reload_alloc_ms_median']:.2f} ms; beyond the copies, outside / inside the "
                      f"set's clock: offload {run['offload_outside_ms_median']:.2f} / "
                      f"{run['offload_around_ms_median']:.2f} ms, reload {run['reload_outside_ms_median']:.2f} / "
                      f"{run['reload_around_ms_median']:.2f} ms")
        if not (run["correct_after_first_cycle"] and run["correct_after_all_cycles"]):
            raise SystemExit(f"set {key} ({name}): bytes changed across offload/reload; refusing to report")
        log(f"  {name}: offload {run['offload_wall_gbps']:.1f} GB/s wall, reload {run['reload_wall_gbps']:.1f} "
            f"GB/s wall (copies {run['offload_gbps']:.1f} / {run['reload_gbps']:.1f}; {beyond})")
        out[name] = run
    del tensors
    torch.cuda.empty_cache()
    return out


def ceilings(res: dict) -> tuple[float, float]:
    """(D2H, H2D) GB/s: the best of the raw single copy and the chunked engine copies of the same run. A
    single 4 GiB copy runs a little below what chunked copies reach, so it alone under-states the link."""
    p, sweep = res["peak"], res.get("chunk_sweep_gbps") or {}
    return (max([p["d2h"]["gbps"], *(v["d2h"] for v in sweep.values())]),
            max([p["h2d"]["gbps"], *(v["h2d"] for v in sweep.values())]))


def _wall_headline(res: dict) -> dict:
    """Wall-clock offload and reload against the ceilings, each set's first cycle and median, and the worst
    set's (the target is for every shape)."""
    d2h, h2d = ceilings(res)
    by_set: dict = {}
    for key, runs in res["wall"].items():
        row = {}
        for name, r in runs.items():
            n, first = r["nbytes"], r["first_cycle"]
            row[name] = {"offload": r["offload_wall_gbps"] / d2h, "reload": r["reload_wall_gbps"] / h2d,
                         "offload_first": n / (first["offload_wall_ms"] / 1e3) / 1e9 / d2h,
                         "reload_first": n / (first["reload_wall_ms"] / 1e3) / 1e9 / h2d}
        by_set[key] = row
    pick = {k: {**v["pipelined"], "reload": max(v["pipelined"]["reload"], v["pipelined_again"]["reload"])}
            for k, v in by_set.items()}  # the better of the two runs of the default reload (drift shows in both)
    worst = min(pick, key=lambda k: min(pick[k]["offload"], pick[k]["reload"]))
    out = {"wall_ceiling_d2h_gbps": d2h, "wall_ceiling_h2d_gbps": h2d, "wall_worst_set": worst,
           "offload_wall_vs_peak_worst": min(v["offload"] for v in pick.values()),
           "reload_wall_vs_peak_worst": min(v["reload"] for v in pick.values()),
           "reload_wall_vs_peak_first_cycle_worst": min(v["reload_first"] for v in pick.values()),
           "wall_vs_peak_by_set": by_set}
    mapped = {k: v["mapped"] for k, v in by_set.items() if "mapped" in v}
    if mapped:  # the same figures for the set held in mapped memory
        for fig in ("offload", "reload", "offload_first", "reload_first"):
            out[f"mapped_{fig}_wall_vs_peak_worst"] = min(v[fig] for v in mapped.values())
    return out


SMALL_MODES = ("slab", "coalesced", "per_tensor")  # the SwapSet ways of moving the small-tensor set


def small_tensors(count: int, reps: int) -> dict:
    """The small-tensor set through a SwapSet per tensor, in staging chunks and on slabs, same run."""
    tensors = transfer.make_small_set(count, "cuda")
    log(f"small-tensor set: {count} tensors, {sum(t.nbytes for t in tensors.values()) / GB:.2f} GB")
    out: dict = {}

    def timed(name: str, **kw) -> None:
        run = transfer.colomem_swaps(tensors, reps, **kw)
        if not (run["correct_after_first_cycle"] and run["correct_after_all_cycles"]):
            raise SystemExit(f"small-tensor set ({name}): bytes changed across offload/reload; refusing to report")
        log(f"  {name}: offload {run['offload_wall_gbps']:.1f} GB/s wall, reload {run['reload_wall_gbps']:.1f} GB/s wall")
        out[name] = run

    timed("coalesced", coalesce_below=swap_coalesce.COALESCE_BELOW_ON)
    timed("per_tensor", coalesce_below=0)
    out["torch"] = transfer.torch_baselines(tensors, 0, reps)
    # Last: the slab set re-homes these tensors onto its slabs at its first offload, and they stay there. A
    # storage with a holder outside the set is not re-homed: what earlier runs left in reference cycles goes
    # first, and the storages the tensors ended on are reported, so a slab run that packed nothing shows.
    gc.collect()
    timed("slab", pack_small=swap_slab.PACK_SMALL_ON, coalesce_below=0)
    out["slab"]["storages_after"] = len({t.untyped_storage()._cdata for t in tensors.values()})
    log(f"  slab: the {count} tensors ended on {out['slab']['storages_after']} storages")
    del tensors
    torch.cuda.empty_cache()
    return out


def headline(res: dict) -> dict:
    """Top-level ratios for the 7B set (or the first set measured) and the small-tensor set."""
    if res.get("mode") != "cuda":
        return {}
    if "wall" in res:
        return _wall_headline(res)  # --only wall
    if not res["sets"]:
        return _small_headline(res)  # --only small
    key = "7b" if "7b" in res["sets"] else next(iter(res["sets"]))
    s, p = res["sets"][key], res["peak"]
    c, g = s["colomem"], s.get("colomem_gap")
    return {
        "headline_set": key,
        "offload_vs_peak": c["offload_gbps"] / p["d2h"]["gbps"],
        "reload_vs_peak": c["reload_gbps"] / p["h2d"]["gbps"],
        "offload_vs_peak_first_cycle": c["offload_gbps_first"] / p["d2h"]["gbps"],
        "reload_vs_peak_first_cycle": c["reload_gbps_first"] / p["h2d"]["gbps"],
        **({"reload_vs_peak_gap": g["reload_gbps"] / p["h2d"]["gbps"],
            "reload_vs_peak_first_cycle_gap": g["reload_gbps_first"] / p["h2d"]["gbps"],
            "offload_vs_peak_first_cycle_gap": g["offload_gbps_first"] / p["d2h"]["gbps"], "gap_s": g["gap_s"]}
           if g else {}),
        "offload_wall_vs_peak": c["offload_wall_gbps"] / p["d2h"]["gbps"],
        "reload_wall_vs_peak": c["reload_wall_gbps"] / p["h2d"]["gbps"],
        "bidir_vs_peak": s["bidir"]["gbps"] / p["bidir"]["gbps"],
        "bidir_wall_vs_peak": s["bidir"].get("wall_gbps", 0.0) / p["bidir"]["gbps"],
        "bidir_alloc_ms": s["bidir"].get("alloc_ms_median"),
        "pool_16GB_seconds": res["pool_create"]["seconds"],
        "pool_16GB_seconds_populate": res.get("pool_create_populate", {}).get("seconds"),
        "freed_fraction": c["freed_fraction"],
        **_small_headline(res),
    }


def _small_headline(res: dict) -> dict:
    """small_tensors_wall_vs_peak: offload and reload wall time together against the one-way peaks, for the
    best of the modes (small_tensors_mode names it); small_tensors_<mode>_* for each mode."""
    st, p = res.get("small_tensors"), res["peak"]
    if not st:
        return {}
    out: dict = {}
    for name in [m for m in SMALL_MODES if m in st]:
        r, key = st[name], "small_tensors_" + name
        ideal_ms = r["nbytes"] / p["d2h"]["gbps"] / 1e6 + r["nbytes"] / p["h2d"]["gbps"] / 1e6
        out[key + "_wall_vs_peak"] = ideal_ms / (r["offload_wall_ms_median"] + r["reload_wall_ms_median"])
        out[key + "_offload_wall_vs_peak"] = r["offload_wall_gbps"] / p["d2h"]["gbps"]
        out[key + "_reload_wall_vs_peak"] = r["reload_wall_gbps"] / p["h2d"]["gbps"]
    best = max((m for m in SMALL_MODES if m in st), key=lambda m: out[f"small_tensors_{m}_wall_vs_peak"])
    out["small_tensors_mode"] = best
    for k in ("wall_vs_peak", "offload_wall_vs_peak", "reload_wall_vs_peak"):
        out["small_tensors_" + k] = out[f"small_tensors_{best}_{k}"]
    pre = st["torch"].get("nonblocking_into_prepinned")
    if pre:
        out["small_tensors_torch_prepinned_vs_peak"] = pre["gbps"] / p["d2h"]["gbps"]
    return out


def table(res: dict) -> str:
    if res["mode"] != "cuda":
        h = res["host"]
        return (f"host path only (no CUDA device): {h['nbytes'] / GB:.3f} GB set, offload "
                f"{h['offload']['gbps']:.2f} GB/s, reload {h['reload']['gbps']:.2f} GB/s, correct={h['correct']}")
    p = res["peak"]
    rows = [("raw pinned D2H (one copy)", p["d2h"]["gbps"], 1.0), ("raw pinned H2D (one copy)", p["h2d"]["gbps"], 1.0),
            ("raw pinned both directions", p["bidir"]["gbps"], 1.0)]
    for key, s in res["sets"].items():
        c = s["colomem"]
        rows += [(f"{key} colomem offload", c["offload_gbps"], c["offload_gbps"] / p["d2h"]["gbps"]),
                 (f"{key} colomem offload (1st cycle)", c["offload_gbps_first"], c["offload_gbps_first"] / p["d2h"]["gbps"]),
                 (f"{key} colomem offload (wall)", c["offload_wall_gbps"], c["offload_wall_gbps"] / p["d2h"]["gbps"]),
                 (f"{key} colomem reload", c["reload_gbps"], c["reload_gbps"] / p["h2d"]["gbps"]),
                 (f"{key} colomem reload (1st cycle)", c["reload_gbps_first"], c["reload_gbps_first"] / p["h2d"]["gbps"]),
                 (f"{key} colomem reload (wall)", c["reload_wall_gbps"], c["reload_wall_gbps"] / p["h2d"]["gbps"]),
                 *([(f"{key} colomem reload, {g['gap_s']:g} s after offload", g["reload_gbps"],
                     g["reload_gbps"] / p["h2d"]["gbps"]),
                    (f"{key} colomem reload, {g['gap_s']:g} s after offload (1st cycle)", g["reload_gbps_first"],
                     g["reload_gbps_first"] / p["h2d"]["gbps"])] if (g := s.get("colomem_gap")) else []),
                 (f"{key} colomem bidirectional", s["bidir"]["gbps"], s["bidir"]["gbps"] / p["bidir"]["gbps"])]
        if "wall_gbps" in s["bidir"]:
            rows.append((f"{key} colomem bidirectional (wall, incl. {s['bidir']['alloc_ms_median']:.0f} ms alloc)",
                         s["bidir"]["wall_gbps"], s["bidir"]["wall_gbps"] / p["bidir"]["gbps"]))
        for name, v in (s.get("reload_variants") or {}).items():
            rows.append((f"{key} reload, engine {name}", v["gbps"], v["gbps"] / p["h2d"]["gbps"]))
        for name, t in (s.get("torch") or {}).items():
            if t:
                rows.append((f"{key} torch {name}", t["gbps"], t["gbps"] / p["d2h"]["gbps"]))
    if "wall" in res:
        d2h, h2d = ceilings(res)
        for key, runs in res["wall"].items():
            for name, r in runs.items():
                rows += [(f"{key} offload (wall, {name})", r["offload_wall_gbps"], r["offload_wall_gbps"] / d2h),
                         (f"{key} reload (wall, {name})", r["reload_wall_gbps"], r["reload_wall_gbps"] / h2d)]
    if st := res.get("small_tensors"):
        n = st["coalesced"]["tensors"]
        for name, r in ((m.replace("_", " "), st[m]) for m in SMALL_MODES if m in st):
            rows += [(f"{n} small tensors, {name}, offload (wall)", r["offload_wall_gbps"],
                      r["offload_wall_gbps"] / p["d2h"]["gbps"]),
                     (f"{n} small tensors, {name}, reload (wall)", r["reload_wall_gbps"],
                      r["reload_wall_gbps"] / p["h2d"]["gbps"])]
        if pre := st["torch"].get("nonblocking_into_prepinned"):
            rows.append((f"{n} small tensors, torch nonblocking_into_prepinned", pre["gbps"], pre["gbps"] / p["d2h"]["gbps"]))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'measurement':<{w}}  {'GB/s':>8}  {'x peak':>7}", "-" * (w + 19)]
    lines += [f"{n:<{w}}  {g:8.2f}  {r:7.3f}" for n, g, r in rows]
    for pc in (res.get("pool_create"), res.get("pool_create_populate")):
        if pc:
            lines.append(f"pool of {pc['nbytes'] / GB:.0f} GB ({pc['prefault']}) created and pinned in "
                         f"{pc['seconds']:.3f} s (pre-fault {pc['prefault_seconds']:.3f} s, register "
                         f"{pc['pin_seconds']:.3f} s)")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = res["peak"]
    labels, vals, peaks = [], [], []
    for key, s in res["sets"].items():
        c = s["colomem"]
        for name, v, pk in ((f"{key}\noffload", c["offload_gbps"], p["d2h"]["gbps"]),
                            (f"{key}\nreload", c["reload_gbps"], p["h2d"]["gbps"]),
                            (f"{key}\nbidir", s["bidir"]["gbps"], p["bidir"]["gbps"])):
            labels.append(name)
            vals.append(v)
            peaks.append(pk)
        pre = (s.get("torch") or {}).get("nonblocking_into_prepinned")
        if pre:
            labels.append(f"{key}\ntorch prepinned")
            vals.append(pre["gbps"])
            peaks.append(p["d2h"]["gbps"])
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.1), 4))
    ax.bar(range(len(vals)), peaks, color="#dddddd", label="raw peak (same run)")
    ax.bar(range(len(vals)), vals, color="#3366aa", width=0.6, label="measured")
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"colomem transfers on {res.get('device', '?')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    meta = {"command": "python -m colomem.bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "colomem": colomem.build_info(), "torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if torch.cuda.is_available() and colomem.build_info()["cuda"]:
        res = run_gpu(a)
    else:
        why = "colomem._C is host-only" if not colomem.build_info()["cuda"] else "no CUDA device visible"
        log(f"{why}: running the host path on a small set (no GPU numbers)")
        res = {"mode": "host", "reason": why, "host": transfer.host_path(SHAPES["tiny"], 3 if a.quick else a.reps)}
    out = {**headline(res), **res, "meta": meta}
    with open(os.path.join(a.out, "transfer.json"), "w") as f:
        json.dump(out, f, indent=1)
    if res["mode"] == "cuda" and res["sets"] and not a.no_plot:
        try:
            plot(res, os.path.join(a.out, "transfer.png"))
        except ImportError:
            log("matplotlib missing: no plot")
    print(table(res))
    for k, v in headline(res).items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
