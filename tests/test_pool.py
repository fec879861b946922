"""The host pool: allocation, coalescing, stats, cap, errors; a stateful property test against a model."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import colomem
from colomem import _C
from colomem.errors import (ColomemError, DoubleReleaseError, InvalidArgumentError, NotAvailableError,
                            PoolBusyError, PoolClosedError, PoolExhaustedError)

MiB = 1 << 20


def test_alloc_is_aligned_and_rounded():
    with colomem.PinnedPool("4MiB", pin=False) as pool:
        a = pool.alloc(1)
        b = pool.alloc(5000)
        assert a.address % 4096 == 0 and b.address % 4096 == 0
        assert a.nbytes == 4096 and b.nbytes == 8192
        assert pool.stats()["in_use_bytes"] == 4096 + 8192
        a.release()
        b.release()


def test_reserved_is_exact_not_power_of_two():
    with colomem.PinnedPool(3 * MiB + 123, pin=False, huge_pages=False) as pool:
        # rounded to the page size, never to the next power of two (what torch's host allocator does)
        assert pool.stats()["reserved_bytes"] == 3 * MiB + 4096


def test_free_coalesces_neighbours():
    with colomem.PinnedPool("8MiB", pin=False) as pool:
        blocks = [pool.alloc(MiB) for _ in range(8)]
        assert pool.stats()["largest_free_block"] == 0
        for i in (1, 3, 2):  # free the middle ones out of order: they must merge into one 3 MiB run
            blocks[i].release()
        assert pool.stats()["largest_free_block"] == 3 * MiB
        for i in (0, 4, 5, 6, 7):
            blocks[i].release()
        s = pool.stats()
        assert s["largest_free_block"] == 8 * MiB and s["in_use_bytes"] == 0 and s["blocks"] == 0


def test_blocks_are_reused_without_growth():
    with colomem.PinnedPool("4MiB", pin=False) as pool:
        for _ in range(200):
            blocks = [pool.alloc(512 * 1024) for _ in range(8)]
            for b in blocks:
                b.release()
        s = pool.stats()
        assert s["segments"] == 1 and s["reserved_bytes"] == 4 * MiB
        assert s["peak_in_use_bytes"] == 4 * MiB


def test_grows_by_segments_up_to_the_cap():
    with colomem.PinnedPool(0, max_bytes="6MiB", segment_bytes="2MiB", pin=False) as pool:
        blocks = [pool.alloc(2 * MiB) for _ in range(3)]
        assert pool.stats()["segments"] == 3
        with pytest.raises(PoolExhaustedError, match="max_bytes") as ei:
            pool.alloc(4096)
        assert isinstance(ei.value, MemoryError) and isinstance(ei.value, ColomemError)
        blocks[0].release()
        blocks[0] = pool.alloc(4096)  # room again after a release
        for b in blocks:
            b.release()


def test_large_request_gets_its_own_segment():
    with colomem.PinnedPool(0, segment_bytes="2MiB", pin=False) as pool:
        b = pool.alloc(5 * MiB)
        assert b.nbytes == 5 * MiB
        assert pool.stats()["reserved_bytes"] >= 5 * MiB
        b.release()


def test_double_release_and_foreign_block():
    with colomem.PinnedPool("1MiB", pin=False) as pool, colomem.PinnedPool("1MiB", pin=False) as other:
        b = pool.alloc(100)
        b.release()
        with pytest.raises(DoubleReleaseError, match="already released"):
            b.release()
        c = other.alloc(100)
        with pytest.raises(InvalidArgumentError, match="another pool"):
            pool.free(c)
        with pytest.raises(DoubleReleaseError, match="does not belong"):
            pool._core.free(10**9)
        c.release()


def test_close_refuses_while_blocks_hold_data_and_use_after_close_fails():
    pool = colomem.PinnedPool("1MiB", pin=False)
    b = pool.alloc(100)
    with pytest.raises(PoolBusyError, match="still in use"):
        pool.close()
    b.release()
    pool.close()
    assert pool.closed
    with pytest.raises(PoolClosedError):
        pool.alloc(1)
    pool.close()  # closing twice is harmless


def test_force_close_discards():
    pool = colomem.PinnedPool("1MiB", pin=False)
    pool.alloc(100)
    pool.close(force=True)
    assert pool.closed


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="power of two"):
        colomem.PinnedPool(0, pin=False, alignment=3000)
    with pytest.raises(InvalidArgumentError, match="larger than max_bytes"):
        colomem.PinnedPool("2MiB", max_bytes="1MiB", pin=False)
    with pytest.raises(InvalidArgumentError, match="pin must be"):
        colomem.PinnedPool(0, pin="yes")
    with pytest.raises(ValueError, match="not a byte size"):
        colomem.PinnedPool("lots", pin=False)


@pytest.mark.skipif(_C.device_count() > 0, reason="checks the error raised where no GPU is visible")
def test_pinning_without_a_gpu_says_what_to_do():
    with pytest.raises(NotAvailableError, match="pin=False"):
        colomem.PinnedPool("1MiB", pin=True)
    assert colomem.PinnedPool("1MiB", pin="auto").pinned is False


def test_block_as_tensor_views_the_memory():
    torch = pytest.importorskip("torch")
    with colomem.PinnedPool("1MiB", pin=False) as pool:
        b = pool.alloc(64)
        t = b.as_tensor()
        t[:64] = torch.arange(64, dtype=torch.uint8)
        assert bytes(b.as_tensor(8).tolist()) == bytes(range(8))
        b.release()


class PoolModel(RuleBasedStateMachine):
    """Random alloc/free sequences: blocks never overlap, stats match a model, freeing all coalesces."""

    def __init__(self):
        super().__init__()
        self.pool = colomem.PinnedPool(0, max_bytes="8MiB", segment_bytes="2MiB", pin=False, huge_pages=False,
                                       alignment=256)
        self.live = {}

    @rule(n=st.integers(1, 3 * MiB))
    def alloc(self, n):
        try:
            b = self.pool.alloc(n)
        except PoolExhaustedError:
            return
        assert b.nbytes >= n and b.nbytes % 256 == 0 and b.address % 256 == 0
        self.live[b.block_id] = b

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        bid = data.draw(st.sampled_from(sorted(self.live)))
        self.live.pop(bid).release()

    @invariant()
    def consistent(self):
        s = self.pool.stats()
        assert s["in_use_bytes"] == sum(b.nbytes for b in self.live.values())
        assert s["blocks"] == len(self.live)
        assert s["reserved_bytes"] <= 8 * MiB
        spans = sorted((b.address, b.address + b.nbytes) for b in self.live.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))

    def teardown(self):
        for b in self.live.values():
            b.release()
        s = self.pool.stats()
        assert s["in_use_bytes"] == 0
        # every segment is one free run again: the largest free block is a whole segment
        assert s["segments"] == 0 or s["largest_free_block"] >= 2 * MiB
        self.pool.close()


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
