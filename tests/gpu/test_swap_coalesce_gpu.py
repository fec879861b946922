"""GPU staging chunks: a 20,000-tensor mixed-dtype set keeps every byte over offload/reload, its memory goes
back to the driver on offload, ordered=False and swap() order correctly with the scatter on the engine's
stream, and a device too full for the staging buffer still offloads (one copy per storage)."""

import pytest
import torch

import colomem
from colomem import swap_coalesce
from colomem.bench.transfer import make_small_set
from _swap_gpu import as_bytes, driver_free, pool  # noqa: F401  (pool: a fixture)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def coalescing_on(monkeypatch):
    """These tests are about coalescing: every set they build coalesces unless it says otherwise."""
    monkeypatch.setattr(swap_coalesce, "COALESCE_BELOW_DEFAULT", swap_coalesce.COALESCE_BELOW_ON)


MiB = 1 << 20


def test_twenty_thousand_small_tensors_round_trip_and_free_their_memory(pool):
    tensors = make_small_set(20000, "cuda", seed=3)
    tensors["large"] = torch.randint(-2**31, 2**31 - 1, (8 * MiB,), dtype=torch.int32, device="cuda")
    want = {k: as_bytes(v) for k, v in tensors.items()}
    nbytes = sum(t.nbytes for t in tensors.values())
    torch.cuda.empty_cache()
    s = colomem.SwapSet.from_tensors(tensors, pool)
    for _ in range(2):
        free0 = driver_free()
        reserved0 = torch.cuda.memory_reserved()
        s.offload()
        assert s._layout.chunks and not s._layout.fallback
        assert len(s._layout.direct) == 1  # only the large one moves on its own
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
        assert reserved0 - torch.cuda.memory_reserved() >= 0.95 * nbytes
        assert driver_free() - free0 >= 0.95 * nbytes
        s.reload()
        torch.cuda.synchronize()
        for k, v in tensors.items():
            assert torch.equal(as_bytes(v), want[k]), k
    s.close()


def test_unordered_reload_and_swap_of_chunked_sets_read_the_scattered_bytes(pool):
    a, b = make_small_set(3000, "cuda", seed=4), make_small_set(3000, "cuda", seed=5)
    want_a, want_b = ({k: as_bytes(v) for k, v in t.items()} for t in (a, b))
    sa, sb = colomem.SwapSet.from_tensors(a, pool, name="a"), colomem.SwapSet.from_tensors(b, pool, name="b")
    sb.offload()
    colomem.swap(offload=sa, reload=sb, timing=True)
    # read on the current stream right after swap(): it waited for the scatter of b
    assert all(torch.equal(as_bytes(v), want_b[k]) for k, v in b.items())
    pending = colomem.PendingReloads()
    pending.add(sa.reload_async(ordered=False))
    pending.wait(60)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream reads only after the handle's wait: the scatter is done
        ok = all(torch.equal(as_bytes(v), want_a[k]) for k, v in a.items())
    assert ok
    sa.close(), sb.close()


def test_no_room_for_the_staging_buffer_falls_back_to_per_storage_copies(pool, monkeypatch):
    tensors = make_small_set(500, "cuda", seed=6)
    want = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool)

    def full(self, device):
        raise torch.OutOfMemoryError("CUDA out of memory (staging buffer)")

    monkeypatch.setattr(swap_coalesce.Layout, "grow_staging", full)
    s.offload()
    assert s._layout.fallback
    s.reload()
    torch.cuda.synchronize()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in tensors.items())
    s.close()
