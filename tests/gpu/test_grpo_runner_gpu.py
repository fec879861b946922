"""The colocated GRPO runner on a real GPU with vLLM + DeepSpeed: the default job's loop end to end.

Each run is the runner CLI in a fresh process (vLLM's engine process and DeepSpeed's state end with it):
- the phases run in order every step and the rollout generates with the trained weights (logprob gap small);
- GPU memory left while both sides sleep stays flat across steps (no memory alarm);
- the trainer gives its GPU memory back at every offload (colomem), or the baseline's does (timesplit).

Run: python -m pytest -m "gpu and vllm and deepspeed" -s tests/gpu/test_grpo_runner_gpu.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
CYCLE = ["offload", "barrier_wake", "wake_weights", "sync", "check", "wake_kv", "rollout", "sleep",
         "barrier_train", "reload", "train"]


def _run(tmp_path, name, *flags, timeout=540):
    out = tmp_path / name
    # Not this process's torch.distributed variables: a DeepSpeedTrainer built earlier in the same pytest
    # run set them, and the child would take them for a torchrun launch (MASTER_PORT: this process's store)
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update({"COLOMEM_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
                "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")})
    cmd = [sys.executable, str(ROOT / "runners" / "grpo_colocated.py"), "--backend", "gpu", "--out", str(out),
           "--no-progress", *flags]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "phase_s" in s]
    summary = json.loads((out / "summary.json").read_text())
    return steps, summary, log


def _check_loop(steps, summary, n, settled=1):
    """settled: the first step of the placement the run keeps (the planner's plan starts after step 0, and
    its first step is a warm-up: the trainer's caching allocator grows into the memory it now keeps)."""
    assert summary["status"] == "ok" and summary["backend"] == "gpu" and len(steps) == n
    for s in steps:
        assert [p for p in s["phase_s"] if p not in ("score", "reload_wait")] == CYCLE
        # vLLM sampled with the weights the trainer had just before this step's update (bf16 numerics)
        assert s["train/rollout_logprob_gap"] < 0.05, s["train/rollout_logprob_gap"]
        assert s["sync/ntensors"] > 0
    assert [s["weight_version"] for s in steps] == list(range(1, n + 1))
    floor = [s["memory"]["sleep"]["driver_used"] for s in steps[settled:]]
    assert max(floor) - min(floor) < 256 * MiB, floor           # nothing left behind between steps
    assert not summary["memory_alarms"]


def test_default_job_colomem(tmp_path):
    # the moving path: every step offloads the trainer and puts vLLM to sleep
    steps, summary, log = _run(tmp_path, "colomem", "--steps", "8", "--offload", "all", "--rollout-sleep", "always")
    _check_loop(steps, summary, 8)
    for s in steps:
        mem = s["memory"]
        # the trainer gives (nearly) all of its memory back while vLLM runs
        assert mem["offload"]["allocated"] < 64 * MiB, (
            mem["offload"], {k: v for k, v in s.items() if k.startswith("trainer_offload/")})
        assert mem["train"]["allocated"] > mem["offload"]["allocated"]
        assert mem["offload"]["pinned_host"] > 0
    assert "step   8/8" in log


def test_default_job_timesplit_baseline(tmp_path):
    steps, summary, _ = _run(tmp_path, "timesplit", "--steps", "4", "--switch", "timesplit")
    _check_loop(steps, summary, 4)


def test_default_job_lora(tmp_path):
    steps, summary, _ = _run(tmp_path, "lora", "--steps", "4", "--lora", "--lora-r", "8", "--lr", "5e-3")
    _check_loop(steps, summary, 4)


def test_default_job_auto_placement_moves_nothing_once_it_fits(tmp_path):
    # the default: step 0 moves everything and measures; the job fits, so from step 1 on nothing moves, vLLM
    # stays awake and drops its prefix cache while the trainer trains (the sync only collects that reset)
    steps, summary, _ = _run(tmp_path, "auto", "--steps", "6")
    _check_loop(steps, summary, 6, settled=2)
    assert summary["placement"]["label"] == "nothing moves"
    assert all("trainer_offload/seconds" not in s for s in steps[1:])
    assert all(s["sync/prefix_reset_early"] for s in steps[2:])      # retired after step 1's rollout on
    assert not steps[1]["sync/prefix_reset_early"]                   # step 0's vLLM slept: nothing to drop


def test_default_job_with_compiled_layers_trimmed_recompute_and_a_grown_micro_batch(tmp_path):
    # --torch-compile and --grow-micro-batch with checkpointing on the planner's default, whose
    # --trim-recompute auto trims: the tiny job fits, so after the measuring step no layer is checkpointed any
    # more and the micro-batch grows in what is left; vLLM samples with the weights the compiled trainer trained
    steps, summary, log = _run(tmp_path, "tuned", "--steps", "5", "--torch-compile", "--gradient-checkpointing",
                               "true", "--grow-micro-batch")
    _check_loop(steps, summary, 5, settled=2)
    assert "[colomem] training: torch.compile on" in log
    trim = log.index("--gradient-checkpointing false from step 2 on (--trim-recompute")
    events = [json.loads(x) for x in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    placement = [e for e in events if e.get("event") == "placement"][-1]
    layers = placement["recompute_probe"]["layers"]
    assert placement["recompute_trimmed"] == [layers, 0]
    # the measuring step recomputed every layer (the trainer trains in training mode), the others none
    assert [s["train/recomputed_layers"] for s in steps] == [layers] + [0] * 4
    was, now = placement["micro_batch_grown"]
    assert now > was and log.index(f"--micro-batch {was} -> {now} from step 2 on") > trim
    # fewer, larger micro-batches from the step after the measuring one
    assert steps[1]["train/micro_batches"] < steps[0]["train/micro_batches"]


def test_default_job_with_its_kv_cache_sized_to_the_rollout(tmp_path):
    # --kv-cache-bytes auto beside a utilization that alone would give vLLM most of the GPU: vLLM keeps only
    # what the step's rollout can hold (every sequence at --max-model-len, a quarter more), so the trainer's
    # memory is left and nothing moves after the measuring step
    steps, summary, log = _run(tmp_path, "kvauto", "--steps", "4", "--kv-cache-bytes", "auto",
                               "--gpu-memory-utilization", "0.9")
    _check_loop(steps, summary, 4, settled=2)
    line = next(x for x in log.splitlines() if "(--kv-cache-bytes auto:" in x)
    events = [json.loads(x) for x in (tmp_path / "kvauto" / "metrics.jsonl").read_text().splitlines()]
    placement = [e for e in events if e.get("event") == "placement"][-1]
    fig = placement["figures"][0]
    # vLLM's cache: the size asked for (its allocations rounded up to whole pages, a layer's each), not the
    # tens of GiB the utilization would have given it
    assert 0 < fig["kv_need"] <= fig["kv_cache"] <= fig["kv_need"] * 1.25 + 64 * MiB, (fig, line)
    assert summary["placement"]["label"] == "nothing moves"
    assert not placement["kv_hint"]                          # no utilization advice to a run that sized it
