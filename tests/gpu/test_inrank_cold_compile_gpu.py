"""vLLM inside the trainer's process with CUDA graphs, its torch.compile cache empty (a fresh machine's first
run): the in-process engine's graphs must survive the trainer's offloads.

A trainer offload ends with colomem.engines.deepspeed.state.release_cached_memory(), which empties torch's
cache and, unless something holds them, frees torch's cuBLAS workspaces (torch._C._cuda_clearCublasWorkspaces:
one per cuBLAS handle and stream, 32 MiB on Hopper). The GEMMs inside CUDA graphs captured in this process
carry the workspace address of the stream they were captured on, so with vLLM in the process a freed
workspace is memory the next graph replay writes into after it belongs to nobody: a fault at the first decode
step (a FULL graph replay; the prefill before it runs outside graphs) when the address was given back to the
driver, silent writes into someone else's memory when it was handed out again. An in-process VLLMRollout
therefore holds the workspaces from its start to its close (colomem._torch.hold_cublas_workspaces). Whether a
run without that hold faults depends on what the address became, so these tests look at the workspaces
themselves, and run whole jobs on a cold compile (where the fault showed).

- test_graph_workspaces_survive_the_trainers_cache_release: the probe (tests/gpu/_cold_compile_probe.py)
  builds the in-process engine with graphs, generates, runs the release the trainer runs, reports whether the
  workspace-sized blocks of vLLM's capture stream are still allocated and mapped (they must be: the engine
  holds them), and generates again. The control runs torch.cuda.empty_cache() alone. The probe's lines say how
  far each got.
- test_cold_compile_job_in_rank: the tiny default job, the 1.5B full job (--engine in-rank) and the 1.5B LoRA
  job with --shared-base --shared-base-rollout merged, 3 steps each, each with an empty vLLM cache
  (VLLM_CACHE_ROOT; vLLM puts Inductor's and Triton's caches under it too), --no-enforce-eager; each must end
  with status ok, and its log must show a compile, not a load from the cache.

Every run is a subprocess with this process's environment, so diagnostics pass through: CUDA_LAUNCH_BLOCKING=1
(the fault raised at the kernel that makes it), VLLM_LOGGING_LEVEL=DEBUG (vLLM then also checks that every
graph replay sees its capture's input addresses), TORCH_LOGS=recompiles. COLOMEM_TEST_KEEP_CUBLAS=1 runs the
jobs through `_cold_compile_probe.py keep-cublas`, which makes torch._C._cuda_clearCublasWorkspaces a no-op
whoever holds the workspaces (a fault that stays is then not theirs). About 7 minutes on one H100 (three cold vLLM compiles of the
1.5B shape, one of the tiny model, one warm).

Run: python -m pytest -q -rs -s -m vllm tests/gpu/test_inrank_cold_compile_gpu.py
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "_cold_compile_probe.py"
# COLOMEM_TEST_KEEP_CUBLAS=1: the jobs run with torch's cuBLAS workspaces never cleared (the A/B of the suspect)
KEEP_CUBLAS = os.environ.get("COLOMEM_TEST_KEEP_CUBLAS", "") == "1"
DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
STEPS = 3
FAULT = re.compile(r"cudaError\w+|illegal memory access|unspecified launch failure|CUDA error[^\n]*|"
                   r"dump_input\.py[^\n]{0,160}|Directly load[^\n]{0,120}|Compiling a graph[^\n]{0,120}")

# the most telling first: a stage cut by its time bound keeps what ran
JOBS = {
    "1p5b_full": ["--config", str(ROOT / "configs" / "grpo_1p5b_full.yaml"), "--engine", "in-rank"],
    "1p5b_lora_shared_merged": ["--config", str(ROOT / "configs" / "grpo_1p5b_lora.yaml"), "--engine", "in-rank",
                                "--shared-base", "--shared-base-rollout", "merged"],
    "tiny_default": ["--engine", "in-rank"],
}


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """COLOMEM_CACHE shared by the module's runs: the 1.5B-shaped model is built once."""
    return tmp_path_factory.mktemp("colomem-cache")


@pytest.fixture(scope="module")
def probe_vllm_cache(tmp_path_factory):
    """The probes' vLLM cache: empty for the first probe, whose compile the second one loads."""
    return tmp_path_factory.mktemp("probe-vllm-cache")


