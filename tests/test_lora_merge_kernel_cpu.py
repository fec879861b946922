"""colomem._C.lora_merge on the host (the reference the GPU kernel must match bit for bit) and its torch
wrapper colomem.engines.lora_merge_kernel: out = bf16(w + s * B @ A) with one rounding, within half a bf16
step of the exact sum plus what an fp32 sum of r + 1 terms may stray; in place the same bits as into a new
tensor; transposed factors (fan_in_fan_out) read through strides; fp32 factors; bad arguments refused before
anything is written. The GPU's result against this one: tests/gpu/test_lora_merge_kernel_gpu.py."""
import types

import pytest
import torch

from colomem import _C
from colomem.engines.lora_merge_kernel import kernel_merge
from colomem.errors import InvalidArgumentError, NotAvailableError


def _layer(fan_in_fan_out=False):
    return types.SimpleNamespace(fan_in_fan_out=fan_in_fan_out)


def _factors(m=37, n=53, r=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(m, n, generator=g) * 0.02).to(torch.bfloat16)
    A = (torch.randn(r, n, generator=g) * n ** -0.5).to(dtype)
    B = (torch.randn(m, r, generator=g) * 0.05).to(dtype)
    return w, A, B


def _within_one_rounding(got, w, A, B, s):
    """|got - exact| <= half a bf16 step of the larger of the two, plus (r + 2) * 2^-24 of the terms' sum."""
    W, A64, B64 = w.double(), A.double(), B.double()
    exact = W + s * (B64 @ A64)
    order = (A.shape[0] + 2) * 2.0 ** -24 * (W.abs() + abs(s) * (B64.abs() @ A64.abs()))
    half_step = 2.0 ** -8 * (1 + 2.0 ** -7) * torch.maximum(got.double().abs(), exact.abs())
    assert torch.all((got.double() - exact).abs() <= half_step + order)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-factors", "fp32-factors"])
def test_the_merge_rounds_once_and_in_place_gives_the_same_bits(dtype):
    w, A, B = _factors(dtype=dtype)
    out = kernel_merge(_layer(), w, A, B, 2.0, in_place=False)
    assert out.dtype == torch.bfloat16 and out.data_ptr() != w.data_ptr()
    _within_one_rounding(out, w, A, B, 2.0)
    # where the exact sum is far from a rounding boundary, it is the exact sum rounded once
    exact = (w.double() + 2.0 * (B.double() @ A.double()))
    assert (out == exact.to(torch.bfloat16)).float().mean() > 0.99
    inplace = w.clone()
    assert kernel_merge(_layer(), inplace, A, B, 2.0, in_place=True).data_ptr() == inplace.data_ptr()
    assert torch.equal(inplace, out)


def test_transposed_factors_are_read_through_their_strides():
    """peft's fan_in_fan_out: the weight is stored n x m and the delta is (B @ A).T."""
    w, A, B = _factors()
    wt = w.T.contiguous()
    got = kernel_merge(_layer(fan_in_fan_out=True), wt, A, B, 2.0, in_place=False)
    want = kernel_merge(_layer(), w, A, B, 2.0, in_place=False)
    assert torch.equal(got, want.T)
    # a weight that is itself a strided view
    view = kernel_merge(_layer(), wt.T, A, B, 2.0, in_place=False)
    assert torch.equal(view, want)


def test_no_adapter_rows_gives_the_weight_back_and_a_nan_is_torchs_nan():
    w, A, B = _factors(r=0)
    assert torch.equal(kernel_merge(_layer(), w, A, B, 2.0, in_place=False), w)
    w, A, B = _factors()
    w[3, 4] = float("nan")
    out = kernel_merge(_layer(), w, A, B, 2.0, in_place=False)
    assert out[3, 4].view(torch.int16).item() == (w.float() + 0)[3, 4].to(torch.bfloat16).view(torch.int16).item()
    assert torch.isnan(out[3, 4]) and not torch.isnan(out[3, 5])


def test_what_it_does_not_take_is_left_to_the_caller():
    w, A, B = _factors()
    assert kernel_merge(_layer(), w.float(), A, B, 2.0, in_place=False) is None          # an fp32 weight
    assert kernel_merge(_layer(), w, A.float(), B, 2.0, in_place=False) is None          # mixed factors
    assert kernel_merge(_layer(), w, A.half(), B.half(), 2.0, in_place=False) is None    # fp16 factors
    with pytest.raises(ValueError, match="product"):
        kernel_merge(_layer(), w[:, :10], A, B, 2.0, in_place=False)


def test_bad_arguments_are_refused_before_anything_is_written():
    w, A, B = _factors(m=4, n=6, r=2)
    out = torch.zeros_like(w)
    args = dict(w=w.data_ptr(), ws0=6, ws1=1, p=B.data_ptr(), ps0=2, ps1=1, q=A.data_ptr(), qs0=6, qs1=1,
                out=out.data_ptr(), os0=6, os1=1, m=4, n=6, r=2, scale=2.0)
    for bad, match in [({"m": -1}, "sizes"), ({"factors": 2}, "factors"), ({"os0": 0}, "strides"),
                       ({"out": 0}, "aligned"), ({"w": w.data_ptr() + 1}, "aligned"), ({"q": 0}, "factors need"),
                       ({"factors": 1, "p": B.data_ptr() + 2}, "4-byte")]:
        with pytest.raises(InvalidArgumentError, match=match):
            _C.lora_merge(**{**args, **bad})
        assert not out.any()
    _C.lora_merge(**args)
    assert out.any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: tests/gpu covers the device path")
def test_a_gpu_merge_without_a_gpu_says_so():
    w, A, B = _factors(m=4, n=6, r=2)
    with pytest.raises(NotAvailableError):
        _C.lora_merge(w.data_ptr(), 6, 1, B.data_ptr(), 2, 1, A.data_ptr(), 6, 1, w.data_ptr(), 6, 1, 4, 6, 2, 2.0,
                      device=0)
