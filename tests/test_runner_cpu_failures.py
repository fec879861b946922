"""The colocated loop on CPU when something fails: a reward that raises or hangs, an out-of-memory error at
wake or in training, Ctrl-C; what is cleaned up, what the metrics keep and which knob the error names."""
import json

import pytest
import torch

from colomem.errors import CudaOutOfMemoryError
from colomem.grpo.rewards import RewardFunctionError
from colomem.runner import run_job
from colomem.runner.timeline import read_jsonl

from runner_cpu_helpers import cache_env, model_cache  # noqa: F401  (fixtures)
from runner_cpu_helpers import small_cfg, spy_factory

pytest.importorskip("transformers")


def test_cleanup_and_metrics_when_a_reward_fn_raises(cache_env, tmp_path):
    calls = {"n": 0}

    def flaky(prompt, completion, **meta):
        calls["n"] += 1
        if calls["n"] > 16:                      # the second step's first sample
            raise ZeroDivisionError("reward bug")
        return 0.5
    held = {}
    with pytest.raises(RewardFunctionError, match=r"'flaky' raised ZeroDivisionError: reward bug on sample 0"):
        run_job(small_cfg(tmp_path / "bad"), reward_fns=[flaky], engines_factory=spy_factory(held),
                print_fn=lambda *_: None)
    assert held["calls"].count("close") == 2 and held["pool"].closed      # rollout + trainer closed
    recs = read_jsonl(tmp_path / "bad" / "metrics.jsonl")
    assert [r.get("event", r.get("step")) for r in recs] == ["start", 0, "placement", 1, "end"]
    assert recs[3]["failed"] == "score" and "reward bug" in recs[3]["error"]        # the failed step's line
    assert "sleep" in recs[3]["phase_s"] and "train" not in recs[3]["phase_s"]
    assert recs[-1]["status"] == "error" and "reward bug" in recs[-1]["error"]
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert summary["status"] == "error" and summary["steps_done"] == 1 and "flaky" in summary["error"]


def test_a_hanging_reward_is_bounded_by_the_phase_timeout(cache_env, tmp_path):
    import threading
    import time

    from colomem.runner import PhaseTimeoutError

    release = threading.Event()

    def hangs(prompt, completion, **meta):
        release.wait(60)                          # a remote verifier that never answers (blocked in C)
        return 0.0
    held = {}
    t0 = time.monotonic()
    try:
        with pytest.raises(PhaseTimeoutError, match="score phase.*phase_timeout_s=5"):
            run_job(small_cfg(tmp_path / "hang", phase_timeout_s=5.0), reward_fns=[hangs],
                    engines_factory=spy_factory(held), print_fn=lambda *_: None)
    finally:
        release.set()
    assert time.monotonic() - t0 < 45          # not the reward's 60 s: the step stopped waiting at 5 s
    assert held["calls"].count("close") == 2 and held["pool"].closed
    recs = read_jsonl(tmp_path / "hang" / "metrics.jsonl")
    assert recs[1]["failed"] == "score" and "phase_timeout_s" in recs[1]["error"]


def test_metrics_already_written_stay_intact(cache_env, tmp_path):
    out = tmp_path / "reused"
    out.mkdir()
    old = b'{"step":0,"reward_mean":0.25}\n{"step":1,"reward_mean":0.5}\n{"step":2,"rew'   # torn last line
    (out / "metrics.jsonl").write_bytes(old)

    def boom(prompt, completion, **meta):
        raise RuntimeError("stop here")
    with pytest.raises(RewardFunctionError):
        run_job(small_cfg(out), reward_fns=[boom], print_fn=lambda *_: None)
    data = (out / "metrics.jsonl").read_bytes()
    assert data.startswith(old + b"\n")                         # old bytes untouched, torn line closed
    recs = read_jsonl(out / "metrics.jsonl")
    assert recs[:2] == [{"step": 0, "reward_mean": 0.25}, {"step": 1, "reward_mean": 0.5}]
    assert recs[2]["event"] == "start" and recs[-1]["status"] == "error"


