"""Measurements of the transfer benchmark: raw pinned peaks, torch baselines, colomem swaps, pool creation."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

import colomem
from colomem import _C
from colomem._torch import mem_get_info
from colomem.bench.shapes import ModelShape


def cuda_time_ms(fn: Callable[[], object], streams=()) -> float:
    """Device time of fn with CUDA events on the current stream (other streams joined before the end)."""
    cur = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for s in streams:
        s.wait_stream(cur)
    start.record(cur)
    fn()
    for s in streams:
        cur.wait_stream(s)
    end.record(cur)
    end.synchronize()
    return start.elapsed_time(end)


def summary(values_ms: list[float], nbytes: int) -> dict:
    med = statistics.median(values_ms)
    return {"ms_median": med, "ms_min": min(values_ms), "ms_max": max(values_ms), "reps": len(values_ms),
            "gbps": nbytes / (med / 1e3) / 1e9}


def raw_peaks(nbytes: int, reps: int) -> dict:
    """One big pinned copy per direction, and both directions at once on two streams (the ceilings)."""
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a.random_(0, 255)
    host_b.random_(0, 255)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h():
        host_a.copy_(dev_a, non_blocking=True)

    def h2d():
        dev_b.copy_(host_b, non_blocking=True)

    def both():
        with torch.cuda.stream(s1):
            host_a.copy_(dev_a, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_b.copy_(host_b, non_blocking=True)

    out = {}
    for name, fn, moved, streams in (("d2h", d2h, nbytes, ()), ("h2d", h2d, nbytes, ()),
                                     ("bidir", both, 2 * nbytes, (s1, s2))):
        cuda_time_ms(fn, streams)  # warm-up
        out[name] = summary([cuda_time_ms(fn, streams) for _ in range(reps)], moved)
    # device-to-device, counting bytes read plus written (the ceiling of the weight bridge)
    d2d = [cuda_time_ms(lambda: dev_b.copy_(dev_a)) for _ in range(reps + 1)][1:]
    out["d2d"] = summary(d2d, 2 * nbytes)
    del dev_a, dev_b, host_a, host_b
    torch.cuda.empty_cache()
    return out


def make_set(shape: ModelShape, device, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, s in shape.tensors():
        t = torch.empty(s, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(generator=gen)  # random bit patterns, never zeros
        out[name] = t
    return out


# The small-tensor set: 20,000 tensors of 4 KiB to 132 KiB (1.35 GB), dtypes in turn, the shape of LoRA
# adapters, norms, biases and optimizer scalars that a SwapSet moves in staging chunks.
SMALL_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)


def make_small_set(count: int, device, seed: int = 0, max_bytes: int = 132 << 10) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for i in range(count):
        dt = SMALL_DTYPES[i % len(SMALL_DTYPES)]
        nbytes = 4096 + (i * 7919) % (max_bytes - 4096)  # spread evenly over the range, odd sizes
        itemsize = torch.empty((), dtype=dt).element_size()
        t = torch.empty(max(1, nbytes // itemsize), dtype=dt, device=device)
        t.view(torch.uint8).random_(0, 2 if dt == torch.bool else 256, generator=gen)
        out[f"small.{i}"] = t
    return out


def fingerprint(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Cheap exact fingerprint: int64 sum of each tensor's 16-bit words (any changed bytes show up)."""
    return [int(_words(t).to(torch.int64).sum()) if t.numel() else 0 for t in tensors.values()]


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() % 2 == 0 else t.view(torch.uint8)


def torch_baselines(tensors: dict[str, torch.Tensor], slow_reps: int, fast_reps: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    res = {}

    def timed(fn, reps):
        vals = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            vals.append((time.perf_counter() - t0) * 1e3)
        return summary(vals, nbytes)

    def pin_then_copy():
        # What a first offload does without a pool: fresh pinned memory per tensor, all kept (no reuse).
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
        held = []
        for t in tensors.values():
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            held.append(h)
        torch.cuda.synchronize()
        del held

    if slow_reps:  # seconds each: one repetition is enough to make the point
        res["cpu_per_tensor"] = timed(lambda: [t.cpu() for t in tensors.values()], slow_reps)
        res["pin_per_tensor_then_copy"] = timed(pin_then_copy, slow_reps)
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in tensors.items()}

    def into_prepinned():
        for k, t in tensors.items():
            pinned[k].copy_(t, non_blocking=True)

    into_prepinned()
    res["nonblocking_into_prepinned"] = timed(into_prepinned, fast_reps)
    del pinned
    return res


