#!/usr/bin/env python3
"""Where a SwapSet offload / reload spends the wall clock beyond its copies, and whether that can overlap them.

    python3 benchmarks/diag_release.py --out DIR [--reps N] [--set 1.5b|7b]

The offload's extra is resize_(0) of every storage + torch.cuda.empty_cache() (cudaFree of each segment); the
reload's is resize_(nbytes) of every storage (cudaMalloc through torch's caching allocator) before any copy.
Each part repeated --reps times, every repetition kept with median / min / max (ms):
  release_regrow  release + empty_cache of the whole set, then its re-grow, the GPU idle (per storage, per size)
  during_copy     a 12 MiB segment freed / allocated while a long copy runs on a side stream: does the call wait
                  for it; 200 allocations during the copy: does it slow down
  reload          plain torch H2D of the set: into live memory (copy_only), re-grow all then copy (serial), re-grow
                  piece by piece (64 MiB, x4 each) while earlier pieces copy (pipelined); bytes checked each time
  offload         D2H alone (copy_only), then release all (serial), pieces released as their copies end while
                  later ones copy (pipelined); bytes checked each time
  swapset         colomem's SwapSet on the same set: wall clock against its engine's device time
A child process repeats all but swapset under expandable_segments:True (an allocator setting read when CUDA
starts); its results go under `expandable_segments`. Writes DIR/diag_release.json after every part.
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
sys.path.insert(0, ROOT)  # `python3 benchmarks/diag_release.py` measures the checkout's colomem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from release_set import (ALIGN, FIRST_PIECE, GROWTH, Set, alloc_conf, checksum, make_pieces, ms_since,  # noqa: E402
                         pc, segments, size_class, stats, summarise)

MiB, GiB = 1 << 20, 1 << 30
SEG = 12 * MiB          # >= 10 MiB: torch's caching allocator gives it a segment of its own (one cudaMalloc)
LOOP_ALLOCS = 200


def release_regrow(s: Set, reps: int) -> dict:
    """Part 1: the offload's release and the reload's re-grow alone, the GPU idle."""
    rows, per_call = [], [[] for _ in s.storages]
    for _ in range(reps):
        torch.cuda.synchronize()
        reserved, segs = torch.cuda.memory_reserved(), segments()
        t0 = pc()
        for st in s.storages:
            st.resize_(0)
        t1 = pc()
        torch.cuda.empty_cache()
        t2 = pc()
        r = {"resize0_ms": (t1 - t0) * 1e3, "empty_cache_ms": (t2 - t1) * 1e3,
             "freed_bytes": reserved - torch.cuda.memory_reserved(), "segments_freed": segs - segments()}
        r["empty_cache_us_per_segment"] = r["empty_cache_ms"] * 1e3 / max(1, r["segments_freed"])
        t0 = pc()
        for i, (st, n) in enumerate(zip(s.storages, s.nbytes)):
            a = pc()
            st.resize_(n)
            per_call[i].append(pc() - a)
        r["regrow_ms"] = ms_since(t0)
        r["regrow_us_per_storage"] = r["regrow_ms"] * 1e3 / len(s.storages)
        r["segments_regrown"] = segments() - segs + r["segments_freed"]
        torch.cuda.synchronize()
        rows.append(r)
    out = summarise(rows)
    out["storages"] = len(s.storages)
    by_class: dict = {}
    for cls in sorted({size_class(n) for n in s.nbytes}):
        idx = [i for i, n in enumerate(s.nbytes) if size_class(n) == cls]
        by_class[cls] = {"storages": len(idx), "bytes": sum(s.nbytes[i] for i in idx),
                         "regrow_ms": stats([sum(per_call[i][r] for i in idx) * 1e3 for r in range(reps)]),
                         "us_per_storage_median": statistics.median(per_call[i][r] * 1e6 for i in idx
                                                                    for r in range(reps))}
    out["regrow_by_size_class"] = by_class
    return out


def during_copy(s: Set, reps: int, long_bytes: int) -> dict:
    """Part 2: does freeing / allocating a segment wait for a long copy on another stream; do 200 allocations
    slow that copy. Each call comes right after an empty_cache, so it is a driver call (reserved_delta_bytes
    shows it: minus a segment for a free, plus one for an allocation)."""
    cur, side = torch.cuda.current_stream(), torch.cuda.Stream()
    bufs = {"dev": torch.empty(long_bytes, dtype=torch.uint8, device="cuda"), "host": s.host_buf[:long_bytes]}

    def start(d2h: bool):
        torch.cuda.synchronize()  # each copy starts on an idle GPU
        side.wait_stream(cur)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            e0.record(side)
            if d2h:
                bufs["host"].copy_(bufs["dev"], non_blocking=True)
            else:
                bufs["dev"].copy_(bufs["host"], non_blocking=True)
            e1.record(side)
        return e0, e1

    def timed_call(prefix: str, d2h, call) -> dict:
        """call() on the host while the long copy runs (d2h None: on an idle GPU)."""
        reserved = torch.cuda.memory_reserved()
        r: dict = {}
        e0, e1 = start(d2h) if d2h is not None else (None, None)
        if e1 is not None:
            r["running_before"] = not e1.query()
        t0 = pc()
        call()
        r["call_ms"] = ms_since(t0)
        if e0 is not None and e1 is not None:
            r["done_at_return"] = e1.query()
            e1.synchronize()
            r["copy_ms"] = e0.elapsed_time(e1)
        r["reserved_delta_bytes"] = torch.cuda.memory_reserved() - reserved
        return {prefix + k: v for k, v in r.items()}

    def new() -> torch.Tensor:
        return torch.empty(SEG, dtype=torch.uint8, device="cuda")

    def scenario(d2h) -> dict:
        r: dict = {}
        if d2h is not None:
            e0, e1 = start(d2h)
            e1.synchronize()
            r["copy_alone_ms"] = e0.elapsed_time(e1)
        torch.cuda.empty_cache()
        # control: nothing cached, so no cudaFree: a wait here would be torch's own, not the driver's
        r.update(timed_call("nothing_free_", d2h, torch.cuda.empty_cache))
        held = [new()]
        held.clear()  # back to torch's cache, no driver call yet: the empty_cache below frees its segment
        r.update(timed_call("free_", d2h, torch.cuda.empty_cache))
        r.update(timed_call("alloc_", d2h, lambda: held.append(new())))
        held.clear()
        torch.cuda.empty_cache()
        r.update(timed_call("loop_", d2h, lambda: held.extend(new() for _ in range(LOOP_ALLOCS))))
        held.clear()
        r.update(timed_call("loop_free_", None, torch.cuda.empty_cache))  # LOOP_ALLOCS segments, GPU idle
        return r

    out: dict = {"long_copy_bytes": long_bytes, "segment_bytes": SEG, "loop_allocs": LOOP_ALLOCS,
                 "idle": summarise([scenario(None) for _ in range(reps)])}
    for name, d2h in (("d2h", True), ("h2d", False)):
        start(d2h)[1].synchronize()  # warm-up
        out[name] = summarise([scenario(d2h) for _ in range(reps)])
    bufs.clear()
    torch.cuda.empty_cache()
    return out


def reload_once(s: Set, side: torch.cuda.Stream, pieces: list[list[int]]) -> dict:
    """Re-grows each piece (only storages released before), then queues its H2D copies on `side`, the next
    piece re-grown while they run. One piece: re-grow all, then copy all."""
    cur = torch.cuda.current_stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = pc()
    grow_ms = 0.0
    for k, piece in enumerate(pieces):
        a = pc()
        s.regrow(piece)
        grow_ms += ms_since(a)
        side.wait_stream(cur)  # the allocator may hand out memory the current stream used last: copy after it
        with torch.cuda.stream(side):
            if k == 0:
                e0.record(side)
            for i in piece:
                s.tensors[i].copy_(s.host[i], non_blocking=True)
    e1.record(side)
    submit_ms = ms_since(t0)
    e1.synchronize()
    return {"wall_ms": ms_since(t0), "grow_ms": grow_ms, "submit_ms": submit_ms,
            "copy_span_ms": e0.elapsed_time(e1)}


def offload_once(s: Set, side: torch.cuda.Stream, pieces: list[list[int]], release: bool) -> dict:
    """Queues every piece's D2H copies on `side` (an event after each), then, piece after piece as its event
    completes, shrinks its storages and calls empty_cache() while later pieces may still copy."""
    cur = torch.cuda.current_stream()
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in pieces]
    torch.cuda.synchronize()
    t0 = pc()
    side.wait_stream(cur)  # the copies read what the current stream wrote last
    with torch.cuda.stream(side):
        start.record(side)
        for piece, ev in zip(pieces, ends):
            for i in piece:
                s.host[i].copy_(s.tensors[i], non_blocking=True)
            ev.record(side)
    submit_ms = ms_since(t0)
    piece_release_ms = []
    for piece, ev in zip(pieces, ends):
        ev.synchronize()  # this piece's copies are done: nothing else uses its memory, it may go now
        if release:
            a = pc()
            for i in piece:
                s.storages[i].resize_(0)
            torch.cuda.empty_cache()
            piece_release_ms.append(ms_since(a))
    return {"wall_ms": ms_since(t0), "submit_ms": submit_ms, "copy_span_ms": start.elapsed_time(ends[-1]),
            "release_ms": sum(piece_release_ms), "piece_release_ms": piece_release_ms}


def piece_list(s: Set, pieces: list[list[int]]) -> list[dict]:
    return [{"storages": len(p), "bytes": sum(s.nbytes[i] for i in p)} for p in pieces]


def reload_part(s: Set, reps: int) -> dict:
    """Part 4: pipelined re-grow + H2D against re-grow-then-copy and the copy alone."""
    side, idx = torch.cuda.Stream(), list(range(len(s.tensors)))
    pieces = make_pieces(s.nbytes)
    variants = {"copy_only": [idx], "serial": [idx], "pipelined": pieces}
    rows: dict = {k: [] for k in variants}
    for _ in range(reps):
        for name, pcs in variants.items():  # interleaved, so a drift reaches every variant alike
            if name == "copy_only":
                for t in s.tensors:
                    t.zero_()  # live memory, no longer holding the right bytes
            else:
                s.release_all()
            r = reload_once(s, side, pcs)
            r["ok"] = checksum(s.tensors) == s.ref
            if not r["ok"]:
                s.prepare()  # the offload part reads the set's bytes: they must be right again
            rows[name].append(r)
    return {"pieces": piece_list(s, pieces), **{k: summarise(v) for k, v in rows.items()}}


def offload_part(s: Set, reps: int) -> dict:
    """Part 5: D2H with each piece released as soon as it is copied, against copy-all-then-release."""
    side, n = torch.cuda.Stream(), len(s.tensors)
    idx = list(range(n))
    # largest piece first, so the release left after the last copy is that of the smallest piece
    pieces = [[n - 1 - i for i in p] for p in make_pieces(s.nbytes[::-1])][::-1]
    variants = {"copy_only": ([idx], False), "serial": ([idx], True), "pipelined": (pieces, True)}
    zeros = torch.zeros(max(s.nbytes), dtype=torch.uint8, device="cuda")
    rows: dict = {k: [] for k in variants}
    for _ in range(reps):
        for name, (pcs, release) in variants.items():
            for h, nb in zip(s.host_flat, s.nbytes):  # the host copy zeroed: only this offload can fill it
                h.copy_(zeros[:nb], non_blocking=True)
            r = offload_once(s, side, pcs, release)
            reload_once(s, side, [idx])  # back from the host copy, so the checksum judges this offload
            r["ok"] = checksum(s.tensors) == s.ref
            if not r["ok"]:
                s.prepare()  # the next variants start from the right bytes again
            rows[name].append(r)
    del zeros
    torch.cuda.empty_cache()
    return {"pieces": piece_list(s, pieces), **{k: summarise(v) for k, v in rows.items()}}


def swapset_part(s: Set, reps: int) -> dict:
    """colomem's SwapSet (release=True, per-storage copies) on the same set: wall clock against device time.
    The first cycle after the pool's creation is kept apart (it runs below the link, see diag_reload.py)."""
    try:
        import colomem
        pool = colomem.PinnedPool(int(sum(s.nbytes) * 1.01) + 64 * MiB)
        sw = colomem.SwapSet.from_tensors(s.tensors, pool, name="diag_release")
    except Exception as exc:  # e.g. a host-only colomem._C: the torch parts above still stand
        return {"error": repr(exc)}
    rows: list[dict] = []
    closing: list[str] = []  # filled in `finally`, after a return value holding it was built
    try:
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = pc()
            off = sw.offload(timing=True)
            off_wall = ms_since(t0)
            t0 = pc()
            inn = sw.reload(timing=True)
            torch.cuda.synchronize()
            in_wall = ms_since(t0)
            rows.append({"offload_wall_ms": off_wall, "offload_device_ms": off.device_ms,
                         "offload_extra_ms": off_wall - off.device_ms, "reload_wall_ms": in_wall,
                         "reload_device_ms": inn.device_ms, "reload_alloc_ms": inn.alloc_ms,
                         "reload_extra_ms": in_wall - inn.device_ms})
    except Exception as exc:
        return {"error": repr(exc), "cycles_done": rows, "close_errors": closing}
    finally:
        for close in (sw.close, pool.close):  # best effort: an error above is what the JSON must carry
            try:
                close()
            except Exception as exc:
                closing.append(repr(exc))
    return {"first_cycle": rows[0], **summarise(rows[1:]), "ok": checksum(s.tensors) == s.ref,
            "close_errors": closing}


