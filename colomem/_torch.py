"""Tensor plumbing between torch and the pointer-level core (the core never sees a tensor)."""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from colomem import _C
from colomem.units import parse_bytes

CUDA_STREAM_LEGACY = 0x1  # cudaStreamLegacy
_engines: dict[int, "_C.CopyEngine"] = {}
_engines_lock = threading.Lock()


def chunk_bytes_default() -> int:
    return parse_bytes(os.environ.get("COLOMEM_CHUNK_BYTES", "64MiB"))


def small_copy_bytes_default() -> int:
    return parse_bytes(os.environ.get("COLOMEM_SMALL_COPY_BYTES", "1MiB"))


def device_index(device: torch.device) -> int:
    """-1 for the host backend, else the CUDA device index (current device when unspecified)."""
    if device.type == "cpu":
        return -1
    if device.type != "cuda":
        raise ValueError(f"unsupported device {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def engine_for(device: torch.device) -> "_C.CopyEngine":
    """One copy engine (two streams) per device per process, shared by every set."""
    idx = device_index(device)
    with _engines_lock:
        eng = _engines.get(idx)
        if eng is None:
            eng = _C.CopyEngine(idx, chunk_bytes_default(), small_copy_bytes_default())
            _engines[idx] = eng
        return eng


def stream_handle(device: torch.device, stream: Optional[torch.cuda.Stream] = None) -> int:
    """The integer handle of `stream` (default: the current stream of `device`); 0 for the host."""
    if device.type != "cuda":
        return 0
    s = stream if stream is not None else torch.cuda.current_stream(device)
    # torch's default stream is the legacy default stream, handle 0; the core reads 0 as "no stream",
    # so it is passed as cudaStreamLegacy (0x1), which names the same stream.
    return int(s.cuda_stream) or CUDA_STREAM_LEGACY


def mem_get_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes as the driver sees them; (0, 0) on the host."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.mem_get_info(device)


class _CudaArray:
    """Exposes raw device memory through __cuda_array_interface__ so torch can view it without a copy."""

    def __init__(self, address: int, shape: tuple, typestr: str, owner=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False),
                                         "version": 3, "strides": None, "stream": None}
        self._owner = owner  # keeps the mapping alive as long as a view exists


def device_bytes(address: int, nbytes: int, device: torch.device, owner=None) -> torch.Tensor:
    """A uint8 CUDA tensor viewing `nbytes` at `address` on `device` (no copy, not resizable)."""
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(address, (nbytes,), "|u1", owner), device=device)