def test_oom_at_wake_rolls_back_and_names_the_knob(cache_env, tmp_path):
    held = {}
    oom = CudaOutOfMemoryError("cudaMalloc failed: out of memory")
    with pytest.raises(CudaOutOfMemoryError) as ei:
        run_job(small_cfg(tmp_path / "oom"), engines_factory=spy_factory(held, {("wake_kv", 2): oom}),
                print_fn=lambda *_: None)
    msg = str(ei.value)
    assert "step 1" in msg and "'wake_kv'" in msg and "--gpu-memory-utilization (now 0.2)" in msg
    assert "--max-model-len" in msg and "put back to sleep" in msg and "not reloaded" in msg
    calls = held["calls"]
    after = calls[len(calls) - calls[::-1].index("wake_kv"):]          # what ran after the failed wake
    assert after[0] == "sleep" and "reload" not in after and "generate" not in after
    assert held["pool"].closed
    failed = [r for r in read_jsonl(tmp_path / "oom" / "metrics.jsonl") if r.get("failed")]
    assert len(failed) == 1 and failed[0]["failed"] == "wake_kv" and "wake_kv" in failed[0]["memory"]
    summary = json.loads((tmp_path / "oom" / "summary.json").read_text())
    assert summary["status"] == "error" and summary["steps_done"] == 1


def test_the_runner_gives_its_own_flags_in_place_of_the_rollouts_advice():
    from types import SimpleNamespace

    from colomem.engines.vllm.wake_memory import wake_oom_message
    from colomem.runner.loop_memory import oom_error
    from colomem.runner.placement import EVERYTHING_MOVES

    c = SimpleNamespace(gpu_memory_utilization=0.97, max_model_len=256, switch="colomem", micro_batch=8)
    e = CudaOutOfMemoryError(wake_oom_message(("kv_cache",), 135 << 30, 129 << 30, "before waking", 0))
    msg = str(oom_error(c, EVERYTHING_MOVES, "wake_kv", 0, e, "the rollout engine was put back to sleep"))
    assert msg.count("To fit:") == 1 and msg.count("gpu-memory-utilization") == 1
    assert "--gpu-memory-utilization (now 0.97)" in msg and "gpu_memory_utilization" not in msg
    assert "needs 135.00 GiB but 129.00 GiB is free" in msg and "The rollout engine was put back to sleep" in msg


def test_oom_in_training_after_a_partial_kv_release_names_the_whole_release():
    from dataclasses import replace
    from types import SimpleNamespace

    from colomem.runner.loop_memory import oom_error
    from colomem.runner.placement import ALL_CATEGORIES, Placement

    c = SimpleNamespace(gpu_memory_utilization=0.3, max_model_len=256, switch="colomem", micro_batch=8)
    p = replace(Placement(ALL_CATEGORIES, True), kv_release=6 << 30)
    msg = str(oom_error(c, p, "train", 3, torch.OutOfMemoryError("oom"), None))
    assert "--micro-batch (now 8)" in msg and "released only 6.00 GiB of its KV cache" in msg
    assert "--kv-release all" in msg
    # a rollout phase's shortage is the KV cache's own: the release while training is not the knob there
    assert "--kv-release" not in str(oom_error(c, p, "rollout", 3, torch.OutOfMemoryError("oom"), None))


def test_oom_in_training_names_micro_batch(cache_env, tmp_path):
    held = {}
    with pytest.raises(CudaOutOfMemoryError, match=r"'train'.*--micro-batch \(now 8\)"):
        run_job(small_cfg(tmp_path / "oomt"),
                engines_factory=spy_factory(held, trainer_faults={("train_step", 1): torch.OutOfMemoryError("oom")}),
                print_fn=lambda *_: None)


def test_ctrl_c_is_reported_as_interrupted(cache_env, tmp_path):
    calls = {"n": 0}

    def stop_at_second_step(prompt, completion, **meta):
        calls["n"] += 1
        if calls["n"] > 16:
            raise KeyboardInterrupt
        return 0.5
    held = {}
    with pytest.raises(KeyboardInterrupt):
        run_job(small_cfg(tmp_path / "int"), reward_fns=[stop_at_second_step], engines_factory=spy_factory(held),
                print_fn=lambda *_: None)
    assert held["pool"].closed
    summary = json.loads((tmp_path / "int" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] == 1
    assert read_jsonl(tmp_path / "int" / "metrics.jsonl")[-1]["status"] == "interrupted"
