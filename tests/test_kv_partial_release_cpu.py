"""sleep(keep_weights=True, kv_bytes=N) without vLLM: only the fewest KV-cache allocations that hold N bytes
are unmapped (the largest first), the rest of the cache and the weights stay mapped, the wake maps back only
those, vLLM's own sleep from that state unmaps nothing twice, and bad sizes are refused before vLLM is asked.

The real ColomemWorkerExtension and kv_release run against the stand-in for vLLM's cumem allocator of
test_vllm_kv_sleep_cpu.py (three KV allocations of 4096, 8192 and 2048 bytes)."""

from __future__ import annotations

import pytest

from colomem.engines.hf_rollout import HFRollout
from colomem.engines.vllm.worker.kv_release import chosen
from colomem.errors import InvalidArgumentError
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)
from fakes.vllm import trainer_weights
from test_vllm_kv_sleep_cpu import KV_SIZES, engine_steps, make_kv


def kv_by_size(c) -> dict:
    return {int(c.pointer_to_data[p].handle[1]): p for p in c.tagged("kv_cache")}


def test_the_fewest_allocations_that_hold_the_bytes_are_chosen_largest_first():
    sizes = [(0x30, 4), (0x10, 8), (0x20, 8), (0x40, 2)]
    assert chosen(sizes, 1) == [0x10]
    assert chosen(sizes, 8) == [0x10]
    assert chosen(sizes, 9) == [0x10, 0x20]                   # equal sizes: by address
    assert chosen(sizes, 17) == [0x10, 0x20, 0x30]
    assert chosen(sizes, 22) == [0x30, 0x10, 0x20, 0x40]      # all of it: every one, in table order
    assert chosen(sizes, None) == [p for p, _ in sizes]


@pytest.mark.parametrize("ask, released", [(5000, (8192,)), (9000, (8192, 4096)), (1, (8192,)),
                                           (10 ** 9, KV_SIZES)])
def test_a_partial_release_unmaps_only_what_it_needs_and_the_wake_maps_only_that(ask, released):
    r = make_kv()
    r.load_weights(trainer_weights(1).items(), version=1)
    c = r._worker.cumem
    by_size, weights = kv_by_size(c), c.tagged("weights")
    out = {by_size[n] for n in released}
    r.llm.calls.clear()

    r.sleep(keep_weights=True, kv_bytes=ask)
    assert r.phase == "weights" and weights <= c.mapped
    assert not out & c.mapped and (c.tagged("kv_cache") - out) <= c.mapped
    assert r.timings["kv_released_bytes"] == sum(released) == r.memory()["kv_released_bytes"]
    maps = c.maps

    r.load_weights(trainer_weights(2).items(), version=2)
    r.check()
    r.wake_kv()
    assert c.maps - maps == len(released)                     # only what went comes back
    assert c.tagged("kv_cache") <= c.mapped and r.timings["kv_mapped_bytes"] == sum(released)
    # the prefix cache drops: blocks of the layers mapped back hold undefined bytes now
    assert engine_steps(r) == ["pause", "colomem_kv_release", "colomem_kv_map", "reset_prefix_cache", "resume"]
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


def test_vllms_own_sleep_after_a_partial_release_unmaps_nothing_twice_and_wakes_whole():
    r = make_kv(sleep_level=1)
    r.load_weights(trainer_weights(3).items(), version=1)
    c = r._worker.cumem
    r.sleep(keep_weights=True, kv_bytes=100)
    r.sleep()                                # vLLM's sleep unmaps the rest; the released entry is lent out
    assert r.phase == "asleep" and not c.mapped
    r.wake()
    assert c.mapped == set(c.pointer_to_data)
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


@pytest.mark.parametrize("kw, match", [({"kv_bytes": 0}, "positive"), ({"kv_bytes": -4}, "positive"),
                                       ({"kv_bytes": 2.5}, "positive"), ({"kv_bytes": True}, "positive"),
                                       ({"kv_bytes": 4096, "keep_weights": False}, "keep_weights=True")])
def test_bad_sizes_are_refused_before_vllm_is_asked(kw, match):
    r = make_kv()
    calls = len(r.llm.calls)
    kw.setdefault("keep_weights", True)
    with pytest.raises(InvalidArgumentError, match=match):
        r.sleep(**kw)
    assert r.phase == "awake" and len(r.llm.calls) == calls
    r.close()


def test_the_stand_in_takes_the_same_arguments(tmp_path):
    from colomem.grpo.tasks import make_task
    from colomem.grpo.tiny_model import model_dir       # a model saved from a config, random weights

    tiny = model_dir("tiny", make_task("successor").alphabet, cache_dir=tmp_path / "models", log=lambda *_: None)
    r = HFRollout(tiny, eos_token_id=1, pad_token_id=0)
    r.sleep(keep_weights=True, kv_bytes=4096)
    assert r.phase == "weights" and r.timings["kv_release_asked_bytes"] == 4096
    r.wake_kv()
    with pytest.raises(InvalidArgumentError, match="keep_weights=True"):
        r.sleep(kv_bytes=4096)
    r.close()


def test_a_tail_that_cannot_be_lent_falls_back_to_whole_layers_once_and_says_why(caplog):
    """kv_tail on, but the engine's worker finds no layout to lend a tail of (here: the stand-in has no KV
    tensors and no scheduler at all): the first partial release logs why and releases whole layers; later
    ones do not ask again."""
    r = make_kv(kv_tail=True)
    assert r.kv_tail
    r.load_weights(trainer_weights(1).items(), version=1)
    c = r._worker.cumem
    by_size = kv_by_size(c)
    r.llm.calls.clear()
    with caplog.at_level("WARNING"):
        r.sleep(keep_weights=True, kv_bytes=5000)
    assert "cannot lend its tail" in caplog.text and "has no KV tensors" in caplog.text
    assert not r.kv_tail and not r.kv_tail_lent
    assert by_size[8192] not in c.mapped and r.timings["kv_released_bytes"] == 8192
    r.check()
    r.wake_kv()
    r.sleep(keep_weights=True, kv_bytes=5000)
    assert engine_steps(r).count("colomem_kv_tail_lend") == 1
    r.close()
