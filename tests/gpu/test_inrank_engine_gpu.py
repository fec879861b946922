"""The in-rank vLLM engine (--engine in-rank: vLLM inside the torchrun rank, external launcher, direct sync) on
real GPUs, against the cross-process engine.

One GPU: the default job under `torchrun --nproc-per-node 1` with each engine, the same seed. What "the same
reward curve" means here: the first step is bit-identical (same initial weights, the same per-request seeds,
the same vLLM kernels: the engine's place changes nothing it computes), and the later steps stay within
sampling noise, not bit-identical by contract: DeepSpeed's backward (attention kernels that accumulate with
atomics) is not bitwise deterministic run to run, so after the first update the weights may differ in their
last bits, a sampled token may flip and the two runs go on as two samples of one process. Bounds: every step's
mean reward within 0.15 (a few of 256 completions flipping), the last-5 mean within 0.05. How many steps came
out bit-identical is printed (benchmarks/bench_inrank.py reports it too).

Two GPUs (multi_gpu; not run on a one-GPU host): a TP=2 engine whose two shards share the node (each rank
holds about half the weights of the TP=1 engine and both train), and two TP=1 engines (DP=2) that each
generate their half of the prompts.

Run: python -m pytest -m "gpu and vllm and deepspeed" -s tests/gpu/test_inrank_engine_gpu.py
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
CYCLE = ["offload", "barrier_wake", "wake_weights", "sync", "check", "wake_kv", "rollout", "sleep",
         "barrier_train", "reload", "train"]
STEPS = 8


def _env(tmp_path):
    # not this process's torch.distributed variables (an earlier test's trainer set them); torchrun sets its own
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update({"COLOMEM_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
                "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return env


def _torchrun(tmp_path, name, nproc, *flags, timeout=400):
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "runners" / "grpo_colocated.py"), "--backend", "gpu", "--out", str(out), "--no-progress",
           "--report-to", "none", "--no-plots", *flags]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "phase_s" in s]
    return steps, json.loads((out / "summary.json").read_text()), out


def _check_loop(steps, summary, n):
    assert summary["status"] == "ok" and summary["backend"] == "gpu" and len(steps) == n
    for s in steps:
        assert [p for p in s["phase_s"] if p not in ("score", "reload_wait")] == CYCLE
        assert s["train/rollout_logprob_gap"] < 0.05, s["train/rollout_logprob_gap"]   # trained weights used
        assert s["sync/ntensors"] > 0
    assert [s["weight_version"] for s in steps] == list(range(1, n + 1))


def test_default_job_in_rank_has_the_cross_process_reward_curve(tmp_path):
    inrank, s_in, _ = _torchrun(tmp_path, "inrank", 1, "--engine", "in-rank", "--steps", str(STEPS))
    cross, s_cross, _ = _torchrun(tmp_path, "crossproc", 1, "--engine", "cross-process", "--steps", str(STEPS))
    _check_loop(inrank, s_in, STEPS)
    _check_loop(cross, s_cross, STEPS)
    a = [s["reward_mean"] for s in inrank]
    b = [s["reward_mean"] for s in cross]
    same = sum(x == y for x, y in zip(a, b))
    print(f"\nin-rank {a}\ncross-process {b}\nbit-identical steps: {same}/{STEPS}; sync s in-rank "
          f"{s_in['phase_s_median'].get('sync')}, cross-process {s_cross['phase_s_median'].get('sync')}")
    assert a[0] == b[0], (a, b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 0.15, (a, b)
    assert abs(s_in["reward_last5_mean"] - s_cross["reward_last5_mean"]) <= 0.05, (a, b)
    # the in-rank sync is in process: no bridge buckets
    assert all(s["sync/nbuckets"] == 0 for s in inrank) and all(s["sync/nbuckets"] > 0 for s in cross)
    # vLLM's pool in the rank's own allocator is the engine's memory, not the trainer's: the trainer's figures
    # the planner reads (after the first step's offload, nothing of the trainer left) are the cross-process
    # run's, give or take what vLLM allocates outside its sleepable pool (sampler tensors, CUDA graphs)
    off_in, off_cross = inrank[0]["memory"]["offload"], cross[0]["memory"]["offload"]
    assert off_in["engine_reserved"] > 0 and "engine_reserved" not in off_cross, (off_in, off_cross)
    assert off_in["reserved"] <= off_cross["reserved"] + (1 << 30), (off_in, off_cross)
    assert off_in["reserved"] <= off_in["driver_used"], off_in


# ------------------------------------------------------------------------------------------ two GPUs
SHARD = textwrap.dedent(r'''
    import json, os, sys
    from colomem.engines.vllm import VLLMRollout, VLLMConfig
    model, out, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank = int(os.environ["RANK"])
    r = VLLMRollout(model, config=VLLMConfig(tensor_parallel_size=tp, engine_in_process=True,
                                             external_launcher=True, sync_transport="direct",
                                             gpu_memory_utilization=0.2, max_model_len=256,
                                             device=int(os.environ["LOCAL_RANK"])))
    mem = r.rpc("colomem_memory")[0]
    outs = r.generate([[5, 6, 7]], n=4, max_new_tokens=8, seed=3)
    with open(os.path.join(out, f"shard{tp}-{rank}.json"), "w") as f:
        json.dump({"weights": mem.get("cumem_bytes_by_tag", {}).get("weights"),
                   "tokens": [c.token_ids for c in outs[0]]}, f)
    r.close()
''')


def _model(tmp_path):
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    return model_dir("qwen2-0.5b", make_task("successor").alphabet, cache_dir=tmp_path / "cache" / "models",
                     log=lambda *_: None)


@pytest.mark.multi_gpu
def test_a_tp2_engine_keeps_half_the_weights_on_each_rank_and_both_shards_sample_alike(tmp_path):
    model = str(_model(tmp_path))
    script = tmp_path / "shard.py"
    script.write_text(SHARD)
    for tp in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
               str(script), model, str(tmp_path), str(tp)]
        p = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    one = json.loads((tmp_path / "shard1-0.json").read_text())
    shards = [json.loads((tmp_path / f"shard2-{r}.json").read_text()) for r in (0, 1)]
    assert shards[0]["tokens"] == shards[1]["tokens"]             # the two shards of one engine agree
    for s in shards:       # about half: the embeddings and linears split, norms are whole on both
        assert 0.4 * one["weights"] < s["weights"] < 0.7 * one["weights"], (one, shards)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("tp", [2, 1])
def test_two_ranks_in_rank_train_with_tp_or_dp(tmp_path, tp):
    steps, summary, out = _torchrun(tmp_path, f"tp{tp}", 2, "--engine", "in-rank", "--tensor-parallel-size",
                                    str(tp), "--steps", "4", timeout=500)
    _check_loop(steps, summary, 4)
    assert summary["world_size"] == 2
    per_rank = [[json.loads(x) for x in (out / "ranks" / f"rank{r}.jsonl").read_text().splitlines()]
                for r in (0, 1)]
    # every rank trains on its half; the reduced metrics agree
    for a, b in zip(*per_rank):
        assert a["reward_mean"] == b["reward_mean"] and a["weight_version"] == b["weight_version"]
