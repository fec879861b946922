"""The pipelined reload and offload on the host path: the pieces cover the set, the first of few storages
whatever their order, then by size with growing totals; a
set reloaded piece by piece gets every byte back, in every dtype, views and Parameters included, as the
grow-everything-first reload does; a piece that finds no memory or whose submission is refused leaves the set
offloaded with its bytes in the pool and no storage grown, and a later reload restores it. An offload frees
each piece once its copy ended and the last with the set; a piece whose copy fails puts the freed ones back
from the pool; a refused piece leaves the set resident."""

from types import SimpleNamespace

import pytest
import torch

import colomem
from colomem import _torch, swap_pipeline
from colomem.errors import CudaError, CudaOutOfMemoryError, InvalidArgumentError
from colomem.swap import OFFLOADED, RESIDENT
from random_bytes import random_tensor
from swap_faults import failing_engine  # noqa: F401  (fixture)

KiB = 1 << 10
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64]


class _E:  # what pieces() reads of an entry
    def __init__(self, nbytes):
        self.nbytes = nbytes


def tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {f"t{i}": random_tensor((3 * KiB + 97 * i,), DTYPES[i % len(DTYPES)], gen) for i in range(40)}
    base = random_tensor((64, 33), torch.float32, gen)
    out["base"], out["view"] = base, base[2:7, 1::3]
    out["param"] = torch.nn.Parameter(random_tensor((50, 7), torch.float32, gen))
    return out


def as_bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


