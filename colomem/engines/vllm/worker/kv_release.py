"""The KV cache released alone, inside vLLM's worker: for a job whose trainer reads vLLM's weights in place.

vLLM's sleep levels both unmap the weights (level 1 copies them to host memory first). When the trainer's
frozen base parameters are views of those weights, they must stay mapped, at their addresses, byte for byte,
while the trainer trains; only the KV cache may go. vLLM's CuMemAllocator keeps one entry per allocation
(address, size, tag, the driver handle): `release` unmaps the entries tagged "kv_cache" (all of them, or the
fewest that hold the bytes the caller asks for: training may need only part of a large cache's memory, and
mapping back costs time by the byte) and hands their physical memory back to the driver, touching no
"weights" entry; `map_back` creates new physical memory
and maps it at the same virtual addresses. Every tensor that views the cache (the model runner's kv_caches,
the attention layers' bound caches, CUDA graphs captured over them) keeps its data_ptr, so nothing is
rebuilt; only the bytes are new (undefined). Hence the caller resets the prefix cache after `map_back`,
and `map_back` asks the model runner to re-fill what vLLM allocated under that tag besides the cache itself
(`post_kv_cache_wake_up`, which vLLM's own wake of "kv_cache" runs: block-table layout tensors, fp8 scales).

What a KV-only sleep leaves on the GPU, besides the weights it keeps on purpose:
  - torch's caching allocator in this process: blocks cached after the last generate are released
    (empty_cache, safe: only unused blocks go); tensors still alive stay, among them the sampler's and the
    input batch's persistent buffers vLLM pre-allocated at start (their memory is reused every step).
  - CUDA graph pools (enforce_eager=False): graphs replay fixed addresses, and freeing their pool would mean
    capturing again; they stay. The KV cache coming back at the same addresses keeps them valid.
  - the CUDA context, cuBLAS / NCCL workspaces and the KV-zeroing metadata vLLM builds outside its pool:
    not freeable without tearing the engine down.

vLLM's table of allocations stays whole throughout, so its own sleep / wake and its free callback (a tensor
freed at shutdown) find every entry. Its own sleep would unmap every entry, including ones unmapped here
(an error in the middle of that sleep), so `lend` takes the released entries out of the table for the
length of such a sleep and `take_back` returns them: afterwards they are unmapped like every other entry,
and vLLM's wake of "kv_cache" maps them again.
"""

from __future__ import annotations

import logging
import time
import types
from typing import TYPE_CHECKING, Any, Optional

import torch

from colomem._torch import mem_get_info
from colomem.errors import (ColomemError, CudaOutOfMemoryError, InvalidArgumentError, NotAvailableError,
                            PhaseOrderError, is_oom)
from colomem.units import format_bytes

from .state import synchronize

if TYPE_CHECKING:
    from . import ColomemWorkerExtension

log = logging.getLogger(__name__)

KV_TAG = "kv_cache"
WEIGHTS_TAG = "weights"


def cumem_api(worker: Any) -> types.SimpleNamespace:
    """vLLM's CuMemAllocator and its two C calls, or NotAvailableError saying why the KV cache cannot be
    released alone (no sleep mode, no CUDA allocator of vLLM's in this process)."""
    model_config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    if model_config is not None and not getattr(model_config, "enable_sleep_mode", False):
        raise NotAvailableError("vLLM was started without enable_sleep_mode=True: its KV cache is not in "
                                "memory it can unmap. Start it with sleep mode (VLLMRollout does unless "
                                "llm_kwargs turns it off)")
    try:
        from vllm.device_allocator import cumem
    except ImportError as exc:
        raise NotAvailableError(f"vLLM's cumem allocator cannot be imported ({exc}); the KV-only sleep needs "
                                "vLLM's CUDA build") from exc
    alloc = getattr(cumem.CuMemAllocator, "instance", None)
    if not getattr(cumem, "cumem_available", False) or alloc is None:
        raise NotAvailableError("vLLM's CuMemAllocator holds no memory in this process (sleep mode off, or "
                                "another platform's allocator): the KV cache cannot be released alone")
    return types.SimpleNamespace(allocator=alloc, create_and_map=cumem.create_and_map,
                                 unmap_and_release=cumem.unmap_and_release)