def run_child(a, out_dir: str) -> tuple[dict | None, dict]:
    """This script again with expandable segments on, bounded by --child-timeout; -> (its results, how it ran)."""
    path = os.path.join(out_dir, "diag_release_expandable.json")
    if os.path.exists(path):
        os.remove(path)  # an earlier run's file must not pass for this one's
    env = dict(os.environ)
    conf = ",".join(x for x in (alloc_conf(), "expandable_segments:True") if x)
    env["PYTORCH_CUDA_ALLOC_CONF"] = env["PYTORCH_ALLOC_CONF"] = conf  # the old name and the newer one
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--out", out_dir, "--reps", str(a.reps),
           "--set", a.set, "--long-gib", str(a.long_gib)]
    info: dict = {"command": " ".join(cmd), "alloc_conf": conf,
                  "timeout_s": a.child_timeout, "timed_out": False}
    t0 = pc()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.child_timeout)
        info["rc"], tail = p.returncode, (p.stdout or "")[-1500:] + (p.stderr or "")[-1500:]
    except subprocess.TimeoutExpired as exc:  # run() has killed it; the parts it finished are in its file
        info["rc"], info["timed_out"] = None, True
        tail = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (exc.stdout, exc.stderr))[-3000:]
    info["seconds"] = pc() - t0
    if info["rc"] != 0:
        info["output_tail"] = tail
    res = None
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    return res, info


