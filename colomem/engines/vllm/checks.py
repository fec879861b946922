"""Weight checksums and parameter sampling, the same on both sides of the sync.

The trainer process (VLLMRollout) and vLLM's worker (ColomemWorkerExtension) must compute the same number
for the same bytes, so both import this module; it holds no RPC class and imports no vLLM.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Optional

import torch

from colomem.bridge.buckets import dtype_name

# Words (4 bytes) read per tensor by tensor_checksum: enough to catch garbage, cheap on a large model.
CHECKSUM_SAMPLE_WORDS = 1 << 16


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    try:
        return flat.view(torch.uint8)
    except RuntimeError:  # a view at an offset the dtype reinterpretation refuses: copy once
        return flat.clone().view(torch.uint8)


def checksum_parts(t: torch.Tensor, sample_words: int = CHECKSUM_SAMPLE_WORDS) -> tuple:
    """tensor_checksum without waiting for the device: (an int64 tensor [acc, tail] on t's device, byte
    count), queued on the current stream; finish_checksum turns it into the number. Many of them cost one
    device-to-host copy (finish_checksums) instead of a wait each."""
    b = _byte_view(t)
    n = b.numel()
    nw = n // 4
    zero = torch.zeros((), dtype=torch.int64, device=b.device)
    acc = zero
    if nw:
        w = b[: nw * 4]
        try:
            w = w.view(torch.int32)
        except RuntimeError:
            w = w.clone().view(torch.int32)
        step = max(1, -(-nw // max(1, sample_words)))
        s = w[::step].to(torch.int64)
        pos = torch.arange(1, s.numel() + 1, device=s.device, dtype=torch.int64)
        acc = (s * pos).sum()  # |s| < 2**31, pos <= 2**16 per default: no int64 overflow
    tail = b[nw * 4:].to(torch.int64).sum() if n % 4 else zero
    return torch.stack([acc, tail]), n


def finish_checksum(parts, n: int) -> int:
    acc, tail = (int(v) for v in parts)
    return (acc * 1_000_003 + tail * 31 + n) & ((1 << 63) - 1)


def finish_checksums(pending: dict) -> dict:
    """{name: checksum} from {name: checksum_parts(...)}, with one copy to the host."""
    if not pending:
        return {}
    from colomem._torch import read_back_words  # no copy engine: it may be busy with an offload

    values = read_back_words(torch.stack([p for p, _ in pending.values()])).tolist()
    return {name: finish_checksum(v, n) for (name, (_, n)), v in zip(pending.items(), values)}


def tensor_checksum(t: torch.Tensor, sample_words: int = CHECKSUM_SAMPLE_WORDS) -> int:
    """A position-weighted sum of up to `sample_words` evenly spaced 32-bit words of the tensor's bytes.

    Integer arithmetic only, so the trainer process and vLLM's worker get the same number for the same
    bytes whatever the reduction order. It samples: equal checksums do not prove equal tensors, but weights
    that were never restored, zeroed, or loaded into the wrong place differ.
    """
    parts, n = checksum_parts(t, sample_words)
    return finish_checksum(parts.tolist(), n)


def spread_sample(names: Iterable[str], k: int) -> list[str]:
    """A deterministic sample of about k names spread over the list (stable across processes)."""
    names = sorted(names)
    if k <= 0 or not names:
        return []
    if len(names) <= k:
        return names
    step = len(names) / k
    return [names[int(i * step)] for i in range(k)]


def hashed_pick(name: str, modulus: int = 4) -> bool:
    """True for about 1/modulus of names, the same ones in every process."""
    return zlib.crc32(name.encode()) % modulus == 0


def same_layout(t: torch.Tensor, info: Optional[list]) -> bool:
    """The trainer's tensor has the bytes layout of vLLM's parameter (same shape and dtype: unfused,
    unsharded); `info` is the parameter's [shape, dtype] from param_info."""
    return info is not None and list(t.shape) == list(info[0]) and dtype_name(t.dtype) == info[1]


def param_info(model: torch.nn.Module) -> dict:
    """{name: [shape, dtype]} of the model's parameters."""
    return {n: [list(p.shape), dtype_name(p.dtype)] for n, p in model.named_parameters()}


def coverage(param_names: set, loaded: set) -> dict:
    """Which parameters a version did not write ("complete": None when the loader said nothing)."""
    if not loaded:  # the model's load_weights returned nothing we can use: coverage unknown
        return {"complete": None, "nmissing": -1, "missing": []}
    missing = sorted(param_names - set(loaded))
    return {"complete": not missing, "nmissing": len(missing), "missing": missing[:16]}


__all__ = ["CHECKSUM_SAMPLE_WORDS", "checksum_parts", "coverage", "finish_checksum", "finish_checksums",
           "hashed_pick", "param_info", "same_layout", "spread_sample", "tensor_checksum"]
