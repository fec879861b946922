"""colomem.engines.lora.fused_merge: on the CPU one adapter whose factors have the weight's dtype is merged in
one GEMM (addmm: the product summed in fp32, added to the weight, rounded once), in place or into a new tensor;
other dtypes, and weights on a GPU (whose bf16 GEMM rounds the product first), are left to the fp32 path;
cuBLAS's reduced-precision shortcuts are off while it runs and the process's flags come back after."""
import types

import pytest
import torch

from colomem.engines.lora import exact_matmul, fused_merge, merge_adapters


def _factors(out=48, n_in=40, r=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g).to(dtype)
    A = (torch.randn(r, n_in, generator=g) * 0.1).to(dtype)
    B = (torch.randn(out, r, generator=g) * 0.1).to(dtype)
    return w, A, B


def _reference(w, A, B, s):
    """The sum in fp32 rounded once: what every merge path must give (within the order of the fp32 sums)."""
    return (w.float() + s * (B.float() @ A.float())).to(w.dtype)


def _layer(fan_in_fan_out=False):
    return types.SimpleNamespace(fan_in_fan_out=fan_in_fan_out, scaling={"default": 2.0})


def _within_one_ulp(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(got.dtype).eps
    assert torch.all((got.float() - want.float()).abs() <= eps * want.float().abs() + 1e-30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_writes_the_weights_own_storage_and_equals_the_new_tensor_bit_for_bit(dtype):
    w, A, B = _factors(dtype=dtype)
    new = fused_merge(_layer(), w, A, B, 2.0, in_place=False)
    assert new is not None and new.data_ptr() != w.data_ptr()
    base = w.clone()
    ptr = w.data_ptr()
    out = fused_merge(_layer(), w, A, B, 2.0, in_place=True)
    assert out is w and w.data_ptr() == ptr          # no copy: the weight itself holds the merge
    assert torch.equal(w, new)
    _within_one_ulp(w, _reference(base, A, B, 2.0))
    assert not torch.equal(w, base)


def test_a_transposed_layer_adds_the_transposed_product():
    w, A, B = _factors(out=48, n_in=40)
    wt = w.T.contiguous()                              # fan_in_fan_out: the weight is stored (in, out)
    got = fused_merge(_layer(fan_in_fan_out=True), wt, A, B, 2.0, in_place=False)
    want = fused_merge(_layer(), w, A, B, 2.0, in_place=False)
    assert got.shape == (40, 48)
    assert torch.equal(got, want.T)


def test_factors_of_another_dtype_are_left_to_the_fp32_path_and_nothing_is_written():
    w, A, B = _factors()
    before = w.clone()
    assert fused_merge(_layer(), w, A.float(), B.float(), 2.0, in_place=True) is None
    assert torch.equal(w, before)
    # merge_adapters then sums in an fp32 copy: the same value as the reference, the weight untouched
    got = merge_adapters(_layer(), w, [(A.float(), B.float())], ["default"])
    assert torch.equal(w, before)
    _within_one_ulp(got, _reference(w, A, B, 2.0))


def test_merge_adapters_with_one_adapter_of_the_weights_dtype_is_the_fused_merge():
    w, A, B = _factors()
    got = merge_adapters(_layer(), w, [(A, B)], ["default"])
    assert torch.equal(got, fused_merge(_layer(), w, A, B, 2.0, in_place=False))
    assert got.data_ptr() != w.data_ptr()


def test_the_reduced_precision_flags_are_off_inside_and_come_back_after_even_on_an_error():
    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    try:
        m.allow_tf32 = m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = True
        with pytest.raises(RuntimeError, match="inside"):
            with exact_matmul():
                assert not (m.allow_tf32 or m.allow_bf16_reduced_precision_reduction
                            or m.allow_fp16_reduced_precision_reduction)
                raise RuntimeError("inside")
        assert m.allow_tf32 and m.allow_bf16_reduced_precision_reduction and m.allow_fp16_reduced_precision_reduction
    finally:
        m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


def test_a_nested_exact_matmul_leaves_the_flags_off_until_the_outer_one_ends():
    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    try:
        m.allow_tf32 = m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = True
        with exact_matmul():
            with exact_matmul():
                assert not m.allow_tf32
            assert not (m.allow_tf32 or m.allow_bf16_reduced_precision_reduction)   # the inner one set nothing back
        assert m.allow_tf32 and m.allow_bf16_reduced_precision_reduction and m.allow_fp16_reduced_precision_reduction
        with exact_matmul():                     # and an error inside an inner one still ends the outer one right
            with pytest.raises(RuntimeError):
                with exact_matmul():
                    raise RuntimeError("inside")
            assert not m.allow_tf32
        assert m.allow_tf32
    finally:
        m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


def test_a_weight_neither_on_the_cpu_nor_on_a_cuda_gpu_is_left_to_the_fp32_path():
    """Off the CPU the merge is the core's kernel (cuBLAS's bf16 GEMM rounds the product before adding the
    weight: two roundings), which runs on CUDA GPUs only: a weight elsewhere takes the fp32 path, fused_merge
    declines it and writes nothing."""
    from colomem.engines.lora_merge_kernel import kernel_merge

    w, A, B = (t.to("meta") for t in _factors())
    assert fused_merge(_layer(), w, A, B, 2.0, in_place=True) is None
    assert fused_merge(_layer(), w, A, B, 2.0, in_place=False) is None
    assert kernel_merge(_layer(), w, A, B, 2.0, in_place=True) is None     # also once the kernel is on


def test_the_fp32_path_computes_its_product_without_tf32_even_where_the_job_turned_it_on(monkeypatch):
    """A job may turn TF32 on for its training: the merge's fp32 product still runs without it (on a GPU
    TF32 rounds the factors to 10 bits), and the job's setting comes back after."""
    import colomem.engines.lora as lora

    m = torch.backends.cuda.matmul
    seen = []
    real = lora.adapter_delta
    monkeypatch.setattr(lora, "adapter_delta", lambda *a: seen.append(m.allow_tf32) or real(*a))
    saved = m.allow_tf32
    try:
        m.allow_tf32 = True
        w, A, B = _factors(dtype=torch.float32)
        merge_adapters(_layer(), w.to(torch.bfloat16), [(A, B)], ["default"])    # fp32 factors: the fp32 path
        assert seen == [False] and m.allow_tf32
    finally:
        m.allow_tf32 = saved
