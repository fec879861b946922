"""sleep(keep_weights=True) on real vLLM 0.24 (GPU host): only the KV cache goes back to the driver, the weights
stay mapped at their addresses with their bytes, and after wake_kv() greedy tokens equal those before the
sleep (the prefix cache was reset: the same prompts do not reuse blocks that hold undefined bytes now). Several
cycles in a row, vLLM's own sleep while the cache is released, and a plain sleep / wake afterwards.

The in-process engine (vLLM inside this process, as `--engine in-rank` runs it) and the cross-process one; one
at a time. The model is the tiny random Qwen2 of test_vllm_adapter.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from test_vllm_adapter import GPU_UTIL, build_tiny, greedy   # noqa: E402

from colomem.errors import PhaseOrderError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]
MiB = 1 << 20
CYCLES = 3


def driver_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def weights_layout(r):
    """vLLM's parameters' data_ptr, a checksum of every parameter, and its "weights" allocations (mapped?)."""
    ptrs = r.rpc("colomem_param_pointers")[0]
    sums = r.rpc("colomem_param_checksums", sorted(ptrs), 0)[0]["checksums"]
    return ptrs, sums, r.rpc("colomem_kv_state")[0]["weights"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen2-kv")
    cfg, ntok = build_tiny(d)
    rng = random.Random(2)
    prompts = [[rng.randrange(10, ntok) for _ in range(rng.randint(8, 40))] for _ in range(6)]
    return str(d), prompts


@pytest.fixture(scope="module", params=["in_process", "cross_process"])
def engine(request, tiny):
    from colomem.engines.vllm import VLLMRollout

    d, _ = tiny
    in_process = request.param == "in_process"
    kw = dict(engine_in_process=True, sync_transport="direct") if in_process else {}
    r = VLLMRollout(d, gpu_memory_utilization=GPU_UTIL, max_model_len=256, max_num_seqs=16, seed=0,
                    sleep_level=1, kv_tail=True, **kw)
    yield r
    r.close()


def test_kv_sleep_releases_only_the_cache_and_greedy_tokens_come_back(engine, tiny):
    r = engine
    _, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]        # also fills the prefix cache with these prompts
    kv_bytes = r.rpc("colomem_memory")[0]["cumem_bytes_by_tag"]["kv_cache"]
    assert kv_bytes > 1000 * MiB
    ptrs, sums, weights = weights_layout(r)
    assert weights and all(mapped for _, _, mapped in weights)
    for cycle in range(CYCLES):
        awake = driver_free()
        r.sleep(keep_weights=True)
        freed = driver_free() - awake
        assert r.phase == "weights"
        assert 0.95 * kv_bytes <= freed <= kv_bytes + 512 * MiB, (
            f"cycle {cycle}: the KV-only sleep freed {freed / MiB:.0f} MiB, the KV cache is {kv_bytes / MiB:.0f} MiB")
        assert r.timings["kv_released_bytes"] == kv_bytes and r.memory()["kv_released"]
        state = r.rpc("colomem_kv_state")[0]
        assert state["released"] and not any(mapped for _, _, mapped in state["kv_cache"])
        assert weights_layout(r) == (ptrs, sums, weights), "the weights moved or changed during a KV-only sleep"
        r.check()
        with pytest.raises(PhaseOrderError):
            r.wake_weights()                                   # the runner's window skips it
        asleep = driver_free()
        r.wake_kv()
        taken = asleep - driver_free()
        assert taken >= 0.95 * kv_bytes and r.timings["kv_mapped_bytes"] == kv_bytes
        assert all(mapped for _, _, mapped in r.rpc("colomem_kv_state")[0]["kv_cache"])
        assert [c.token_ids for c in greedy(r, prompts)] == before, f"cycle {cycle}: other tokens after the wake"
    assert weights_layout(r) == (ptrs, sums, weights)


def test_vllms_own_sleep_while_the_cache_is_released_then_a_plain_cycle(engine, tiny):
    r = engine
    _, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]
    awake = driver_free()
    r.sleep(keep_weights=True)
    r.sleep()                                                  # level 1: the weights to host memory too
    assert r.phase == "asleep" and not r.memory()["kv_released"]
    vllm_bytes = sum(r.rpc("colomem_memory")[0]["cumem_bytes_by_tag"].values())
    assert driver_free() - awake >= 0.9 * vllm_bytes
    r.wake_weights()
    r.check()
    r.wake_kv()                                                # vLLM's own wake of the cache
    assert [c.token_ids for c in greedy(r, prompts)] == before
    r.sleep()                                                  # and a plain cycle still works
    r.wake()
    r.check()
    assert [c.token_ids for c in greedy(r, prompts)] == before


def test_a_partial_release_frees_only_its_allocations_and_greedy_tokens_come_back(engine, tiny):
    """sleep(keep_weights=True, kv_bytes=N) with kv_tail off: the fewest KV allocations holding N bytes go
    back to the driver (vLLM has one a layer), the rest stays mapped, and the tokens after the wake are those
    before."""
    r = engine
    assert r.kv_tail, "built with kv_tail=True: vLLM runs colomem's scheduler"
    r.kv_tail = False
    _, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]
    state = r.rpc("colomem_kv_state")[0]
    sizes = sorted((n for _, n, _ in state["kv_cache"]), reverse=True)
    assert len(sizes) >= 2, f"vLLM allocated its KV cache in {len(sizes)} piece(s): nothing to release part of"
    ask = sizes[0] + 1                                         # more than the largest: two allocations go
    want = sizes[0] + sizes[1]
    for cycle in range(2):
        awake = driver_free()
        r.sleep(keep_weights=True, kv_bytes=ask)
        freed = driver_free() - awake
        assert r.timings["kv_released_bytes"] == want
        assert 0.95 * want <= freed <= want + 512 * MiB, (
            f"cycle {cycle}: freed {freed / MiB:.0f} MiB for a release of {want / MiB:.0f} MiB")
        mapped = [m for _, _, m in r.rpc("colomem_kv_state")[0]["kv_cache"]]
        assert mapped.count(False) == 2 and mapped.count(True) == len(sizes) - 2
        r.check()
        asleep = driver_free()
        r.wake_kv()
        assert asleep - driver_free() >= 0.95 * want and r.timings["kv_mapped_bytes"] == want
        assert [c.token_ids for c in greedy(r, prompts)] == before, f"cycle {cycle}: other tokens after the wake"
    r.kv_tail = True


def tail_state(r):
    return r.rpc("colomem_kv_tail_state")[0]


def test_a_lent_tail_frees_its_chunks_at_once_and_the_rollout_starts_on_the_head(engine, tiny):
    """kv_tail: sleep(keep_weights=True, kv_bytes=N) lends every layer's tail, at least N
    bytes, to the driver; wake_kv() maps nothing; greedy tokens equal those of the whole cache; the tail stays
    with the driver through the wakes and rollouts that follow (they never run short of the head's blocks)."""
    r = engine
    _, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]
    kv_bytes = r.rpc("colomem_memory")[0]["cumem_bytes_by_tag"]["kv_cache"]
    ask = kv_bytes // 2
    awake = driver_free()             # the whole cache mapped; from the first lend on, the tail stays out
    for cycle in range(CYCLES):       # (the rollout here never runs short of the head's blocks)
        r.sleep(keep_weights=True, kv_bytes=ask)
        freed = driver_free() - awake
        lent = r.timings["kv_released_bytes"]
        st = tail_state(r)
        assert st["held"] and st["held_blocks"] > 0 and r.kv_tail_lent
        assert ask <= lent <= ask + st["layers"] * st["chunk_bytes"]
        assert 0.95 * lent <= freed <= lent + 512 * MiB, (
            f"cycle {cycle}: the lent tail freed {freed / MiB:.0f} MiB, it is {lent / MiB:.0f} MiB")
        assert st["mapped_bytes"] + lent == st["layers"] * st["layer_bytes"] <= kv_bytes
        r.check()
        asleep = driver_free()
        r.wake_kv()
        assert r.timings["kv_mapped_bytes"] == 0 and asleep - driver_free() < 256 * MiB, "the wake mapped memory"
        assert [c.token_ids for c in greedy(r, prompts)] == before, f"cycle {cycle}: other tokens on the head"


