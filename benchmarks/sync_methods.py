"""The sync methods and sleep/wake modes bench_sync.py times, each against one running vLLM engine.

Every section checks first (the trainer's tensors against vLLM's parameters by checksum), then times: the
median of the reps after a warm-up, GB/s of payload bytes and the ratio to a device-to-device copy of the same
run (d2d_ceiling). Each writes its figures into the size's result dict `res`:
  bench_rpc         one collective_rpc that does nothing (the floor under every sync through vLLM)
  bench_bridge      colomem's WeightBridge per bucket size, and the best once more with load_weights each sync
  bench_direct      vLLM's engine inside this process, sync_transport="direct"
  bench_torch_ipc   per-tensor CUDA IPC (torch's reduce_tensor / rebuild_cuda_tensor in the worker)
  bench_reload      vLLM's reload_weights from a safetensors folder
  bench_sleep_wake  sleep / wake cycles: vLLM's level 1, the colomem pool backup, level 2 + a bridge sync
torch, transformers and colomem are imported inside the functions: bench_sync.py sets the environment first.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

GiB = 1 << 30
T0 = time.perf_counter()
BENCH_WORKER = "sync_worker.BenchWorkerExtension"   # benchmarks/sync_worker.py


def log(*a):
    print(f"[bench_sync {time.perf_counter() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


def summary(seconds: list, nbytes: int, d2d_gbps: float) -> dict:
    ms = [s * 1e3 for s in seconds]
    med = statistics.median(ms)
    gbps = nbytes / (med / 1e3) / 1e9
    return {"ms_median": round(med, 3), "ms_min": round(min(ms), 3), "ms_max": round(max(ms), 3), "reps": len(ms),
            "gbps": round(gbps, 1), "ratio_to_d2d": round(gbps / d2d_gbps, 3) if d2d_gbps else None}


# ------------------------------------------------------------------------------------------ measurements
def d2d_ceiling(nbytes: int, reps: int) -> dict:
    """One device-to-device copy of nbytes: GB/s of bytes copied (read + write = twice that in traffic)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.fill_(7)
    times = []
    for i in range(reps + 1):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        if i:
            times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    med = statistics.median(times)
    return {"nbytes": nbytes, "ms_median": round(med * 1e3, 3), "gbps": round(nbytes / med / 1e9, 1)}


def make_weights(cfg, seed: int = 0):
    """The trainer's weights: HF names and shapes (meta-device model), random bf16 values on the GPU."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        meta = Qwen2ForCausalLM(cfg)
    spec = [(n, tuple(p.shape)) for n, p in meta.named_parameters()]
    del meta
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for n, shape in spec:
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.normal_(0.0, 0.02, generator=g)
        out.append((n, t))
    torch.cuda.synchronize()
    return out


def ipc_entries(items) -> list:
    """torch.multiprocessing's per-tensor CUDA IPC handles, as plain values collective_rpc can carry."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for name, t in items:
        _, a = reduce_tensor(t)
        (_, size, stride, offset, _, dtype, _, handle, sbytes, soff, rg, rch, rco, eh, esr) = a
        out.append({"name": name, "args": [list(size), list(stride), int(offset), str(dtype).split(".")[-1],
                                           handle, int(sbytes), int(soff), bool(rg), rch, int(rco), eh,
                                           bool(esr)]})
    return out


