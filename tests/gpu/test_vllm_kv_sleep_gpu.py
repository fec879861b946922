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
                    sleep_level=1, **kw)
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
    """sleep(keep_weights=True, kv_bytes=N): the fewest KV allocations holding N bytes go back to the driver
    (vLLM has one a layer), the rest stays mapped, and the tokens after the wake are those before."""
    r = engine
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
