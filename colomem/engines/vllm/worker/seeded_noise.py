"""One launch for the sampling noise of every seeded request of a decode step, inside vLLM's worker.

vLLM's sampler (vllm.v1.sample.ops.topk_topp_sampler.random_sample) draws the exponential noise of each
request that has a seed of its own with that request's torch.Generator: one kernel launch per request and
decode step, 256 launches a step for a rollout of 32 prompts x 8 completions. `install` puts in its place a
version that draws every seeded row of the step at once with colomem's counter-based generator
(csrc/core/seeded_noise.h), keyed by the request generator's seed and counted by its offset, so a request
still samples the same tokens whatever it is batched with, and a resumed run repeats them. Each draw moves
the generator's offset on by 4, as torch's draw of one row does, so vLLM's rewind of a partial prefill's draw
(offset - 4) repeats that draw too. The tokens differ from those of vLLM's own seeded draws (another
generator, the same distribution); rows without a seed keep vLLM's noise.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from colomem import _C
from colomem.errors import InvalidArgumentError

log = logging.getLogger(__name__)

ROW_OFFSET = 4        # how far torch's Philox offset moves for one row's exponential_() (vLLM rewinds by it)
MIN_SEEDED = 2        # fewer seeded rows than this: vLLM's own loop costs as little
SAMPLER_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
_INT64 = 1 << 63


def draws(generators: dict) -> torch.Tensor:
    """[3, n] int64 on the host: the rows of `generators` ({row: torch.Generator}), their seeds and the
    offsets to draw at; each generator's offset moves on by ROW_OFFSET."""
    rows, seeds, offsets = [], [], []
    for row, g in generators.items():
        seed = int(g.initial_seed())
        off = int(g.get_offset())
        g.set_offset(off + ROW_OFFSET)
        rows.append(int(row))
        seeds.append(seed - 2 * _INT64 if seed >= _INT64 else seed)   # the same 64 bits, as int64
        offsets.append(off)
    return torch.tensor([rows, seeds, offsets], dtype=torch.int64)


def exponential_rows(q: torch.Tensor, meta: torch.Tensor) -> None:
    """Writes the noise of meta's rows ([3, n]: rows, seeds, offsets) into the float32 matrix q, in place, on
    q's device (on the GPU: one launch on the current stream)."""
    if q.dtype != torch.float32 or q.dim() != 2 or q.stride(1) != 1:
        raise InvalidArgumentError(f"the noise goes into a float32 matrix with contiguous rows, got "
                                   f"{q.dtype} of shape {tuple(q.shape)} and strides {q.stride()}")
    if meta.dtype != torch.int64 or meta.dim() != 2 or meta.shape[0] != 3 or meta.device.type != "cpu":
        raise InvalidArgumentError(f"meta must be a [3, n] int64 host tensor, got {meta.dtype} "
                                   f"{tuple(meta.shape)} on {meta.device}")
    n = int(meta.shape[1])
    if n == 0:
        return
    rows = meta[0]
    if int(rows.min()) < 0 or int(rows.max()) >= q.shape[0]:
        raise InvalidArgumentError(f"noise rows {rows.tolist()} fall outside the matrix's {q.shape[0]} rows")
    meta = meta.contiguous()
    if q.device.type == "cuda":
        on_device = meta.to(q.device, non_blocking=True)     # stream-ordered before the kernel that reads it
        stream = torch.cuda.current_stream(q.device).cuda_stream
        _C.exponential_rows(q.data_ptr(), q.stride(0), q.shape[0], q.shape[1], on_device.data_ptr(), n,
                            stream, q.device.index)
    else:
        _C.exponential_rows(q.data_ptr(), q.stride(0), q.shape[0], q.shape[1], meta.data_ptr(), n, 0, -1)


def batched(original: Callable, sampler: ModuleType) -> Callable:
    """vLLM's random_sample(probs, generators, use_fp64_gumbel) with the seeded rows drawn in one launch."""

    @functools.wraps(original)
    def random_sample(probs: torch.Tensor, generators: dict, use_fp64_gumbel: bool = False,
                      *args: Any, **kwargs: Any) -> torch.Tensor:
        if (args or kwargs or use_fp64_gumbel or len(generators) < MIN_SEEDED or probs.dtype != torch.float32
                or probs.dim() != 2 or probs.stride(1) != 1):
            return original(probs, generators, use_fp64_gumbel, *args, **kwargs)
        q = torch.empty_like(probs)
        if len(generators) != probs.shape[0]:
            q.exponential_()                    # the unseeded rows: vLLM's noise, from the engine's generator
        exponential_rows(q, draws(generators))
        return sampler.sample_with_exponential_noise(probs, q)

    random_sample._colomem_original = original  # type: ignore[attr-defined]
    return random_sample


def _sampler(module: Optional[ModuleType]) -> Optional[ModuleType]:
    if module is not None:
        return module
    import importlib

    try:
        return importlib.import_module(SAMPLER_MODULE)
    except ImportError:
        return None


def install(module: Optional[ModuleType] = None) -> bool:
    """Puts the batched draw in place of vLLM's random_sample in this process. False (and vLLM's own kept)
    when this vLLM lacks the names it replaces or relies on."""
    sampler = _sampler(module)
    current = getattr(sampler, "random_sample", None)
    if sampler is None or current is None or not hasattr(sampler, "sample_with_exponential_noise"):
        log.warning("this vLLM's sampler has no random_sample / sample_with_exponential_noise: its own "
                    "per-request draws stay")
        return False
    if not hasattr(current, "_colomem_original"):
        setattr(sampler, "random_sample", batched(current, sampler))
    return True


def uninstall(module: Optional[ModuleType] = None) -> None:
    sampler = _sampler(module)
    original = getattr(getattr(sampler, "random_sample", None), "_colomem_original", None)
    if sampler is not None and original is not None:
        setattr(sampler, "random_sample", original)


def installed(module: Optional[ModuleType] = None) -> bool:
    return hasattr(getattr(_sampler(module), "random_sample", None), "_colomem_original")


__all__ = ["batched", "draws", "exponential_rows", "install", "installed", "uninstall"]
