"""The KV cache's tail lent to the trainer, inside vLLM's worker (see colomem.engines.vllm.kv_tail).

The first lend takes vLLM's KV allocations over: each layer's one driver handle is unmapped and released once,
its entry leaves vLLM's allocator table (kept here), and a core MappedRange is laid over the same addresses
in chunks colomem maps and unmaps on its own; the head's chunks map at once. Every tensor that views the
cache keeps its data_ptr (CUDA graphs included); the bytes are new, so the caller resets the prefix cache.
From then on a lend holds the tail's blocks out of the scheduler's queue and unmaps their chunks; nothing
comes back at the wake: the scheduler grows the tail back chunk by chunk when its free blocks run short
(tail_scheduler.py), so the rollout starts on the head's blocks at once.

vLLM's own paths must not meet an allocation it no longer maps: `restore` gives the entries back before its
sleep (unmapped: vLLM counts them as asleep and its wake maps them whole) and before the engine closes
(mapped whole again, for its free callback).

The worker and the scheduler share a process and, for every call here, a thread: these run as the engine's
RPCs, between scheduling steps, while vLLM's scheduling is paused.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from colomem.errors import CudaOutOfMemoryError, NotAvailableError, PhaseOrderError, is_oom

from ..kv_tail import CHUNK_BYTES_DEFAULT, Grower, TailGeometry, tail_geometry
from .kv_release import KV_TAG
from .state import KvTail, synchronize

if TYPE_CHECKING:
    from . import ColomemWorkerExtension

log = logging.getLogger(__name__)


def _layer_tensors(worker: Any) -> list:
    """vLLM's KV tensors, one per allocation, in address order; NotAvailableError for a layout without one
    tensor per layer."""
    runner = getattr(worker, "model_runner", None)
    caches = list(getattr(runner, "kv_caches", None) or [])
    config = getattr(runner, "kv_cache_config", None)
    groups = getattr(config, "kv_cache_groups", None)
    if not caches or groups is None:
        raise NotAvailableError("vLLM's model runner has no KV tensors (kv_caches) to lend a tail of")
    if len(groups) != 1:
        raise NotAvailableError(f"the KV cache has {len(groups)} attention groups sharing its tensors; a tail "
                                "by blocks needs one group")
    dtype = str(getattr(getattr(runner, "cache_config", None), "cache_dtype", "auto"))
    if dtype != "auto":
        raise NotAvailableError(f"a quantized KV cache ({dtype}) is zeroed whole at every wake; only a cache "
                                "of the model's dtype lends a tail")
    by_ptr: dict = {}
    for t in caches:
        if isinstance(t, torch.Tensor):
            by_ptr.setdefault(int(t.data_ptr()), t)
    return [by_ptr[p] for p in sorted(by_ptr)]


def _page_of(t: torch.Tensor) -> int:
    """One kernel block's bytes in tensor t, whose first dimension must be the block, outermost."""
    esize = t.element_size()
    page = t.stride(0) * esize
    inner = sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])) + 1
    if t.dim() < 2 or inner > t.stride(0) or page * t.shape[0] > t.untyped_storage().nbytes():
        raise NotAvailableError(f"a KV tensor of shape {tuple(t.shape)} and strides {t.stride()} does not keep "
                                "each block's bytes together, block outermost (another attention backend or "
                                "layout); the KV cache is released by whole layers instead")
    return page


