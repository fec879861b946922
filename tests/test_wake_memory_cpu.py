"""The wake's memory check (colomem/engines/vllm/wake_memory.py) against vLLM's allocations by tag: what the
planner asks (need) is exactly what the wake refuses under, a tag of 0 bytes included."""
from types import SimpleNamespace

import pytest

from colomem.engines.vllm import wake_memory
from colomem.engines.vllm.wake_memory import WAKE_MARGIN, TagWake
from colomem.errors import CudaOutOfMemoryError

GiB = 1 << 30


class Calls:
    """The two engine calls a TagWake makes, recorded."""

    def __init__(self, layout):
        self.layout, self.woken = layout, []

    def rpc(self, method, *args, timeout=None):
        assert method == "colomem_memory"
        return [{"cumem_bytes_by_tag": self.layout}]

    def call(self, fn, timeout, what):
        fn(SimpleNamespace(wake_up=lambda tags: self.woken.append(tuple(tags))))


def _wake(monkeypatch, free, layout=None):
    calls = Calls({"weights": 10 * GiB, "kv_cache": 0} if layout is None else layout)
    w = TagWake(calls, SimpleNamespace(device=0, wake_timeout_s=5.0))
    w.read_layout()
    monkeypatch.setattr(wake_memory, "free_bytes", lambda device: free)
    return w, calls


def test_a_tag_of_no_bytes_needs_nothing_and_wakes_with_nothing_free(monkeypatch):
    w, calls = _wake(monkeypatch, free=0)
    assert w.need(("kv_cache",)) == 0
    w.wake(("kv_cache",), (1, "vllm"))
    assert calls.woken == [("kv_cache",)]


@pytest.mark.parametrize("short", [1, 0])
def test_the_wake_refuses_exactly_below_what_need_says(monkeypatch, short):
    need = 10 * GiB + WAKE_MARGIN
    w, calls = _wake(monkeypatch, free=need - short)
    assert w.need(("weights",)) == need
    if short:
        with pytest.raises(CudaOutOfMemoryError, match="still asleep"):
            w.wake(("weights",), (1, "vllm"))
        assert calls.woken == []                       # refused before vLLM was asked
    else:
        w.wake(("weights",), (1, "vllm"))
        assert calls.woken == [("weights",)]


def test_an_unread_layout_gives_no_figure_and_does_not_block_the_wake(monkeypatch):
    w, calls = _wake(monkeypatch, free=0, layout={})
    assert w.need(("weights",)) is None
    w.wake(("weights",), (1, "vllm"))
    assert calls.woken == [("weights",)]
