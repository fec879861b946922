"""SwapSet's staging chunks on the host path: small storages gathered into chunks and scattered back keep every
byte and every object, large ones still move on their own, and a failure part way leaves the set as it was."""

import pytest
import torch

import colomem
from colomem import swap_coalesce
from colomem.errors import InvalidArgumentError
from random_bytes import random_tensor
from swap_faults import failing_engine  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def coalescing_on(monkeypatch):
    """These tests are about coalescing: every set they build coalesces unless it says otherwise."""
    monkeypatch.setattr(swap_coalesce, "COALESCE_BELOW_DEFAULT", swap_coalesce.COALESCE_BELOW_ON)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex64, torch.complex128]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]
KiB = 1 << 10


def as_bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).clone() if t.numel() else torch.empty(0)


def mixed_set(n_small=300, seed=0):
    """Small tensors of every dtype at odd sizes, a few large ones, a view, a non-contiguous tensor and an
    empty one: {name: tensor}."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n_small):
        dt = DTYPES[i % len(DTYPES)]
        out[f"small{i}"] = random_tensor((1 + (i * 37) % 997,), dt, gen)
    for i in range(3):
        out[f"large{i}"] = random_tensor((600 * KiB + 13 * i,), torch.int16, gen)  # > 1 MiB each
    base = random_tensor((64, 33), torch.float32, gen)
    out["base"], out["view_of_base"] = base, base[3:9, 1::2]  # one storage, moved once
    out["transposed"] = random_tensor((17, 29), torch.bfloat16, gen).t()
    out["empty"] = torch.empty(0, dtype=torch.float16)
    return out


@pytest.fixture
def pool():
    p = colomem.PinnedPool("16MiB", pin=False)
    yield p
    p.close(force=True)


def cycle_and_check(s, tensors, cycles=3):
    before = {k: as_bytes(v) for k, v in tensors.items()}
    ids = {k: id(v) for k, v in tensors.items()}
    storages = {k: v.untyped_storage()._cdata for k, v in tensors.items()}
    for _ in range(cycles):
        s.offload()
        assert all(v.untyped_storage().nbytes() == 0 for v in tensors.values())
        s.reload()
        for k, v in tensors.items():
            assert id(v) == ids[k] and v.untyped_storage()._cdata == storages[k], k
            assert torch.equal(as_bytes(v), before[k]), k


def test_small_storages_move_in_chunks_and_keep_bytes_and_objects(pool):
    tensors = mixed_set()
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", staging_bytes=64 * KiB)
    cycle_and_check(s, tensors)
    layout = s._layout
    assert layout is not None and len(layout.chunks) > 3 and not layout.fallback
    direct = {e.nbytes for e in layout.direct}
    assert all(n >= swap_coalesce.COALESCE_BELOW_DEFAULT for n in direct)  # the three large ones
    assert len(direct) == 3
    for c in layout.chunks:
        assert c.nbytes <= 64 * KiB and all(off % swap_coalesce.ALIGN == 0 for off in c.offsets)
    assert len(s._kept) == len(layout.units())  # one pool block per chunk and per large storage, kept


def test_the_layout_and_its_views_are_made_once_while_the_storages_stay(pool):
    tensors = mixed_set(50)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu")
    s.offload(); s.reload()
    layout, views = s._layout, [c.views for c in s._layout.chunks]
    s.offload(); s.reload()
    assert s._layout is layout and [c.views for c in layout.chunks] == views
    # a storage that appears later gives a new layout, with the new tensor in it
    extra = torch.arange(100, dtype=torch.int32)
    s2 = colomem.SwapSet.from_tensors(lambda: [*tensors.values(), *([extra] if grow else [])], pool, device="cpu")
    grow = False
    s2.offload(); s2.reload()
    first = s2._layout
    grow = True
    s2.offload()
    assert s2._layout is not first and extra.untyped_storage().nbytes() == 0
    s2.reload()
    assert torch.equal(extra, torch.arange(100, dtype=torch.int32))


def test_coalesce_below_zero_copies_each_storage_on_its_own(pool):
    tensors = mixed_set(40)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", coalesce_below=0)
    cycle_and_check(s, tensors, cycles=2)
    assert not s._layout.chunks and len(s._layout.direct) == len(s._entries)


@pytest.mark.parametrize("kw", [{"coalesce_below": -1}, {"staging_bytes": 0}, {"coalesce_below": 1.5}])
def test_bad_coalescing_options_are_refused(pool, kw):
    with pytest.raises(InvalidArgumentError):
        colomem.SwapSet.from_tensors([torch.ones(3)], pool, device="cpu", **kw)


def test_host_view_of_a_chunk_member_reads_its_own_bytes(pool):
    tensors = mixed_set(30)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu")
    want = {k: v.clone() for k, v in tensors.items()}
    s.offload()
    for k in ("small3", "small17", "transposed", "view_of_base", "large1"):
        assert torch.equal(as_bytes(s.host_view(tensors[k])), as_bytes(want[k])), k
    raw = s.host_storage(tensors["small5"])
    assert torch.equal(raw, want["small5"].view(-1).view(torch.uint8))
    s.reload()


def test_blocks_of_chunks_are_given_back_once_without_keep_blocks(pool):
    tensors = mixed_set(200)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", keep_blocks=False, staging_bytes=32 * KiB)
    cycle_and_check(s, tensors, cycles=2)
    assert pool.stats()["in_use_bytes"] == 0
    s.offload()
    held = s.host_bytes
    assert held == sum(u.block.nbytes for u in s._layout.units())
    s.discard()
    assert pool.stats()["in_use_bytes"] == 0


def test_swap_and_unordered_reload_of_chunked_sets(pool):
    a, b = mixed_set(120, seed=1), mixed_set(120, seed=2)
    want_a, want_b = ({k: as_bytes(v) for k, v in t.items()} for t in (a, b))
    sa = colomem.SwapSet.from_tensors(a, pool, device="cpu", staging_bytes=16 * KiB)
    sb = colomem.SwapSet.from_tensors(b, pool, device="cpu", staging_bytes=16 * KiB)
    sb.offload()
    colomem.swap(offload=sa, reload=sb, timing=True)
    colomem.swap(offload=sb, reload=sa)
    pending = colomem.PendingReloads()
    pending.add(sb.reload_async(ordered=False))
    pending.wait(60)
    for t, want in ((a, want_a), (b, want_b)):
        assert all(torch.equal(as_bytes(v), want[k]) for k, v in t.items())


def test_no_room_for_the_staging_buffer_copies_each_storage(pool, monkeypatch):
    tensors = mixed_set(60)
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu")

    def full(self, device):
        raise torch.OutOfMemoryError("no room for the staging buffer")

    monkeypatch.setattr(swap_coalesce.Layout, "grow_staging", full)
    cycle_and_check(s, tensors, cycles=2)
    assert s._layout.chunks and s._layout.fallback


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_failed_offload_part_way_leaves_every_tensor_resident_and_intact(pool, failing_engine, fail_at):
    arm, disarm = failing_engine
    tensors = mixed_set(150)
    before = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", staging_bytes=8 * KiB)
    arm(fail_at)  # 1: the direct copies; then the chunks
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.offload()
    disarm()
    assert s.state == "resident" and pool.stats()["in_use_bytes"] == 0
    assert all(torch.equal(as_bytes(v), before[k]) for k, v in tensors.items())
    cycle_and_check(s, tensors, cycles=1)  # and the set works after it


@pytest.mark.parametrize("fail_at", [2, 3, 5])
def test_a_failed_reload_part_way_leaves_the_set_offloaded_with_its_bytes_in_the_pool(pool, failing_engine,
                                                                                      fail_at):
    arm, disarm = failing_engine
    tensors = mixed_set(150)
    before = {k: as_bytes(v) for k, v in tensors.items()}
    s = colomem.SwapSet.from_tensors(tensors, pool, device="cpu", staging_bytes=8 * KiB)
    s.offload()
    arm(fail_at)
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.reload()
    disarm()
    assert s.state == "offloaded" and all(v.untyped_storage().nbytes() == 0 for v in tensors.values())
    s.reload()
    assert all(torch.equal(as_bytes(v), before[k]) for k, v in tensors.items())


def test_a_module_and_its_optimizer_train_the_same_after_chunked_cycles(pool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 24)
    model(x).square().mean().backward()
    opt.step()
    import copy
    twin, twin_opt = copy.deepcopy((model, opt))
    params = list(model.parameters())
    sets = [colomem.SwapSet.from_module(model, pool, device="cpu", grads=True),
            colomem.SwapSet.from_optimizer(opt, pool, device="cpu")]
    for _ in range(2):
        with colomem.offloaded(*sets):
            assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert sets[0]._layout.chunks and sets[1]._layout.chunks
    assert all(p is q for p, q in zip(model.parameters(), params))
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