def _free_bytes(device: torch.device) -> int:
    return mem_get_info(device)[0]


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def chosen(sizes: list[tuple[int, int]], nbytes: Optional[int]) -> list[int]:
    """The allocations a release of at least `nbytes` unmaps, from (address, bytes) pairs: the fewest, the
    largest first (vLLM allocates one per attention layer, all of one size), by address among equals; every
    one when nbytes is None or not less than their sum."""
    if nbytes is None or nbytes >= sum(n for _, n in sizes):
        return [ptr for ptr, _ in sizes]
    out, got = [], 0
    for ptr, n in sorted(sizes, key=lambda pn: (-pn[1], pn[0])):
        if got >= nbytes:
            break
        out.append(ptr)
        got += n
    return out


def release(worker: "ColomemWorkerExtension", nbytes: Optional[int] = None) -> dict:
    """Unmaps "kv_cache" allocations and frees their physical memory; the "weights" ones stay as they are.
    nbytes: release at least that many bytes of the cache, in whole allocations (the fewest that hold them),
    the others staying mapped with their contents; None: all of it.

    The caller paused vLLM's scheduling first: nothing may run on the cache while it is unmapped.
    """
    if nbytes is not None and int(nbytes) <= 0:
        raise InvalidArgumentError(f"nbytes={nbytes}: release a positive number of bytes, or None for the "
                                   "whole KV cache")
    st = worker._colomem().kv
    if st.released or st.lent:
        raise PhaseOrderError("vLLM's KV cache is already released; map it back (colomem_kv_map) first")
    api = worker._colomem_cumem()
    kv = [(int(ptr), data) for ptr, data in api.allocator.pointer_to_data.items() if data.tag == KV_TAG]
    if kv:
        picked = set(chosen([(ptr, int(data.handle[1])) for ptr, data in kv], nbytes))
        kv = [(ptr, data) for ptr, data in kv if ptr in picked]
    if not kv:
        raise NotAvailableError("vLLM's allocator holds no allocation tagged 'kv_cache' (an engine without "
                                "a KV cache, or a vLLM version that tags it otherwise)")
    unmapped = [hex(ptr) for ptr, _ in kv if not worker._colomem_is_mapped(ptr)]   # of those chosen
    if unmapped:
        raise PhaseOrderError(f"{len(unmapped)} of vLLM's {len(kv)} KV-cache allocations are not mapped (e.g. "
                              f"{unmapped[:2]}): vLLM's own sleep released them; wake it first")
    device = worker._colomem_device()
    synchronize(device)          # no queued kernel may still read or write the cache when its memory goes
    free0 = _free_bytes(device)
    t0 = time.perf_counter()
    try:
        for ptr, data in kv:
            api.unmap_and_release(data.handle)
            st.released.append(ptr)
            st.nbytes += int(data.handle[1])
    finally:                     # after a failure partway, st says exactly what is unmapped (map_back maps it)
        _empty_cache(device)
    st.release_s = time.perf_counter() - t0
    return {"released_bytes": st.nbytes, "nallocs": len(st.released), "seconds": st.release_s,
            "freed_bytes": max(0, _free_bytes(device) - free0)}


