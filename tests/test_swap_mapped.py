"""MappedSet and MappedOptimizerState on the host path (the core's host mappings, the host copy engine, real
torch): bytes round-trip through the pool chunk by chunk; an offload unmaps every chunk; a reload within a
budget brings back only the leading chunks that fit, and a later one the rest; the tensors keep their
addresses; a failure (no pool memory, a closed pool, a copy submission refused part way) leaves every chunk
where its bytes are whole and a later move completes; and an Adam optimizer whose moments live in mapped
memory steps bit for bit as one that never moved, across offloads, a checkpoint and a load."""

import pytest
import torch

from colomem import _torch
from colomem.errors import (ColomemError, CudaOutOfMemoryError, DeviceMismatchError, InvalidArgumentError,
                            PoolClosedError, PoolExhaustedError)
from colomem.optim_mapped import MappedOptimizerState
from colomem.pool import PinnedPool
from colomem.swap_mapped import DEVICE, POOL, MappedSet
from swap_faults import failing_engine  # noqa: F401  (fixture)

MiB = 1 << 20


@pytest.fixture
def pool():
    p = PinnedPool(pin=False)
    yield p
    p.close(force=True)


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(1000, 1000, generator=g)),
            ("b", torch.randint(-2**62, 2**62, (1_500_001,), dtype=torch.int64, generator=g)),
            ("c", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("d", torch.randn(3, 333, 17, generator=g).to(torch.float16))]


