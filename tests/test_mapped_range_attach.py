"""The core's MappedRange laid over addresses another owner reserved (MappedRange.attach), on the host: its
chunks map and unmap there as any range's (the head keeps its bytes while the tail goes and comes back
fresh), its close leaves the owner's reservation in place (the owner maps there again), and misaligned or
null addresses and sizes are refused before anything is mapped. What the KV cache's tail mapped on demand
needs (docs/kv-on-demand.md); the GPU kind: tests/gpu/test_mapped_range_attach_gpu.py."""

import ctypes
import os

import pytest
import torch

from colomem import _C
from colomem.errors import InvalidArgumentError, NotAvailableError

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")


def reserved_at(address: int, nbytes: int) -> bool:
    """Whether /proc/self/maps has mappings covering [address, address + nbytes) without a gap."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            spans.append((lo, hi))
    at = address
    for lo, hi in sorted(spans):
        if lo <= at < hi:
            at = hi
    return at >= address + nbytes


def test_an_attached_range_maps_chunks_in_the_owners_addresses_and_leaves_them_reserved():
    owner = _C.MappedRange(-1, 4 * MiB, 4 * MiB)          # reserves; maps nothing
    r = _C.MappedRange.attach(-1, owner.ptr, 4 * MiB, MiB)
    assert owner.owns_addresses and not r.owns_addresses
    assert r.ptr == owner.ptr and r.nchunks == 4 and r.reserved_bytes == 4 * MiB and r.granularity == PAGE
    assert r.map(0, 4) == 4
    for i in range(4):
        ctypes.memset(r.ptr + i * MiB, 0x21 + i, MiB)
    r.close()
    assert r.closed and r.mapped_chunks == 0
    assert reserved_at(owner.ptr, 4 * MiB)                # the owner's reservation is still there
    assert owner.map(0, 1) == 1                           # and the owner maps in it again
    ctypes.memset(owner.ptr, 0x5A, MiB)
    assert ctypes.string_at(owner.ptr + MiB - 8, 8) == b"\x5a" * 8
    owner.close()


def test_the_tail_goes_and_comes_back_fresh_while_the_head_keeps_its_bytes():
    owner = _C.MappedRange(-1, 8 * MiB, 8 * MiB)
    r = _C.MappedRange.attach(-1, owner.ptr, 8 * MiB, 2 * MiB)
    r.map(0, r.nchunks)
    for i in range(r.nchunks):
        ctypes.memset(r.ptr + i * 2 * MiB, 0x31 + i, 2 * MiB)
    assert r.unmap(2, 2) == 2 and r.mapped_bytes == 4 * MiB
    assert [r.is_mapped(i) for i in range(4)] == [True, True, False, False]
    assert r.map(0, 4) == 2                               # only the tail was missing
    for i in (0, 1):
        assert ctypes.string_at(r.ptr + i * 2 * MiB, 2 * MiB) == bytes([0x31 + i]) * (2 * MiB)
    for i in (2, 3):
        assert ctypes.string_at(r.ptr + i * 2 * MiB, 64) == bytes(64)
    r.close()
    owner.close()


@pytest.mark.parametrize("shift,nbytes,what", [(1, 4 * MiB, "multiples"), (0, 4 * MiB + 1, "multiples"),
                                               (None, 4 * MiB, "non-null")])
def test_misaligned_or_null_addresses_and_sizes_are_refused(shift, nbytes, what):
    owner = _C.MappedRange(-1, 8 * MiB, 8 * MiB)
    address = 0 if shift is None else owner.ptr + shift
    with pytest.raises(InvalidArgumentError, match=what):
        _C.MappedRange.attach(-1, address, nbytes, MiB)
    assert owner.mapped_chunks == 0 and reserved_at(owner.ptr, 8 * MiB)
    owner.close()


def test_an_attached_gpu_range_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    with pytest.raises(NotAvailableError):
        _C.MappedRange.attach(0, 1 << 21, 1 << 21, 1 << 21)