def colomem_swaps(tensors: dict[str, torch.Tensor], reps: int, gap_s: float = 0.0, **set_kw) -> dict:
    """Offload/reload of the set through a pool made for it, the first cycle after pool creation reported.

    gap_s: seconds between each offload and its reload (in a colocated step the other engine's phase runs
    there). Back to back (0), the reload lands in memory the driver took back milliseconds earlier, and
    copies into such memory run slower for a while (docs/performance.md, pool pinning and reloads)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    before = fingerprint(tensors)
    torch.cuda.empty_cache()  # what earlier code left cached must not count as freed by the offload
    t0 = time.perf_counter()
    pool = colomem.PinnedPool(int(nbytes * 1.01) + (64 << 20))
    pool_s = time.perf_counter() - t0
    s = colomem.SwapSet.from_tensors(tensors, pool, name="bench", **set_kw)
    cyc: list[dict] = []
    res: dict[str, Any] = {"nbytes": nbytes, "tensors": len(tensors), "pool_create_s": pool_s, "gap_s": gap_s,
                           "cycles": cyc}
    free_resident = mem_get_info(torch.device("cuda"))[0]
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = s.offload(timing=True)
        off_wall = time.perf_counter() - t0
        freed = mem_get_info(torch.device("cuda"))[0] - free_resident
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        inn = s.reload(timing=True)
        torch.cuda.synchronize()
        in_wall = time.perf_counter() - t0
        cyc.append({"offload_ms": out.device_ms, "offload_wall_ms": off_wall * 1e3,
                    "reload_ms": inn.device_ms, "reload_wall_ms": in_wall * 1e3, "freed_bytes": freed,
                    "reload_alloc_ms": inn.alloc_ms,   # host time re-growing (pipelined: mostly behind copies)
                    # where the wall clock beyond the copies goes: the host's work outside the set's own clock
                    # (the plan, the layout, the pool blocks; the reload's final synchronize), and inside it
                    # beyond the copies' span on the device (submission, the first piece's growth, the
                    # release after the last copy, the wait's wake-up)
                    "offload_outside_ms": (off_wall - out.seconds) * 1e3,
                    "offload_around_ms": out.seconds * 1e3 - out.device_ms,
                    "reload_outside_ms": (in_wall - inn.seconds) * 1e3,
                    "reload_around_ms": inn.seconds * 1e3 - inn.device_ms})
        if i == 0:
            res["correct_after_first_cycle"] = fingerprint(tensors) == before
    res["correct_after_all_cycles"] = fingerprint(tensors) == before
    summarize_cycles(res, cyc, nbytes)
    s.close()
    pool.close()
    return res


def summarize_cycles(res: dict, cyc: list[dict], nbytes: int) -> None:
    """Into `res`: the first cycle, each figure's median over the cycles, the copy and wall-clock rates (median
    and first cycle) and the share of the set's bytes each offload gave back to the driver."""
    res["first_cycle"] = cyc[0]
    for k in cyc[0]:
        if k != "freed_bytes":
            res[k + "_median"] = statistics.median(c[k] for c in cyc)
    for d in ("offload", "reload"):
        res[f"{d}_gbps"] = nbytes / (res[f"{d}_ms_median"] / 1e3) / 1e9
        res[f"{d}_gbps_first"] = nbytes / (cyc[0][f"{d}_ms"] / 1e3) / 1e9
        res[f"{d}_wall_gbps"] = nbytes / (res[f"{d}_wall_ms_median"] / 1e3) / 1e9
    res["freed_fraction"] = statistics.median(c["freed_bytes"] for c in cyc) / nbytes


def colomem_bidir(shape: ModelShape, reps: int) -> dict:
    """Offload set A while reloading set B (both directions at once), alternating."""
    a, b = make_set(shape, "cuda", seed=1), make_set(shape, "cuda", seed=2)
    fa, fb = fingerprint(a), fingerprint(b)
    nbytes = sum(t.numel() * t.element_size() for t in a.values())
    pool = colomem.PinnedPool(int(2 * nbytes * 1.01) + (64 << 20))
    sa = colomem.SwapSet.from_tensors(a, pool, name="a")
    sb = colomem.SwapSet.from_tensors(b, pool, name="b")
    sb.offload()
    times, walls, allocs = [], [], []
    for i in range(reps + 1):
        src, dst = (sa, sb) if i % 2 == 0 else (sb, sa)
        torch.cuda.synchronize()
        t0 = time.perf_counter()

        out, inn = colomem.swap(offload=src, reload=dst, timing=True)
        walls.append((time.perf_counter() - t0) * 1e3)
        if i > 0:
            times.append(out.span_ms)  # copy time of both directions together, on the device
            allocs.append(inn.alloc_ms)  # swap() re-grows the reloaded set before either copy starts
    if sa.state != "resident":
        colomem.swap(offload=sb, reload=sa)
    sb.reload() if sb.state == "offloaded" else None
    ok = fingerprint(a) == fa and fingerprint(b) == fb
    res = summary(times, 2 * nbytes)
    wall = statistics.median(walls[1:])
    res.update({"nbytes_each_way": nbytes, "correct": ok, "wall_ms_median": wall, "first_ms": walls[0],
                "alloc_ms_median": statistics.median(allocs), "wall_gbps": 2 * nbytes / (wall / 1e3) / 1e9})
    sa.close(); sb.close()
    pool.close()
    del a, b
    torch.cuda.empty_cache()
    return res


