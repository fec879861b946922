"""DeepSpeedTrainer's optimizer state on a real GPU (ZeRO-2 and ZeRO-3): reloaded inside the optimizer step
(a lower peak, the same training), a deferred offload that frees it after finish, and Adam's moments sent out
behind the training or the rollout, back inside the step (also from memory colomem maps, part back early); each
trains bit for bit like an engine never offloaded. The model, the trainer and the checksums: deepspeed_cases.py.

Run: python -m pytest -m "gpu and deepspeed" -s tests/gpu/test_deepspeed_optimizer_step.py
"""
import pytest
import torch
from deepspeed_cases import (ALLOC_MARGIN, PEAK_SLACK, STEPS, MiB, baseline, final_state, make_batch, make_trainer,
                             model_dir, ready, reference_run, settle)

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed, pytest.mark.slow]
__all__ = ["model_dir", "ready"]      # fixtures, used by name


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_state_reloaded_inside_the_step_trains_the_same_with_a_lower_peak(model_dir, ready, stage):
    """optimizer_reload "step": reload() leaves the masters and moments in the pool; the optimizer step brings
    them back once the gradients are flattened, cast and freed. Training matches the never-offloaded engine
    bit for bit, and the training peak is below an overlapped reload's (the moments are not on the GPU
    beside the gradients' fp32 copy)."""
    import colomem

    ref_losses, ref_state = reference_run(model_dir, stage, False)
    peaks = {}
    for mode in ("overlap", "step"):
        pool = colomem.PinnedPool(0)
        t = make_trainer(model_dir, stage, False, pool=pool, optimizer_reload=mode)
        try:
            losses = [t.train_step(make_batch(0))["loss"]]
            for step in range(1, STEPS):
                if stage == 3:
                    t.engine.empty_partition_cache()
                t.offload()
                t.reload()
                if mode == "step":
                    # nothing of the optimizer state is back yet: it waits for the step
                    assert t.last_reload.deferred_bytes == 0
                    strategy = t._strategies["colomem"]
                    assert strategy.late_outstanding and strategy.late.state == "offloaded"
                settle()
                torch.cuda.reset_peak_memory_stats()
                out = t.train_step(make_batch(step))
                peaks.setdefault(mode, []).append(torch.cuda.max_memory_allocated())
                assert ("optimizer_reload_s" in out) == (mode == "step"), out
                # the forward and backward's peak, read before the step: within the whole training's
                assert 0 < out["reserved_before_step_max"] <= torch.cuda.max_memory_reserved(), out
                losses.append(out["loss"])
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6, (mode, losses, ref_losses)
            assert final_state(t) == ref_state, mode
            # an offload right after a reload (no step between) keeps the state: it comes back, then goes out
            t.offload()
            t.reload()
            t.offload()
            t.reload()
            t.wait_reload()
            assert final_state(t) == ref_state, mode
        finally:
            t.close()
            pool.close()
    print(f"\n[zero{stage}] training peak allocated, overlap {max(peaks['overlap']) / MiB:.0f} MiB, at the step "
          f"{max(peaks['step']) / MiB:.0f} MiB")
    # ZeRO-2's peak is its step's (the moments beside the fp32 gradients); ZeRO-3 steps sub-group by sub-group
    assert max(peaks["step"]) < max(peaks["overlap"]) if stage == 2 else max(peaks["step"]) <= max(peaks["overlap"])


def test_a_deferred_offload_frees_the_optimizer_state_after_finish_and_trains_the_same(model_dir, ready):
    """offload(defer=True): the masters and moments are still copying on return (the runner's
    --overlap-offload); finish_offload() waits and gives their memory back; training matches the
    never-offloaded engine bit for bit."""
    import colomem

    ref_losses, ref_state = reference_run(model_dir, 2, False)
    _, alloc_base = baseline()
    pool = colomem.PinnedPool(0)
    t = make_trainer(model_dir, 2, False, pool=pool)
    try:
        losses = [t.train_step(make_batch(0))["loss"]]
        for step in range(1, STEPS):
            t.offload(defer=True)
            rep = t.last_offload
            assert t.offload_pending and rep.deferred_bytes > 0, rep.to_dict()
            assert t.finish_offload() >= 0.0 and not t.offload_pending
            settle()
            # everything went back once the deferred part finished copying
            assert torch.cuda.memory_allocated() - alloc_base <= ALLOC_MARGIN
            t.reload()
            losses.append(t.train_step(make_batch(step))["loss"])
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
        assert final_state(t) == ref_state
    finally:
        t.close()
        pool.close()


