"""The pipelined reload on a GPU: a set of several pieces comes back byte for byte and its memory goes back
to the driver while offloaded; a kernel queued on the current stream right after reload() (without waiting
for the handle) reads every piece's bytes, the last piece's included; a reload that finds memory for only
part of the set raises the typed error, leaves the set offloaded with no memory held, and a later reload
restores every byte; a reload short of the driver's memory gives the allocator's cache back before its first
piece, not between its copies; a reload re-grows the set in expandable segments, the process's allocator
setting back after it, and that memory goes back to the driver at the next offload."""

import pytest
import torch

import colomem
from colomem import _torch, swap_pipeline
from colomem.errors import CudaOutOfMemoryError
from colomem.swap import OFFLOADED
from _swap_gpu import as_bytes, driver_free, pool  # noqa: F401  (pool: a fixture)

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def make(seed, count=48, mib=12):
    """~600 MB: 48 storages of 7-17 MiB (several pieces), random bytes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {f"t{i}": torch.randint(-2**15, 2**15, ((mib + (i % 11) - 5) * MiB // 2,), dtype=torch.int16,
                                   device="cuda", generator=gen) for i in range(count)}


def sums(ts):
    # one int64 sum per tensor, queued on the current stream: what a kernel after reload() sees
    return torch.stack([t.to(torch.int64).sum() for t in ts.values()])


@pytest.mark.parametrize("pipeline,expandable", [(True, False), (False, False), (True, True)])
def test_a_set_of_several_pieces_round_trips_and_frees_its_memory(pool, pipeline, expandable):
    ts = make(1)
    want = {k: as_bytes(v) for k, v in ts.items()}
    want_sums = sums(ts).cpu()
    nbytes = sum(v.nbytes for v in ts.values())
    s = colomem.SwapSet.from_tensors(ts, pool, name="piped", pipeline=pipeline, expandable=expandable)
    for _ in range(3):
        before = driver_free()
        s.offload()
        assert driver_free() - before >= nbytes - 64 * MiB  # back with the driver
        assert swap_pipeline.applies(s, s._layout) and len(swap_pipeline.pieces(s._layout.direct)) >= 3
        h = s.reload_async()
        got = sums(ts)  # queued right behind the reload: the current stream waits for the last piece
        h.wait(60)
        assert torch.equal(got.cpu(), want_sums)
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())
    s.close()


def test_memory_for_part_of_the_set_is_a_typed_error_and_a_later_reload_restores_it(pool):
    ts = make(2)
    want = {k: as_bytes(v) for k, v in ts.items()}
    nbytes = sum(v.nbytes for v in ts.values())
    s = colomem.SwapSet.from_tensors(ts, pool, name="half")
    s.offload()
    torch.cuda.empty_cache()
    # leave room for about a third of the set: the first piece (64 MiB) and part of the second fit
    room = nbytes // 3
    blocker = torch.empty(max(0, driver_free() - room), dtype=torch.uint8, device="cuda")
    free_before = driver_free()
    with pytest.raises(CudaOutOfMemoryError, match="data is still in the pinned pool"):
        s.reload()
    assert s.state == OFFLOADED
    assert all(v.untyped_storage().nbytes() == 0 for v in ts.values())
    torch.cuda.empty_cache()
    assert driver_free() >= free_before - 64 * MiB  # what the failed pieces grew went back
    del blocker
    torch.cuda.empty_cache()
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())
    s.close()


def test_a_reload_regrows_in_expandable_segments_and_puts_the_setting_back(pool):
    ts = make(3, count=8)
    want = {k: as_bytes(v) for k, v in ts.items()}
    s = colomem.SwapSet.from_tensors(ts, pool, name="expandable", expandable=True)
    s.offload()
    s.reload()
    expandable = [(g["address"], g["total_size"]) for g in torch.cuda.memory_snapshot() if g.get("is_expandable")]
    assert all(any(a <= v.data_ptr() < a + n for a, n in expandable) for v in ts.values())
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())
    assert "expandable_segments:True" not in _torch._allocator_settings()  # the process's own setting is back
    before = driver_free()
    s.offload()  # expandable memory goes back to the driver too
    assert driver_free() - before >= sum(v.nbytes for v in ts.values()) - 64 * MiB
    s.reload()  # and comes back whole from the pool
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())
    s.close()


@pytest.mark.skipif(_torch.process_expandable(), reason="the process's memory is in expandable segments")
def test_a_reload_into_memory_the_allocator_holds_cached_never_frees_it_behind_its_own_copies(pool):
    # The driver has room for less than the set; the rest is cached by torch in 16 MiB cudaMalloc'd blocks no
    # storage of the set fits in. The reload gives that cache back before its first piece, so no piece's
    # growth has to (the allocator's free-and-retry, a cudaFree that waits for the pieces already copying).
    ts = make(4, count=6, mib=96)                          # ~576 MiB in storages of 91-101 MiB: 3+ pieces
    want = {k: as_bytes(v) for k, v in ts.items()}
    nbytes = sum(v.nbytes for v in ts.values())
    s = colomem.SwapSet.from_tensors(ts, pool, name="cached", expandable=False)
    s.offload()
    torch.cuda.empty_cache()
    hog = torch.empty(max(0, driver_free() - nbytes - 512 * MiB), dtype=torch.uint8, device="cuda")
    blocks = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range((nbytes + 256 * MiB) // (16 * MiB))]
    del blocks                                             # cached by the allocator, not with the driver
    assert driver_free() < nbytes
    assert swap_pipeline.release_first(torch.device("cuda"), nbytes)
    retries = torch.cuda.memory_stats()["num_alloc_retries"]
    s.reload()
    assert torch.cuda.memory_stats()["num_alloc_retries"] == retries
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())
    del hog
    s.close()
