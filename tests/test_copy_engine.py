"""The raw copy engine (pointers in, handles out) and the error hierarchy, host backend and CUDA."""

import ctypes

import pytest
import torch

import colomem
from colomem import _C
from colomem.errors import (ColomemError, CudaError, CudaOutOfMemoryError, InvalidArgumentError,
                            NotAvailableError, TransferTimeoutError)


def test_host_engine_copies_and_reports_progress():
    eng = _C.CopyEngine(-1, chunk_bytes=1000)
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (1, 999, 1000, 1001, 12345)]
    dst = [torch.zeros_like(s) for s in src]
    t = eng.submit("d2h", [(d.data_ptr(), s.data_ptr(), s.numel()) for d, s in zip(dst, src)], timing=True)
    t.wait(30)
    assert t.done() and t.completed_copies() == 5 and t.ncopies == 5
    assert t.nbytes == sum(s.numel() for s in src) and t.direction == "d2h"
    assert t.elapsed_ms() >= 0
    assert all(torch.equal(a, b) for a, b in zip(src, dst))


def test_host_engine_rejects_bad_submissions():
    eng = _C.CopyEngine(-1)
    with pytest.raises(InvalidArgumentError, match="'d2h' or 'h2d'"):
        eng.submit("sideways", [])
    with pytest.raises(InvalidArgumentError, match="null pointer"):
        eng.submit("h2d", [(0, 0, 10)])
    with pytest.raises(InvalidArgumentError, match="no streams"):
        eng.submit("h2d", [], wait_stream=1)
    t = eng.submit("h2d", [])
    t.wait(5)
    with pytest.raises(InvalidArgumentError, match="timing=True"):
        t.elapsed_ms()


def test_error_hierarchy():
    for cls in (InvalidArgumentError, TransferTimeoutError, NotAvailableError, CudaError, CudaOutOfMemoryError,
                colomem.PoolExhaustedError, colomem.PeerError, colomem.StaleWeightsError, colomem.PhaseOrderError):
        assert issubclass(cls, ColomemError)
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(TransferTimeoutError, TimeoutError)
    assert issubclass(CudaOutOfMemoryError, CudaError) and issubclass(CudaOutOfMemoryError, MemoryError)
    assert issubclass(colomem.DeviceMismatchError, InvalidArgumentError)


def test_build_info_says_what_was_built():
    info = colomem.build_info()
    assert info["version"] == colomem.__version__
    assert isinstance(info["cuda"], bool) and info["device_count"] >= 0
    if info["cuda"]:
        assert info["cuda_version"] >= 12000 and "90" in info["cuda_archs"]


@pytest.mark.skipif(_C.device_count() > 0, reason="checks the errors raised where no GPU is visible")
def test_cuda_calls_without_a_gpu_say_what_to_do():
    with pytest.raises(NotAvailableError, match="device='cpu'"):
        _C.CopyEngine(0)


@pytest.mark.gpu
def test_cuda_engine_copies_both_directions_at_once():
    eng = _C.CopyEngine(0, chunk_bytes=1 << 20, small_copy_bytes=4096)
    pool = colomem.PinnedPool("64MiB")
    sizes = [3, 4096, 5000, (1 << 20) + 7, 3 << 20]
    gen = torch.Generator().manual_seed(0)
    host_src = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    dev = [h.cuda() for h in host_src]
    blocks = [pool.alloc(n) for n in sizes]
    out = eng.submit("d2h", [(b.address, d.data_ptr(), d.numel()) for b, d in zip(blocks, dev)],
                     wait_stream=torch.cuda.current_stream().cuda_stream, timing=True)
    fresh = [torch.empty_like(d) for d in dev]
    inn = eng.submit("h2d", [(f.data_ptr(), h.data_ptr(), h.numel()) for f, h in zip(fresh, host_src)],
                     signal_stream=torch.cuda.current_stream().cuda_stream)
    out.wait(30)
    inn.wait(30)
    assert out.nchunks >= 4 and out.elapsed_ms() > 0
    assert all(torch.equal(b.as_tensor(h.numel()), h) for b, h in zip(blocks, host_src))
    assert all(torch.equal(f.cpu(), h) for f, h in zip(fresh, host_src))
    for b in blocks:
        b.release()
    pool.close()


