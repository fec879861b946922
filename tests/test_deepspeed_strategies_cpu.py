"""The DeepSpeed adapter without DeepSpeed: the state collection and the swap strategies on a ZeRO-2-shaped
stand-in (host path): bytes and objects back, deferred and held offloads, training the same after a swap."""

import pytest
import torch

import colomem
from colomem.errors import ColomemError
from colomem.engines import deepspeed as dsa
from colomem.engines.deepspeed import state as ds_state
from colomem.engines.deepspeed import strategies
from colomem.engines.deepspeed.strategies import ColomemOffload, ToOffload
from fakes.deepspeed import bare_trainer, fake_zero2_engine
from fakes.models import tiny_qwen2

CPU = torch.device("cpu")


# ---------------------------------------------------------------------- a ZeRO-2-shaped engine stand-in
def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def state_tensors(engine):
    """What must come back exactly: found independently of the adapter's collector."""
    out = [p for p in engine.module.parameters()] + [b for b in engine.module.buffers()]
    out += engine.optimizer.bit16_groups_flat + engine.optimizer.single_partition_of_fp32_groups
    out += [v for st in engine.optimizer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    out.append(engine.optimizer.new_release_buffer)
    return out


def test_collect_dedups_views_and_sorts_by_category():
    eng = fake_zero2_engine()
    st = dsa.collect_engine_state(eng, CPU)
    names = {c: [n for n, _ in st.groups[c]] for c in dsa.CATEGORIES}
    flat = eng.optimizer.bit16_groups_flat[0]
    assert names["params"][0] == "optimizer.bit16_groups_flat[0]"
    assert "inv_freq" in names["params"]
    assert not any(n.startswith("0.") or n.startswith("1.") for n in names["params"])   # views of the flat
    assert names["master"] == ["optimizer.single_partition_of_fp32_groups[0]"]
    assert sorted(n.rsplit(".", 1)[1] for n in names["optim"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert [n for n, _ in st.scratch] == ["optimizer.ipg_buckets[torch.bfloat16].buffer[0]"]
    assert st.unlisted == [("optimizer.new_release_buffer", 64)]
    assert names["other"] == ["optimizer.new_release_buffer"]
    assert st.sizes["params"] == flat.untyped_storage().nbytes() + 5 * 4
    assert st.sizes["master"] == flat.numel() * 4
    assert st.sizes["scratch"] == 128
    keys = [ds_state.storage_key(t) for _, t in st.swap_items() + st.scratch]
    assert len(keys) == len(set(keys))


def test_collect_skips_other_devices_and_empty_storages():
    eng = fake_zero2_engine()
    eng.optimizer.grads_in_partition = torch.empty(0)
    st = dsa.collect_engine_state(eng, torch.device("meta"))
    assert st.swap_items() == [] and st.scratch == []
    st = dsa.collect_engine_state(eng, CPU)
    assert all(n != "optimizer.grads_in_partition" for n, _ in st.swap_items())


@pytest.fixture
def pool():
    p = colomem.PinnedPool("1MiB", pin=False)
    yield p
    p.close(force=True)


def test_colomem_strategy_round_trip_keeps_objects_and_bytes(pool):
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    params_before = list(eng.module.parameters())
    before = snapshot(tensors)
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    for cycle in range(3):
        move = s.offload()
        assert move.nbytes == sum(move.state.sizes[c] for c in dsa.CATEGORIES)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert eng.optimizer.ipg_buckets[torch.bfloat16].buffer[0].untyped_storage().nbytes() == 0
        # the pool copy is readable while offloaded, with the tensor's own layout
        w = eng.module[0].weight
        hv = s.host_view(w)
        assert hv.dtype == w.dtype and hv.shape == w.shape and torch.equal(hv, before[0])
        s.reload()
        assert list(eng.module.parameters()) == params_before            # the same objects
        for t, b in zip(tensors, before):
            assert torch.equal(t, b), "bytes changed over a swap"
        assert eng.optimizer.ipg_buckets[torch.bfloat16].buffer[0].numel() == 64
        assert s.host_view(eng.module[0].weight) is None                  # views die with the reload
    # the params are still views into the flat buffer: an update of the flat is seen by the model
    eng.optimizer.bit16_groups_flat[0].fill_(1.0)
    assert torch.all(eng.module[1].bias == 1.0)
    s.close()


def test_a_new_placement_gives_the_old_layouts_blocks_back_before_it_offloads():
    """The sets keep their pool blocks for the next offload of the same tensors. When the placement changes
    (the plan after the measuring step keeps the weights and moves the moments), those blocks would not be
    reused: they go back first, so the new offload fits in the memory the first one pinned."""
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    before = snapshot(tensors)
    pool = colomem.PinnedPool("1MiB", segment_bytes="64KiB", pin=False)
    try:
        s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
        s.offload()                                  # everything moves (the measuring step)
        s.reload()
        assert s.swapset.host_bytes > 0 and s.late.host_bytes > 0        # kept for an offload like it
        reserved = pool.stats()["reserved_bytes"]
        s.keep = ("params", "other", "grads", "master")
        assert s.swapset.host_bytes == 0 and s.late.host_bytes == 0
        assert pool.stats()["in_use_bytes"] == 0
        move = s.offload()                           # the moments alone
        assert move.nbytes == move.state.sizes["optim"]
        assert pool.stats()["reserved_bytes"] == reserved                # nothing new pinned
        s.reload()
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)
        s.keep = ("params", "grads", "other", "master")                  # the same placement: blocks stay
        assert s.late.host_bytes > 0
        s.close()
    finally:
        pool.close(force=True)


def _moments_only_strategy(pool):
    """A ZeRO-2 stand-in engine, its state's tensors and their bytes, Adam's moments, and a strategy that moves
    only those moments (everything else kept)."""
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    moments = [v for st in eng.optimizer.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.numel() > 1]
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.keep = ("params", "other", "grads", "master")
    return tensors, snapshot(tensors), moments, s


def test_the_moments_out_behind_training_come_back_inside_the_step_with_their_bytes(pool):
    """optimizer_out_until_step's strategy calls: the moments start copying out while the rest stays; the
    trainer counts them outstanding at once (the step's hook is armed while they still copy), and bringing
    them back first waits for the copy out."""
    tensors, before, moments, s = _moments_only_strategy(pool)
    move = s.offload(defer_late=True)
    assert move.nbytes == 0 and s.pending_bytes == move.state.sizes["optim"] > 0     # all of it deferred
    s.reload(late=False)
    assert s.late_outstanding                       # copying out still counts: the hook arms now
    assert s.reload_late() == move.state.sizes["optim"]
    assert not s.late_outstanding and s.pending_bytes == 0
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    assert all(m.untyped_storage().nbytes() > 0 for m in moments)
    s.close()


def _refuse_late_copies(monkeypatch, s: ColomemOffload, real_async) -> None:
    """From now on the strategy's LATE set cannot start a copy (the other set still can)."""
    def refuse(self, *a, **kw):
        if self is s.late:
            raise ColomemError("no copy today")
        return real_async(self, *a, **kw)
    monkeypatch.setattr(type(s.late), "offload_async", refuse)


def test_a_deferred_offload_moves_the_rest_before_it_starts_and_a_failed_start_leaves_the_engine_whole(
        pool, monkeypatch):
    """The rest of the state is offloaded, and waited for, before the moments start copying: waited for after
    them it would queue behind their whole copy on the same copy engine. When the moments' copy cannot start,
    the rest comes back: the engine stays trainable, its bytes unchanged."""
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    before = snapshot(tensors)
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.keep = ("grads", "other")                     # the parameters move first, the rest is deferred
    calls = []
    real_off, real_async = type(s.swapset).offload, type(s.late).offload_async

    def offload(self, *a, **kw):
        calls.append(("offload", self.name))
        return real_off(self, *a, **kw)

    def offload_async(self, *a, **kw):
        if self is s.late:                          # (offload() itself goes through offload_async too)
            calls.append(("async", self.name, s.swapset.state))
        return real_async(self, *a, **kw)
    monkeypatch.setattr(type(s.swapset), "offload", offload)
    monkeypatch.setattr(type(s.late), "offload_async", offload_async)
    monkeypatch.setattr(strategies, "release_cached_memory", lambda: calls.append(("release",)))
    move = s.offload(defer_late=True)
    # the cache goes back between the two: after the deferred copy started, a cudaFree would wait for it
    assert calls == [("offload", s.swapset.name), ("release",), ("async", s.late.name, "offloaded")]
    moved, sizes, pending = move.nbytes, dict(move.state.sizes), s.pending_bytes    # (no tensors in a repr)
    assert moved == sizes["params"] > 0 and pending == sizes["master"] + sizes["optim"] > 0, (moved, sizes, pending)
    s.finish_late()
    s.reload()
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    _refuse_late_copies(monkeypatch, s, real_async)
    with pytest.raises(ColomemError, match="no copy today"):
        s.offload(defer_late=True)
    assert s.swapset.state == s.late.state == "resident" and s.pending_bytes == 0
    for t, b in zip(tensors, before):
        assert torch.equal(t, b) and t.untyped_storage().nbytes() > 0
    s.close()


def test_a_held_deferred_offload_starts_only_when_asked_and_a_failed_start_leaves_the_moments_whole(
        pool, monkeypatch):
    """hold_late: the rest moves, the moments stay where they are (counted as pending, and outstanding for
    the step's reload) until start_late(); finish_late() starts them itself when nobody did. A start that
    fails leaves them on the GPU with their bytes, and a reload then has nothing of them to bring back."""
    tensors, before, moments, s = _moments_only_strategy(pool)
    started = []
    real_async = type(s.late).offload_async

    def offload_async(self, *a, **kw):
        if self is s.late:
            started.append(self.name)
        return real_async(self, *a, **kw)
    monkeypatch.setattr(type(s.late), "offload_async", offload_async)
    for start in (s.start_late, lambda: None):      # started by the caller, then by finish_late() itself
        move = s.offload(defer_late=True, hold_late=True)
        assert not started and s.pending_bytes == move.state.sizes["optim"] > 0
        assert all(m.untyped_storage().nbytes() > 0 for m in moments)   # not copying yet: still there
        start()
        s.finish_late()
        assert started == [s.late.name] and s.pending_bytes == 0
        assert all(m.untyped_storage().nbytes() == 0 for m in moments)  # copied out, freed
        s.reload()
        started.clear()
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)
    _refuse_late_copies(monkeypatch, s, real_async)
    s.offload(defer_late=True, hold_late=True)
    s.reload(late=False)
    assert s.late_outstanding                       # held: the step's hook arms for it
    with pytest.raises(ColomemError, match="no copy today"):
        s.reload_late()
    assert s.pending_bytes == 0 and not s.late_outstanding and s.late.state == "resident"
    assert s.reload_late() == 0                     # nothing of it left to bring back
    for t, b in zip(tensors, before):
        assert torch.equal(t, b) and t.untyped_storage().nbytes() > 0
    s.close()


def test_the_trainer_ends_a_held_deferred_offload_in_a_thread_and_waits_for_it_before_going_on(pool):
    """DeepSpeedTrainer's start_offload / finish_offload(background=True) over the strategy: the held copy
    starts when asked, its end runs in a thread (the trainer counts it pending meanwhile), and the next
    finish_offload() waits for it: the moments' storages are freed, their bytes in the pool."""
    tensors, before, moments, s = _moments_only_strategy(pool)
    t = bare_trainer(tiny_qwen2(), None, pool)
    t._strategies = {"colomem": s}
    t.last_offload = None
    s.offload(defer_late=True, hold_late=True)
    assert t.offload_pending
    t.start_offload()
    assert t.finish_offload(background=True) == 0.0 and t.offload_pending
    assert t.finish_offload() >= 0.0 and not t.offload_pending and s.pending_bytes == 0
    assert all(m.untyped_storage().nbytes() == 0 for m in moments)
    s.reload()
    for x, b in zip(tensors, before):
        assert torch.equal(x, b)
    s.close()


def test_colomem_strategy_close_while_offloaded_gives_the_blocks_back(pool):
    eng = fake_zero2_engine()
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.offload()
    assert pool.stats()["in_use_bytes"] > 0
    s.close()
    assert pool.stats()["in_use_bytes"] == 0


def test_to_strategy_round_trip(pool):
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    before = snapshot(tensors)
    s = ToOffload(lambda: dsa.collect_engine_state(eng, CPU), CPU)
    for _ in range(2):
        move = s.offload()
        assert move.nbytes == sum(move.state.sizes[c] for c in dsa.CATEGORIES)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        s.reload()
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)


def test_training_continues_identically_after_a_swap(pool):
    """Same updates with and without a swap in between (the optimizer keeps its state objects)."""
    def run(swap):
        eng = fake_zero2_engine(seed=1)
        s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
        master = eng.optimizer.single_partition_of_fp32_groups[0]
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            if swap:
                s.offload()
                s.reload()
            master.grad = torch.randn(master.shape, generator=g)
            eng.optimizer.optimizer.step()
            eng.optimizer.bit16_groups_flat[0].copy_(master.detach())
        s.close()
        return [p.detach().clone() for p in eng.module.parameters()]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
