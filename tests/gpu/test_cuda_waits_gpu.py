"""Bounded waits of the CUDA core under a stream that does not move (tests/gpu/_stream_gate.py): closing an
IPC buffer, a device checksum, and a copy submission that fails after it queued some chunks."""

import threading

import pytest
import torch

import colomem
from colomem import _C, _torch
from colomem.errors import CudaError, TransferTimeoutError

from _stream_gate import StreamGate

pytestmark = pytest.mark.gpu
MiB = 1 << 20
CHUNK = 4 * MiB
GOOD = 8 * MiB        # a copy that is valid throughout
SHORT = 30 * MiB      # the device tensor a copy overruns: 7 chunks fit, the 8th crosses its end
OVERRUN = 60 * MiB    # the bytes that copy claims
QUEUED = 28 * MiB     # what its chunks before the failing one copy


@pytest.fixture
def gate():
    g = StreamGate(0)
    yield g
    if g.held:
        g.release()  # a failed test must not leave a stream, and everything behind it, hung
    torch.cuda.synchronize()


def own_segment_tensor(nbytes: int) -> torch.Tensor:
    """Random bytes in a tensor that ends where its cudaMalloc segment ends, so a copy running past its end
    crosses the allocation's end (the runtime refuses it) instead of reading a neighbour in the segment."""
    torch.cuda.empty_cache()
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    end = t.data_ptr() + nbytes
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]:
            assert seg["address"] + seg["total_size"] == end, \
                "the caching allocator put the tensor inside a larger segment; run without PYTORCH_CUDA_ALLOC_CONF"
            return t
    raise AssertionError("the tensor's segment is not in torch.cuda.memory_snapshot()")


def overrun_copies(block: colomem.pool.Block, good: torch.Tensor, short: torch.Tensor) -> list:
    """A good copy, then one whose 8th chunk runs past the end of `short` (cudaMemcpyAsync fails there)."""
    return [(block.address, good.data_ptr(), GOOD), (block.address + GOOD, short.data_ptr(), OVERRUN)]


def host_bytes(block, offset: int, nbytes: int) -> torch.Tensor:
    return block.as_tensor()[offset:offset + nbytes]


# -- IPC buffers --------------------------------------------------------------------------------------------
def test_ipc_buffer_close_times_out_under_a_held_stream_then_closes_once_released(gate):
    buf = _C.ExportableBuffer(0, 2 * MiB)
    ptr = buf.ptr
    view = _torch.device_bytes(ptr, 2 * MiB, torch.device("cuda", 0), owner=buf)
    view.fill_(0)  # the fill kernel loaded before the gate holds (_stream_gate's docstring says why)
    torch.cuda.synchronize()
    gate.hold()
    with torch.cuda.stream(gate.stream):
        view.fill_(7)  # a kernel writing the buffer, queued behind the gate
    del view
    with pytest.raises(TransferTimeoutError, match="stays mapped"):
        buf.close(timeout_s=0.2)
    assert not buf.closed and buf.ptr == ptr  # unmapping under the queued kernel would fault: still mapped

    # a close waiting for the device does not lock the buffer: other threads still read it meanwhile
    errors = []
    closer = threading.Thread(target=lambda: _close_into(buf, 120.0, errors))
    closer.start()
    reader_saw = []
    reader = threading.Thread(target=lambda: reader_saw.append((buf.ptr, buf.closed)))
    reader.start()
    reader.join(30.0)
    assert reader_saw == [(ptr, False)], "ptr/closed blocked behind a close() waiting for the device"
    assert closer.is_alive()  # the gate still holds the kernel: that close is still waiting

    gate.release()
    buf.close(timeout_s=60.0)  # waits for the other close's outcome, or closes itself
    closer.join(60.0)
    assert errors == [] and buf.closed


def _close_into(buf, timeout_s: float, errors: list) -> None:
    try:
        buf.close(timeout_s=timeout_s)
    except BaseException as exc:  # noqa: BLE001 - reported to the test thread
        errors.append(exc)


# -- checksum -----------------------------------------------------------------------------------------------
def test_device_checksum_times_out_on_a_held_stream_and_is_right_once_released(gate):
    n = 3 * MiB + 5
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    want = _C.checksum_buffer(data.cpu().numpy().tobytes(), 1)
    other = torch.cuda.Stream()
    # the checksum kernel loaded before the gate holds (_stream_gate's docstring says why)
    assert _C.checksum(data.data_ptr(), n, 1, other.cuda_stream, 0) == want
    gate.hold()
    with pytest.raises(TransferTimeoutError, match="checksum"):
        _C.checksum(data.data_ptr(), n, 1, gate.stream.cuda_stream, 0, timeout_s=0.2)
    assert _C.checksum(data.data_ptr(), n, 1, other.cuda_stream, 0) == want  # only the held stream waits
    gate.release()
    assert _C.checksum(data.data_ptr(), n, 1, gate.stream.cuda_stream, 0, timeout_s=60.0) == want


