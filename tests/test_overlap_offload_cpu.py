"""--overlap-offload on the host path with real torch: the optimizer state is still copying out when offload()
returns, its memory goes when finish_offload() waits, training stays bit-identical, and in the runner every
step waits for it before the rollout's KV cache wakes."""
import json

import pytest
import torch

from colomem.pool import PinnedPool
from colomem.runner.config import ConfigError, config_from_dict
from test_overlap_reload_cpu import batch_for, snapshot, tiny  # noqa: F401  (the fixture)

pytest.importorskip("transformers")


def _train(tiny, defer: bool, steps: int = 4):
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.grpo.config import GRPOConfig

    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, grpo=GRPOConfig(group_size=4), pool=pool)
    try:
        for k in range(steps):
            if k:
                t.offload(defer=defer)
                assert t.offload_pending == (defer and k > 0)
                state = [v for st in t.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
                if defer:
                    # the sync's weights are readable at once; the moments lose their storage at the wait
                    assert all(".lora_" in n or v.numel() >= 0 for n, v in t.named_weights())
                    assert t.last_offload.deferred_bytes == sum(v.numel() * v.element_size() for v in state)
                    waited = t.finish_offload()
                    assert waited >= 0.0 and not t.offload_pending
                    assert t.last_offload.by_category["optim"] == t.last_offload.deferred_bytes
                assert all(v.untyped_storage().nbytes() == 0 for v in state if v.numel())
                assert t.finish_offload() == 0.0                       # nothing left to wait for
                t.reload()
            t.train_step(batch_for(k))
        return snapshot(t)
    finally:
        t.close()
        assert pool.stats()["in_use_bytes"] == 0
        pool.close()


def test_a_deferred_offload_trains_bit_identically(tiny):  # noqa: F811
    p0, s0 = _train(tiny, defer=False)
    p1, s1 = _train(tiny, defer=True)
    assert all(torch.equal(p0[n], p1[n]) for n in p0) and all(torch.equal(s0[k], s1[k]) for k in s0)


def test_reload_and_close_finish_a_deferred_offload_first(tiny):  # noqa: F811
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.grpo.config import GRPOConfig

    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, grpo=GRPOConfig(group_size=4), pool=pool)
    t.train_step(batch_for(0))
    before = snapshot(t)
    t.offload(defer=True)
    t.reload()                              # no finish_offload(): reload waits for the copy itself
    assert not t.offload_pending
    t.wait_reload()                         # the optimizer state comes back behind the next step (overlap_reload)
    after = snapshot(t)
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    t.offload(defer=True)
    t.close()                               # and close gives every block back
    assert pool.stats()["in_use_bytes"] == 0
    pool.close()


def test_a_deferred_offload_ended_in_a_thread_is_waited_for_by_the_trainer_and_its_errors_reach_it(
        tiny, monkeypatch):  # noqa: F811
    """finish_offload(background=True) returns at once; the copy's end runs in a thread, and the trainer's
    next use of its state (reload, the next finish, close) waits for it; the state comes back bit for bit. An
    error in the thread is raised by that next call, and a timeout leaves the thread to a later call."""
    import threading

    from colomem.engines.stand_ins import TorchTrainer
    from colomem.errors import ColomemError, TransferTimeoutError
    from colomem.grpo.config import GRPOConfig

    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(tiny, lr=1e-2, micro_batch=4, grpo=GRPOConfig(group_size=4), pool=pool)
    t.train_step(batch_for(0))
    before = snapshot(t)
    gate, threads = threading.Event(), []
    real = TorchTrainer._finish_offload_now

    def gated(self, timeout=None):              # the background end waits for the test's gate
        if threading.current_thread() is not threading.main_thread():
            threads.append(threading.current_thread().name)
            assert gate.wait(30)
        return real(self, timeout)
    monkeypatch.setattr(TorchTrainer, "_finish_offload_now", gated)
    t.offload(defer=True, hold=True)
    assert t.finish_offload(background=True) == 0.0 and t.offload_pending
    with pytest.raises(TransferTimeoutError):
        t.finish_offload(timeout=0.05)          # still gated: the thread goes on
    assert t.offload_pending
    gate.set()
    t.reload()                                  # waits for the thread, which ended the copy
    assert not t.offload_pending and threads == ["the end of the deferred offload"]
    t.wait_reload()
    after = snapshot(t)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])

    def broken(self, timeout=None):
        if threading.current_thread() is threading.main_thread():
            return real(self, timeout)
        raise ColomemError("the copy failed")
    monkeypatch.setattr(TorchTrainer, "_finish_offload_now", broken)
    t.offload(defer=True)
    t.finish_offload(background=True)
    with pytest.raises(ColomemError, match="the copy failed"):
        t.finish_offload()
    assert not t._finishing.busy                # collected: the error was the thread's last word
    monkeypatch.setattr(TorchTrainer, "_finish_offload_now", real)
    t.close()
    assert pool.stats()["in_use_bytes"] == 0
    pool.close()


