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
