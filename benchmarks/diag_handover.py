#!/usr/bin/env python3
"""Is GPU memory slower to map and to copy into right after another process gave it back?

    python3 benchmarks/diag_handover.py --out DIR [--gib 8] [--rounds 3]

In the colocated loop memory changes hands between processes at every switch: vLLM's weights wake into what
the trainer's cache released a moment before, and the trainer's optimizer state comes back into what vLLM's
sleep released. Both ran slower than the same work on memory the process had used itself (the weights' wake
0.10 s against 0.03 s, the moments' copies back at 0.85 of the link against 0.96-0.98 in the transfer bench).
Here, with nothing else on the GPU, --gib of memory is taken (torch's expandable segments: cuMemCreate and
cuMemMap, as vLLM's sleep allocator and colomem's re-growth do) and filled from pinned host memory, the
allocation and the copy timed apart, after:
  fresh   nothing used that memory before in this run (first, once)
  own     this process took, touched and gave back the same amount just before
  other   another process took, touched and gave back the same amount just before (the handover)
`own` and `other` alternate for --rounds rounds. Writes DIR/diag_handover.json: per condition the
allocation's seconds and the copy's rate over a raw pinned copy's in the same process (the ceiling).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

GiB = 1 << 30
EXPANDABLE = "expandable_segments:True"


def _touch_and_give_back(torch, nbytes: int) -> None:
    """Takes nbytes on the GPU, touches every byte, gives them back to the driver."""
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    del t
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


def _take_and_give_back(nbytes: int, done) -> None:
    """The other process's turn: the same, then it says so."""
    import torch

    _touch_and_give_back(torch, nbytes)
    done.send(True)
    done.close()


def _timed_fill(torch, host, nbytes: int) -> dict:
    """Takes nbytes on the GPU and copies `host` into them: the allocation's host seconds, the copy's device
    seconds and its rate."""
    t0 = time.perf_counter()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    alloc_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dev.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    copy_s = start.elapsed_time(end) / 1e3
    del dev
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return {"alloc_s": alloc_s, "copy_s": copy_s, "gbps": nbytes / copy_s / 1e9}


def _ceiling(torch, host, nbytes: int) -> float:
    """A raw pinned copy into memory this process holds and touched already (best of three), GB/s."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.fill_(0)
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    del dev
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return best


def summarize(rows: list, ceiling_gbps: float) -> dict:
    """Per condition: medians (and ranges) of the allocation's seconds and the copy's rate over the ceiling."""
    out: dict = {}
    for cond in ("fresh", "own", "other"):
        got = [r for r in rows if r["condition"] == cond]
        if not got:
            continue
        ratios = [r["gbps"] / ceiling_gbps for r in got]
        allocs = [r["alloc_s"] for r in got]
        out[cond] = {"n": len(got), "alloc_s": statistics.median(allocs), "alloc_s_range": [min(allocs), max(allocs)],
                     "copy_vs_ceiling": statistics.median(ratios), "copy_vs_ceiling_range": [min(ratios), max(ratios)]}
    return out


def run(a) -> dict:
    import torch

    nbytes = int(a.gib * GiB)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host.fill_(7)
    rows = [{"condition": "fresh", "round": 0, **_timed_fill(torch, host, nbytes)}]
    ceiling = _ceiling(torch, host, nbytes)
    ctx = mp.get_context("spawn")
    for rnd in range(a.rounds):
        for cond in ("own", "other"):
            if cond == "own":
                _touch_and_give_back(torch, nbytes)
            else:
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_take_and_give_back, args=(nbytes, send))
                p.start()
                send.close()
                if not recv.poll(a.timeout_s):
                    p.kill()
                    raise TimeoutError(f"the other process did not give its {a.gib} GiB back within {a.timeout_s} s")
                recv.recv()
                p.join(a.timeout_s)
                if p.is_alive():
                    p.kill()
                    raise TimeoutError("the other process did not exit after giving its memory back")
            rows.append({"condition": cond, "round": rnd, **_timed_fill(torch, host, nbytes)})
            print(f"[handover] round {rnd} {cond}: alloc {rows[-1]['alloc_s'] * 1e3:.1f} ms, copy "
                  f"{rows[-1]['gbps']:.1f} GB/s ({rows[-1]['gbps'] / ceiling:.3f} of {ceiling:.1f})", flush=True)
    return {"gib": a.gib, "rounds": a.rounds, "ceiling_gbps": ceiling, "rows": rows,
            "summary": summarize(rows, ceiling), "device": torch.cuda.get_device_name(),
            "command": "python3 benchmarks/diag_handover.py " + " ".join(sys.argv[1:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=8.0, help="memory taken and filled per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="bound on the other process's turn")
    a = ap.parse_args(argv)
    if not a.gib > 0 or a.rounds < 1:
        ap.error("--gib must be > 0 and --rounds >= 1")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE     # before torch's allocator starts (the child's too)
    import torch

    if not torch.cuda.is_available():
        print("[handover] no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    res = run(a)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "diag_handover.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