def map_back(worker: "ColomemWorkerExtension") -> dict:
    """Creates physical memory for every released allocation and maps it at its old address; on a failure
    (out of memory) unmaps what it mapped, so the cache stays wholly released and a retry can come."""
    st = worker._colomem().kv
    if st.lent:
        raise PhaseOrderError("vLLM's KV-cache entries are lent to vLLM's own sleep (colomem_kv_take_back "
                              "was not called)")
    if not st.released:
        raise PhaseOrderError("vLLM's KV cache was not released by colomem_kv_release; nothing to map back")
    api = worker._colomem_cumem()
    table = api.allocator.pointer_to_data
    gone = [hex(p) for p in st.released if p not in table]
    if gone:
        raise ColomemError(f"{len(gone)} released KV-cache allocations are no longer in vLLM's table (e.g. "
                           f"{gone[:2]}): the engine freed its cache meanwhile; close the rollout and start "
                           f"a new one")
    device = worker._colomem_device()
    free0 = _free_bytes(device)
    t0 = time.perf_counter()
    mapped: list = []
    try:
        for ptr in st.released:
            api.create_and_map(table[ptr].handle)
            mapped.append(ptr)
    except Exception as exc:
        for ptr in mapped:
            try:
                api.unmap_and_release(table[ptr].handle)
            except Exception as undo:  # noqa: BLE001  (the first failure is the one to report)
                log.error("unmapping KV-cache allocation %#x after a failed map-back failed: %s", ptr, undo)
        _empty_cache(device)
        if is_oom(exc):
            raise CudaOutOfMemoryError(
                f"mapping vLLM's KV cache back ({format_bytes(st.nbytes)}) ran out of GPU memory: {exc}. It stays "
                f"released; free memory (offload more of the trainer, lower gpu_memory_utilization) and call "
                f"wake_kv() again") from exc
        raise
    nbytes = st.nbytes
    st.released, st.nbytes = [], 0
    st.map_s = time.perf_counter() - t0
    post = getattr(getattr(worker, "model_runner", None), "post_kv_cache_wake_up", None)
    if post is not None:
        post()                   # what vLLM allocated under the tag besides the cache came back undefined
    synchronize(device)
    return {"mapped_bytes": nbytes, "nallocs": len(mapped), "seconds": st.map_s,
            "taken_bytes": max(0, free0 - _free_bytes(device))}


def lend(worker: "ColomemWorkerExtension") -> dict:
    """Takes the released entries out of vLLM's table while vLLM's own sleep runs (it would unmap them a
    second time). Nothing frees a KV tensor during a sleep, so no free callback looks for them meanwhile."""
    st = worker._colomem().kv
    table = worker._colomem_cumem().allocator.pointer_to_data
    st.lent = {p: table.pop(p) for p in st.released if p in table}
    return {"lent": len(st.lent)}


def take_back(worker: "ColomemWorkerExtension", slept: bool) -> dict:
    """Returns lent entries to vLLM's table. slept: vLLM's sleep ran, so vLLM counts the KV cache as asleep
    and its wake_up(["kv_cache"]) maps them from now on; otherwise they are still released here."""
    st = worker._colomem().kv
    table = worker._colomem_cumem().allocator.pointer_to_data
    table.update(st.lent)
    n, st.lent = len(st.lent), {}
    if slept:
        st.released, st.nbytes = [], 0
    return {"returned": n, "released_bytes": st.nbytes}


def state(worker: "ColomemWorkerExtension") -> dict:
    """[(address, bytes, mapped)] of vLLM's "weights" and "kv_cache" allocations, and what is released."""
    st = worker._colomem().kv
    table = worker._colomem_cumem().allocator.pointer_to_data
    by_tag: dict = {WEIGHTS_TAG: [], KV_TAG: []}
    for ptr, data in sorted(list(table.items()) + list(st.lent.items())):
        if data.tag in by_tag:
            by_tag[data.tag].append([int(ptr), int(data.handle[1]), bool(worker._colomem_is_mapped(int(ptr)))])
    return {"weights": by_tag[WEIGHTS_TAG], "kv_cache": by_tag[KV_TAG], "released": bool(st.released),
            "released_bytes": st.nbytes}


__all__ = ["KV_TAG", "chosen", "cumem_api", "lend", "map_back", "release", "state", "take_back"]
