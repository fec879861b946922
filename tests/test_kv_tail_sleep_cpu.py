"""KvSleep's side of a lent KV tail (colomem.engines.vllm.kv_sleep), with the engine's calls recorded: the lend
after pausing vLLM's scheduling, the prefix-cache reset started right after it and only collected at the wake,
no mapping at the wake, the chunks given back (unmapped, out of vLLM's table) around vLLM's own sleep and
(mapped whole) before the engine closes. The worker's side runs on vLLM itself only (tests/gpu/
test_vllm_kv_sleep_gpu.py)."""

from __future__ import annotations

import concurrent.futures
import types

import pytest

from colomem.engines.vllm.kv_sleep import KvSleep
from colomem.engines.vllm.prefix_cache import PrefixCache
from colomem.engines.vllm.tail_scheduler import QUALNAME
from colomem.errors import InvalidArgumentError, NotAvailableError, PhaseOrderError

GIB = 1 << 30


class Llm:
    def __init__(self, log):
        self.log = log

    def sleep(self, level):
        self.log.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.log.append(f"wake_up{tags}")

    def reset_prefix_cache(self):
        self.log.append("reset_prefix_cache")
        return True


class Calls:
    """EngineCalls as KvSleep and PrefixCache use it; the worker's replies canned per method."""

    def __init__(self, replies):
        self.log, self.replies, self.broken = [], replies, None
        self.llm = Llm(self.log)
        self.pending = []

    def rpc(self, method, *args, timeout=None):
        self.log.append(method)
        reply = self.replies[method]
        if isinstance(reply, Exception):
            raise reply
        return [reply(*args) if callable(reply) else reply]

    def start(self, fn, what):
        fut = concurrent.futures.Future()
        self.pending.append((fn, fut))     # runs when waited for: the reset is queued, not done, at the lend
        self.log.append(f"start {what}")
        return fut

    def wait(self, fut, timeout, what):
        for fn, f in list(self.pending):
            if f is fut:
                self.pending.remove((fn, f))
                f.set_result(fn(self.llm))
        return fut.result()

    def call(self, fn, timeout, what):
        return fn(self.llm)


def kv_sleep(replies, tail=True):
    calls = Calls(replies)
    opts = types.SimpleNamespace(device=-1, wake_timeout_s=5.0)
    kwargs = {"enable_sleep_mode": True, **({"scheduler_cls": QUALNAME} if tail else {})}
    return KvSleep(calls, kwargs, opts, 0, PrefixCache(calls)), calls


LENT = {"lent_bytes": 6 * GIB, "seconds": 0.01, "held_blocks": 4096, "first_block": 100, "chunks": 3,
        "fresh": True}


def test_a_lent_tail_maps_nothing_at_the_wake_and_its_reset_runs_behind_the_training():
    kv, calls = kv_sleep({"colomem_kv_tail_lend": LENT})
    out = kv.release(nbytes=5 * GIB)
    assert calls.log == ["sleep0", "colomem_kv_tail_lend", "start reset_prefix_cache()"]
    assert out["kv_released_bytes"] == 6 * GIB and out["kv_tail_held_blocks"] == 4096
    assert kv.released and kv.tail and kv.tail_held and kv.report()["kv_tail_lent"]
    calls.log.clear()
    out = kv.map_back()
    assert calls.log == ["reset_prefix_cache", "wake_up['scheduling']"]      # collected, then scheduling on
    assert out["kv_mapped_bytes"] == 0 and out["kv_tail_lent_bytes"] == 6 * GIB
    assert not kv.released and not kv.tail and kv.tail_held


def test_a_layout_that_cannot_lend_falls_back_to_whole_layers_and_is_not_asked_again():
    kv, calls = kv_sleep({"colomem_kv_tail_lend": NotAvailableError("a quantized cache"),
                          "colomem_kv_release": {"released_bytes": 8 * GIB, "freed_bytes": 8 * GIB,
                                                 "seconds": 0.1},
                          "colomem_kv_map": {"taken_bytes": 8 * GIB, "seconds": 0.1}})
    assert kv.release(nbytes=5 * GIB)["kv_released_bytes"] == 8 * GIB and not kv.tail and not kv.tail_possible
    assert calls.log == ["sleep0", "colomem_kv_tail_lend", "colomem_kv_release"]
    kv.map_back()
    calls.log.clear()
    kv.release(nbytes=5 * GIB)
    assert "colomem_kv_tail_lend" not in calls.log
    kv.release(already_out=True)


def test_vllms_own_sleep_gets_the_chunks_back_unmapped_and_lent_out_of_its_table():
    kv, calls = kv_sleep({"colomem_kv_tail_lend": LENT,
                          "colomem_kv_tail_restore": lambda mapped: {"restored": 28, "mapped": mapped,
                                                                     "released_bytes": 0 if mapped else 9 * GIB},
                          "colomem_kv_take_back": {"returned": 28, "released_bytes": 0}})
    kv.release(nbytes=GIB)
    calls.log.clear()
    with kv.lent_to_vllm_sleep():
        calls.llm.sleep(1)
    assert calls.log == ["reset_prefix_cache", "colomem_kv_tail_restore", "sleep1", "colomem_kv_take_back"]
    assert not kv.tail_held and not kv.released and kv.nbytes == 0


def test_an_engine_closing_gets_its_allocations_back_mapped_whole():
    kv, calls = kv_sleep({"colomem_kv_tail_lend": LENT,
                          "colomem_kv_tail_restore": lambda mapped: {"restored": 28, "mapped": mapped}})
    kv.release(nbytes=GIB)
    calls.log.clear()
    kv.map_before_close()
    assert calls.log == ["colomem_kv_tail_restore"] and not kv.tail_held and not kv.released


def test_the_tail_switch_refuses_an_engine_without_the_scheduler_and_a_held_cache():
    kv, _ = kv_sleep({}, tail=False)
    assert not kv.tail_possible
    with pytest.raises(InvalidArgumentError, match="without colomem's scheduler"):
        kv.set_tail(True)
    kv, _ = kv_sleep({"colomem_kv_tail_lend": LENT})
    kv.release(nbytes=GIB)
    with pytest.raises(PhaseOrderError, match="held as chunks"):
        kv.set_tail(False)
    assert kv.set_room(lambda: None, in_process=False) is False      # the engine's own process frees it
