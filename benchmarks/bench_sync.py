#!/usr/bin/env python3
"""Trainer -> vLLM weight sync on one GPU: colomem's bridge against vLLM's own ways, and sleep/wake modes.

  python benchmarks/bench_sync.py --out OUT/sync [--sizes 1.5b,7b] [--reps 10] [--buckets 512MiB,1GiB]

For Qwen2-1.5B- and Qwen2-7B-shaped bf16 models (config only; vLLM loads load_format="dummy" weights), the
"trainer" holds random weights on the same GPU and sends them to vLLM with:
  bridge      colomem WeightBridge -> the listener thread in vLLM's worker (sync_transport="listener", the
              default): no RPC per sync, buckets announced and ACKed over the bridge socket, recorded
              load_weights copies replayed (load_plan); the best bucket size once more with fast_load=False
              (load_weights every sync), for what the replay is worth
  direct      vLLM's engine inside this process (sync_transport="direct"), a second engine started last
  torch_ipc   per-tensor CUDA IPC: torch's reduce_tensor in the trainer, rebuild_cuda_tensor in the worker,
              one collective_rpc carrying every handle (vLLM's non-packed IPC weight transfer, the fast case)
  reload      vLLM's collective_rpc("reload_weights") from a safetensors directory written once (page cache warm)
and times vLLM's sleep(level=1)/wake_up against the colomem pool backup (weights copied into a pinned pool,
vLLM sleeps at level 2) and against level 2 + a full bridge sync. Every method is checked first (checksums of
the trainer's tensors against vLLM's parameters), then timed: median of --reps after --warmup, GB/s of
payload bytes, and the ratio to a device-to-device copy measured in the same run.

The sections themselves (what each sends and how it is checked) are in sync_methods.py; this file runs them
per size, each size in a process of its own, and writes and prints the report.

The baselines need two RPCs the product's worker does not have (colomem_ping, colomem_apply_torch_ipc): vLLM
runs the benchmark's worker extension (sync_worker.BenchWorkerExtension), with this folder put on PYTHONPATH
for vLLM's processes. Each size runs in its own process with one engine. Writes <out>/bench_sync.json (top
level: sync_7b_ms_median, sync_7b_baseline_ms = the fastest baseline, ...) and <out>/sync_<size>.json, and
prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from sync_methods import (BENCH_WORKER, GiB, T0, bench_bridge, bench_direct, bench_reload, bench_rpc,
                          bench_sleep_wake, bench_torch_ipc, d2d_ceiling, log, make_weights)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

if ROOT not in sys.path:
    sys.path.append(ROOT)   # a fallback: an installed colomem or PYTHONPATH's comes first

from colomem.grpo.tiny_model import SHAPES as MODEL_SHAPES  # noqa: E402

# Qwen2 configs (HF transformers names) of Qwen2-1.5B and Qwen2-7B: the one table's dimensions (through the
# runner's model specs), with the published configs' context length
SHAPES = {size: dict(MODEL_SHAPES[f"qwen2-{size}"], max_position_embeddings=32768, rms_norm_eps=1e-6,
                     use_sliding_window=False) for size in ("1.5b", "7b")}
KEY = {"1.5b": "1p5b", "7b": "7b"}
TARGET_7B_MS = 30.0
SIZE_TIMEOUT_S = {"1.5b": 140.0, "7b": 210.0}   # both sizes fit the 6-minute budget of one GPU run


def env_defaults():
    for k, v in {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                 "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}.items():
        os.environ.setdefault(k, v)
    # vLLM's worker imports the benchmark's extension by name, and the checkout's colomem before any other;
    # spawned processes read PYTHONPATH, this one (the in-process engine) sys.path.
    paths = [ROOT, HERE]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p and p not in paths])
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)


def run_size(size: str, a, path: str) -> dict:
    """Runs every section for one size; the results so far are on disk after each (a timeout keeps them)."""
    env_defaults()
    import torch
    import vllm
    from transformers import Qwen2Config

    from colomem.engines.vllm import VLLMRollout

    res = {"size": size, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "vllm": vllm.__version__, "errors": []}
    d = tempfile.mkdtemp(prefix=f"bench-sync-{size}-", dir=a.scratch)
    cfg = Qwen2Config(**SHAPES[size])
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(d)
    r = None

    def save():
        res["wall_s"] = round(time.perf_counter() - T0, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    try:
        res["d2d"] = d2d_ceiling(2 * GiB, 5)
        d2d = res["d2d"]["gbps"]
        log(f"{size}: d2d copy {d2d} GB/s")
        items = make_weights(cfg)
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        res.update(params=sum(t.numel() for _, t in items), nbytes=nbytes, tensors=len(items))
        t = time.perf_counter()
        r = VLLMRollout(d, gpu_memory_utilization=a.gpu_util, max_model_len=1024, max_num_seqs=8, seed=0,
                        enforce_eager=True, bucket_bytes=a.buckets.split(",")[0].partition("x")[0],
                        worker_extension=BENCH_WORKER,
                        llm_kwargs=dict(load_format="dummy", skip_tokenizer_init=True))
        res["engine_start_s"] = round(time.perf_counter() - t, 1)
        log(f"{size}: engine up in {res['engine_start_s']} s; {nbytes / GiB:.2f} GiB of weights, {len(items)} tensors")
        sections = [("rpc", lambda: bench_rpc(r, res)),
                    ("bridge", lambda: bench_bridge(r, items, nbytes, a, d2d, res)),
                    ("torch_ipc", lambda: bench_torch_ipc(r, items, nbytes, a, d2d, res)),
                    ("sleep_wake", lambda: bench_sleep_wake(r, items, nbytes, a, res)),
                    ("reload", lambda: bench_reload(r, items, nbytes, d, a, d2d, res))]
        for name, fn in sections:
            if name in a.skip.split(","):
                continue
            try:
                fn()
                save()
            except Exception as exc:  # noqa: BLE001  (record, go on with the other sections)
                res["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
                if r.phase != "awake":
                    try:
                        r.wake()
                    except Exception:  # noqa: BLE001
                        pass
        if "direct" not in a.skip.split(","):
            r.close()          # its GPU memory goes back before the in-process engine starts
            r = None
            try:
                bench_direct(d, items, nbytes, a, d2d, res)
            except Exception as exc:  # noqa: BLE001
                res["errors"].append(f"direct: {type(exc).__name__}: {exc}")
                traceback.print_exc()
            save()
    except Exception as exc:  # noqa: BLE001
        res["errors"].append(f"setup: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        if r is not None:
            r.close()
        shutil.rmtree(d, ignore_errors=True)
    save()
    return res


# ------------------------------------------------------------------------------------------------ report
def headline(sizes: dict) -> dict:
    top: dict = {}
    for size, r in sizes.items():
        k = KEY[size]
        best = r.get("bridge_best")
        if best:
            top[f"sync_{k}_ms_median"] = best["ms_median"]
            top[f"sync_{k}_gbps"] = best["gbps"]
            top[f"sync_{k}_ratio_to_d2d"] = best["ratio_to_d2d"]
            top[f"sync_{k}_bucket"] = best["bucket"]
            top[f"sync_{k}_transport"] = "listener"
        if "direct_in_process" in r:  # another deployment (vLLM inside the trainer's process): beside, not instead
            top[f"sync_{k}_direct_in_process_ms"] = r["direct_in_process"]["ms_median"]
        if "rpc_roundtrip_ms" in r:
            top[f"rpc_roundtrip_{k}_ms"] = r["rpc_roundtrip_ms"]["ms_median"]
        old = r.get("bridge_load_weights")
        if old:
            top[f"sync_{k}_load_weights_ms"] = old["ms_median"]
        base = {n: r[n]["ms_median"] for n in ("torch_ipc", "reload") if "ms_median" in r.get(n, {})}
        if base:
            name = min(base, key=base.get)
            top[f"sync_{k}_baseline_ms"] = base[name]
            top[f"sync_{k}_baseline"] = name
        sw = r.get("sleep_wake", {})
        for mode, x in sw.items():
            top[f"sleep_wake_{k}_{mode}_cycle_ms"] = x["cycle_ms_median"]
        if "vllm_level1" in sw and "colomem_pool" in sw:
            top[f"sleep_wake_{k}_pool_faster_than_level1"] = \
                sw["colomem_pool"]["cycle_ms_median"] < sw["vllm_level1"]["cycle_ms_median"]
    if "sync_7b_ms_median" in top:
        top["sync_7b_target_ms"] = TARGET_7B_MS
        top["sync_7b_meets_target"] = top["sync_7b_ms_median"] <= TARGET_7B_MS
    return top


def table(sizes: dict) -> str:
    lines = [f"{'size':5} {'sync method':34} {'ms median':>10} {'GB/s':>8} {'x d2d':>6}"]

    def row(size: str, label: str, x: dict) -> None:
        lines.append(f"{size:5} {label:34} {x['ms_median']:10.2f} {x['gbps']:8.1f} {x['ratio_to_d2d']:6.3f}")

    for size, r in sizes.items():
        d2d = r.get("d2d", {})
        for b, x in r.get("bridge", {}).items():
            row(size, f"colomem bridge, {b} buckets", x)
        for key, label in (("direct_in_process", "direct, vLLM in this process"),
                           ("bridge_load_weights", "bridge {bucket}, load_weights each sync"),
                           ("torch_ipc", "torch per-tensor CUDA IPC"),
                           ("reload", "vLLM reload_weights (safetensors)")):
            x = r.get(key) or {}
            if "ms_median" in x:
                row(size, label.format(bucket=x.get("bucket", "")), x)
        if d2d:
            one_copy_ms = d2d["ms_median"] * r.get("nbytes", 0) / d2d["nbytes"]   # the model's bytes, copied once
            lines.append(f"{size:5} {'d2d copy (ceiling, one copy)':34} {one_copy_ms:10.2f} {d2d['gbps']:8.1f} "
                         f"{1.0:6.3f}")
    lines.append("")
    lines.append(f"{'size':5} {'sleep/wake mode':26} {'sleep ms':>9} {'wake W ms':>10} {'sync ms':>8} {'wake KV':>8} "
                 f"{'cycle ms':>9} {'first cycle':>12}")
    for size, r in sizes.items():
        for n, x in r.get("sleep_wake", {}).items():
            lines.append(f"{size:5} {n:26} {x['sleep_ms_median']:9.1f} {x['wake_weights_ms_median']:10.1f} "
                         f"{x.get('sync_ms_median', 0.0):8.1f} {x['wake_kv_ms_median']:8.1f} "
                         f"{x['cycle_ms_median']:9.1f} {x['first']['cycle']:12.1f}")
    for size, r in sizes.items():
        for e in r.get("errors", []):
            lines.append(f"ERROR {size}: {e}")
    return "\n".join(lines)


def run_child(cmd: list, timeout: float):
    """Runs one size in its own process group; on timeout the group (vLLM's engine included) is killed."""
    import signal

    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"timeout after {timeout:.0f} s: killing process group {proc.pid}")
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        return "timeout"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for bench_sync.json, sync_<size>.json")
    p.add_argument("--sizes", default="1.5b,7b")
    p.add_argument("--buckets", default="256MiB,512MiB,1GiB", help="bridge bucket sizes to time (comma-separated; '2GiBx1': one buffer, no double buffering)")
    p.add_argument("--reps", type=int, default=10, help="timed bridge syncs per bucket size")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--slow-reps", type=int, default=5, help="timed torch IPC syncs")
    p.add_argument("--reload-reps", type=int, default=2, help="timed reload_weights from disk")
    p.add_argument("--sw-reps", type=int, default=3, help="timed sleep/wake cycles per mode (after a first one)")
    p.add_argument("--gpu-util", type=float, default=0.3, help="vLLM gpu_memory_utilization")
    p.add_argument("--no-ablation", dest="ablation", action="store_false",
                   help="skip timing the best bucket size with load_weights every sync (fast_load=False)")
    p.add_argument("--skip", default="", help="sections to skip: rpc,bridge,torch_ipc,sleep_wake,reload,direct "
                                              "(the last starts a second engine, inside this process)")
    p.add_argument("--scratch", default=None, help="where the safetensors baseline is written (default: $TMPDIR)")
    p.add_argument("--size-timeout", type=float, default=None,
                   help="seconds per size before its process group is killed (default 140 for 1.5b, 210 for 7b)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.child:
        run_size(a.child, a, os.path.join(a.out, f"sync_{KEY[a.child]}.json"))
        sys.stdout.flush()
        os._exit(0)  # skip the slow teardown of engine threads
    argv = list(sys.argv[1:] if argv is None else argv)
    sizes: dict = {}
    for size in a.sizes.split(","):
        if size not in SHAPES:
            raise SystemExit(f"unknown size {size!r}; choose from {sorted(SHAPES)}")
        path = os.path.join(a.out, f"sync_{KEY[size]}.json")
        if os.path.exists(path):
            os.remove(path)
        log(f"size {size}: starting its process")
        rc = run_child([sys.executable, os.path.abspath(__file__), *argv, "--child", size],
                       a.size_timeout or SIZE_TIMEOUT_S[size])
        sizes[size] = json.load(open(path)) if os.path.exists(path) else {"errors": []}
        if rc != 0:
            sizes[size].setdefault("errors", []).append(f"the {size} process ended with {rc}")
    out = {"command": "python benchmarks/bench_sync.py " + " ".join(argv), **headline(sizes), "sizes": sizes}
    with open(os.path.join(a.out, "bench_sync.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(table(sizes), flush=True)
    return 0 if not any(r.get("errors") for r in sizes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