def _geometry(worker: Any, table: dict, chunk_bytes: int) -> tuple[TailGeometry, list, Any]:
    """The tail's geometry, the KV allocations' addresses and the scheduler whose blocks they hold."""
    from colomem import _C

    from ..tail_scheduler import active_scheduler

    tensors = _layer_tensors(worker)
    kernel_blocks = {int(t.shape[0]) for t in tensors}
    scheduler = active_scheduler(lambda n: all(k % n == 0 for k in kernel_blocks))
    num_blocks = len(scheduler.colomem_tail.pool.blocks)
    sizes, pages = [], set()
    for t in tensors:
        data = table.get(int(t.data_ptr()))
        if data is None or data.tag != KV_TAG:
            raise NotAvailableError("a KV tensor does not start an allocation of vLLM's tagged 'kv_cache' (tensors "
                                    "packed into one allocation); the KV cache is released by whole layers")
        pages.add(_page_of(t) * t.shape[0] // num_blocks)
        sizes.append(int(data.handle[1]))
    if len(pages) != 1:
        raise NotAvailableError(f"the layers' blocks differ in size ({sorted(pages)}); a tail by blocks needs one")
    device = int(tensors[0].device.index)
    geo = tail_geometry(pages.pop(), num_blocks, sizes, int(_C.ipc_granularity(device)), chunk_bytes)
    return geo, [int(t.data_ptr()) for t in tensors], scheduler


def _take_over(worker: "ColomemWorkerExtension", tail: KvTail, chunk_bytes: int) -> None:
    """vLLM's KV allocations become MappedRanges at the same addresses, nothing mapped yet."""
    from colomem import _C

    api = worker._colomem_cumem()
    table = api.allocator.pointer_to_data
    geo, ptrs, scheduler = _geometry(worker, table, chunk_bytes)
    unmapped = [hex(p) for p in ptrs if not worker._colomem_is_mapped(p)]
    if unmapped:
        raise PhaseOrderError(f"{len(unmapped)} of vLLM's KV allocations are not mapped (e.g. {unmapped[:2]}): "
                              "its own sleep released them; wake it first")
    device = worker._colomem_device()
    synchronize(device)
    tail.geometry, tail.scheduler = geo, scheduler     # from here on restore() gives back what was taken
    for ptr in ptrs:
        data = table[ptr]
        api.unmap_and_release(data.handle)
        tail.taken[ptr] = table.pop(ptr)
        tail.ranges.append(_C.MappedRange.attach(device.index, ptr, int(data.handle[1]), geo.chunk_bytes))


def _map_rows(tail: KvTail, first: int, count: int) -> None:
    """Maps chunks [first, first + count) of every layer, row by row; on a failure unmaps the row it broke
    in (rows before it stay mapped) and raises."""
    for c in range(first, first + count):
        done = []
        try:
            for r in tail.ranges:
                r.map(c, 1)
                done.append(r)
        except BaseException:
            for r in done:
                r.unmap(c, 1)
            raise


def _grow(tail: KvTail, c: int) -> bool:
    """The scheduler's Grower: chunk c of every layer mapped again; False when the GPU lacks the memory."""
    try:
        _map_rows(tail, c, 1)
    except Exception as exc:  # noqa: BLE001  (out of memory waits for the next try; anything else is a bug)
        if is_oom(exc):
            return False
        raise
    return True


def lend(worker: "ColomemWorkerExtension", nbytes: Optional[int], chunk_bytes: int = CHUNK_BYTES_DEFAULT) -> dict:
    """Lends at least nbytes of the KV cache (None: all of it but the first chunk of each layer), as the
    tail of every layer: its blocks out of the scheduler's queue, its chunks unmapped. The caller paused
    vLLM's scheduling, and resets the prefix cache afterwards (new weights come; after the first lend,
    `fresh` in the report, the head's bytes are new too)."""
    st = worker._colomem()
    tail: KvTail = st.tail
    if st.kv.released or st.kv.lent:
        raise PhaseOrderError("vLLM's KV cache is released by whole layers now; map it back first")
    t0 = time.perf_counter()
    fresh = tail.geometry is None
    if fresh:
        _take_over(worker, tail, chunk_bytes)
    geo = tail.geometry
    assert geo is not None
    start = geo.tail_start(nbytes)
    hold = tail.scheduler.colomem_tail
    if fresh:
        _map_rows(tail, 0, start)
    elif start > tail.start:       # a shorter tail: what it no longer lends comes back (a longer one's extra
        _map_rows(tail, tail.start, start - tail.start)   # chunks unmap below)
    hold.hold_from(geo.first_block(start))
    synchronize(worker._colomem_device())          # nothing queued may still touch the chunks that go
    for r in tail.ranges:
        r.unmap(start, geo.nchunks - start)
    freed = geo.tail_bytes(start)
    tail.start, tail.lent_bytes = start, freed
    tail.scheduler.colomem_grower = Grower(geo, lambda c: _grow(tail, c), time.monotonic)
    return {"lent_bytes": freed, "first_block": geo.first_block(start), "chunks": geo.nchunks - start,
            "held_blocks": hold.held, "fresh": fresh, "seconds": time.perf_counter() - t0}


def restore(worker: "ColomemWorkerExtension", mapped: bool) -> dict:
    """Gives vLLM back its KV allocations: every block to the queue, the chunks unmapped. mapped: each entry
    back in vLLM's table, mapped whole again under vLLM's handle (before the engine closes; needs the lent
    bytes free). Else the entries stay unmapped and out of the table, as a whole-layer release lends them to
    vLLM's sleep (kv_release.lend): colomem_kv_take_back returns them after it, and vLLM's wake maps them."""
    st = worker._colomem()
    tail: KvTail = st.tail
    if tail.geometry is None:
        return {"restored": 0, "mapped": bool(mapped)}
    api = worker._colomem_cumem()
    table = api.allocator.pointer_to_data
    synchronize(worker._colomem_device())
    tail.scheduler.colomem_grower = None
    tail.scheduler.colomem_tail.give_all()
    entries = sorted(tail.taken.items())
    for r in tail.ranges:
        r.close()
    st.tail = KvTail()
    if not mapped:
        st.kv.lent = dict(entries)
        st.kv.released = [p for p, _ in entries]
        st.kv.nbytes = sum(int(d.handle[1]) for _, d in entries)
        return {"restored": len(entries), "mapped": False, "released_bytes": st.kv.nbytes}
    for n, (ptr, data) in enumerate(entries):
        try:
            api.create_and_map(data.handle)
        except Exception as exc:
            for p, d in entries[n:]:                 # the rest stays released, in vLLM's table
                table[p] = d
            st.kv.released = [p for p, _ in entries[n:]]
            st.kv.nbytes = sum(int(d.handle[1]) for _, d in entries[n:])
            if is_oom(exc):
                raise CudaOutOfMemoryError(f"mapping vLLM's KV allocation {ptr:#x} back whole ran out of GPU "
                                           f"memory: {exc}") from exc
            raise
        table[ptr] = data
    return {"restored": len(entries), "mapped": True}


def state(worker: "ColomemWorkerExtension") -> dict:
    tail: KvTail = worker._colomem().tail
    if tail.geometry is None:
        return {"held": False}
    g = tail.geometry
    return {"held": True, "layers": g.nlayers, "layer_bytes": g.layer_bytes, "chunk_bytes": g.chunk_bytes,
            "page_bytes": g.page_bytes,
            "num_blocks": g.num_blocks, "start": tail.start, "lent_bytes": tail.lent_bytes,
            "held_blocks": tail.scheduler.colomem_tail.held,
            "mapped_bytes": sum(r.mapped_bytes for r in tail.ranges),
            "grown_chunks": getattr(tail.scheduler.colomem_grower, "grown_chunks", 0)}


__all__ = ["lend", "restore", "state"]
