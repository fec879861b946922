"""Undoing a wake that ran out of memory halfway, so vLLM is fully asleep again.

vLLM's wake_up maps allocation after allocation and stops at the first failure; the executor still counts
the tags as asleep. This unmaps what was already mapped. With keep_weights (level-1 backups), an allocation
whose host backup was already copied back and dropped gets a new backup first, so no weight is lost.
"""

from __future__ import annotations

import torch

from colomem import _C

from .state import device_copy


def rollback_wake(device: torch.device, tags: list, keep_weights: bool, timeout: float) -> dict:
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    alloc = CuMemAllocator.get_instance()
    mapped = [(ptr, data) for ptr, data in alloc.pointer_to_data.items()
              if data.tag in tags and _C.pointer_is_mapped(int(ptr))]
    copies, backups = [], []
    for ptr, data in mapped:
        if keep_weights and data.tag == "weights" and data.cpu_backup_tensor is None:
            size = int(data.handle[1])
            backup = _pinned(size)
            copies.append((backup.data_ptr(), int(ptr), size))
            backups.append((data, backup))
    if copies:  # every backup is complete before anything is unmapped (a failed copy unmaps nothing)
        device_copy(device, "d2h", copies, timeout)
    for data, backup in backups:
        data.cpu_backup_tensor = backup
    released = 0
    for _, data in mapped:
        unmap_and_release(data.handle)
        released += int(data.handle[1])
    torch.cuda.empty_cache()
    return {"released_bytes": released}


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


__all__ = ["rollback_wake"]
