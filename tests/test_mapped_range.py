"""The core's MappedRange on the host (anonymous mappings at fixed addresses in one reservation): its chunk
layout, bytes that stay while mapped and are gone once unmapped, memory given back to the system by an
unmap (the process's resident set shrinks), a failed call that changes nothing, and the tensors colomem
lays out in it keeping their addresses across unmap/map cycles."""

import ctypes
import math
import os

import pytest
import torch

from colomem import _C
from colomem.errors import InvalidArgumentError, NotAvailableError, PoolClosedError
from colomem.mapped import ALIGN, MappedMemory, layout

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_chunks_cover_the_range_and_the_last_one_holds_the_rest():
    r = _C.MappedRange(-1, 10 * MiB + 5, 3 * MiB + 1)
    g = r.granularity
    assert g == PAGE and r.chunk_bytes == math.ceil((3 * MiB + 1) / g) * g
    sizes = [r.chunk_size(i) for i in range(r.nchunks)]
    assert all(s % g == 0 for s in sizes) and sizes[:-1] == [r.chunk_bytes] * (r.nchunks - 1)
    assert sum(sizes) == r.reserved_bytes >= r.nbytes == 10 * MiB + 5
    assert [r.chunk_offset(i) for i in range(r.nchunks)] == [i * r.chunk_bytes for i in range(r.nchunks)]
    assert r.mapped_chunks == 0 and r.mapped_bytes == 0
    r.close()


def test_bytes_stay_while_mapped_and_a_remapped_chunk_starts_fresh():
    r = _C.MappedRange(-1, 4 * MiB, MiB)
    assert r.map(0, 4) == 4 and r.map(1, 2) == 0  # already mapped: nothing to do
    ptr = r.ptr
    for i in range(4):
        ctypes.memset(ptr + i * MiB, 0x11 * (i + 1), MiB)
    assert r.unmap(1, 1) == 1 and not r.is_mapped(1) and r.mapped_bytes == 3 * MiB
    assert r.map(0, 4) == 1 and r.ptr == ptr  # the same addresses
    assert ctypes.string_at(ptr + MiB, 16) == bytes(16)  # its old bytes are gone
    for i in (0, 2, 3):
        assert ctypes.string_at(ptr + i * MiB, MiB) == bytes([0x11 * (i + 1)]) * MiB
    r.close()


def test_an_unmap_gives_the_memory_back():
    r = _C.MappedRange(-1, 256 * MiB, 64 * MiB)
    before = resident_bytes()
    r.map(0, 4)  # populated when mapped
    mapped = resident_bytes()
    r.unmap(0, 4)
    after = resident_bytes()
    assert mapped - before >= 200 * MiB
    assert mapped - after >= 200 * MiB
    r.close()


def test_out_of_range_and_closed_calls_are_refused_without_a_change():
    r = _C.MappedRange(-1, 2 * MiB, MiB)
    r.map(0, 1)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        r.map(1, 2)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        r.unmap(3, 1)
    with pytest.raises(InvalidArgumentError):
        r.chunk_size(2)
    assert r.mapped_chunks == 1 and r.is_mapped(0) and not r.is_mapped(1)
    with pytest.raises(InvalidArgumentError, match="NaN"):
        r.close(float("nan"))
    assert not r.closed and r.mapped_chunks == 1
    r.close()
    r.close()  # idempotent
    assert r.closed and r.mapped_chunks == 0
    with pytest.raises(PoolClosedError):
        r.ptr
    with pytest.raises(PoolClosedError):
        r.map(0, 1)


@pytest.mark.parametrize("nbytes,chunk", [(0, MiB), (MiB, 0)])
def test_empty_sizes_are_refused(nbytes, chunk):
    with pytest.raises(InvalidArgumentError):
        _C.MappedRange(-1, nbytes, chunk)


def test_a_gpu_range_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(NotAvailableError):
        _C.MappedRange(0, MiB, MiB)


def test_layout_aligns_every_start():
    offsets, total = layout([3, 512, 1000, 1])
    assert offsets == [0, ALIGN, 2 * ALIGN, 4 * ALIGN] and total == 5 * ALIGN


def test_tensors_in_mapped_memory_keep_their_address_across_cycles():
    m = MappedMemory(3 * MiB, "cpu", MiB)
    m.map()
    a = m.tensor_at(0, torch.empty(MiB // 4, dtype=torch.float32))
    b = m.tensor_at(MiB, torch.empty((512, 2048), dtype=torch.int16))
    a.copy_(torch.arange(a.numel(), dtype=torch.float32))
    b.fill_(-7)
    pa, pb = a.data_ptr(), b.data_ptr()
    saved = b.clone()
    m.unmap(1, 2)
    m.map()
    b.copy_(saved)
    assert (a.data_ptr(), b.data_ptr()) == (pa, pb)
    assert torch.equal(a, torch.arange(a.numel(), dtype=torch.float32)) and bool((b == -7).all())
    assert list(m.chunks_of(MiB - 4, 8)) == [0, 1] and list(m.chunks_of(0, 0)) == []
    with pytest.raises(InvalidArgumentError):
        m.bytes_at(3 * MiB - 4, 8)
    with pytest.raises(InvalidArgumentError):
        m.tensor_at(2, torch.empty(4, dtype=torch.float32))
    del a, b
    m.close()