def reload_variants(tensors: dict[str, torch.Tensor], variants: dict, reps: int) -> dict:
    """Reload of the set with copy engines of other chunk / small-copy sizes (which default to pick)."""
    from colomem import _torch as ct

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    pool = colomem.PinnedPool(int(nbytes * 1.01) + (64 << 20))
    s = colomem.SwapSet.from_tensors(tensors, pool, name="variants")
    idx = torch.cuda.current_device()
    default = ct.engine_for(torch.device("cuda", idx))
    out = {}
    try:
        for name, (chunk, small) in variants.items():
            ct._engines[idx] = _C.CopyEngine(idx, chunk, small)
            ms = []
            for _ in range(reps + 1):
                s.offload()
                ms.append(s.reload(timing=True).device_ms)
            out[name] = {"chunk_bytes": chunk, "small_copy_bytes": small, **summary(ms[1:], nbytes)}
    finally:
        ct._engines[idx] = default
        if s.state != "resident":
            s.reload()
        s.close()
        pool.close()
    return out


def _anon_huge_bytes() -> int:
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _thp_settings() -> dict:
    out = {}
    for k in ("enabled", "defrag"):
        try:
            out[k] = open(f"/sys/kernel/mm/transparent_hugepage/{k}").read().strip()
        except OSError:
            out[k] = "unknown"
    return out


def pool_creation(nbytes: int, prefault: str = "populate") -> dict:
    huge0 = _anon_huge_bytes()
    t0 = time.perf_counter()
    pool = colomem.PinnedPool(nbytes, prefault=prefault)
    total = time.perf_counter() - t0
    st = pool.stats()
    huge1 = _anon_huge_bytes()
    pool.close()
    return {"nbytes": nbytes, "prefault": prefault, "seconds": total, "prefault_seconds": st["prefault_seconds"],
            "pin_seconds": st["pin_seconds"], "map_seconds": st["map_seconds"],
            "huge_page_bytes": huge1 - huge0 if huge0 >= 0 else None, "thp": _thp_settings()}


def chunk_sweep(nbytes: int, chunks_mib: list[int], reps: int) -> dict:
    """Raw engine throughput for one big buffer at several chunk sizes (picks the default chunk)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    pool = colomem.PinnedPool(nbytes + (4 << 20))
    blk = pool.alloc(nbytes)
    out = {}
    for c in chunks_mib:
        eng = _C.CopyEngine(torch.cuda.current_device(), c << 20, 1 << 20)
        vals = {}
        for d, op in (("d2h", (blk.address, dev.data_ptr(), nbytes)), ("h2d", (dev.data_ptr(), blk.address, nbytes))):
            ms = []
            for _ in range(reps + 1):
                t = eng.submit(d, [op], wait_stream=torch.cuda.current_stream().cuda_stream, timing=True)
                t.wait(60)
                ms.append(t.elapsed_ms())
            vals[d] = summary(ms[1:], nbytes)["gbps"]
        out[str(c)] = vals
    blk.release()
    pool.close()
    return out


def host_path(shape: ModelShape, reps: int) -> dict:
    """The host backend (no GPU): CPU tensors to the pool and back with memcpy."""
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randint(-30000, 30000, s, dtype=torch.int16, generator=gen).view(torch.bfloat16)
               for n, s in shape.tensors()}
    ref = {k: v.clone() for k, v in tensors.items()}
    nbytes = sum(t.numel() * 2 for t in tensors.values())
    pool = colomem.PinnedPool(nbytes + (8 << 20))
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu")
    off, rel = [], []
    for _ in range(reps):
        off.append(s.offload().seconds * 1e3)
        rel.append(s.reload().seconds * 1e3)
    ok = all(torch.equal(tensors[k].view(torch.int16), ref[k].view(torch.int16)) for k in ref)
    s.close()
    pool.close()
    return {"nbytes": nbytes, "correct": ok, "offload": summary(off, nbytes), "reload": summary(rel, nbytes)}