@pytest.fixture
def pool():
    p = colomem.PinnedPool("16MiB", pin=False)
    yield p
    p.close(force=True)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 16 KiB, x2 each: the test sets (~1 MB) make several."""
    monkeypatch.setattr(swap_pipeline, "FIRST_PIECE_BYTES", 16 * KiB)
    monkeypatch.setattr(swap_pipeline, "PIECE_GROWTH", 2)


def test_pieces_cover_the_entries_in_order_with_growing_targets():
    entries = [_E(n) for n in [10, 10, 10, 500, 10, 10, 10, 10, 30, 30, 30, 30, 30, 5]]
    cut = swap_pipeline.pieces(entries, first=20, growth=3)
    assert [e for p in cut for e in p] == entries
    assert [sum(e.nbytes for e in p) for p in cut] == [20, 510, 190, 5]  # >= 20, >= 60, >= 180, the rest
    assert swap_pipeline.pieces([], first=20) == []
    assert [len(p) for p in swap_pipeline.pieces([_E(5)], first=20)] == [1]


def test_reload_piece_by_piece_restores_every_byte_and_object(pool, small_pieces):
    ts = tensors()
    want = {k: as_bytes(v) for k, v in ts.items()}
    ids = {k: id(v) for k, v in ts.items()}
    s = colomem.SwapSet(ts, pool, device="cpu")
    for _ in range(3):
        s.offload()
        assert all(v.untyped_storage().nbytes() == 0 for v in ts.values())
        layout = s._layout
        assert swap_pipeline.applies(s, layout) and len(swap_pipeline.pieces(layout.direct)) > 3
        st = s.reload()
        assert s.state == RESIDENT and st.alloc_ms >= 0
        for k, v in ts.items():
            assert id(v) == ids[k] and torch.equal(as_bytes(v), want[k]), k
    assert ts["view"].untyped_storage()._cdata == ts["base"].untyped_storage()._cdata
    assert isinstance(ts["param"], torch.nn.Parameter)


def test_pipelined_and_grow_first_reloads_agree(pool, small_pieces):
    a, b = tensors(1), tensors(1)
    sa = colomem.SwapSet(a, pool, device="cpu", name="piped")
    sb = colomem.SwapSet(b, pool, device="cpu", name="first", pipeline=False)
    for s in (sa, sb):
        s.offload()
        s.reload()
    for k in a:
        assert torch.equal(as_bytes(a[k]), as_bytes(b[k])), k


def test_a_refused_piece_leaves_the_set_offloaded_then_it_reloads(pool, small_pieces, failing_engine):
    arm, disarm = failing_engine
    ts = tensors(2)
    want = {k: as_bytes(v) for k, v in ts.items()}
    s = colomem.SwapSet(ts, pool, device="cpu")
    s.offload()
    arm(3)  # the third piece's submission is refused, two pieces were queued before it
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.reload()
    disarm()
    s.wait_pending()  # nothing parked: the queued pieces had finished; a no-op then
    assert s.state == OFFLOADED
    assert all(v.untyped_storage().nbytes() == 0 for v in ts.values())
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())


def test_no_memory_for_a_piece_is_a_typed_error_and_loses_nothing(pool, small_pieces, monkeypatch):
    ts = tensors(3)
    want = {k: as_bytes(v) for k, v in ts.items()}
    s = colomem.SwapSet(ts, pool, device="cpu")
    s.offload()
    real = torch.UntypedStorage.resize_
    calls = {"n": 0}

    def resize_(self, n):
        if n:
            calls["n"] += 1
            if calls["n"] == 12:  # part way through the pieces
                raise torch.OutOfMemoryError("injected: no memory for this storage")
        return real(self, n)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", resize_)
    with pytest.raises(CudaOutOfMemoryError, match="data is still in the pinned pool"):
        s.reload()
    monkeypatch.setattr(torch.UntypedStorage, "resize_", real)
    assert s.state == OFFLOADED
    assert all(v.untyped_storage().nbytes() == 0 for v in ts.values())
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())


class _FailedWait:
    """A finished transfer whose wait reports a failed copy (as a CUDA error would)."""

    def __init__(self, real):
        self.real = real

    def done(self):
        return True

    def wait(self, timeout_s):
        self.real.wait(timeout_s)
        raise CudaError("injected: this copy failed")

    def elapsed_ms(self):
        return 0.0


class _EngineFailingAWait:
    def __init__(self, real, fail_at):
        self.real, self.fail_at, self.calls = real, fail_at, 0

    def submit(self, direction, copies, **kw):
        self.calls += 1
        t = self.real.submit(direction, copies, **kw)
        return _FailedWait(t) if self.calls == self.fail_at else t

    def stream(self, direction):
        return self.real.stream(direction)


def model_like(first):
    """A model's storages in its order, in units of first/16: the embedding first (huge), layers of tiny norms,
    small and middle-sized weights, the output head last (huge)."""
    u = first // 16
    layer = [1, 1, 3, 3, 12, 12, 12]
    return [_E(400 * u)] + [_E(n * u) for _ in range(6) for n in layer] + [_E(1), _E(400 * u)]


def test_pieces_start_with_few_storages_up_to_the_first_piece_and_grow_by_size(small_pieces):
    first = swap_pipeline.FIRST_PIECE_BYTES
    entries = model_like(first)
    cut = swap_pipeline.reload_pieces(entries)
    flat = [e for p in cut for e in p]
    assert sorted(map(id, flat)) == sorted(map(id, entries))            # every storage once
    assert [e.nbytes for e in cut[0]] == [12 * first // 16, 12 * first // 16]     # the fewest that reach it
    sizes = [e.nbytes for e in flat[len(cut[0]):]]
    assert sizes == sorted(sizes) and sizes[-2:] == [400 * first // 16] * 2       # the two huge ones last
    totals = [sum(e.nbytes for e in p) for p in cut]
    assert all(t >= first * 2 ** i for i, t in enumerate(totals[:-1]))
    # no storage fits the first piece: the smallest one alone
    big = [_E(5 * first), _E(2 * first), _E(3 * first)]
    assert [e.nbytes for e in swap_pipeline.reload_pieces(big)[0]] == [2 * first]
    assert swap_pipeline.reload_pieces([]) == []


def test_offload_pieces_end_with_the_small_one(small_pieces):
    entries = model_like(swap_pipeline.FIRST_PIECE_BYTES)
    cut = swap_pipeline.offload_pieces(SimpleNamespace(direct=entries))
    assert cut == list(reversed(swap_pipeline.reload_pieces(entries)))
    assert sum(e.nbytes for e in cut[-1]) < 2 * swap_pipeline.FIRST_PIECE_BYTES and len(cut[-1]) == 2
    assert max(e.nbytes for e in cut[0]) == 400 * swap_pipeline.FIRST_PIECE_BYTES // 16     # the huge ones first


def test_an_offload_frees_each_piece_as_its_copy_ends_and_the_last_with_the_set(pool, small_pieces):
    ts = tensors(4)
    want = {k: as_bytes(v) for k, v in ts.items()}
    s = colomem.SwapSet(ts, pool, device="cpu")
    h = s.offload_async()
    cut = swap_pipeline.offload_pieces(s._layout)
    assert len(cut) >= 3
    h._advance(60.0)  # what wait() runs first: every piece but the last is freed once its copy ended
    assert all(e.storage.nbytes() == 0 for p in cut[:-1] for e in p)
    assert all(e.storage.nbytes() == e.nbytes for e in cut[-1])
    assert s.state == "offloading"
    h.wait(60)
    assert s.state == OFFLOADED and all(v.untyped_storage().nbytes() == 0 for v in ts.values())
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())


class _EngineRecording:
    """The engine, with each submission written into `order`."""
    def __init__(self, real, order):
        self.real, self.order = real, order

    def submit(self, *a, **k):
        self.order.append("submit")
        return self.real.submit(*a, **k)


def test_an_offload_in_pieces_releases_the_cached_memory_before_its_first_copy(pool, small_pieces, monkeypatch):
    # a cudaFree of memory torch had cached waits for copies in flight: it goes before any piece is queued
    ts = tensors(6)
    want = {k: as_bytes(v) for k, v in ts.items()}
    order: list = []
    real = _torch.engine_for(torch.device("cpu"))
    monkeypatch.setattr(_torch, "engine_for", lambda device: _EngineRecording(real, order))
    monkeypatch.setattr(_torch, "release_cached", lambda device: order.append(f"release {device.type}"))
    s = colomem.SwapSet(ts, pool, device="cpu")
    s.offload()
    assert order[0] == "release cpu" and order.count("submit") == len(swap_pipeline.offload_pieces(s._layout))
    assert order.count("release cpu") == 1
    order.clear()
    s.reload()
    assert "release cpu" not in order
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())
    # all of the process's memory in expandable segments: released behind the copies, where it does not wait
    monkeypatch.setattr(_torch, "process_expandable", lambda: True)
    order.clear()
    s.offload()
    assert "release cpu" not in order and "submit" in order
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())


def test_a_reload_releases_the_cache_first_only_when_the_driver_cannot_give_the_set(monkeypatch):
    cuda = torch.device("cuda", 0)     # a device object only: the decision reads the driver's figures
    free = {"bytes": 0}
    monkeypatch.setattr(_torch, "mem_get_info", lambda device: (free["bytes"], 80 << 30))
    monkeypatch.setattr(_torch, "process_expandable", lambda: False)
    need = 10 << 30
    free["bytes"] = need + swap_pipeline.RELEASE_MARGIN_BYTES
    assert not swap_pipeline.release_first(cuda, need)          # the driver has room: keep the cache
    free["bytes"] = need + swap_pipeline.RELEASE_MARGIN_BYTES - 1
    assert swap_pipeline.release_first(cuda, need)              # a piece would make the allocator free it
    assert not swap_pipeline.release_first(torch.device("cpu"), need)
    monkeypatch.setattr(_torch, "process_expandable", lambda: True)
    assert not swap_pipeline.release_first(cuda, need)          # unmaps do not wait for the copies


def test_a_reload_short_of_driver_memory_releases_the_cache_before_its_first_piece(pool, small_pieces,
                                                                                    monkeypatch):
    ts = tensors(7)
    want = {k: as_bytes(v) for k, v in ts.items()}
    s = colomem.SwapSet(ts, pool, device="cpu")
    s.offload()
    order: list = []
    real = _torch.engine_for(torch.device("cpu"))
    monkeypatch.setattr(_torch, "engine_for", lambda device: _EngineRecording(real, order))
    monkeypatch.setattr(_torch, "release_cached", lambda device: order.append("release"))
    asked: list = []
    monkeypatch.setattr(swap_pipeline, "release_first", lambda device, n: asked.append(n) or True)
    s.reload()
    assert asked == [s.nbytes] and order[0] == "release" and order.count("release") == 1
    assert order.count("submit") == len(swap_pipeline.pieces(s._layout.direct)) > 1
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())


def test_a_failed_piece_copy_puts_the_freed_pieces_back_from_the_pool(pool, small_pieces, monkeypatch):
    ts = tensors(5)
    want = {k: as_bytes(v) for k, v in ts.items()}
    s = colomem.SwapSet(ts, pool, device="cpu")
    real = _torch.engine_for(torch.device("cpu"))
    monkeypatch.setattr(_torch, "engine_for", lambda device: _EngineFailingAWait(real, 3))
    h = s.offload_async()
    with pytest.raises(CudaError, match="injected"):
        h.wait(60)
    # the two pieces freed before the failed one are back, bytes from the pool: the whole set is on its device
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())


def test_a_refused_offload_piece_leaves_the_set_resident_then_it_offloads(pool, small_pieces, failing_engine):
    arm, disarm = failing_engine
    ts = tensors(6)
    want = {k: as_bytes(v) for k, v in ts.items()}
    s = colomem.SwapSet(ts, pool, device="cpu")
    arm(2)
    with pytest.raises(InvalidArgumentError, match="injected"):
        s.offload()
    disarm()
    assert s.state == RESIDENT and pool.stats()["in_use_bytes"] == 0
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())
    s.offload()
    s.reload()
    assert all(torch.equal(as_bytes(v), want[k]) for k, v in ts.items())


@pytest.mark.skipif(not hasattr(torch._C, "_accelerator_getAllocatorSettings"), reason="torch without it")
def test_the_expandable_window_switches_the_setting_and_puts_it_back(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with _torch.expandable_segments(torch.device("cuda")):
        assert "expandable_segments:True" in torch._C._accelerator_getAllocatorSettings()
    assert "expandable_segments:True" not in _torch._allocator_settings()
    with _torch.expandable_segments(torch.device("cpu")):  # the host path: nothing to switch
        assert "expandable_segments:True" not in _torch._allocator_settings()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the process's own choice stays
    calls = []
    monkeypatch.setattr(_torch, "_set_allocator_settings", calls.append)
    with _torch.expandable_segments(torch.device("cuda")):
        pass
    assert calls == []


def test_the_expandable_default_comes_from_the_environment(pool, monkeypatch):
    monkeypatch.delenv("COLOMEM_SWAP_EXPANDABLE", raising=False)
    assert colomem.SwapSet([torch.zeros(3)], pool, device="cpu").expandable
    monkeypatch.setenv("COLOMEM_SWAP_EXPANDABLE", "0")
    assert not colomem.SwapSet([torch.zeros(3)], pool, device="cpu").expandable
    monkeypatch.setenv("COLOMEM_SWAP_EXPANDABLE", "1")
    assert colomem.SwapSet([torch.zeros(3)], pool, device="cpu").expandable
    assert not colomem.SwapSet([torch.zeros(3)], pool, device="cpu", expandable=False).expandable
    monkeypatch.setenv("COLOMEM_SWAP_EXPANDABLE", "yes")
    with pytest.raises(InvalidArgumentError, match="COLOMEM_SWAP_EXPANDABLE"):
        colomem.SwapSet([torch.zeros(3)], pool, device="cpu")
