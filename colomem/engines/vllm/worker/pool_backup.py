"""weights_backup="pool": vLLM's "weights" allocations saved into a colomem pinned pool before a level-2
sleep and copied back at wake.

vLLM's cumem-backed parameters are foreign storages (they cannot be resized), so this copies raw bytes by
address and leaves the tensors alone. The blocks are kept between cycles, so later cycles allocate nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from colomem.errors import InvalidArgumentError, WeightCheckError

from .state import PoolBackup, WorkerState, device_copy

if TYPE_CHECKING:
    from . import ColomemWorkerExtension


def save(worker: "ColomemWorkerExtension", timeout: float) -> dict:
    """Copies the bytes of every "weights" allocation into the pool (D2H, chunked)."""
    bk = worker._colomem().backup
    layout = worker._colomem_weight_allocations()
    if not layout:
        raise InvalidArgumentError("vLLM tagged no allocation 'weights'; start the LLM with "
                                   "enable_sleep_mode=True")
    if layout != bk.layout:  # first save, or vLLM re-allocated: size the blocks again
        free_blocks(bk)
        pool = _pool(bk, sum(n for _, n in layout))
        bk.blocks = [pool.alloc(n) for _, n in layout]
        bk.layout = layout
    copies = [(blk.address, ptr, n) for blk, (ptr, n) in zip(bk.blocks, layout)]
    bk.saved = False
    bk.save_s = device_copy(worker._colomem_device(), "d2h", copies, timeout)
    bk.saved = True
    return {"nbytes": sum(n for _, n in layout), "nallocs": len(layout), "seconds": bk.save_s,
            "pool": pool_stats(bk)}


def restore(worker: "ColomemWorkerExtension", timeout: float) -> dict:
    """Copies the saved bytes back to the same addresses (vLLM re-maps them where they were)."""
    bk = worker._colomem().backup
    if not bk.saved:
        raise InvalidArgumentError("nothing saved in the pool: call colomem_save_weights_to_pool before "
                                   "sleeping")
    layout = worker._colomem_weight_allocations()
    if layout != bk.layout:
        raise WeightCheckError("vLLM's weight allocations changed while asleep; the pool copy no longer "
                               "matches them: sync the weights instead")
    copies = [(ptr, blk.address, n) for blk, (ptr, n) in zip(bk.blocks, layout)]
    bk.restore_s = device_copy(worker._colomem_device(), "h2d", copies, timeout)
    return {"nbytes": sum(n for _, n in layout), "nallocs": len(layout), "seconds": bk.restore_s}


def pool_stats(bk: PoolBackup) -> dict:
    if bk.pool is None or bk.pool.closed:
        return {}
    s = bk.pool.stats()
    return {k: s[k] for k in ("reserved_bytes", "in_use_bytes", "segments", "pin_seconds", "pinned")}


def free_blocks(bk: PoolBackup) -> None:
    for blk in bk.blocks:
        blk.release()
    bk.blocks, bk.layout, bk.saved = [], [], False


def close(st: WorkerState) -> None:
    """Frees the pool (the engine is about to shut down)."""
    bk = st.backup
    if bk.pool is not None and not bk.pool.closed:
        bk.pool.close(force=True)
    st.backup = PoolBackup()


def _pool(bk: PoolBackup, need: int):
    from colomem.pool import PinnedPool

    if bk.pool is None or bk.pool.closed:
        bk.pool = PinnedPool(0, max_bytes=None)
    if sum(b.nbytes for b in bk.blocks) < need:
        bk.pool.reserve(need)  # pinned once, as one segment
    return bk.pool


__all__ = ["close", "free_blocks", "pool_stats", "restore", "save"]