def _job(out, **kw):
    data = {"backend": "cpu", "steps": 3, "prompts_per_step": 4, "micro_batch": 8, "progress": False,
            "plots": False, "report_to": ["none"], "out": str(out), "grpo": {"group_size": 4}, "save_every": 3,
            "offload": "all", "rollout_sleep": "always", **kw}
    return config_from_dict(data)


def test_every_step_waits_for_the_offload_before_the_kv_cache_wakes(job_env, tmp_path):
    from colomem.runner.backends import build_engines
    from colomem.runner.job import run_job

    events: list = []

    def factory(c, b, m, t, r, g):
        e = build_engines(c, b, m, t, r, grad_accum=g)
        roll, tr = e.rollout, e.trainer
        for obj, name in ((tr, "finish_offload"), (tr, "offload"), (roll, "wake_kv"), (roll, "wake_weights")):
            real = getattr(obj, name)

            def logged(*a, _real=real, _name=name, _obj=obj, **kw):
                pending = getattr(tr, "offload_pending", False)
                events.append((_name, pending))
                return _real(*a, **kw)
            setattr(obj, name, logged)
        return e

    over = run_job(_job(tmp_path / "over", overlap_offload=True), engines_factory=factory, print_fn=lambda *_: None)
    plain = run_job(_job(tmp_path / "plain"), print_fn=lambda *_: None)
    assert over.summary["status"] == plain.summary["status"] == "ok"
    kv = [pending for name, pending in events if name == "wake_kv"]
    assert kv and not any(kv), events                   # no KV wake while the optimizer state still copied out
    waits = [pending for name, pending in events if name == "finish_offload"]
    assert any(waits), events                           # and a deferred part was there to wait for
    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                         if '"reward_mean"' in x]
    assert any("offload_wait" in x["phase_s"] for x in lines(tmp_path / "over"))
    assert [x["reward_mean"] for x in lines(tmp_path / "over")] == [x["reward_mean"] for x in lines(tmp_path / "plain")]
    a = torch.load(tmp_path / "over" / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
    b = torch.load(tmp_path / "plain" / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in b["model"])
    for i, st in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][i][k], v) for k, v in st.items() if torch.is_tensor(v))


def test_the_timesplit_baseline_refuses_an_overlapped_offload(tmp_path):
    with pytest.raises(ConfigError, match="overlap-offload"):
        config_from_dict({"backend": "cpu", "switch": "timesplit", "overlap_offload": True, "out": str(tmp_path)})


def test_the_deepspeed_offload_defers_the_optimizer_state():
    """ColomemOffload (the DeepSpeed trainer's offload) on a ZeRO-2-shaped engine of real tensors: the fp32
    masters and Adam moments still copying on return, the rest gone; finish_late() ends it; bytes round-trip."""
    from colomem.engines import deepspeed as dsa
    from colomem.engines.deepspeed.state import LATE_CATEGORIES
    from fakes.deepspeed import unchanged, zero2_swap

    with zero2_swap() as (pool, s, (master, weight, moments), before):
        for _ in range(2):
            move = s.offload(defer_late=True)
            assert weight.untyped_storage().nbytes() == 0                    # the forward's state: gone
            late = s.pending_bytes
            assert late == sum(move.state.sizes[c] for c in LATE_CATEGORIES) > 0
            assert move.nbytes == sum(move.state.sizes[c] for c in dsa.CATEGORIES) - late
            assert s.finish_late() == late and s.pending_bytes == 0 and s.finish_late() == 0
            assert master.untyped_storage().nbytes() == 0 and all(m.untyped_storage().nbytes() == 0 for m in moments)
            s.reload()
            assert unchanged((master, weight, *moments), before)
        s.offload(defer_late=True)
        s.close()                                   # closing waits for the deferred part, then frees its blocks
        assert pool.stats()["in_use_bytes"] == 0
