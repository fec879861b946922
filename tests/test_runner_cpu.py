"""The colocated loop on CPU, end to end on the tiny model: phases in order, metrics that stay valid,
weights that really reach the rollout, cleanup whatever fails, OOM rollback."""
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from colomem.errors import CudaOutOfMemoryError, PhaseOrderError, StaleWeightsError
from colomem.runner.config import RunConfig, config_from_dict
from colomem.grpo.rewards import RewardFunctionError
from colomem.runner import CYCLE, PhaseMachine, run_job
from colomem.runner.backends import build_engines
from colomem.runner.timeline import MemoryAlarm, MetricsWriter, read_jsonl

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One tiny model for the whole session (built once, found again through COLOMEM_CACHE)."""
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    root = tmp_path_factory.mktemp("colomem-cache")
    model_dir("tiny", make_task("successor").alphabet, cache_dir=root / "models", log=lambda *_: None)
    return root


@pytest.fixture
def cache_env(model_cache, monkeypatch):
    monkeypatch.setenv("COLOMEM_CACHE", str(model_cache))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    return model_cache


def small_cfg(out, **kw) -> RunConfig:
    data = {"backend": "cpu", "steps": 2, "prompts_per_step": 4, "micro_batch": 8, "progress": False,
            "out": str(out), "grpo": {"group_size": 4}}
    for k, v in kw.items():
        if k == "grpo":
            data["grpo"].update(v)
        else:
            data[k] = v
    return config_from_dict(data)


class Spy:
    """Records method calls of the wrapped engine; raises a planned fault at the k-th call of a method."""

    def __init__(self, inner, faults=None, log=None):
        self.inner, self.faults = inner, dict(faults or {})
        self.calls = log if log is not None else []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def wrapped(*a, **k):
            self.calls.append(name)
            fault = self.faults.get((name, sum(1 for c in self.calls if c == name)))
            if fault is not None:
                raise fault
            return attr(*a, **k)
        return wrapped


def spy_factory(holder, rollout_faults=None, trainer_faults=None):
    def factory(cfg, backend, model_path, tok, ranks, grad_accum):
        eng = build_engines(cfg, backend, model_path, tok, ranks, grad_accum=grad_accum)
        log = holder.setdefault("calls", [])
        eng.rollout = Spy(eng.rollout, rollout_faults, log)
        eng.trainer = Spy(eng.trainer, trainer_faults, log)
        holder["engines"] = eng
        holder["pool"] = eng.pool
        holder["trainer"] = eng.trainer.inner
        holder["rollout"] = eng.rollout.inner
        return eng
    return factory


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


# ---------------------------------------------------------------------------------------------- failures
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


def test_oom_in_training_names_micro_batch(cache_env, tmp_path):
    held = {}
    with pytest.raises(CudaOutOfMemoryError, match=r"'train'.*--micro-batch \(now 8\)"):
        run_job(small_cfg(tmp_path / "oomt"),
                engines_factory=spy_factory(held, trainer_faults={("train_step", 1): torch.OutOfMemoryError("oom")}),
                print_fn=lambda *_: None)


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


def test_default_yaml_is_the_embedded_default():
    data = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    assert config_from_dict(data).model_dump() == RunConfig().model_dump()


def test_cli_main(cache_env, tmp_path, capsys):
    from colomem.runner.cli import main

    rc = main(["--backend", "cpu", "--steps", "1", "--prompts-per-step", "4", "--group-size", "2",
               "--out", str(tmp_path / "cli"), "--no-progress", "--no-plots"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "step   1/1" in out and "ok: 1 steps" in out
    assert (tmp_path / "cli" / "summary.json").is_file() and not (tmp_path / "cli" / "timeline.png").exists()
    assert main(["--clip-eps", "2"]) == 2
    assert "grpo.clip_eps = '2' (from --clip-eps)" in capsys.readouterr().err


def test_cpu_explains_what_the_gpu_path_needs(cache_env, tmp_path, capsys):
    from colomem.runner.backends import resolve_backend
    backend, why = resolve_backend("auto")
    if backend != "cpu":
        pytest.skip("the GPU path is available here; this checks the fallback on machines without it")
    assert "vllm" in why and "deepspeed" in why and "CUDA" in why
    res = run_job(small_cfg(tmp_path / "auto", backend="auto", steps=40, cpu_steps=1), print_fn=print)
    assert res.summary["backend"] == "cpu" and res.summary["steps_done"] == 1
    out = capsys.readouterr().out
    assert "1 steps instead of 40" in out and "The GPU path needs" in out


@pytest.mark.slow
def test_default_task_is_learned_on_cpu(cache_env, tmp_path):
    """GRPO on the tiny model learns the default task: the reward rises within 10 steps (16 prompts x 8)."""
    run_job(config_from_dict({"backend": "cpu", "steps": 10, "prompts_per_step": 16, "progress": False,
                              "plots": False, "out": str(tmp_path / "l")}), print_fn=lambda *_: None)
    r = [x["reward_mean"] for x in read_jsonl(tmp_path / "l" / "metrics.jsonl") if "step" in x]
    assert len(r) == 10
    assert sum(r[-3:]) / 3 > sum(r[:3]) / 3 + 0.1, r


def test_a_cross_process_engine_over_several_ranks_is_refused_before_anything_starts():
    from colomem.errors import InvalidArgumentError
    from colomem.runner.ranks import Ranks

    cfg = config_from_dict({"tensor_parallel_size": 2, "backend": "gpu"})
    assert cfg.effective_engine == "in-rank"                          # TP above 1: the engine inside the ranks
    forced = cfg.model_copy(update={"engine": "cross-process"})       # past the run config's own check
    with pytest.raises(InvalidArgumentError, match="needs the in-rank engine"):
        build_engines(forced, "gpu", "/nonexistent", None, Ranks(), grad_accum=1)


def test_a_float32_checkpoint_trains_on_the_cpu(cache_env, tmp_path):
    """A checkpoint saved in float32 (most small ones are) loads as safetensors' read-only file mapping on the
    CPU; the trainer must still offload and reload it (it used to raise ForeignTensorError)."""
    from safetensors.torch import load_file

    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    path = model_dir("tiny", make_task("successor").alphabet, dtype="float32", cache_dir=tmp_path / "models",
                     log=lambda *_: None)
    assert all(t.dtype == torch.float32 for t in load_file(str(path / "model.safetensors")).values())
    res = run_job(small_cfg(tmp_path / "fp32", model=str(path), steps=2), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and res.summary["steps_done"] == 2


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


def test_a_gpu_sized_config_on_the_cpu_says_it_needs_a_gpu(cache_env, tmp_path):
    import time
    from pathlib import Path

    from colomem.errors import NotAvailableError
    from colomem.runner.config import load_run_config
    from colomem.runner.host_memory import check_cpu_fits

    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(["--config", str(root / "configs" / "grpo_1p5b_full.yaml"), "--backend", "cpu",
                           "--out", str(tmp_path / "big")])
    t0 = time.monotonic()
    with pytest.raises(NotAvailableError, match=r"1\.54 B parameters.*GPU path"):
        check_cpu_fits({"hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960,
                        "vocab_size": 151936, "num_attention_heads": 12, "num_key_value_heads": 2},
                       "a 1.5B model", available=16 << 30)
    check_cpu_fits({"hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 64}, "tiny", available=16 << 30)
    from colomem.runner.host_memory import available_host_bytes
    if (available_host_bytes() or 0) < 24e9 * 1.25:     # machines like CI's: the run is refused before building
        with pytest.raises(NotAvailableError, match="GPU path"):
            run_job(cfg, print_fn=lambda *_: None)
        assert time.monotonic() - t0 < 60                              # refused before any model was built
        assert not list((cache_env / "models").glob("qwen2-1.5b*"))


def test_prepare_only_builds_the_model_into_an_empty_cache_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from colomem.runner.cli import main

    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("COLOMEM_CACHE", str(cache))
    out = tmp_path / "out"
    assert main(["--prepare-only", "--backend", "cpu", "--seed", "3", "--out", str(out)]) == 0
    built = [p for p in (cache / "models").iterdir() if (p / "config.json").is_file()]
    assert len(built) == 1 and any(built[0].glob("*.safetensors"))
    assert str(built[0]) in capsys.readouterr().out
    assert not out.exists()                                  # no run: no outputs, no engines
    # the same config then finds it: a second prepare builds nothing new
    assert main(["--prepare-only", "--backend", "cpu", "--seed", "3"]) == 0
    assert [p for p in (cache / "models").iterdir() if (p / "config.json").is_file()] == built


def test_prepare_only_reports_a_bad_input_without_starting_anything(tmp_path, monkeypatch, capsys):
    from colomem.runner.cli import main

    monkeypatch.setenv("COLOMEM_CACHE", str(tmp_path / "cache"))
    assert main(["--prepare-only", "--backend", "cpu", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "error:" in capsys.readouterr().err