def test_a_tail_of_nearly_everything_grows_back_as_the_scheduler_runs_short(engine, tiny):
    """Lending all but each layer's first chunk leaves the scheduler under its low-water mark: its first
    schedule() maps chunks back (their memory taken from the driver) and the tokens are those of the whole
    cache; the next lend frees what grew."""
    r = engine
    _, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]
    kv_bytes = r.rpc("colomem_memory")[0]["cumem_bytes_by_tag"]["kv_cache"]
    for cycle in range(2):
        r.sleep(keep_weights=True, kv_bytes=kv_bytes)
        st = tail_state(r)
        assert st["start"] == 1 and st["grown_chunks"] == 0
        r.check()
        r.wake_kv()
        asleep = driver_free()
        assert [c.token_ids for c in greedy(r, prompts)] == before, f"cycle {cycle}: other tokens after growing"
        st = tail_state(r)
        assert st["grown_chunks"] >= 1
        assert asleep - driver_free() >= 0.9 * st["grown_chunks"] * st["layers"] * st["chunk_bytes"]


def test_vllms_own_sleep_and_a_plain_cycle_after_a_lent_tail(engine, tiny):
    """vLLM's level-1 sleep while a tail is lent (and after one came back) frees all of vLLM's memory: the
    chunks go back to vLLM's table first, unmapped; its wake maps them whole; the tokens are unchanged."""
    r = engine
    _, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]
    for lent_now in (True, False):
        r.sleep(keep_weights=True, kv_bytes=1)
        if not lent_now:                          # the tail came back: the chunks are held, none lent
            r.check()
            r.wake_kv()
        held = tail_state(r)["mapped_bytes"] + sum(r.rpc("colomem_memory")[0]["cumem_bytes_by_tag"].values())
        free0 = driver_free()
        r.sleep()
        assert not tail_state(r)["held"] and r.phase == "asleep"
        assert driver_free() - free0 >= 0.9 * held, "vLLM's sleep left memory of the chunks mapped"
        r.wake_weights()
        r.check()
        r.wake_kv()
        assert all(m for _, _, m in r.rpc("colomem_kv_state")[0]["kv_cache"])
        assert [c.token_ids for c in greedy(r, prompts)] == before
