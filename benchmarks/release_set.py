"""diag_release's parts: the benchmark set on the GPU with its pinned host copy (Set), the pieces its pipelined
copies go in, and the small helpers every part of the diagnostic uses (timing, statistics, checksums)."""
from __future__ import annotations

import os
import statistics
import time

import torch

MiB = 1 << 20
FIRST_PIECE, GROWTH = 64 * MiB, 4
ALIGN = 4096            # offsets of the host copies in their one pinned buffer
pc = time.perf_counter


def ms_since(t0: float) -> float:
    return (pc() - t0) * 1e3


def stats(values: list) -> dict:
    return {"values": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rows: list[dict]) -> dict:
    """Per key over the repetitions: numbers -> stats, flags -> how many were true, anything else as is."""
    out: dict = {}
    for k in rows[0]:
        v = [r[k] for r in rows]
        if isinstance(v[0], bool):
            out[k] = {"values": v, "true": sum(v), "of": len(v)}
        elif isinstance(v[0], (int, float)):
            out[k] = stats(v)
        else:
            out[k] = {"values": v}
    return out


def checksum(tensors: list[torch.Tensor]) -> list[int]:
    """int64 sum of each tensor's 16-bit words, one host sync: a lost or stale copy shows."""
    return torch.stack([t.view(torch.int16).sum(dtype=torch.int64) for t in tensors]).tolist()


def alloc_conf() -> str | None:
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


def segments() -> int:
    return int(torch.cuda.memory_stats().get("segment.all.current", 0))


def size_class(n: int) -> str:
    """torch's caching allocator: <= 1 MiB from 2 MiB segments, < 10 MiB from shared 20 MiB ones, else its own."""
    return "small_le1MiB" if n <= MiB else "mid_lt10MiB" if n < 10 * MiB else "large_ge10MiB"


def make_pieces(sizes: list[int]) -> list[list[int]]:
    """Consecutive indices in pieces of at least FIRST_PIECE, FIRST_PIECE*GROWTH, ... bytes (the last may be less)."""
    pieces, cur, acc, target = [], [], 0, FIRST_PIECE
    for i, n in enumerate(sizes):
        cur.append(i)
        acc += n
        if acc >= target:
            pieces.append(cur)
            cur, acc, target = [], 0, target * GROWTH
    return pieces + [cur] if cur else pieces


class Set:
    """The bf16 benchmark set on the GPU and a pinned copy of it in views of one pinned buffer (as a colomem pool
    holds it; the long copy of during_copy uses the same buffer before the copy is filled)."""

    def __init__(self, shape, host_min: int):
        self.tensors = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for _, s in shape.tensors()]
        self.storages = [t.untyped_storage() for t in self.tensors]
        self.nbytes = [st.nbytes() for st in self.storages]
        offs, off = [], 0
        for n in self.nbytes:
            offs.append(off)
            off += -(-n // ALIGN) * ALIGN
        self.host_buf = torch.empty(max(off, host_min), dtype=torch.uint8, pin_memory=True)
        self.host_flat = [self.host_buf[o:o + n] for o, n in zip(offs, self.nbytes)]
        self.host = [h.view(t.dtype).view(t.shape) for h, t in zip(self.host_flat, self.tensors)]
        self.ref: list[int] = []

    def prepare(self) -> None:
        """Random bytes into the set (what earlier parts left there is garbage) and the same into its host copy."""
        self.regrow()
        gen = torch.Generator(device="cuda").manual_seed(0)
        for t in self.tensors:
            t.view(torch.int16).random_(generator=gen)  # random bit patterns, never all zeros
        for h, t in zip(self.host, self.tensors):
            h.copy_(t)
        self.ref = checksum(self.tensors)

    def regrow(self, idx=None) -> None:
        for i in range(len(self.storages)) if idx is None else idx:
            if self.storages[i].nbytes() == 0:  # resize_ of a live storage would re-allocate and copy it
                self.storages[i].resize_(self.nbytes[i])

    def release_all(self) -> None:
        """As an offload with release=True leaves the set; zeroed first so that stale bytes in re-grown memory
        cannot pass the checksum."""
        for t in self.tensors:
            t.zero_()
        torch.cuda.synchronize()
        for st in self.storages:
            st.resize_(0)
        torch.cuda.empty_cache()
        torch.cuda.synchronize()


__all__ = ["ALIGN", "FIRST_PIECE", "GROWTH", "Set", "alloc_conf", "checksum", "make_pieces", "ms_since", "pc",
           "segments", "size_class", "stats", "summarise"]
