"""The DeepSpeed trainer's offload with Adam's moments in mapped memory (ColomemOffload + MappedMoments), on
the host path over a stand-in ZeRO-2 engine whose inner optimizer is a real torch AdamW: the moments leave
behind a held, deferred offload (straight from their torch tensors the first time, which are freed once the
copy ended), part of them comes back early within a byte budget and the rest at the step, every byte intact;
the optimizer then steps exactly as one whose state never moved; the other ways back (whole, overlapped)
bring them back too; a checkpoint written while they are in the pool resumes bit for bit; and closing
gives every pool block back."""

import pytest
import torch

import colomem
from colomem.engines import deepspeed as dsa
from colomem.engines.deepspeed.mapped_moments import MappedMoments
from colomem.engines.deepspeed.strategies import ColomemOffload
from colomem.optim_mapped import MOMENTS, state_tensors
from colomem.swap import PendingReloads
from fakes.deepspeed import fake_zero2_engine, zero2_tensors

CPU = torch.device("cpu")
KEEP_ALL_BUT_MOMENTS = ("params", "other", "grads", "master")


@pytest.fixture
def pool():
    p = colomem.PinnedPool("1MiB", pin=False)
    yield p
    p.close(force=True)


def strategy(eng, pool):
    moments = MappedMoments(lambda: eng.optimizer.optimizer, pool, 30.0, chunk_bytes=8 << 10)
    return ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0, moments=moments)


def moment_values(eng):
    return [t.clone() for _, _, t in state_tensors(eng.optimizer.optimizer, MOMENTS)]


def adam_step(eng, seed):
    master = eng.optimizer.single_partition_of_fp32_groups[0]
    master.grad = torch.randn(master.shape, generator=torch.Generator().manual_seed(seed))
    eng.optimizer.optimizer.step()
    master.grad = None


def test_the_moments_out_behind_the_rollout_part_back_early_the_rest_at_the_step_and_adam_unchanged(pool):
    eng, ref = fake_zero2_engine(hidden=1024), fake_zero2_engine(hidden=1024)
    _, _, old_moments = zero2_tensors(eng)
    s = strategy(eng, pool)
    s.keep = KEEP_ALL_BUT_MOMENTS
    for cycle in range(3):
        want = moment_values(eng)
        move = s.offload(defer_late=True, hold_late=True)
        assert move.nbytes == 0 and s.pending_bytes >= sum(t.nbytes for t in want)  # held: nothing copied yet
        s.reload(late=False)
        assert s.late_outstanding
        s.finish_late()  # the runner ends it in a thread during the rollout
        mapped = s.moments.state
        assert mapped is not None and mapped.active and mapped.resident_bytes == 0
        if cycle == 0:  # the first copy came straight from the optimizer's own tensors, freed since
            assert all(t.untyped_storage().nbytes() == 0 for t in old_moments)
        chunk = mapped.set.memory.chunk_span(0)[1]
        assert mapped.set.memory.nchunks > 4
        assert s.prefetch_late(2 * chunk) == 2 * chunk  # behind the forward and backward
        mapped.set.wait()
        assert 0 < mapped.resident_bytes < mapped.nbytes and s.late_outstanding
        assert s.reload_late() > 0  # inside the step
        assert not s.late_outstanding and mapped.set.resident
        assert all(torch.equal(a, b) for a, b in zip(moment_values(eng), want))
        adam_step(eng, cycle)
        adam_step(ref, cycle)
    assert all(torch.equal(a, b) for a, b in zip(moment_values(eng), moment_values(ref)))
    masters = [e.optimizer.single_partition_of_fp32_groups[0] for e in (eng, ref)]
    assert torch.equal(*masters)
    s.close()
    assert pool.stats()["in_use_bytes"] == 0


def test_a_whole_offload_and_reload_and_an_overlapped_one_bring_the_moments_back(pool):
    eng = fake_zero2_engine(hidden=1024)
    s = strategy(eng, pool)
    master, weight, _ = zero2_tensors(eng)
    before = [master.clone(), weight.clone()]
    want = moment_values(eng)
    move = s.offload()  # everything moves, the moments into mapped memory
    assert move.nbytes >= sum(t.nbytes for t in want) and s.moments.state.resident_bytes == 0
    assert master.untyped_storage().nbytes() == 0
    # a checkpoint reads them from the pool while offloaded
    views = [s.host_view(t) for _, _, t in state_tensors(eng.optimizer.optimizer, MOMENTS)]
    assert all(v is not None and torch.equal(v, w) for v, w in zip(views, want))
    s.reload()
    assert torch.equal(master, before[0]) and torch.equal(weight, before[1])
    assert all(torch.equal(a, b) for a, b in zip(moment_values(eng), want))
    s.offload()
    pending = PendingReloads()
    s.reload(pending)
    assert pending.nbytes >= sum(t.nbytes for t in want)
    pending.wait(30.0)
    assert s.moments.state.set.resident and torch.equal(master, before[0])
    assert all(torch.equal(a, b) for a, b in zip(moment_values(eng), want))
    s.close()


