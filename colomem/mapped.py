"""Tensors in memory colomem maps itself, chunk by chunk, at fixed addresses (the core's MappedRange).

A tensor the caching allocator holds is one allocation: it leaves the GPU and comes back whole, and its
growth must end before its first byte can be copied back. Tensors laid out in a MappedMemory keep their
addresses while the chunks under them are unmapped (their memory back with the driver) and mapped again one
at a time, so a copy back can start as soon as the first chunk is mapped, and part of a tensor can come back
early while the rest waits for room. On the host (device 'cpu') the same layout lives in anonymous
mappings, so the bookkeeping runs, and is tested, without a GPU.

Reading a tensor whose chunks are not all mapped faults (an illegal address on the GPU: the CUDA context is
lost; SIGSEGV on the host). The owner of the tensors (colomem.swap_mapped.MappedSet) keeps them out of reach
while any chunk is unmapped.
"""

from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from colomem import _C, _torch
from colomem.errors import InvalidArgumentError

MiB = 1 << 20
# Each chunk is one cuMemCreate + cuMemMap when it comes back: its mapping runs behind the copy of the chunk
# before it (256 MiB copy in ~5 ms at the link), and a byte budget can be met to within one chunk.
CHUNK_BYTES_DEFAULT = 256 * MiB
CLOSE_WAIT_S = 60.0  # how long close() waits for the device's queued work by default
ALIGN = 512  # each tensor's start: wider than any dtype's and than the copy engine's vector loads


def layout(sizes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets for tensors of these byte sizes laid end to end, each start a multiple of `align`; -> (offsets,
    total bytes)."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // align) * align
    return offsets, at


class MappedMemory:
    """One reserved range on `device` of at least `nbytes`, in chunks of `chunk_bytes` (rounded up to the
    mapping granularity: 2 MiB on a GPU, the page size on the host). Nothing is mapped until map()."""

    def __init__(self, nbytes: int, device, chunk_bytes: int = CHUNK_BYTES_DEFAULT):
        if not (isinstance(nbytes, int) and nbytes > 0 and isinstance(chunk_bytes, int) and chunk_bytes > 0):
            raise InvalidArgumentError(f"MappedMemory needs nbytes > 0 and chunk_bytes > 0, got {nbytes!r} and "
                                       f"{chunk_bytes!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.range = _C.MappedRange(_torch.device_index(self.device), nbytes, chunk_bytes)

    @property
    def nchunks(self) -> int:
        return self.range.nchunks

    @property
    def mapped_bytes(self) -> int:
        return self.range.mapped_bytes

    @property
    def all_mapped(self) -> bool:
        return self.range.mapped_chunks == self.range.nchunks

    def chunk_span(self, i: int) -> tuple[int, int]:
        """(offset, size) of chunk i."""
        return self.range.chunk_offset(i), self.range.chunk_size(i)

    def chunks_of(self, offset: int, nbytes: int) -> range:
        """The chunks that bytes [offset, offset + nbytes) lie in."""
        if nbytes <= 0:
            return range(0)
        step = self.range.chunk_bytes
        return range(offset // step, min(self.nchunks, math.ceil((offset + nbytes) / step)))

    def map(self, first: int = 0, count: Optional[int] = None) -> int:
        """Maps the unmapped chunks of [first, first + count) (default: to the end); -> how many."""
        return self.range.map(first, self.nchunks - first if count is None else count)

    def unmap(self, first: int = 0, count: Optional[int] = None) -> int:
        """Unmaps the mapped chunks of [first, first + count): their bytes are gone. Only once nothing queued
        still reads or writes them."""
        return self.range.unmap(first, self.nchunks - first if count is None else count)

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor viewing [offset, offset + nbytes) of the range (no copy, not resizable); it keeps this
        object, and so the addresses, alive."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.range.reserved_bytes:
            raise InvalidArgumentError(f"bytes [{offset}, {offset + nbytes}) are outside a mapped range of "
                                       f"{self.range.reserved_bytes} bytes")
        address = self.range.ptr + offset
        if self.device.type == "cuda":
            return _torch.device_bytes(address, nbytes, self.device, owner=self)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_uint8 * nbytes).from_address(address)
        buf.owner = self  # type: ignore[attr-defined]  # the view keeps the range reserved
        return torch.frombuffer(buf, dtype=torch.uint8)

    def tensor_at(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of `like`'s dtype and shape whose bytes are the range's from `offset`."""
        n = like.numel() * like.element_size()
        if offset % like.element_size():
            raise InvalidArgumentError(f"offset {offset} is not a multiple of {like.dtype}'s size")
        return self.bytes_at(offset, n).view(like.dtype).view(like.shape)

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Waits (bounded) for the device's queued work, then unmaps everything and frees the addresses. The
        tensors viewing it must not be used after."""
        self.range.close(timeout_s)

    def __repr__(self) -> str:
        return (f"MappedMemory({self.range.reserved_bytes} bytes on {self.device}, {self.range.mapped_chunks}/"
                f"{self.nchunks} chunks of {self.range.chunk_bytes} mapped)")


__all__ = ["ALIGN", "CHUNK_BYTES_DEFAULT", "MappedMemory", "layout"]