def equal(got, want):
    return all(g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


def test_bytes_round_trip_chunk_by_chunk(pool):
    ts = tensors()
    want = [t.clone() for _, t in ts]
    s = MappedSet(ts, pool, chunk_bytes=2 * MiB)
    assert s.memory.nchunks > 4 and equal(s.tensors, want) and s.resident
    ptrs = [t.data_ptr() for t in s.tensors]
    stats = s.offload(timing=True).wait()
    assert stats.chunks == s.memory.nchunks and stats.nbytes == s.nbytes
    assert s.memory.mapped_bytes == 0 and s.resident_bytes == 0 and not s.resident
    assert s.reload().wait().chunks == s.memory.nchunks
    assert s.resident and s.memory.all_mapped
    assert equal(s.tensors, want) and [t.data_ptr() for t in s.tensors] == ptrs
    for t in s.tensors:  # written on the device between cycles: the next offload carries the new bytes
        t.zero_()
    s.offload().wait()
    s.reload().wait()
    assert all(not t.any() for t in s.tensors)
    s.close()


def test_a_reload_within_a_budget_takes_the_leading_chunks_and_a_later_one_the_rest(pool):
    ts = tensors(1)
    want = [t.clone() for _, t in ts]
    s = MappedSet(ts, pool, chunk_bytes=2 * MiB)
    s.offload().wait()
    chunk = s.memory.chunk_span(0)[1]
    h = s.reload(budget_bytes=3 * chunk + chunk // 2, ordered=False)
    h.wait()
    assert h.chunks == [0, 1, 2] and s.resident_bytes == 3 * chunk
    assert [s.memory.range.is_mapped(i) for i in range(s.memory.nchunks)] == [True] * 3 + [False] * (
        s.memory.nchunks - 3)
    assert s.reload(budget_bytes=chunk // 2).chunks == []  # under one chunk: nothing comes back
    first = s.reload(budget_bytes=2 * chunk, ordered=False)
    rest = s.reload()  # queued behind the one in flight, not over its chunks
    assert set(first.chunks).isdisjoint(rest.chunks)
    assert sorted(first.chunks + rest.chunks) == list(range(3, s.memory.nchunks))
    s.wait()
    assert first.done() and s.resident and equal(s.tensors, want)
    s.close()


def test_a_set_on_two_devices_or_empty_is_refused(pool):
    with pytest.raises(ColomemError):
        MappedSet([], pool)
    if torch.cuda.is_available():
        with pytest.raises(DeviceMismatchError):
            MappedSet([("a", torch.zeros(4)), ("b", torch.zeros(4, device="cuda"))], pool)


def test_an_offload_the_pool_cannot_hold_leaves_the_set_whole_on_the_device():
    small = PinnedPool(max_bytes=4 * MiB, segment_bytes=4 * MiB, pin=False)
    ts = tensors(2)
    want = [t.clone() for _, t in ts]
    s = MappedSet(ts, small, chunk_bytes=2 * MiB)
    with pytest.raises(PoolExhaustedError):
        s.offload()
    assert s.resident and s.memory.all_mapped and equal(s.tensors, want)
    small.close(force=True)
    with pytest.raises(PoolClosedError):
        s.offload()
    assert s.resident and equal(s.tensors, want)
    s.memory.close()


def test_a_reload_from_a_closed_pool_leaves_the_chunks_in_the_pool(pool):
    p = PinnedPool(pin=False)
    s = MappedSet(tensors(3), p, chunk_bytes=2 * MiB)
    s.offload().wait()
    p.close(force=True)
    with pytest.raises(PoolClosedError):
        s.reload()
    assert all(w == POOL for w in s._where) and s.memory.mapped_bytes == 0
    s.memory.close()


def offloaded(pool, seed):
    """A set of tensors(seed) offloaded in 2 MiB chunks, and the bytes it must come back with."""
    ts = tensors(seed)
    want = [t.clone() for _, t in ts]
    s = MappedSet(ts, pool, chunk_bytes=2 * MiB)
    s.offload().wait()
    return s, want


def _short_of_memory(monkeypatch, s, failures, after=0):
    """The set's chunk mapping finds no device memory `failures` times once `after` chunks mapped; -> the
    devices whose torch cache was freed, counted (in place of freeing it)."""
    real, calls, released = s.memory.map, [0], []

    def map_(first=0, count=None):
        calls[0] += 1
        if after < calls[0] <= after + failures:
            raise CudaOutOfMemoryError("cuMemCreate failed: out of memory")
        return real(first, count)

    monkeypatch.setattr(s.memory, "map", map_)
    monkeypatch.setattr(_torch, "release_cached", lambda device: released.append(device))
    return released


def test_a_chunk_that_finds_no_memory_frees_torchs_cache_and_maps_on_the_second_try(pool, monkeypatch):
    s, want = offloaded(pool, 4)
    released = _short_of_memory(monkeypatch, s, 1)
    stats = s.reload(timing=True).wait()
    assert len(released) == 1 and stats.cache_releases == 1 and stats.chunks == s.memory.nchunks
    assert s.resident and equal(s.tensors, want)
    s.close()


def test_a_chunk_that_finds_no_memory_twice_stops_the_reload_with_its_bytes_in_the_pool(pool, monkeypatch):
    s, want = offloaded(pool, 5)
    released = _short_of_memory(monkeypatch, s, 2)
    with pytest.raises(CudaOutOfMemoryError, match="pinned pool"):
        s.reload()
    assert len(released) == 1 and all(w == POOL for w in s._where) and s.memory.mapped_bytes == 0
    assert s.reload().wait().cache_releases == 0  # memory is back: the next reload completes
    assert s.resident and equal(s.tensors, want)
    s.close()


def test_a_prefetch_stops_at_the_first_chunk_without_room_and_leaves_torchs_cache_alone(pool, monkeypatch):
    s, want = offloaded(pool, 6)
    released = _short_of_memory(monkeypatch, s, 10**6, after=2)  # room for two chunks only
    chunk = s.memory.chunk_span(0)[1]
    h = s.reload(5 * chunk, ordered=False, up_to_room=True)
    assert h.chunks == [0, 1] and h.nbytes == 2 * chunk and released == []
    h.wait()
    assert [w for w in s._where[:3]] == [DEVICE, DEVICE, POOL] and s.memory.mapped_bytes == 2 * chunk
    monkeypatch.undo()
    s.reload().wait()  # the step's reload brings the rest
    assert s.resident and equal(s.tensors, want)
    with pytest.raises(InvalidArgumentError):
        s.reload(ordered=True, up_to_room=True)
    s.close()


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))


def _step(model, opt, i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(16, 64, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_adam_with_mapped_moments_steps_bit_for_bit_through_offloads_a_checkpoint_and_a_load(pool, tmp_path):
    ref, mod = _model(0), _model(0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)
    with pytest.raises(ColomemError, match="first optimizer step"):
        MappedOptimizerState(opt, pool=pool)
    _step(ref, ref_opt, 0)
    _step(mod, opt, 0)
    mapped = MappedOptimizerState(opt, pool=pool, chunk_bytes=16 << 10)
    assert mapped.set.memory.nchunks > 2
    ptr = opt.state[next(iter(mod.parameters()))]["exp_avg"].data_ptr()
    for i in range(1, 4):
        mapped.offload().wait()
        if i == 2:
            mapped.reload(budget_bytes=mapped.nbytes // 2, ordered=False).wait()  # part back early
        _step(ref, ref_opt, i)
        _step(mod, opt, i)  # the step's hook brings the rest back before Adam reads it
        assert mapped.set.resident
    assert opt.state[next(iter(mod.parameters()))]["exp_avg"].data_ptr() == ptr
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))
    mapped.offload().wait()
    saved = opt.state_dict()  # its hook brings the state back first
    assert mapped.set.resident
    torch.save(saved, tmp_path / "opt.pt")
    opt.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert not mapped.active  # the loaded tensors are the optimizer's now
    with pytest.raises(ColomemError, match="let go"):
        mapped.offload()
    for i in range(4, 6):
        _step(ref, ref_opt, i)
        _step(mod, opt, i)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))
    again = MappedOptimizerState(opt, pool=pool)
    again.offload().wait()
    again.close()  # the state back in torch tensors the optimizer owns
    _step(ref, ref_opt, 6)
    _step(mod, opt, 6)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))


