"""overlap_reload on the host path with real torch: the optimizer state comes back while forward and
backward run, and training ends bit-identical to a trainer never offloaded and to one reloaded in full."""
import pytest
import torch

from colomem.pool import PinnedPool
from colomem.swap import PendingReloads, SwapSet

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    return model_dir("tiny", make_task("successor").alphabet,
                     cache_dir=tmp_path_factory.mktemp("overlap-cache") / "models", log=lambda *_: None)


def batch_for(step: int):
    from colomem.grpo.batch import Completion, build_batch

    g = torch.Generator().manual_seed(step)
    prompts = [[2, 4, 5, 6], [2, 7, 8, 9]]
    comps = [[Completion(token_ids=torch.randint(3, 12, (3,), generator=g).tolist(), logprobs=[-1.0] * 3)
              for _ in range(4)] for _ in prompts]
    rewards = torch.tensor([1.0, -1, 0.5, -0.5] * 2)
    return build_batch(prompts, comps, rewards, pad_id=0)


def snapshot(t):
    params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    state = {f"{i}.{k}": v.clone() for i, st in enumerate(t.optimizer.state.values())
             for k, v in st.items() if torch.is_tensor(v)}
    return params, state


def train(tiny, mode: str, steps: int = 4, memory: str = "torch", deferred: bool = False):
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.grpo.config import GRPOConfig

    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB") if mode != "resident" else None
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, grpo=GRPOConfig(group_size=4), pool=pool,
                     overlap_reload=(mode == "overlap"), optimizer_reload="step" if mode == "step" else "overlap",
                     optimizer_state_memory=memory)
    try:
        for k in range(steps):
            if k and pool is not None:
                if deferred:        # as the runner's "optimizer state out behind the rollout"
                    t.offload(defer=True, hold=True)
                    t.start_offload()
                    t.finish_offload(background=True)
                else:
                    t.offload()
                t.reload()
                deferred = t.last_reload.deferred_bytes
                assert (deferred > 0) == (mode in ("overlap", "step")), t.last_reload
            out = t.train_step(batch_for(k))
            assert out["reload_wait_s"] >= 0.0
            if memory == "mapped" and k:    # the moments live in the mapped memory since the first offload
                mapped = t._swaps[1].state
                assert mapped is not None and mapped.active and mapped.set.resident, k
                assert {t.optimizer.state[p][key].data_ptr() for p, key in mapped._refs} == \
                    {x.data_ptr() for x in mapped.set.tensors}
            # at the step: the AdamW state came back inside the optimizer step, and is on the device after it
            assert ("optimizer_reload_s" in out) == (mode == "step" and k > 0), out
            assert all(v.untyped_storage().nbytes() > 0 for st in t.optimizer.state.values() for v in st.values()
                       if torch.is_tensor(v))
        return snapshot(t)
    finally:
        t.close()
        if pool is not None:
            assert pool.stats()["in_use_bytes"] == 0
            pool.close()


def test_overlapped_reload_trains_bit_identically(tiny):
    ref_p, ref_s = train(tiny, "resident")
    for mode in ("full", "overlap", "step"):
        p, s = train(tiny, mode)
        assert p.keys() == ref_p.keys() and s.keys() == ref_s.keys() and s
        assert all(torch.equal(p[n], ref_p[n]) for n in p), mode
        assert all(torch.equal(s[n], ref_s[n]) for n in s), mode


def test_adams_moments_in_mapped_memory_train_bit_identically(tiny):
    """optimizer_state_memory "mapped": the moments move into memory colomem maps at their first offload and
    leave and come back chunk by chunk from then on, whole, overlapped, at the step or behind a deferred
    offload; training is the never-offloaded trainer's, bit for bit."""
    ref_p, ref_s = train(tiny, "resident")
    for mode, deferred in (("full", False), ("overlap", False), ("step", False), ("step", True)):
        p, s = train(tiny, mode, memory="mapped", deferred=deferred)
        assert s.keys() == ref_s.keys() and s, (mode, deferred)
        assert all(torch.equal(p[n], ref_p[n]) for n in p), (mode, deferred)
        assert all(torch.equal(s[n], ref_s[n]) for n in s), (mode, deferred)


def test_wait_reload_restores_the_optimizer_state_and_offload_right_after_is_safe(tiny):
    from colomem.engines.stand_ins import TorchTrainer

    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, pool=pool)
    try:
        t.train_step(batch_for(0))
        before = snapshot(t)
        for _ in range(3):          # reload and offload again without a step between: the copies finish first
            t.offload()
            t.reload()
        assert t.wait_reload() >= 0.0
        assert t.wait_reload() == pytest.approx(0.0, abs=0.05)      # nothing pending any more
        after = snapshot(t)
        assert all(torch.equal(after[0][n], before[0][n]) for n in before[0])
        assert all(torch.equal(after[1][n], before[1][n]) for n in before[1])
    finally:
        t.close()
        pool.close()


def test_unordered_reload_is_complete_after_pending_wait():
    pool = PinnedPool("8MiB", pin=False, segment_bytes="8MiB")
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32) for n in (1, 4099, 300_000)]
    want = [t.clone() for t in tensors]
    s = SwapSet(tensors, pool, device="cpu")
    s.offload()
    pending = PendingReloads()
    assert not pending and pending.nbytes == 0
    pending.add(s.reload_async(ordered=False))
    assert pending and pending.nbytes == sum(t.numel() * 4 for t in tensors)
    assert pending.wait(30) >= 0.0
    assert not pending and s.state == "resident"
    assert all(torch.equal(a, b) for a, b in zip(tensors, want))
    s.close()
    pool.close()


def test_stand_ins_implement_the_protocols(tiny):
    from colomem.engines.protocols import AWAKE, ASLEEP, Rollout, Trainer
    from colomem.engines.reports import SwitchReport
    from colomem.engines.stand_ins import HFRollout, TorchTrainer

    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, pool=pool)
    r = HFRollout(tiny, eos_token_id=1, pad_token_id=0)
    try:
        assert isinstance(t, Trainer) and isinstance(r, Rollout)
        assert t.last_offload is None and t.last_reload is None
        t.offload()
        t.reload()
        assert isinstance(t.last_offload, SwitchReport) and t.last_offload.direction == "offload"
        assert t.last_offload.moved_bytes == sum(t.last_offload.by_category.values()) > 0
        assert isinstance(t.last_reload, SwitchReport) and t.last_reload.to_dict()["method"] == "colomem"
        assert r.phase == AWAKE
        r.sleep()
        assert r.phase == ASLEEP and "sleep_s" in r.timings
    finally:
        r.close()
        t.close()
        pool.close()


def test_the_optimizer_state_waits_in_the_pool_for_the_step_and_an_offload_before_it_keeps_it(tiny):
    """optimizer_reload "step": reload() brings back the parameters only; an offload with no step between
    (an evaluation window) moves the state out again intact, and the next step reads it bit for bit."""
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="optimizer_reload"):
        TorchTrainer(tiny, lr=1e-2, micro_batch=4, optimizer_reload="later")
    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, pool=pool, optimizer_reload="step")
    try:
        t.train_step(batch_for(0))
        before = snapshot(t)[1]
        t.offload()
        t.reload()
        sizes = [v.untyped_storage().nbytes() for st in t.optimizer.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim()]
        assert sizes and all(n == 0 for n in sizes)          # still in the pool: no memory of its own yet
        t.offload()
        t.reload()
        assert t.wait_reload() >= 0.0                        # a reader of the state brings it back
        after = snapshot(t)[1]
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    finally:
        t.close()
        assert pool.stats()["in_use_bytes"] == 0
        pool.close()
