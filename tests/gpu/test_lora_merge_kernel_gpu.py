"""The core's one-rounding LoRA merge on a GPU (colomem._C.lora_merge through
colomem.engines.lora_merge_kernel): the GPU's result is the host reference's bit for bit, for Qwen2-7B-sized
layers, bf16 and fp32 factors, transposed factors, in place and into a new tensor, a row count past one
launch's grid; the merge in place allocates nothing; a host tensor's address is refused before a kernel runs.

Run: python -m pytest -m gpu tests/gpu/test_lora_merge_kernel_gpu.py
"""
import types

import pytest
import torch

from colomem import _C
from colomem.engines.lora_merge_kernel import kernel_merge
from colomem.errors import InvalidArgumentError

pytestmark = [pytest.mark.gpu]


def _layer(fan_in_fan_out=False):
    return types.SimpleNamespace(fan_in_fan_out=fan_in_fan_out)


def _factors(m, n, r, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(m, n, generator=g) * 0.02).to(torch.bfloat16)
    A = (torch.randn(r, n, generator=g) * n ** -0.5).to(dtype)
    B = (torch.randn(m, r, generator=g) * 0.05).to(dtype)
    return w, A, B


@pytest.mark.parametrize("m,n,r,dtype,fan", [
    (512, 3584, 16, torch.bfloat16, False),          # k_proj's shape, r 16
    (3584, 1000, 16, torch.float32, False),          # fp32 factors (peft's, on a bf16 base)
    (777, 1031, 7, torch.bfloat16, True),            # ragged edges, odd r, fan_in_fan_out
    (100, 2100, 70, torch.bfloat16, False),          # a rank past two of the kernel's tiles of ranks
    (3584, 18944, 16, torch.bfloat16, False),        # down_proj's shape
    (1_100_000, 3, 2, torch.bfloat16, False),        # more row blocks (16 rows each) than one launch's grid.y
], ids=["k_proj", "fp32-factors", "ragged-transposed", "ranks-past-a-tile", "down_proj", "tall"])
def test_the_gpu_gives_the_host_references_bits(m, n, r, dtype, fan):
    w, A, B = _factors(m, n, r, dtype)
    if fan:
        w = w.T.contiguous()
    want = kernel_merge(_layer(fan), w, A, B, 2.0, in_place=False)       # the host reference
    wg, Ag, Bg = w.cuda(), A.cuda(), B.cuda()
    got = kernel_merge(_layer(fan), wg, Ag, Bg, 2.0, in_place=False)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    before = torch.cuda.memory_allocated()
    same = kernel_merge(_layer(fan), wg, Ag, Bg, 2.0, in_place=True)
    torch.cuda.synchronize()
    assert same.data_ptr() == wg.data_ptr() and torch.cuda.memory_allocated() == before
    assert torch.equal(wg.cpu(), want)


def test_a_host_address_is_refused_before_any_kernel_runs():
    w, A, B = _factors(8, 16, 2)
    wg, Ag, Bg = w.cuda(), A.cuda(), B.cuda()
    with pytest.raises(InvalidArgumentError, match="not CUDA memory"):
        _C.lora_merge(w.data_ptr(), 16, 1, Bg.data_ptr(), 2, 1, Ag.data_ptr(), 16, 1, wg.data_ptr(), 16, 1,
                      8, 16, 2, 2.0, device=torch.cuda.current_device())
    torch.cuda.synchronize()                                   # the context is still usable
    assert torch.equal(wg.cpu(), w)