def write_safetensors(items, d: str, shard_bytes: int = 4 * GiB) -> dict:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    shards, cur, size = [], [], 0
    for n, t in items:
        cur.append((n, t))
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = [], 0
    if cur:
        shards.append(cur)
    for i, shard in enumerate(shards):
        save_file({n: t.detach().cpu().contiguous() for n, t in shard},
                  os.path.join(d, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"))
    return {"files": len(shards), "write_s": round(time.perf_counter() - t0, 2)}


def timed_syncs(fn, warmup: int, reps: int) -> list:
    import torch

    out = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return out


def next_version_sync(r, items):
    """A callable that sends `items` to the rollout as the next weight version each time."""
    def sync():
        r.load_weights(items, version=r.weight_version + 1)
    return sync


def check_new_bytes_arrive(r, items, sync) -> None:
    """After the timed syncs (which sent the same bytes each time), flips every sign in the trainer's
    tensors (exact in any float format), syncs once more and checks vLLM holds the new bytes; flips back."""
    import torch

    with torch.no_grad():
        for _, t in items:
            t.neg_()
    try:
        sync()
        r.check(reference=items)
    finally:
        with torch.no_grad():
            for _, t in items:
                t.neg_()


def bench_rpc(r, res) -> None:
    """One collective_rpc round trip that does nothing: the floor under every sync through vLLM."""
    seconds = timed_syncs(lambda: r.rpc("colomem_ping"), 2, 10)
    res["rpc_roundtrip_ms"] = {"ms_median": round(statistics.median(seconds) * 1e3, 3),
                               "ms_min": round(min(seconds) * 1e3, 3), "reps": len(seconds)}
    log(f"rpc round trip: {res['rpc_roundtrip_ms']}")


def use_buckets(r, spec: str) -> None:
    """Re-creates the rollout's bridge for a bucket spec: "2GiB" (two buffers) or "2GiBx1"."""
    from colomem.units import parse_bytes

    size, _, nbuf = spec.partition("x")
    r.set_bucket_bytes(parse_bytes(size), int(nbuf) if nbuf else 2)


def bench_bridge(r, items, nbytes, a, d2d, res):
    out = res.setdefault("bridge", {})
    for b in a.buckets.split(","):
        use_buckets(r, b)
        sync = next_version_sync(r, items)
        sync()                                       # attach + first pass, then check before timing
        r.check(reference=items)
        r.check()
        seconds = timed_syncs(sync, a.warmup, a.reps)
        st, bs = r.last_sync, r._bridge.last_stats
        check_new_bytes_arrive(r, items, sync)
        out[b] = {**summary(seconds, nbytes, d2d), "buckets": st.nbuckets, "buffers": r.bucket_buffers,
                  "verified": True, "bridge_ms": round(st.bridge_seconds * 1e3, 2),
                  "worker_apply_ms": round(st.apply_seconds * 1e3, 2), "replayed_tensors": st.replayed_tensors,
                  "pack_wait_ms": round(bs.pack_wait_seconds * 1e3, 2) if bs else None}
        log(f"bridge {b}: {out[b]}")
    best = min(out, key=lambda k: out[k]["ms_median"])
    res["bridge_best"] = {"bucket": best, **out[best]}
    # What the replay of recorded copies is worth: the same bucket size with load_weights every sync
    if a.ablation:
        r.fast_load = False
        try:
            use_buckets(r, best)                     # the worker attaches again, without a load plan
            slow_sync = next_version_sync(r, items)
            slow_sync()
            r.check(reference=items)
            seconds = timed_syncs(slow_sync, 1, max(2, a.reps // 2))
            res["bridge_load_weights"] = {
                "bucket": best, **summary(seconds, nbytes, d2d), "buckets": r.last_sync.nbuckets,
                "worker_apply_ms": round(r.last_sync.apply_seconds * 1e3, 2), "verified": True}
            log(f"bridge {best}, load_weights every sync: {res['bridge_load_weights']}")
        finally:
            r.fast_load = True
            use_buckets(r, best)


def bench_direct(d, items, nbytes, a, d2d, res) -> None:
    """vLLM's engine in this process (engine_in_process=True) and sync_transport='direct': the worker's
    recorded copies read the trainer's tensors themselves, no bucket and no second process."""
    from colomem.engines.vllm import VLLMRollout

    t = time.perf_counter()
    r = VLLMRollout(d, gpu_memory_utilization=a.gpu_util, max_model_len=1024, max_num_seqs=8, seed=0,
                    enforce_eager=True, engine_in_process=True, sync_transport="direct",
                    worker_extension=BENCH_WORKER, llm_kwargs=dict(load_format="dummy", skip_tokenizer_init=True))
    try:
        start_s = round(time.perf_counter() - t, 1)
        sync = next_version_sync(r, items)
        sync()                                   # records load_weights
        r.check(reference=items)
        seconds = timed_syncs(sync, a.warmup, a.reps)
        st = r.last_sync
        check_new_bytes_arrive(r, items, sync)
        res["direct_in_process"] = {**summary(seconds, nbytes, d2d), "engine_start_s": start_s, "verified": True,
                                    "worker_apply_ms": round(st.apply_seconds * 1e3, 2),
                                    "replayed_tensors": st.replayed_tensors}
        log(f"direct, engine in process: {res['direct_in_process']}")
    finally:
        r.close()


def bench_torch_ipc(r, items, nbytes, a, d2d, res):
    import torch

    def sync():
        r.rpc("colomem_apply_torch_ipc", ipc_entries(items), timeout=600)
        torch.cuda.ipc_collect()

    sync()
    r.check(reference=items)
    res["torch_ipc"] = {**summary(timed_syncs(sync, max(0, a.warmup - 1), a.slow_reps), nbytes, d2d),
                        "tensors": len(items), "verified": True}
    log(f"torch_ipc: {res['torch_ipc']}")


def bench_reload(r, items, nbytes, d, a, d2d, res):
    res["reload"] = write_safetensors(items, d)
    r.rpc("update_config", {"load_config": {"load_format": "safetensors"}})

    def sync():
        r.rpc("reload_weights", timeout=600)

    sync()                                           # first read (page cache is warm from the write anyway)
    r.check(reference=items)
    res["reload"].update(summary(timed_syncs(sync, 0, a.reload_reps), nbytes, d2d), verified=True)
    log(f"reload: {res['reload']}")


def bench_sleep_wake(r, items, nbytes, a, res):
    """Per mode: a first cycle (pins host memory), then reps of sleep / wake weights / wake KV, timed apart."""
    out = res.setdefault("sleep_wake", {})
    modes = [("vllm_level1", dict(sleep_level=1, weights_backup="vllm"), False),
             ("colomem_pool", dict(sleep_level=1, weights_backup="pool"), False),
             ("level2_plus_bridge_sync", dict(sleep_level=2, weights_backup="vllm"), True)]
    for name, mode, sync in modes:
        r.sleep_level, r.weights_backup = mode["sleep_level"], mode["weights_backup"]
        rows = []
        for rep in range(a.sw_reps + 1):
            t = {}
            s = time.perf_counter()
            r.sleep()
            t["sleep"] = time.perf_counter() - s
            s = time.perf_counter()
            r.wake_weights()
            t["wake_weights"] = time.perf_counter() - s
            if sync:
                s = time.perf_counter()
                r.load_weights(items, version=r.weight_version + 1)
                t["sync"] = time.perf_counter() - s
            r.check()
            s = time.perf_counter()
            r.wake_kv()
            t["wake_kv"] = time.perf_counter() - s
            t["cycle"] = sum(t.values())
            rows.append(t)
        first, later = rows[0], rows[1:]
        out[name] = {"first": {k: round(v * 1e3, 1) for k, v in first.items()},
                     **{f"{k}_ms_median": round(statistics.median(x[k] for x in later) * 1e3, 1)
                        for k in later[0]}, "reps": len(later)}
        if name == "colomem_pool":
            out[name]["pool_save_ms"] = round(r.timings.get("pool_save_s", 0) * 1e3, 1)
            out[name]["pool_restore_ms"] = round(r.timings.get("pool_restore_s", 0) * 1e3, 1)
            moved = r.timings.get("pool_bytes", nbytes)   # every "weights" allocation, a bit more than params
            out[name]["pool_bytes"] = moved
            out[name]["save_gbps"] = round(moved / max(r.timings.get("pool_save_s", 1e-9), 1e-9) / 1e9, 1)
            out[name]["restore_gbps"] = round(moved / max(r.timings.get("pool_restore_s", 1e-9), 1e-9) / 1e9, 1)
        log(f"sleep/wake {name}: {out[name]}")
    r.sleep_level, r.weights_backup = 1, "vllm"

