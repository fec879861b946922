"""DeepSpeedTrainer.offload(keep=...) on a real GPU: what the placement planner keeps stays where it is (the
weights are read there for the sync), what it does not keep goes to the pool and its memory to the driver,
and training goes on exactly like an engine that was never offloaded.

Run: python -m pytest -m "gpu and deepspeed" -s tests/gpu/test_partial_offload_gpu.py
"""
import pytest
import torch

from deepspeed_cases import (MiB, STEPS, baseline, checksum, checksums, final_state, make_batch, make_trainer,
                            model_dir, ready, reference_run)  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed, pytest.mark.slow]

KEEPS = [pytest.param(("params", "other", "grads"), id="optimizer-offloaded"),
         pytest.param(("params", "other", "grads", "master"), id="moments-offloaded"),
         pytest.param(("params", "other", "grads", "master", "optim"), id="nothing-moved")]


def trains_like_the_reference(model_dir, offload):  # noqa: F811
    """STEPS training steps, each after offload(trainer) (which offloads and checks what moved) and a reload:
    the state comes back byte for byte, and the losses and the final state equal a never-offloaded engine's."""
    import colomem

    ref_losses, ref_state = reference_run(model_dir, 2, False)
    pool = colomem.PinnedPool(0)
    t = make_trainer(model_dir, 2, False, pool=pool)
    try:
        losses = [t.train_step(make_batch(0))["loss"]]
        for step in range(1, STEPS):
            before = checksums(t)
            offload(t)
            t.reload()
            t.wait_reload()
            assert checksums(t) == before
            losses.append(t.train_step(make_batch(step))["loss"])
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
        assert final_state(t) == ref_state
    finally:
        t.close()
    assert pool.stats()["in_use_bytes"] == 0
    pool.close()
    baseline()


@pytest.mark.parametrize("keep", KEEPS)
def test_kept_state_stays_the_rest_moves_and_training_matches(model_dir, ready, keep):  # noqa: F811
    def offload(t):
        weights = {n: (w.data_ptr(), checksum(w)) for n, w in t.named_weights()}
        free0 = torch.cuda.mem_get_info()[0]
        t.offload(keep=keep)
        rep = t.last_offload
        moved = sum(v for c, v in rep.by_category.items() if c not in keep and c != "scratch")
        print(f"\n[{'+'.join(keep)}] offload: moved {rep.moved_bytes / MiB:.0f} MiB, freed "
              f"{rep.freed_bytes / MiB:.0f} MiB in {rep.seconds * 1e3:.1f} ms")
        assert rep.moved_bytes == moved
        assert torch.cuda.mem_get_info()[0] - free0 >= moved - 64 * MiB    # given back to the driver
        # the kept weights are read where they are: the same GPU storage, the same bytes, nothing staged
        now = {n: (w.data_ptr(), checksum(w)) for n, w in t.named_weights()}
        assert now == weights and rep.staged_bytes == 0
        assert all(w.is_cuda for _, w in t.named_weights())
    trains_like_the_reference(model_dir, offload)


def test_part_of_the_moments_stays_the_rest_moves_and_training_matches(model_dir, ready):  # noqa: F811
    """offload(keep=..., keep_part=("optim", n)): whole moment tensors up to n bytes stay on the GPU, the
    others move and their memory goes to the driver, and training matches the never-offloaded engine."""
    keep = ("params", "other", "grads", "master")

    def offload(t):
        storages = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes()
                    for _, m in t.state().groups["optim"]}
        moments = sorted(storages.values(), reverse=True)
        assert len(moments) >= 2, "a ZeRO-2 engine keeps exp_avg and exp_avg_sq apart"
        free0 = torch.cuda.mem_get_info()[0]
        t.offload(keep=keep, keep_part=("optim", moments[0]))     # room for the largest alone
        rep = t.last_offload
        assert rep.moved_bytes == sum(moments) - moments[0]
        assert torch.cuda.mem_get_info()[0] - free0 >= rep.moved_bytes - 64 * MiB
    trains_like_the_reference(model_dir, offload)
