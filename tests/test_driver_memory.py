"""The driver's free / total GPU memory is read in one place (colomem._torch.driver_memory): the runner's
timeline, the vLLM wake check and the swap sets report the same figures, and nothing without a GPU."""
import pytest
import torch

from colomem import _torch
from colomem.engines.vllm import wake_memory
from colomem.runner import timeline


def test_without_a_gpu_every_reader_reports_nothing():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible; this is the machine without one")
    assert _torch.driver_memory(None) is None and _torch.driver_memory(0) is None
    assert timeline.gpu_free(None) is None and timeline.gpu_total(None) is None   # the CPU backend
    assert timeline.gpu_free(0) is None and timeline.gpu_total(0) is None
    assert wake_memory.free_bytes(0) is None
    assert _torch.mem_get_info(torch.device("cpu")) == (0, 0)
    assert timeline.memory_snapshot(0)["driver_used"] is None


def test_every_reader_reports_the_drivers_figures(monkeypatch):
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return (3 << 30, 80 << 30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert _torch.driver_memory(1) == (3 << 30, 80 << 30)
    assert timeline.gpu_free(1) == wake_memory.free_bytes(1) == 3 << 30
    assert timeline.gpu_total(1) == 80 << 30
    assert _torch.mem_get_info(torch.device("cuda", 1)) == (3 << 30, 80 << 30)
    assert asked == [1] * 5
    assert timeline.gpu_free(None) is None          # the CPU backend of a run: no device, no driver call
    assert len(asked) == 5


def test_an_in_process_engines_pool_is_not_counted_as_the_trainers(monkeypatch):
    # the in-rank 1.5B job's first offload on an H100: torch's allocator reported 21.2 GiB reserved while the
    # driver had 2.26 GiB in use, since vLLM's sleeping weights and KV cache (20.42 GiB) are segments of a
    # private pool of the same allocator; the trainer's part is what is left
    GiB = 1 << 30
    engine = int(20.42 * GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(76.94 * GiB), int(79.2 * GiB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(21.2 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(20.9 * GiB))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: int(64.5 * GiB))
    snap = timeline.memory_snapshot(0, engine_reserved=engine)
    assert snap["reserved"] == int(21.2 * GiB) - engine and snap["allocated"] == int(20.9 * GiB) - engine
    assert snap["engine_reserved"] == engine and snap["driver_used"] == int(79.2 * GiB) - int(76.94 * GiB)
    assert timeline.peak_reserved(0, engine) == int(64.5 * GiB) - engine
    # an engine in a process of its own holds nothing of this allocator: the figures stay torch's
    alone = timeline.memory_snapshot(0)
    assert alone["reserved"] == int(21.2 * GiB) and "engine_reserved" not in alone
    assert timeline.peak_reserved(0) == int(64.5 * GiB)
    # never below zero (the pool's bookkeeping read at another moment than torch's)
    assert timeline.memory_snapshot(0, engine_reserved=100 * GiB)["reserved"] == 0