def test_moving_out_copies_straight_to_the_pool_and_the_optimizer_switches_only_once_it_ended(pool):
    ref, mod = _model(1), _model(1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)
    _step(ref, ref_opt, 0)
    _step(mod, opt, 0)
    first = next(iter(mod.parameters()))
    old = opt.state[first]["exp_avg"]
    mapped = MappedOptimizerState(opt, pool=pool, chunk_bytes=16 << 10, move_out=True)
    assert mapped.set.memory.mapped_bytes == 0 and not mapped.active
    assert opt.state[first]["exp_avg"] is old  # the optimizer keeps its own until the copy ended
    with pytest.raises(ColomemError, match="finish_move"):
        mapped.offload()
    assert mapped.finish_move() == mapped.nbytes
    assert mapped.active and opt.state[first]["exp_avg"] is not old
    assert old.untyped_storage().nbytes() == 0  # its memory went back
    assert mapped.set.memory.mapped_bytes == 0 and mapped.resident_bytes == 0  # offloaded from the start
    for i in range(1, 4):
        _step(ref, ref_opt, i)
        _step(mod, opt, i)  # the first brings the moments back from the pool
        mapped.offload().wait()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))
    mapped.close()
    assert mapped.closed and not mapped.active


def test_a_moving_out_that_cannot_copy_leaves_the_optimizer_its_own_state():
    small = PinnedPool(max_bytes=64 << 10, segment_bytes=64 << 10, pin=False)
    mod = _model(2)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)
    _step(mod, opt, 0)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with pytest.raises(PoolExhaustedError):
        MappedOptimizerState(opt, pool=small, chunk_bytes=16 << 10, move_out=True)
    for p, st in opt.state.items():
        assert all(torch.equal(v, before[id(p)][k]) for k, v in st.items())
    assert small.stats()["in_use_bytes"] == 0  # the blocks of the chunks that were copied went back
    small.close(force=True)


def test_loading_a_state_dict_read_from_the_same_optimizer_keeps_the_moments_it_aliases(pool):
    """A state dict read in the same process holds the mapped tensors themselves (torch loads a tensor of the
    right dtype and device as it is): loading it back, even after the state went out again, leaves the
    optimizer with its moments' bytes in its own memory, not in the mapped memory let go."""
    ref, mod = _model(3), _model(3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)
    for i in range(2):
        _step(ref, ref_opt, i)
        _step(mod, opt, i)
    mapped = MappedOptimizerState(opt, pool=pool, chunk_bytes=16 << 10)
    saved = opt.state_dict()
    mapped.offload().wait()
    opt.load_state_dict(saved)
    assert mapped.closed
    for _, st in opt.state.items():
        assert all(t.untyped_storage().nbytes() > 0 for t in st.values())
    for i in range(2, 4):
        _step(ref, ref_opt, i)
        _step(mod, opt, i)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))


def test_a_submission_refused_part_way_leaves_each_chunk_where_its_bytes_are_whole(pool, failing_engine):
    arm, disarm = failing_engine
    ts = tensors(4)
    want = [t.clone() for _, t in ts]
    s = MappedSet(ts, pool, chunk_bytes=2 * MiB)
    arm(3)  # the offload's third chunk
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.offload()
    assert s.resident and s.memory.all_mapped and equal(s.tensors, want)  # the first two were copied, not freed
    disarm()
    s.offload().wait()
    arm(3)  # the reload's third chunk: the two before it came back, the rest stays in the pool
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.reload()
    chunk = s.memory.chunk_span(0)[1]
    assert s._where[:3] == [DEVICE, DEVICE, POOL] and s.resident_bytes == 2 * chunk
    assert s.memory.mapped_bytes == 2 * chunk  # the refused chunk was mapped for its copy: unmapped again
    disarm()
    s.reload().wait()
    assert s.resident and equal(s.tensors, want)
    s.close()


def test_a_move_out_refused_part_way_leaves_the_optimizer_its_state_and_the_pool_its_blocks(pool, failing_engine):
    arm, _ = failing_engine
    mod = _model(5)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)
    _step(mod, opt, 0)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    arm(2)
    with pytest.raises(InvalidArgumentError, match="injected"):
        MappedOptimizerState(opt, pool=pool, chunk_bytes=16 << 10, move_out=True)
    for p, st in opt.state.items():
        assert all(torch.equal(v, before[id(p)][k]) for k, v in st.items())
    assert pool.stats()["in_use_bytes"] == 0


def test_the_state_of_params_missing_from_the_groups_moves_too(pool):
    """ZeRO-3 puts a partition in its inner optimizer's param groups only while it steps it: the state is
    found through the state dict, not the groups."""
    ref, mod = _model(6), _model(6)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = torch.optim.Adam(mod.parameters(), lr=1e-3)
    _step(ref, ref_opt, 0)
    _step(mod, opt, 0)
    params = opt.param_groups[0]["params"]
    opt.param_groups[0]["params"] = params[:1]  # the others out of the groups, their state kept
    mapped = MappedOptimizerState(opt, pool=pool, chunk_bytes=16 << 10)
    opt.param_groups[0]["params"] = params
    assert len(mapped._refs) == 2 * len(params)  # both moments of every param
    mapped.offload().wait()
    _step(ref, ref_opt, 1)
    _step(mod, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))
    mapped.close()