@pytest.mark.gpu
def test_cuda_engine_refuses_wrong_pointers():
    eng = _C.CopyEngine(0)
    host = torch.zeros(16, dtype=torch.uint8)
    dev = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(InvalidArgumentError, match="not device memory"):
        eng.submit("d2h", [(dev.data_ptr(), host.data_ptr(), 16)])
    with pytest.raises(InvalidArgumentError, match="expected host memory"):
        eng.submit("d2h", [(dev.data_ptr(), dev.data_ptr(), 16)])


@pytest.mark.gpu
def test_cuda_failure_carries_its_status():
    pool = colomem.PinnedPool("4MiB", pin=True)
    b = pool.alloc(4096)
    with pytest.raises(CudaError) as ei:
        _C.pin_range(b.address, 4096)  # already registered as part of the pool's segment
    assert ei.value.status == 712 and ei.value.status_name == "cudaErrorHostMemoryAlreadyRegistered"
    assert "cudaHostRegister" in str(ei.value) and "pin.cpp" in str(ei.value)
    b.release()
    pool.close()


def test_copy_ranges_on_the_host_copies_every_range_in_order():
    from colomem._torch import copy_ranges, ranges_tensor

    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(4096, dtype=torch.uint8)
    want = dst.clone()
    ops = []
    for k in range(60):  # random lengths (zero included) and sources; destinations never overlap
        n = int(torch.randint(0, 64, (1,), generator=gen))
        d, s = 64 * k, int(torch.randint(0, 4096 - 64, (1,), generator=gen))
        ops.append((d, s, n))
        want[d:d + n] = src[s:s + n]
    copy_ranges(ranges_tensor(ops), torch.device("cpu"), dst_base=dst.data_ptr(), src_base=src.data_ptr())
    assert torch.equal(dst, want)
    copy_ranges(ranges_tensor([]), torch.device("cpu"))  # nothing to do is fine


def test_copy_ranges_refuses_bad_input():
    from colomem._torch import copy_ranges, ranges_tensor

    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="negative"):
        copy_ranges(ranges_tensor([(0, 0, -1)]), torch.device("cpu"), buf.data_ptr(), buf.data_ptr())
    with pytest.raises(InvalidArgumentError, match="null"):
        copy_ranges(ranges_tensor([(0, 0, 4)]), torch.device("cpu"))
    with pytest.raises(ValueError, match="int64"):
        copy_ranges(torch.zeros(2, 3, dtype=torch.int32), torch.device("cpu"))
    assert torch.equal(buf, torch.zeros(16, dtype=torch.uint8))  # nothing was written by a refused call
    if not _C.build_info()["cuda"]:
        with pytest.raises(NotAvailableError, match="without CUDA"):
            ops = ranges_tensor([(8, 0, 4)])  # held: the core reads it through its address
            _C.copy_ranges(ops.data_ptr(), 1, buf.data_ptr(), buf.data_ptr(), 0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])  # the legacy default stream is copied one by one
def test_copy_ranges_on_the_gpu_in_stream_order(side_stream):
    from colomem._torch import copy_ranges, ranges_tensor

    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, generator=gen).to(dev)
    dst = torch.zeros(1 << 22, dtype=torch.uint8, device=dev)
    want = torch.zeros(1 << 22, dtype=torch.uint8)
    src_h = src.cpu()
    ops = []
    for k in range(1500):  # more than one batch of 1024; disjoint destinations, sizes up to 2 KiB
        n = int(torch.randint(0, 2048, (1,), generator=gen))
        d, s = 2048 * k, int(torch.randint(0, (1 << 22) - 2048, (1,), generator=gen))
        ops.append((d, s, n))
        want[d:d + n] = src_h[s:s + n]
    stream = torch.cuda.Stream(dev) if side_stream else torch.cuda.current_stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        copy_ranges(ranges_tensor(ops), dev, dst_base=dst.data_ptr(), src_base=src.data_ptr())
        dst.add_(0)  # later work on the stream sees the copies
    torch.cuda.current_stream(dev).wait_stream(stream)
    assert torch.equal(dst.cpu(), want)