def table(res: dict, label: str) -> None:
    print(f"\n== {label}  (ms: median / min / max)")

    def row(name: str, st, note: str = "") -> None:
        if isinstance(st, dict) and "median" in st:
            print(f"  {name:42} {st['median']:9.2f} {st['min']:9.2f} {st['max']:9.2f}  {note}")

    def flag(f: dict) -> str:
        return f"{f['true']}/{f['of']}"

    rr = res.get("release_regrow")
    if rr:
        row("resize_(0) of all storages", rr["resize0_ms"])
        row("empty_cache after it (GPU idle)", rr["empty_cache_ms"], f"segments {rr['segments_freed']['median']}")
        row(f"regrow of all {rr['storages']} storages", rr["regrow_ms"],
            f"{rr['regrow_us_per_storage']['median']:.1f} us/storage")
        for cls, c in rr["regrow_by_size_class"].items():
            row(f"  {cls} ({c['storages']})", c["regrow_ms"], f"{c['us_per_storage_median']:.1f} us/storage")
    dc = res.get("during_copy")
    if dc:
        what = {"nothing_free": "empty_cache, nothing cached", "free": "12 MiB free (empty_cache)",
                "alloc": "12 MiB alloc", "loop": f"{LOOP_ALLOCS} x 12 MiB allocs"}
        for k, w in what.items():
            row(f"{w}, GPU idle", dc["idle"][k + "_call_ms"])
        for d in ("d2h", "h2d"):
            x = dc[d]
            row(f"{d} long copy alone (device)", x["copy_alone_ms"])
            for k, w in what.items():
                row(f"  {w} during it", x[k + "_call_ms"], f"copy done at return {flag(x[k + '_done_at_return'])}, "
                    f"copy {x[k + '_copy_ms']['median']:.1f} ms")
    for part in ("reload", "offload"):
        for v in ("copy_only", "serial", "pipelined") if part in res else ():
            x = res[part][v]
            row(f"{part} {v} (wall)", x["wall_ms"], f"copy span {x['copy_span_ms']['median']:.1f}, "
                f"bytes ok {flag(x['ok'])}")
    sw = res.get("swapset")
    if sw and "error" not in sw:
        for k in ("offload_wall_ms", "offload_device_ms", "reload_wall_ms", "reload_device_ms", "reload_alloc_ms"):
            row(f"swapset {k}", sw[k], f"bytes ok {sw['ok']}" if k == "reload_alloc_ms" else "")
    elif sw:
        print(f"  swapset: {sw['error']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--set", default="1.5b", choices=("1.5b", "7b"))
    ap.add_argument("--long-gib", type=float, default=4.0, help="the long copy of during_copy (at most 4)")
    ap.add_argument("--child-timeout", type=float, default=35.0, help="seconds for the expandable-segments run")
    ap.add_argument("--no-child", action="store_true", help="skip the expandable-segments run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    if not torch.cuda.is_available():
        print("diag_release: needs a CUDA GPU and none is visible; nothing measured")
        return 0
    from colomem.bench.shapes import SHAPES  # after the check: a CPU-only checkout may lack a built core

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "diag_release_expandable.json" if a.child else "diag_release.json")
    long_bytes = int(min(a.long_gib, 4.0) * GiB) // ALIGN * ALIGN
    shape = SHAPES[a.set]
    res: dict = {"meta": {
        "command": "python3 benchmarks/diag_release.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "alloc_conf": alloc_conf(),
        "set": a.set, "tensors": len(shape.tensors()), "nbytes": shape.nbytes(), "reps": a.reps,
        "first_piece_bytes": FIRST_PIECE, "piece_growth": GROWTH, "part_s": {}}}

    def save() -> None:  # whole files only: the parent may kill the child mid-run and read what it left
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)

    def step(name: str, fn, *args) -> None:
        print(f"[diag_release{' child' if a.child else ''}] {name}", flush=True)
        t0 = pc()
        res[name] = fn(*args)
        res["meta"]["part_s"][name] = pc() - t0
        save()

    t0 = pc()
    s = Set(shape, long_bytes)
    res["meta"]["setup_s"] = pc() - t0
    res["meta"]["expandable_seen"] = any(seg.get("is_expandable", False) for seg in torch.cuda.memory_snapshot())
    step("release_regrow", release_regrow, s, a.reps)
    step("during_copy", during_copy, s, a.reps, long_bytes)
    s.prepare()
    step("reload", reload_part, s, a.reps)
    step("offload", offload_part, s, a.reps)
    if not a.child:
        step("swapset", swapset_part, s, a.reps)
    del s
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # the pinned buffer, not held while the child runs
    if a.child:
        return 0
    if not a.no_child:
        print("[diag_release] the same under expandable_segments:True (child process)", flush=True)
        res["expandable_segments"], res["meta"]["child"] = run_child(a, a.out)
        save()
    table(res, f"{a.set} set, {res['meta']['tensors']} tensors, {res['meta']['nbytes'] / 1e9:.2f} GB, "
               f"{res['meta']['device']}, allocator as configured")
    if res.get("expandable_segments"):
        table(res["expandable_segments"], "the same, expandable_segments:True")
    elif "child" in res["meta"]:
        print(f"\nexpandable-segments run gave nothing: {res['meta']['child']}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