@pytest.mark.parametrize("behind", ["training", "rollout"])
@pytest.mark.parametrize("stage", [2, 3])
def test_the_moments_sent_out_behind_training_come_back_inside_the_step_and_train_the_same(model_dir, ready, stage,
                                                                                          behind):
    """The resident trainer's Adam moments copy to the pool deferred and come back inside the optimizer step:
    behind the forward and backward (optimizer_out_until_step(), leaving before ZeRO's cast), or behind a
    rollout, as the runner's "optimizer state out behind the rollout" does (offload(keep=everything else,
    defer=True) at the switch, the weights readable where they are, reload() waiting for the copy before
    training). Training matches the never-offloaded engine bit for bit, and the training peak stays below
    the resident one's."""
    import colomem
    from colomem.engines.deepspeed.state import CATEGORIES

    ref_losses, ref_state = reference_run(model_dir, stage, False)
    pool = colomem.PinnedPool(0)
    # behind a rollout, reload() must leave the moments for the step, as the runner's plan sets it
    t = make_trainer(model_dir, stage, False, pool=pool,
                     **({"optimizer_reload": "step"} if behind == "rollout" else {}))
    peaks = []
    try:
        losses = [t.train_step(make_batch(0))["loss"]]
        settle()
        torch.cuda.reset_peak_memory_stats()
        losses.append(t.train_step(make_batch(1))["loss"])            # resident: the moments through the step
        resident_peak = torch.cuda.max_memory_allocated()
        for step in range(2, STEPS):
            if stage == 3:
                t.engine.empty_partition_cache()
            settle()
            torch.cuda.reset_peak_memory_stats()
            if behind == "training":
                t.optimizer_out_until_step()
            else:
                # as the runner: held back through the rollout's wake, started before the sync
                t.offload(keep=[c for c in CATEGORIES if c != "optim"], defer=True, hold=True)
                assert t.offload_pending and t.last_offload.deferred_bytes > 0
                t.start_offload()
                assert all(w.is_cuda for _, w in t.named_weights())        # the sync reads them on the GPU
                t.finish_offload(background=True)                          # its end during the "rollout"
                t.reload()                                                 # waits for that thread first
                assert not t.offload_pending and t.last_offload.wait_seconds >= 0.0
            assert not t.offloaded and t.last_reload.seconds >= 0.0
            out = t.train_step(make_batch(step))
            peaks.append(torch.cuda.max_memory_allocated())
            assert "optimizer_reload_s" in out and out["reload_wait_s"] >= 0.0, out
            # where the reload's time went, and the peak with ZeRO's cast, read before the state came back
            assert out["optimizer_reload_copy_s"] > 0.0 and out["optimizer_reload_regrow_s"] >= 0.0, out
            assert out["reserved_at_step_start_max"] >= out["reserved_before_step_max"] > 0, out
            assert t.last_offload.by_category.get("optim", 0) > 0 and not t.offload_pending
            losses.append(out["loss"])
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
        assert final_state(t) == ref_state
        print(f"\n[{stage}] training peak: resident {resident_peak / MiB:.0f} MiB, moments out behind the {behind} "
              f"{max(peaks) / MiB:.0f} MiB")
        # with one gradient reduction a step the peak is the reduction's (the gradients beside their partition),
        # and where the copy out ends against it moves by a tensor of a few MiB (one 2 MiB tensor measured)
        assert max(peaks) <= resident_peak + PEAK_SLACK
    finally:
        t.close()
    assert pool.stats()["in_use_bytes"] == 0
    pool.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_mapped_moments_out_behind_the_rollout_come_back_part_early_and_train_the_same(model_dir, ready, monkeypatch,
                                                                                      stage):
    """optimizer_state_memory "mapped", as the runner's "optimizer state out behind the rollout": the moments
    move out of torch's memory at their first offload (their old memory freed once the copy ended), each step's
    start measures the room beside its peak (the first one's while still resident), and the next reload brings
    that much back behind the forward and backward, the rest inside the step. Training matches the never-offloaded engine bit for bit; the moments'
    mapped memory is all unmapped while they are out; closing gives every pool block back."""
    import colomem
    from colomem.engines.deepspeed import mapped_moments
    from colomem.engines.deepspeed.state import CATEGORIES

    monkeypatch.setattr(mapped_moments, "CHUNK_BYTES", 2 * MiB)   # a small model's moments in several chunks
    ref_losses, _ = reference_run(model_dir, stage, False)
    pool = colomem.PinnedPool(0)
    t = make_trainer(model_dir, stage, False, pool=pool, optimizer_reload="step", optimizer_state_memory="mapped")
    t.prefetch_margin_bytes = 0
    prefetched = []
    try:
        losses = [t.train_step(make_batch(0))["loss"]]
        for step in range(1, STEPS + 2):
            if stage == 3:
                t.engine.empty_partition_cache()
            settle()
            torch.cuda.reset_peak_memory_stats()
            t.offload(keep=[c for c in CATEGORIES if c != "optim"], defer=True, hold=True)
            t.start_offload()
            t.finish_offload(background=True)
            t.reload()
            moments = t._strategies["colomem"].moments
            assert moments.state is not None and moments.state.active
            # out behind the "rollout": nothing of them mapped but what the prefetch brings back
            assert moments.state.set.memory.mapped_bytes == moments.prefetched
            out = t.train_step(make_batch(step) if step < STEPS else make_batch(step % STEPS))
            if step < STEPS:
                losses.append(out["loss"])
            assert "optimizer_reload_s" in out and out["prefetch_room_bytes"] > 0, out
            prefetched.append(out.get("optimizer_prefetch_bytes", 0.0))
        # the room measured at the step before (step 0's, trained resident) is used from the first reload on
        assert min(prefetched) > 0, prefetched
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
    finally:
        t.close()
    assert pool.stats()["in_use_bytes"] == 0
    pool.close()
