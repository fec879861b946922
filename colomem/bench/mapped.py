"""The wall-clock cycles of a set held in memory colomem maps itself (MappedSet), reported with the same keys
as transfer.colomem_swaps so the wall bench's headline reads both the same way.

An offload's wall clock is its copies plus the last chunk's unmap; a reload's is the first chunk's mapping
plus the copies (each later chunk is mapped behind the copy before it). There is no allocator between: no
re-growth of storages, no release of a cache, and the first cycle maps the same kind of memory as the later
ones."""

from __future__ import annotations

import time
from typing import Any

import torch

import colomem
from colomem._torch import mem_get_info
from colomem.bench.transfer import fingerprint, summarize_cycles
from colomem.swap_mapped import MappedSet


def mapped_swaps(tensors: dict[str, torch.Tensor], reps: int, chunk_bytes: int) -> dict:
    """Offload/reload cycles of a MappedSet holding a copy of `tensors` (the originals stay as they are),
    the first cycle after the set was made reported."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    before = fingerprint(tensors)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    pool = colomem.PinnedPool(int(nbytes * 1.01) + (64 << 20))
    pool_s = time.perf_counter() - t0
    s = MappedSet(list(tensors.items()), pool, name="bench", chunk_bytes=chunk_bytes)
    copies = dict(zip(tensors, s.tensors))
    cyc: list[dict] = []
    res: dict[str, Any] = {"nbytes": nbytes, "tensors": len(tensors), "pool_create_s": pool_s,
                           "chunk_bytes": s.memory.range.chunk_bytes, "chunks": s.memory.nchunks, "cycles": cyc}
    device = torch.device("cuda")
    torch.cuda.synchronize()
    free_resident = mem_get_info(device)[0]
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = s.offload(timing=True).wait()
        off_wall = time.perf_counter() - t0
        freed = mem_get_info(device)[0] - free_resident
        t0 = time.perf_counter()
        s.reload(timing=True)
        torch.cuda.synchronize()
        in_wall = time.perf_counter() - t0
        inn = s.wait()
        assert inn is not None
        cyc.append({"offload_ms": out.device_ms, "offload_wall_ms": off_wall * 1e3,
                    "reload_ms": inn.device_ms, "reload_wall_ms": in_wall * 1e3, "freed_bytes": freed,
                    "reload_alloc_ms": inn.map_ms,  # host time mapping chunks (all but the first behind copies)
                    "offload_around_ms": out.seconds * 1e3 - out.device_ms,
                    "reload_around_ms": in_wall * 1e3 - inn.device_ms})
        if i == 0:
            res["correct_after_first_cycle"] = fingerprint(copies) == before
    res["correct_after_all_cycles"] = fingerprint(copies) == before
    summarize_cycles(res, cyc, nbytes)
    del copies
    s.close()
    pool.close()
    return res


__all__ = ["mapped_swaps"]
