"""Small results read back from the GPU by a kernel into pinned memory (colomem._torch.read_back_words, the
checksum's host_out): the bytes arrive, bad host memory is refused, and nothing waits behind a long
device-to-host copy the process has in flight (a copy engine serves such copies in order)."""

import pytest
import torch

from colomem import _C, _torch
from colomem.errors import InvalidArgumentError

pytestmark = pytest.mark.gpu

GiB = 1 << 30


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 3, 1000])
def test_read_back_words_round_trips(dtype, n):
    src = (torch.arange(n, dtype=torch.int64) * 0x0123456789ABCDEF).view(dtype) if dtype == torch.int64 \
        else torch.randn(n, dtype=dtype)
    got = _torch.read_back_words(src.cuda())
    assert got.device.type == "cpu" and got.dtype == dtype and torch.equal(got.view(torch.int64),
                                                                            src.view(torch.int64))


def test_read_back_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="8-byte"):
        _torch.read_back_words(torch.zeros(4, dtype=torch.int32, device="cuda"))
    src = torch.zeros(2, dtype=torch.int64, device="cuda")
    pageable = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(InvalidArgumentError, match="page-locked"):
        _C.store_words(src.data_ptr(), 2, pageable.data_ptr(), torch.cuda.current_stream().cuda_stream, 0)
    with pytest.raises(InvalidArgumentError, match="at most"):
        _C.store_words(src.data_ptr(), (1 << 20) + 1, pageable.data_ptr(), 0, 0)


def test_a_small_read_back_does_not_wait_behind_a_long_copy_out():
    n = 8 * GiB
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    values = torch.arange(16, dtype=torch.int64, device="cuda")
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda")
    want = _C.checksum(data.data_ptr(), data.numel(), 1, 0, 0)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    word = torch.zeros(1, dtype=torch.int64).pin_memory()
    torch.cuda.synchronize()
    eng = _torch.engine_for(torch.device("cuda", 0))
    copy = eng.submit("d2h", [(host.data_ptr(), gpu.data_ptr(), n)])
    try:
        got = _torch.read_back_words(values)
        cur = torch.cuda.current_stream()
        _C.checksum_into(data.data_ptr(), data.numel(), 1, out.data_ptr(), cur.cuda_stream, 0, word.data_ptr())
        cur.synchronize()
        # both came back while the copy still ran: neither queued behind it
        assert not copy.done(), "the 8 GiB copy out ended before a small read back: the GPU is much faster " \
                                "than expected, or the read back waited for it"
        assert got.tolist() == list(range(16))
        assert int(word[0]) & ((1 << 64) - 1) == want
    finally:
        copy.wait(120)
