"""Probe run by tests/gpu/test_inrank_cold_compile_gpu.py in a process of its own (vLLM allows one sleeping
engine a process, and a CUDA fault ends the context): does the trainer's cache release free memory that the
in-process vLLM engine's CUDA graphs still use?

    python tests/gpu/_cold_compile_probe.py release|empty_cache [shape]
    python tests/gpu/_cold_compile_probe.py keep-cublas SCRIPT [its arguments]

It builds an in-process vLLM engine the way --engine in-rank does (external launcher, direct sync, the calls on
the engine-call thread) with CUDA graphs (enforce_eager=False), generates 32 prompts x 8 completions (a decode
batch of 256: a FULL graph replay every decode step), then either

    release      colomem.engines.deepspeed.state.release_cached_memory(), what every trainer offload runs
                 before the rollout (the cuBLAS workspaces freed unless held, then torch.cuda.empty_cache()), or
    empty_cache  torch.cuda.empty_cache() alone (the control),

and generates again. torch keeps one cuBLAS workspace per (cuBLAS handle, stream); vLLM's graphs were
captured on a stream of their own, so the GEMMs inside them carry that stream's workspace address. What the
probe reports, one `PROBE {json}` line per stage on stdout (read even when the process dies):

    generated        the workspace-sized blocks torch's allocator holds after the first generate, with the
                     stream and pool they belong to (stream != 0: vLLM's capture stream)
    released         the same blocks after the release: still_allocated (an allocation of torch's still covers
                     the address) and mapped (the driver still maps it); a block of the capture stream that is
                     no longer allocated is memory the graphs keep writing to
    generated_again  the second generate finished (the replay survived)
    failed           its error, before the process exits on its own

keep-cublas runs SCRIPT (the runner) with torch._C._cuda_clearCublasWorkspaces replaced by a no-op: the A/B
switch of the test's jobs (COLOMEM_TEST_KEEP_CUBLAS=1). colomem._torch.clear_cublas_workspaces() looks that
function up at each call, so every trainer offload still empties torch's cache but leaves the workspaces
whoever holds them. Nothing else changes.
"""
from __future__ import annotations

import json
import os
import re
import sys
import traceback


def emit(**fields) -> None:
    print("PROBE " + json.dumps(fields, default=str), flush=True)


def workspace_bytes() -> int:
    """torch's cuBLAS workspace size (CublasHandlePool.cpp: CUBLAS_WORKSPACE_CONFIG, else 32 MiB on
    sm90/sm100/sm120, 8 MiB + 128 KiB on older GPUs)."""
    import torch

    conf = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":([0-9]+):([0-9]+)", conf)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    major = torch.cuda.get_device_capability()[0]
    return 4096 * 8 * 1024 if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


def allocator_blocks():
    """(workspace-sized active blocks, addresses of every active block) of torch's allocator now."""
    import torch

    want = workspace_bytes()
    sized, active = [], set()
    for seg in torch.cuda.memory_snapshot():
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            active.add(int(b["address"]))
            if int(b.get("requested_size", b.get("size", 0))) == want:
                sized.append({"address": int(b["address"]), "stream": int(seg.get("stream", 0) or 0),
                              "pool": list(seg.get("segment_pool_id", (0, 0))),
                              "segment_bytes": int(seg.get("total_size", 0))})
    return sized, active


def keep_cublas(argv: list) -> None:
    import runpy

    import torch

    torch._C._cuda_clearCublasWorkspaces = lambda: None
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    mode = sys.argv[1]
    if mode == "keep-cublas":
        keep_cublas(sys.argv[2:])
        return 0
    shape = sys.argv[2] if len(sys.argv) > 2 else "qwen2-1.5b"
    if mode not in ("release", "empty_cache"):
        raise SystemExit(f"mode must be release, empty_cache or keep-cublas, got {mode!r}")
    import torch

    torch.cuda.set_device(0)
    import vllm

    from colomem import _C
    from colomem.engines.vllm import VLLMConfig, VLLMRollout
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir

    emit(stage="start", mode=mode, shape=shape, torch=torch.__version__, vllm=vllm.__version__,
         device=torch.cuda.get_device_name(0), workspace_bytes=workspace_bytes(),
         vllm_cache_root=os.environ.get("VLLM_CACHE_ROOT"))
    model = model_dir(shape, make_task("successor").alphabet, log=lambda *_: None)
    r = VLLMRollout(str(model), config=VLLMConfig(
        engine_in_process=True, external_launcher=True, sync_transport="direct", enforce_eager=False,
        gpu_memory_utilization=0.3, max_model_len=512, device=0, generate_timeout_s=120.0))
    prompts = [[3 + (7 * i + j) % 11 for j in range(4)] for i in range(32)]

    def generate(seed: int) -> list:
        outs = r.generate(prompts, n=8, max_new_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        torch.cuda.synchronize()
        return [c.token_ids for group in outs for c in group]

    try:
        first = generate(0)
        before, _ = allocator_blocks()
        emit(stage="generated", completions=len(first), workspaces=before)
        if mode == "release":
            from colomem.engines.deepspeed.state import release_cached_memory

            release_cached_memory()
        else:
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        _, active = allocator_blocks()
        after = [dict(w, still_allocated=w["address"] in active, mapped=bool(_C.pointer_is_mapped(w["address"])))
                 for w in before]
        emit(stage="released", mode=mode, workspaces=after)
        second = generate(1)
        emit(stage="generated_again", completions=len(second))
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends without vLLM's teardown
        emit(stage="failed", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-3000:])
        os._exit(3)      # a CUDA fault leaves the context unusable: vLLM's shutdown could hang on it
    r.close()
    emit(stage="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
