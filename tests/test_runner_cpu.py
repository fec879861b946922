"""The colocated loop on CPU, end to end on the tiny model: phases in order, metrics that stay valid,
weights that really reach the rollout, engines that refuse calls out of order, stale weights stopping the run.
When something fails: test_runner_cpu_failures.py; the runner as a user starts it: test_runner_cli_cpu.py."""
import json
import math

import pytest
import torch

from colomem.errors import PhaseOrderError, StaleWeightsError
from colomem.runner import CYCLE, PhaseMachine, run_job
from colomem.runner.backends import build_engines
from colomem.runner.timeline import MemoryAlarm, MetricsWriter, read_jsonl

from runner_cpu_helpers import cache_env, model_cache  # noqa: F401  (fixtures)
from runner_cpu_helpers import Spy, small_cfg, spy_factory

pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------- the loop
def test_cpu_loop_end_to_end(cache_env, tmp_path):
    held = {}
    res = run_job(small_cfg(tmp_path / "run", steps=3), engines_factory=spy_factory(held),
                  print_fn=lambda *_: None)
    s = res.summary
    assert s["status"] == "ok" and s["steps_done"] == 3 and s["backend"] == "cpu" and s["weight_version"] == 3

    # every engine call happened in the guarded order, step after step
    calls = [c for c in held["calls"] if c in ("offload", "wake_weights", "load_weights", "check", "wake_kv",
                                               "generate", "sleep", "reload", "train_step", "named_weights")]
    one = ["offload", "wake_weights", "named_weights", "load_weights", "check", "wake_kv", "generate", "sleep",
           "reload", "train_step"]
    assert calls == one * 3
    assert "close" in held["calls"] and held["pool"].closed

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]                      # every line is valid JSON
    assert recs[0]["event"] == "start" and recs[-1] == {**recs[-1], "event": "end", "status": "ok"}
    steps = [r for r in recs if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        # (+ reload_wait: the part of train that waited for the optimizer state, counted as switch time)
        assert [p for p in r["phase_s"] if p not in ("score", "reload_wait")] == list(CYCLE)
        assert r["switch_s"] == pytest.approx(sum(v for p, v in r["phase_s"].items()
                                                  if p not in ("rollout", "score", "train")))
        assert set(r["memory"]) == set(CYCLE)
        assert all(v >= 0 for v in r["phase_s"].values())
        assert 0 <= r["reward_mean"] <= 1 and math.isfinite(r["train/loss"])
        assert r["samples_total"] == 16
        # the rollout sampled with exactly the trainer's weights: its logprobs match the trainer's
        assert r["train/rollout_logprob_gap"] < 1e-4
        assert r["sync/ntensors"] > 0 and r["trainer_offload/moved_bytes"] > 0
        assert r["sync/apply_seconds"] > 0  # where the sync's time went is logged with it
    assert [r["weight_version"] for r in steps] == [1, 2, 3]

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["reward_first5_mean"] is not None
    for name in ("timeline.png", "rewards.png"):
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lora_run_syncs_merged_weights(cache_env, tmp_path):
    res = run_job(small_cfg(tmp_path / "lora", lora={"r": 4}, lr=1e-2), print_fn=lambda *_: None)
    steps = [r for r in read_jsonl(tmp_path / "lora" / "metrics.jsonl") if "step" in r]
    assert res.summary["status"] == "ok"
    # step 1 generates with the adapter trained in step 0 merged into the base
    assert steps[1]["train/rollout_logprob_gap"] < 1e-4


def test_a_token_budget_sets_the_micro_batches(cache_env, tmp_path):
    """16 rows of ~10 tokens: a 40-token budget makes micro-batches of 4 rows or fewer (the default job's
    completions vary in length), --micro-batch 8 would make two."""
    res = run_job(small_cfg(tmp_path / "tokens", micro_batch_tokens=40), print_fn=lambda *_: None)
    steps = [r for r in read_jsonl(tmp_path / "tokens" / "metrics.jsonl") if "step" in r]
    assert res.summary["status"] == "ok"
    assert all(s["train/micro_batches"] >= 4 for s in steps)
    assert all(0 <= s["train/padded_fraction"] < 1 for s in steps)


def test_the_summary_says_where_the_start_up_went(cache_env, tmp_path):
    res = run_job(small_cfg(tmp_path / "startup", steps=1), print_fn=lambda *_: None)
    parts = res.summary["startup_s"]
    assert set(parts) == {"inputs", "pool", "rollout", "trainer"} and all(v >= 0 for v in parts.values())
    built = parts["pool"] + parts["rollout"] + parts["trainer"]
    assert built <= res.summary["build_s"] + 1e-6 and built >= 0.9 * res.summary["build_s"]
    assert sum(parts.values()) <= res.summary["wall_s"]


def test_sync_moves_trained_weights_into_the_rollout(cache_env):
    """Train one step, sync: the rollout's sampled logprobs equal the trained policy's, not the old ones."""
    from colomem.engines.stand_ins import HFRollout, TorchTrainer
    from colomem.grpo.batch import build_batch
    from colomem.grpo.config import GRPOConfig
    from colomem.grpo.step import policy_logprobs
    from colomem.grpo.tiny_model import model_dir
    from colomem.grpo.tasks import make_task
    from colomem.pool import PinnedPool

    d = model_dir("tiny", make_task("successor").alphabet)
    r = HFRollout(d, eos_token_id=1, pad_token_id=0)
    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(d, lr=1e-2, micro_batch=8, grpo=GRPOConfig(group_size=4), pool=pool)
    prompts = [[2, 4, 5, 6], [2, 7, 8, 9]]
    comps = r.generate(prompts, n=4, max_new_tokens=3, seed=0)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train_step(build_batch(prompts, comps, torch.tensor([1.0, -1, 1, -1, 1, -1, 1, -1]), pad_id=0))
    assert any(not torch.equal(p, before[n]) for n, p in t.model.named_parameters())
    t.offload()
    r.sleep()
    r.wake_weights()
    r.load_weights(t.named_weights(), 1)
    r.check()
    r.wake_kv()
    comps2 = r.generate(prompts, n=4, max_new_tokens=3, seed=1)
    t.reload()
    b = build_batch(prompts, comps2, torch.zeros(8), pad_id=0)
    with torch.no_grad():
        lp = policy_logprobs(t.model, b)
    mask = b.completion_mask.bool()
    assert torch.allclose(lp[mask], b.old_logprobs[mask], atol=1e-4)
    t.close()
    r.close()
    pool.close()


# ---------------------------------------------------------------------------------------------- guards
def test_phase_machine_order():
    m = PhaseMachine()
    assert m.expected == "offload"
    with pytest.raises(PhaseOrderError, match=r"cannot start 'wake_weights' after 'train'.*'offload' comes next"):
        m.enter("wake_weights")
    for p in CYCLE:
        m.enter(p)
        with pytest.raises(PhaseOrderError, match="still running"):
            m.enter(m.expected)
        m.leave()
    assert m.last == "train" and m.expected == "offload"
    m.enter("offload")
    m.leave(ok=False)
    with pytest.raises(PhaseOrderError, match="failed"):
        m.enter("barrier_wake")
    with pytest.raises(PhaseOrderError, match="unknown phase"):
        PhaseMachine().enter("nap")


def test_rollout_and_trainer_refuse_out_of_order_calls(cache_env):
    from colomem.engines.stand_ins import HFRollout, TorchTrainer
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir
    from colomem.pool import PinnedPool

    d = model_dir("tiny", make_task("successor").alphabet)
    r = HFRollout(d, eos_token_id=1, pad_token_id=0)
    r.sleep()
    with pytest.raises(PhaseOrderError, match="generate while the rollout is 'asleep'"):
        r.generate([[2, 3]], n=1, max_new_tokens=2)
    with pytest.raises(PhaseOrderError, match="load_weights"):
        r.load_weights([], 1)
    with pytest.raises(PhaseOrderError, match="wake_kv"):
        r.wake_kv()
    r.wake_weights()
    r.wake_kv()
    r.expect_version(2)
    with pytest.raises(StaleWeightsError, match="version 0"):
        r.generate([[2, 3]], n=1, max_new_tokens=2)
    r.close()

    pool = PinnedPool("16MiB", pin=False, segment_bytes="16MiB")
    t = TorchTrainer(d, lr=1e-3, micro_batch=4, pool=pool)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in t.model.parameters())     # really gone
    assert {n: w.clone() for n, w in t.named_weights()}.keys() == before.keys()
    assert all(torch.equal(w, before[n]) for n, w in t.named_weights())            # readable for the sync
    with pytest.raises(PhaseOrderError, match="offloaded"):
        t.train_step(None)
    with pytest.raises(PhaseOrderError):
        t.offload()
    t.reload()
    assert all(torch.equal(p, before[n]) for n, p in t.model.named_parameters())   # same bytes back
    with pytest.raises(PhaseOrderError, match="not offloaded"):
        t.reload()
    t.close()
    pool.close()