# -- a submission failing part-way ----------------------------------------------------------------------------
def overrun_setup():
    """A good device tensor, one that ends at its segment's end, and a zeroed pool block for both and more."""
    good = torch.randint(0, 256, (GOOD,), dtype=torch.uint8, device="cuda")
    short = own_segment_tensor(SHORT)
    pool = colomem.PinnedPool(0)
    block = pool.alloc(GOOD + OVERRUN)
    host_bytes(block, 0, GOOD + OVERRUN).zero_()
    return good, short, pool, block


def test_failed_submit_waits_for_the_chunks_it_had_queued(gate):
    good, short, pool, block = overrun_setup()
    eng = _C.CopyEngine(0, CHUNK, MiB, failure_wait_s=60.0)
    gate.hold()
    opener = threading.Timer(0.5, gate.release)  # after the failure; the engine must still be waiting then
    opener.start()
    try:
        with pytest.raises(CudaError) as info:
            eng.submit("d2h", overrun_copies(block, good, short), wait_stream=gate.stream.cuda_stream)
    finally:
        opener.join()
    assert getattr(info.value, "transfer", None) is None  # waited within failure_wait_s: nothing runs now
    # the chunks queued before the failure could only run after the release, and they are done: the engine
    # waited for them before raising, so the caller may free this block now
    assert torch.equal(host_bytes(block, 0, GOOD), good.cpu())
    assert torch.equal(host_bytes(block, GOOD, QUEUED), short[:QUEUED].cpu())
    back = torch.empty_like(good)
    eng.submit("h2d", [(back.data_ptr(), block.address, GOOD)]).wait(60.0)  # the engine is usable after
    assert torch.equal(back, good)
    block.release()
    pool.close()


def test_failed_submit_hands_back_the_chunks_still_running(gate):
    good, short, pool, block = overrun_setup()
    eng = _C.CopyEngine(0, CHUNK, MiB, failure_wait_s=0.0)
    gate.hold()
    with pytest.raises(CudaError) as info:
        eng.submit("d2h", overrun_copies(block, good, short), wait_stream=gate.stream.cuda_stream)
    running = info.value.transfer
    assert isinstance(running, _C.Transfer) and not running.done()
    assert int(host_bytes(block, 0, GOOD + QUEUED).count_nonzero()) == 0  # held: none of them ran yet
    with pytest.raises(TransferTimeoutError):
        running.wait(0.1)
    gate.release()
    running.wait(60.0)
    assert torch.equal(host_bytes(block, 0, GOOD), good.cpu())
    assert torch.equal(host_bytes(block, GOOD, QUEUED), short[:QUEUED].cpu())
    block.release()
    pool.close()


class OverrunInTheMiddle:
    """A real CUDA engine (failure_wait_s=0) given the set's copies with an overrunning one in the middle."""

    def __init__(self, bad: tuple):
        self._engine = _C.CopyEngine(0, CHUNK, MiB, failure_wait_s=0.0)
        self._bad = bad

    def submit(self, direction, copies, **kw):
        return self._engine.submit(direction, copies[:1] + [self._bad] + copies[1:], **kw)


def test_swapset_keeps_its_blocks_under_a_failed_offload_until_the_chunks_finish(gate, monkeypatch):
    a = torch.randn(GOOD // 4, device="cuda")
    b = torch.randn(GOOD // 4, device="cuda")
    want = [a.clone(), b.clone()]
    short = own_segment_tensor(SHORT)
    pool = colomem.PinnedPool("256MiB")
    spare = pool.alloc(OVERRUN)
    monkeypatch.setattr(_torch, "engine_for", lambda device: OverrunInTheMiddle(
        (spare.address, short.data_ptr(), OVERRUN)))
    s = colomem.SwapSet.from_tensors([a, b], pool)
    gate.hold()
    with torch.cuda.stream(gate.stream):  # the offload waits for this stream: its chunks sit behind the gate
        with pytest.raises(CudaError) as info:
            s.offload(60)
    assert isinstance(info.value.handle, colomem.SwapHandle)
    assert s.state == "offloading"
    assert pool.stats()["in_use_bytes"] >= spare.nbytes + 2 * GOOD  # the blocks under the copies stay taken
    with pytest.raises(TransferTimeoutError):
        s.wait_pending(0.1)
    gate.release()
    with pytest.raises(CudaError):
        s.wait_pending(60)
    assert s.state == "resident"
    assert pool.stats()["in_use_bytes"] == spare.nbytes  # rolled back: the set's blocks are free again
    assert all(torch.equal(t, w) for t, w in zip((a, b), want))
    monkeypatch.undo()
    s.offload(60)  # the set and the pool are usable: a full cycle with the process's engine
    s.reload(60)
    assert all(torch.equal(t, w) for t, w in zip((a, b), want))
    s.close()
    spare.release()
    pool.close()
