"""The shared base's guard on a GPU (colomem.engines.base_guard.BaseChecksum): its windows go to the core's
batched checksum in one batch a call; the values are those of the same bytes on the host, and a byte written
anywhere is found by full() at once and by sampled() within `parts` calls.

Run: python -m pytest -m gpu tests/gpu/test_base_guard_gpu.py
"""
import pytest
import torch

from colomem.engines.base_guard import BaseChecksum
from colomem.errors import BaseWrittenError

pytestmark = [pytest.mark.gpu]


def _tensors(device):
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (256, 96), "b": (3, 5), "c": (1000,), "d": (64, 64, 3)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16).to(device) for n, s in shapes.items()}


def test_the_gpu_guard_agrees_with_the_host_and_finds_a_write_anywhere():
    gpu = _tensors("cuda")
    host = {n: t.cpu() for n, t in gpu.items()}
    g, h = BaseChecksum(gpu, parts=4, sample_words=8), BaseChecksum(host, parts=4, sample_words=8)
    assert g.digest() == h.digest()                        # every piece's value equals the host's
    for _ in range(5):
        g.sampled()
    assert g.full() == sum(t.numel() * t.element_size() for t in gpu.values())
    torch.cuda.synchronize()
    with torch.no_grad():
        gpu["a"][200, 77] += 1.0                           # queued on the current stream: the guard sees it
    with pytest.raises(BaseWrittenError, match="the shared base a changed"):
        g.full()
    caught = 0
    for _ in range(4):
        try:
            g.sampled()
        except BaseWrittenError:
            caught += 1
    assert caught >= 1
