"""A submission that fails after the core queued some of its copies (the CUDA engine's error carries those
copies as `.transfer` when they still run): the set must keep the pool blocks and storages those copies use
until they finish, then roll back and be usable. The host engine never fails part-way, so the failure is
injected at the engine's boundary: the real host engine runs the copies, then the submission raises the
core's error with them attached, as the CUDA engine does (tests/gpu/test_cuda_waits_gpu.py triggers the real
failure)."""

import sys

import pytest
import torch

import colomem
from colomem import _C, _torch
from colomem.errors import CudaError, PhaseOrderError

BIG = 256 << 20  # a copy this large runs for tens of milliseconds: it is still running when submit returns


class FailingAfterQueueing:
    """A real engine whose submit() queues the copies, then fails with them still attached (.transfer)."""

    def __init__(self, engine):
        self._engine = engine
        self.running = []

    def submit(self, direction, copies, **kw):
        transfer = self._engine.submit(direction, copies, **kw)
        self.running.append(transfer)
        exc = CudaError("cudaMemcpyAsync failed: invalid argument (copy 1 of 2)")
        exc.transfer = transfer
        raise exc


@pytest.fixture
def pool():
    p = colomem.PinnedPool(0, pin=False)
    yield p
    p.close(force=True)


@pytest.fixture
def failing(monkeypatch):
    eng = FailingAfterQueueing(_torch.engine_for(torch.device("cpu")))
    monkeypatch.setattr(_torch, "engine_for", lambda device: eng)
    yield eng
    for t in eng.running:
        t.wait(60.0)  # never free the test's memory under a copy still running


def test_failed_offload_keeps_its_blocks_until_the_queued_copies_finish(pool, failing, monkeypatch):
    t = torch.arange(BIG // 8, dtype=torch.int64)
    want = t.clone()
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    with pytest.raises(CudaError) as info:
        s.offload(60)
    handle = info.value.handle
    assert isinstance(handle, colomem.SwapHandle)
    assert sys.version_info < (3, 11) or "wait_pending" in "".join(info.value.__notes__)
    # the copy may still be writing into the block: it is neither freed nor handed to another offload
    assert s.state == "offloading" and pool.stats()["in_use_bytes"] >= BIG
    for call in (s.offload, s.reload, s.close):
        with pytest.raises(PhaseOrderError, match="wait_pending"):
            call()
    with pytest.raises(CudaError) as again:
        s.wait_pending(60)
    assert again.value is info.value  # the same failure, reported once the copies were done
    assert s.state == "resident" and s.wait_pending() is None
    assert pool.stats()["in_use_bytes"] == 0  # the rollback gave every block back, kept ones included
    assert torch.equal(t, want)  # an offload only reads the tensors
    monkeypatch.undo()
    s.offload(60)  # the set and the pool are usable again
    s.reload(60)
    assert torch.equal(t, want)


def test_failed_reload_keeps_the_storages_until_the_queued_copies_finish(pool, monkeypatch):
    t = torch.arange(BIG // 8, dtype=torch.int64)
    want = t.clone()
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    s.offload(60)
    eng = FailingAfterQueueing(_torch.engine_for(torch.device("cpu")))
    monkeypatch.setattr(_torch, "engine_for", lambda device: eng)
    try:
        with pytest.raises(CudaError) as info:
            s.reload(60)
        # the copy may still be writing into the re-grown storage: it is not shrunk (freed) under it
        assert s.state == "reloading" and t.untyped_storage().nbytes() == BIG
        with pytest.raises(CudaError):
            info.value.handle.wait(60)
        assert s.state == "offloaded" and t.untyped_storage().nbytes() == 0
    finally:
        for tr in eng.running:
            tr.wait(60.0)
    monkeypatch.undo()
    s.reload(60)  # the pool copy was kept: the bytes come back
    assert torch.equal(t, want)


def test_a_failure_with_nothing_running_rolls_back_at_once(pool, monkeypatch):
    class FailingBeforeQueueing:
        def submit(self, direction, copies, **kw):
            raise CudaError("cudaEventCreate failed: out of resources")

    monkeypatch.setattr(_torch, "engine_for", lambda device: FailingBeforeQueueing())
    t = torch.arange(1 << 16, dtype=torch.int64)
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    with pytest.raises(CudaError) as info:
        s.offload(60)
    assert not hasattr(info.value, "handle")
    assert s.state == "resident" and s.wait_pending() is None and pool.stats()["in_use_bytes"] == 0


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_copy_engine_refuses_a_bad_failure_wait(bad):
    with pytest.raises(colomem.errors.InvalidArgumentError, match="timeout"):
        _C.CopyEngine(-1, failure_wait_s=bad)


def test_copy_engine_takes_an_unbounded_failure_wait():
    eng = _C.CopyEngine(-1, failure_wait_s=float("inf"))
    src, dst = torch.arange(1024, dtype=torch.int64), torch.zeros(1024, dtype=torch.int64)
    eng.submit("d2h", [(dst.data_ptr(), src.data_ptr(), src.numel() * 8)]).wait(60.0)
    assert torch.equal(dst, src)