def test_a_state_dict_read_while_the_moments_are_out_brings_them_back_first(pool):
    eng = fake_zero2_engine(hidden=1024)
    s = strategy(eng, pool)
    s.keep = KEEP_ALL_BUT_MOMENTS
    want = moment_values(eng)
    s.offload(defer_late=True)
    s.reload(late=False)
    s.finish_late()
    saved = eng.optimizer.optimizer.state_dict()  # e.g. a checkpoint: the optimizer's hook reloads
    got = [saved["state"][0][k] for k in MOMENTS]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not s.moments.outstanding
    s.reload_late()  # the rest of the LATE part (Adam's step count)
    eng.optimizer.optimizer.load_state_dict(saved)  # new tensors: the mapped state lets go
    assert s.moments.state.closed
    s.offload(defer_late=True)  # and the next offload moves the loaded ones
    s.reload(late=False)
    s.reload_late()
    assert s.moments.state.active and all(torch.equal(a, b) for a, b in zip(moment_values(eng), want))
    s.close()


def test_the_room_at_the_steps_start_and_the_budget_it_gives():
    from colomem.engines.deepspeed.at_step import prefetch_budget, prefetch_room

    # 5 mapped there, 10 free at the peak: 15 could have been
    assert prefetch_room(free=10, peak_reserved=100, reserved_now=100, mapped_now=5) == 15
    # the allocator gave 10 back after its peak (a retry): that memory was taken at the peak
    assert prefetch_room(free=20, peak_reserved=100, reserved_now=90, mapped_now=5) == 15
    assert prefetch_room(free=0, peak_reserved=100, reserved_now=50, mapped_now=0) == 0
    assert prefetch_budget([30, 20, 25], margin=4) == 16  # the smallest room of the steps measured
    assert prefetch_budget([3], margin=4) == 0 and prefetch_budget([], margin=4) == 0


def test_the_step_start_hook_records_each_steps_room_before_the_state_comes_back():
    from colomem.engines.deepspeed.step_reload import ReloadAtStep, StepStartPeak

    eng = fake_zero2_engine()
    order = []
    peak = StepStartPeak(eng.optimizer, lambda: 7, room=lambda: order.append("room") or 11 * len(order))
    at_step = ReloadAtStep(eng.optimizer, lambda: order.append("reload") or 0)
    for _ in range(2):
        at_step.arm()
        adam_step(eng, 0)
    assert order == ["room", "reload", "room", "reload"] and peak.rooms == [11, 33] and peak.room == 33
    peak.close()
    at_step.close()


def test_the_trainer_prefetches_what_the_measured_room_allows_less_the_margin(pool):
    from types import SimpleNamespace

    from fakes.deepspeed import bare_trainer

    eng = fake_zero2_engine(hidden=1024)
    s = strategy(eng, pool)
    s.keep = KEEP_ALL_BUT_MOMENTS
    s.offload(defer_late=True)
    s.reload(late=False)
    s.finish_late()
    chunk = s.moments.state.set.memory.chunk_span(0)[1]
    t = bare_trainer(eng.module, None, pool)
    t.prefetch_margin_bytes = chunk
    t._start_peak = SimpleNamespace(rooms=[9 * chunk, 4 * chunk + 5, 6 * chunk])
    assert t._prefetch_moments(s) == 3 * chunk  # the smallest room, less the margin, in whole chunks
    assert s.late_outstanding
    # the next step's room counts the prefetched chunks as mapped, whether or not their copies were waited for
    assert s.moments.mapped_bytes == 3 * chunk
    s.reload_late()
    s.close()


def test_a_checkpoint_written_with_the_moments_in_the_pool_resumes_bit_for_bit(pool, tmp_path):
    """The checkpoint reads mapped moments from their pool copies (the trainer offloaded, nothing on the
    device to read), and loading writes into a fresh engine's mapped moments in place: both engines then
    step the same."""
    from colomem.engines.deepspeed import checkpoint
    from fakes.deepspeed import bare_trainer

    def trainer(eng):
        t = bare_trainer(eng.module, None, pool)
        t.__dict__.update(engine=eng, deepspeed_version="0.19.8", steps=3, rank=0)
        return t

    eng, other = fake_zero2_engine(seed=0, hidden=1024), fake_zero2_engine(seed=5, hidden=1024)
    s, s2 = strategy(eng, pool), strategy(other, pool)
    for x in (s, s2):
        x.keep = KEEP_ALL_BUT_MOMENTS
        x.offload(defer_late=True)
        x.finish_late()
    want = moment_values_in_pool(s)
    assert s.moments.state.resident_bytes == 0
    checkpoint.prepare_state(trainer(eng), tmp_path, s)()
    blob = torch.load(checkpoint.rank_file(tmp_path, 0), map_location="cpu", weights_only=True)
    saved = [v[k] for v in blob["optimizer"]["state"].values() for k in MOMENTS]
    assert all(torch.equal(a, b) for a, b in zip(saved, want))
    for x in (s, s2):  # both back on the "device" (in their mapped memory), as a resume finds them
        x.reload(late=False)
        x.reload_late()
    checkpoint.load_state(trainer(other), tmp_path)
    assert other.optimizer.optimizer.state[other.optimizer.single_partition_of_fp32_groups[0]]["exp_avg"] \
        .data_ptr() == s2.moments.state.set.tensors[0].data_ptr()   # in place, in the mapped memory
    assert all(torch.equal(a, b) for a, b in zip(moment_values(other), want))
    for seed in range(2):
        adam_step(eng, seed)
        adam_step(other, seed)
    assert all(torch.equal(a, b) for a, b in zip(moment_values(eng), moment_values(other)))
    s.close()
    s2.close()
    assert pool.stats()["in_use_bytes"] == 0


def moment_values_in_pool(s):
    """The moments as their pool copies hold them (the mapped memory is not on the device now)."""
    return [s.host_view(t).clone() for _, _, t in state_tensors(s.moments._optimizer(), MOMENTS)]
