"""Memory colomem maps itself, on a GPU: a MappedRange's chunks go back to the driver when unmapped and come
back at the same addresses; a MappedSet round-trips its bytes chunk by chunk, gives its memory to the driver
while offloaded and takes only the chunks a budget allows; a kernel queued right after an ordered reload
(no host wait) reads every chunk, also after an earlier unordered part; a reload whose memory sits in
torch's cache frees the cache and completes, and a prefetch stops where the free memory ends; a reload the driver cannot give memory for raises the typed
error and keeps what it brought back; and Adam with its moments in mapped memory
steps bit for bit as one that never moved."""

import pytest
import torch

from colomem import _C
from colomem.errors import CudaOutOfMemoryError
from colomem.optim_mapped import MappedOptimizerState
from colomem.swap_mapped import DEVICE, POOL, MappedSet
from _swap_gpu import as_bytes, driver_free, pool  # noqa: F401  (pool: a fixture)

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def make(seed, count=12, mib=40):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(f"t{i}", torch.randint(-2**15, 2**15, ((mib + 3 * i) * MiB // 2,), dtype=torch.int16, device="cuda",
                                    generator=gen)) for i in range(count)]


def sums(ts):
    return torch.stack([t.to(torch.int64).sum() for t in ts])


def test_a_range_gives_its_chunks_to_the_driver_and_maps_them_back_at_the_same_addresses():
    torch.cuda.empty_cache()
    r = _C.MappedRange(torch.cuda.current_device(), 512 * MiB, 128 * MiB)
    assert r.granularity % (2 * MiB) == 0 and r.nchunks == 4
    free0 = driver_free()
    r.map(0, 4)
    assert free0 - driver_free() >= 500 * MiB
    ptr = r.ptr
    t = _C_view(r, 512 * MiB)
    t.fill_(3)
    torch.cuda.synchronize()  # unmap does not wait for the device: the fill must be done with the chunks
    r.unmap(1, 2)
    assert driver_free() - (free0 - 512 * MiB) >= 250 * MiB
    r.map(0, 4)
    assert r.ptr == ptr
    t[128 * MiB:384 * MiB].fill_(3)
    assert int(t.to(torch.int64).sum()) == 3 * 512 * MiB
    del t
    torch.cuda.empty_cache()  # the sum's int64 copy went to torch's cache
    r.close()
    assert driver_free() >= free0 - 4 * MiB


def _C_view(r, nbytes):
    from colomem import _torch
    return _torch.device_bytes(r.ptr, nbytes, torch.device("cuda", r.device), owner=r)


def test_a_set_round_trips_frees_its_memory_and_a_kernel_after_an_ordered_reload_sees_every_chunk(pool):
    ts = make(1)
    want = [as_bytes(t) for _, t in ts]
    want_sums = sums([t for _, t in ts]).cpu()
    s = MappedSet(ts, pool, chunk_bytes=64 * MiB)
    del ts
    torch.cuda.empty_cache()
    held = driver_free()
    s.offload(timing=True).wait()
    assert driver_free() - held >= s.nbytes - 4 * MiB and s.memory.mapped_bytes == 0
    # part back early, unordered; the rest ordered behind it; a kernel queued at once reads all of it
    s.reload(budget_bytes=s.nbytes // 3, ordered=False)
    s.reload(ordered=True)
    got_sums = sums(s.tensors).cpu()  # queued before any host wait
    s.wait()
    assert torch.equal(got_sums, want_sums)
    assert all(torch.equal(as_bytes(t), w) for t, w in zip(s.tensors, want))
    s.close()


def test_a_reload_within_a_budget_takes_only_that_much_from_the_driver(pool):
    s = MappedSet(make(2), pool, chunk_bytes=64 * MiB)
    torch.cuda.empty_cache()
    s.offload().wait()
    free0 = driver_free()
    s.reload(budget_bytes=256 * MiB, ordered=False).wait()
    assert s.resident_bytes == 256 * MiB
    assert 250 * MiB <= free0 - driver_free() <= 260 * MiB
    s.reload().wait()
    assert s.resident
    s.close()


def offloaded(pool, seed):
    """A set offloaded in 64 MiB chunks, the bytes it must come back with, and torch's cache emptied."""
    ts = make(seed)
    want = [as_bytes(t) for _, t in ts]
    s = MappedSet(ts, pool, chunk_bytes=64 * MiB)
    del ts
    s.offload().wait()
    torch.cuda.empty_cache()
    return s, want


def test_a_reload_short_of_memory_raises_keeps_what_came_back_and_completes_later(pool):
    s, want = offloaded(pool, 3)
    room = s.nbytes // 2
    hog = torch.empty(driver_free() - room, dtype=torch.uint8, device="cuda")
    with pytest.raises(CudaOutOfMemoryError):
        s.reload()
    back = [i for i, w in enumerate(s._where) if w == DEVICE]
    assert back == list(range(len(back))) and 0 < s.resident_bytes <= room
    assert all(w == POOL for w in s._where[len(back):])
    assert s.memory.mapped_bytes == s.resident_bytes  # nothing mapped beyond the chunks that came back
    del hog
    torch.cuda.empty_cache()
    s.reload().wait()
    assert s.resident and all(torch.equal(as_bytes(t), w) for t, w in zip(s.tensors, want))
    s.close()


def test_a_reload_whose_memory_sits_in_torchs_cache_frees_the_cache_and_completes(pool):
    s, want = offloaded(pool, 4)
    hog = torch.empty(driver_free() - s.nbytes // 2, dtype=torch.uint8, device="cuda")
    del hog  # freed, but held in torch's cache: only torch can use it until the cache is emptied
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > s.nbytes // 2
    stats = s.reload(timing=True).wait()
    assert stats.cache_releases == 1 and s.resident
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < s.nbytes // 2
    assert all(torch.equal(as_bytes(t), w) for t, w in zip(s.tensors, want))
    s.close()


def test_a_prefetch_takes_only_the_free_memory_and_leaves_torchs_cache_alone(pool):
    s, want = offloaded(pool, 5)
    hog = torch.empty(driver_free() - s.nbytes // 2, dtype=torch.uint8, device="cuda")
    del hog
    cached = torch.cuda.memory_reserved()
    h = s.reload(ordered=False, up_to_room=True)
    h.wait()
    assert 0 < h.nbytes <= s.nbytes // 2 and not s.resident
    assert torch.cuda.memory_reserved() == cached  # the forward and backward keep their cache
    torch.cuda.empty_cache()
    s.reload().wait()
    assert s.resident and all(torch.equal(as_bytes(t), w) for t, w in zip(s.tensors, want))
    s.close()


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()


def _step(model, opt, i):
    g = torch.Generator(device="cuda").manual_seed(100 + i)
    x = torch.randn(64, 512, device="cuda", generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("fused", [False, True])
def test_adam_with_mapped_moments_steps_bit_for_bit(pool, fused):
    ref, mod = _model(0), _model(0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, fused=fused)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3, fused=fused)
    _step(ref, ref_opt, 0)
    _step(mod, opt, 0)
    mapped = MappedOptimizerState(opt, pool=pool, chunk_bytes=2 * MiB)
    assert mapped.set.memory.nchunks > 2
    for i in range(1, 5):
        mapped.offload().wait()
        if i % 2:
            mapped.reload(budget_bytes=mapped.nbytes // 2, ordered=False)  # part back early, not waited for
        _step(ref, ref_opt, i)
        _step(mod, opt, i)  # the hook queues the rest; Adam runs after it in stream order
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))
    mapped.close()