def test_stale_weights_stop_the_run(cache_env, tmp_path):
    class NoSync(Spy):
        def __getattr__(self, name):
            if name == "load_weights":
                return lambda named, version: None           # "syncs" nothing, version stays 0
            return super().__getattr__(name)
    held = {}

    def factory(cfg, backend, model_path, tok, ranks, grad_accum):
        eng = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum)
        eng.rollout = NoSync(eng.rollout)
        held["eng"] = eng
        return eng
    with pytest.raises(StaleWeightsError, match="step 1"):
        run_job(small_cfg(tmp_path / "stale"), engines_factory=factory, print_fn=lambda *_: None)


# ---------------------------------------------------------------------------------------------- pieces
def test_metrics_writer_appends_valid_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    w = MetricsWriter(p)
    w.write({"a": 1.0, "nan": float("nan"), "t": torch.tensor(2.5), "nested": {"inf": float("inf")}})
    w.close()
    w = MetricsWriter(p)
    w.write({"b": 2})
    w.close()
    lines = p.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"a": 1.0, "nan": None, "t": 2.5, "nested": {"inf": None}}, {"b": 2}]
    with pytest.raises(ValueError):
        w.write({"c": 3})


def test_memory_alarm_flags_growth_after_sleep():
    a = MemoryAlarm(threshold_bytes=100 << 20, warmup_steps=1)
    assert a.observe(0, 10 << 30) is None                # warm-up step ignored
    assert a.observe(1, 1 << 30) is None                 # baseline
    assert a.observe(2, (1 << 30) + (50 << 20)) is None  # within the threshold
    msg = a.observe(3, (1 << 30) + (300 << 20))
    assert msg and "grew by 300.00 MiB" in msg
    assert a.observe(4, (1 << 30) + (300 << 20)) is None  # same level: said once
    assert len(a.alarms) == 1 and a.observe(5, None) is None


def test_memory_alarm_restarts_with_a_new_placement_after_its_first_step():
    # the planner's first step moves everything (vLLM asleep: a low floor); from step 1 nothing moves, the
    # awake engine is the floor, and the resident trainer's first training adds its cached activations
    a = MemoryAlarm(threshold_bytes=256 << 20, warmup_steps=1)
    a.restart(1)
    assert a.observe(1, 31 << 30) is None                 # the new placement's first step: a warm-up
    assert a.observe(2, (31 << 30) + (954 << 20)) is None  # its baseline
    assert a.observe(3, (31 << 30) + (954 << 20)) is None and not a.alarms
    msg = a.observe(4, (32 << 30) + (954 << 20))
    assert msg and "since step 2" in msg and len(a.alarms) == 1