def _env(model_cache: Path, vllm_cache: Path) -> dict:
    """This process's environment (diagnostic variables pass through) without torch.distributed variables an
    earlier test left, a cold vLLM cache (VLLM_CACHE_ROOT: vLLM points Inductor and Triton under it once it
    compiles; the two set here cover what runs before that), the module's model cache."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update({"COLOMEM_CACHE": str(model_cache), "PYTHONUNBUFFERED": "1",
                "VLLM_CACHE_ROOT": str(vllm_cache),
                "TORCHINDUCTOR_CACHE_DIR": str(vllm_cache / "inductor"),
                "TRITON_CACHE_DIR": str(vllm_cache / "triton"),
                "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return env


def _notes(log: str, limit: int = 12) -> str:
    """The log's lines that say what happened: CUDA errors, vLLM's input dump, compile or cache load."""
    seen: list = []
    for m in FAULT.finditer(log):
        s = m.group(0)
        if s not in seen:
            seen.append(s)
    return "\n".join(seen[:limit])


def _probe_lines(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("PROBE "):
            try:
                rec = json.loads(line[len("PROBE "):])
            except ValueError:       # another writer's bytes on the same line
                continue
            out[rec.get("stage", "?")] = rec
    return out


@pytest.mark.parametrize("mode", ["release", "empty_cache"])
def test_graph_workspaces_survive_the_trainers_cache_release(model_cache, probe_vllm_cache, mode):
    p = subprocess.run([sys.executable, str(PROBE), mode, "qwen2-1.5b"], cwd=ROOT,
                       env=_env(model_cache, probe_vllm_cache), capture_output=True, text=True, timeout=300)
    log = p.stdout + p.stderr
    stages = _probe_lines(p.stdout)
    print(f"\n[{mode}] rc={p.returncode}")
    for name, rec in stages.items():
        print(f"[{mode}] {name}: {json.dumps(rec)[:1500]}")
    print(f"[{mode}] notes:\n{_notes(log)}")
    assert "generated" in stages, f"the probe did not get through its first generate (rc {p.returncode}):\n" \
                                  f"{log[-6000:]}"
    released = stages.get("released", {}).get("workspaces", [])
    graph_side = [w for w in released if w["stream"] != 0]
    if not stages["generated"]["workspaces"]:
        print(f"[{mode}] note: no block of the cuBLAS workspace's size was allocated after the first generate "
              "(another workspace size or torch version): the probe cannot tell where vLLM's graphs point")
    freed = [w for w in graph_side if not (w["still_allocated"] and w["mapped"])]
    assert not freed, (
        f"{mode}: {len(freed)} cuBLAS-workspace-sized block(s) of a non-default stream (vLLM's graph capture) "
        f"were freed or unmapped while the engine's CUDA graphs still use them: {freed}; the next graph replay "
        "writes into memory nobody owns (release_cached_memory clears torch's cuBLAS workspaces)")
    assert p.returncode == 0 and "generated_again" in stages, (
        f"{mode}: the second generate failed (rc {p.returncode}); {stages.get('failed', {}).get('error')}\n"
        f"{_notes(log)}\n{log[-6000:]}")


@pytest.mark.parametrize("job", list(JOBS))
def test_cold_compile_job_in_rank(tmp_path, model_cache, job):
    out = tmp_path / job
    vllm_cache = tmp_path / "vllm-cache"          # empty: this run compiles vLLM's graphs itself
    runner = [str(PROBE), "keep-cublas"] if KEEP_CUBLAS else []
    cmd = [sys.executable, *runner, str(ROOT / "runners" / "grpo_colocated.py"), "--backend", "gpu", *JOBS[job],
           "--steps", str(STEPS), "--no-enforce-eager", "--out", str(out), "--no-progress", "--report-to", "none",
           "--no-plots"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(model_cache, vllm_cache), capture_output=True, text=True,
                       timeout=420)
    log = p.stdout + p.stderr
    notes = _notes(log)
    print(f"\n[{job}] rc={p.returncode}{' (cuBLAS workspaces kept)' if KEEP_CUBLAS else ''}\n{notes}")
    assert "Directly load" not in log and "Compiling a graph" in log, (
        f"{job}: vLLM did not compile its graphs in this run (a warm cache?):\n{notes}\n{log[-3000:]}")
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    steps = []
    if (out / "metrics.jsonl").is_file():
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "phase_s" in s]
    assert p.returncode == 0 and summary.get("status") == "ok" and len(steps) == STEPS, (
        f"{job}: rc {p.returncode}, status {summary.get('status')!r}, {len(steps)} of {STEPS} steps\n{notes}\n"
        f"{log[-6000:]}")
    # the rollout sampled with the weights the trainer had (the sync reached vLLM); looser than the runner
    # tests' 0.05: the LoRA shapes measured about 0.054 (bf16), and this test is about faults, not numerics
    for s in steps:
        assert s["train/rollout_logprob_gap"] < 0.1, (job, s["train/rollout_logprob_gap"])
