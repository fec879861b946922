"""The core's MappedRange laid over addresses another owner reserved (MappedRange.attach), on a GPU: chunks
mapped there hold bytes a kernel writes and reads; unmapping the tail gives its memory to the driver while the
head keeps its bytes; the tail maps back at the same addresses; close() leaves the owner's reservation, where
the owner maps again; a misaligned address is refused. The owner here is another MappedRange that reserved
and mapped nothing (vLLM's allocator reserves the same way, with the driver's smallest granularity).

Run: python -m pytest -m gpu tests/gpu/test_mapped_range_attach_gpu.py
"""
import pytest
import torch

from colomem import _C, _torch
from colomem.errors import InvalidArgumentError
from _swap_gpu import driver_free

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def view(r, offset, nbytes):
    return _torch.device_bytes(r.ptr + offset, nbytes, torch.device("cuda", 0), owner=r)


def test_the_tail_goes_back_to_the_driver_and_returns_while_the_head_keeps_its_bytes():
    owner = _C.MappedRange(0, 256 * MiB, 256 * MiB)
    n = owner.reserved_bytes
    r = _C.MappedRange.attach(0, owner.ptr, n, 32 * MiB)
    assert not r.owns_addresses and n % r.granularity == 0 and r.chunk_bytes % r.granularity == 0
    before = driver_free()
    r.map(0, r.nchunks)
    assert before - driver_free() >= n - 2 * MiB
    head = r.nchunks // 2
    head_bytes = sum(r.chunk_size(i) for i in range(head))
    gen = torch.Generator(device="cuda").manual_seed(0)
    want = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
    view(r, 0, n).copy_(want)
    mapped = driver_free()
    assert r.unmap(head, r.nchunks - head) == r.nchunks - head
    assert driver_free() - mapped >= n - head_bytes - 2 * MiB     # the tail's memory is the driver's again
    assert torch.equal(view(r, 0, head_bytes), want[:head_bytes])
    assert r.map(0, r.nchunks) == r.nchunks - head and r.ptr == owner.ptr
    view(r, head_bytes, n - head_bytes).fill_(7)
    assert torch.equal(view(r, 0, head_bytes), want[:head_bytes])
    assert int(view(r, head_bytes, n - head_bytes).sum()) == 7 * (n - head_bytes)
    torch.cuda.synchronize()
    r.close()
    assert owner.map(0, 1) == 1                                   # the reservation is the owner's still
    view(owner, 0, MiB).fill_(3)
    assert int(view(owner, 0, MiB).sum()) == 3 * MiB
    torch.cuda.synchronize()
    owner.close()


def test_a_misaligned_address_is_refused_before_anything_is_mapped():
    owner = _C.MappedRange(0, 64 * MiB, 64 * MiB)
    free = driver_free()
    with pytest.raises(InvalidArgumentError, match="multiples"):
        _C.MappedRange.attach(0, owner.ptr + 4096, owner.reserved_bytes - 2 * MiB, 2 * MiB)
    assert driver_free() == free and owner.mapped_chunks == 0
    owner.close()
