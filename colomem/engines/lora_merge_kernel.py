"""The core's one-rounding LoRA merge (colomem._C.lora_merge) for torch tensors.

weight + scaling * B @ A into a bf16 weight, the product summed in fp32 and the weight rounded once, reading
and writing the weight once: what the fp32 path gives (one rounding) at the memory traffic of one GEMM,
where cuBLAS's bf16 GEMM would round twice. On a GPU it is one launch on the current stream; on the host the
core's reference version runs (slow: for tests; the CPU's own addmm rounds once already).

The merge paths in colomem.engines.lora take it on a GPU while GPU_KERNEL is True (the fp32 path otherwise).
Its GPU test, tests/gpu/test_lora_merge_kernel_gpu.py, checks the GPU's result bit for bit against the host's;
GPU_KERNEL stays False until that test has run on the kernel as it is now.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from torch import Tensor

GPU_KERNEL = False        # the merge paths use the kernel on a GPU (see the module's docstring)


@functools.cache
def _core_has_cuda() -> bool:
    """Whether the core was built with CUDA (asked once: the merge calls this for every layer)."""
    from colomem import _C

    return bool(_C.build_info().get("cuda"))


def kernel_merge(layer: Any, weight: "Tensor", A: "Tensor", B: "Tensor", scaling: float,
                 in_place: bool) -> Optional["Tensor"]:
    """weight + scaling * B @ A by the core's kernel, into `weight` (in_place) or a new tensor; oriented as
    the layer's base weight (peft's fan_in_fan_out: the transposed product, read through strides, no copy).
    None, nothing written, where it does not apply: a weight that is not a 2-D bf16 tensor, factors neither
    both bf16 nor both fp32, tensors on different devices or on a device that is neither the CPU nor a CUDA
    GPU, or a GPU where the core was built without CUDA."""
    import torch

    from colomem import _C

    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or A.dtype != B.dtype \
            or A.dtype not in (torch.bfloat16, torch.float32) or not (weight.device == A.device == B.device) \
            or weight.device.type not in ("cpu", "cuda"):
        return None
    if weight.is_cuda and not _core_has_cuda():
        return None
    P, Q = (A.T, B.T) if getattr(layer, "fan_in_fan_out", False) else (B, A)     # P: m x r, Q: r x n
    m, n = weight.shape
    r = P.shape[1]
    if P.shape != (m, r) or Q.shape != (r, n):
        raise ValueError(f"the adapter's product is {P.shape[0]} x {Q.shape[1]}, the weight {m} x {n}")
    out = weight if in_place else torch.empty_like(weight)
    device = weight.device.index if weight.is_cuda else -1
    stream = torch.cuda.current_stream(weight.device).cuda_stream if weight.is_cuda else 0
    (ws0, ws1), (ps0, ps1), (qs0, qs1), (os0, os1) = weight.stride(), P.stride(), Q.stride(), out.stride()
    with torch.no_grad():
        _C.lora_merge(weight.data_ptr(), ws0, ws1, P.data_ptr(), ps0, ps1, Q.data_ptr(), qs0, qs1, out.data_ptr(),
                      os0, os1, m, n, r, float(scaling), factors=1 if A.dtype == torch.float32 else 0,
                      stream=stream, device=device)
    return out


__all__ = ["GPU_KERNEL", "kernel_merge"]
