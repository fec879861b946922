"""colomem: share each GPU between a vLLM rollout engine and a DeepSpeed trainer.

Core pieces (see docs/design.md): PinnedPool (page-locked host memory, pinned once), SwapSet (GPU <-> pool
swaps that keep every tensor object), swap/offloaded (both directions at once; scoped offload), MappedSet and
MappedOptimizerState (tensors in memory colomem maps chunk by chunk, moved a chunk at a time), and the weight
bridge (colomem.bridge) that hands trainer weights to vLLM's worker process GPU to GPU.
"""

from colomem._version import __version__
from colomem import _C
from colomem.errors import *  # noqa: F401,F403
from colomem.pool import Block, PinnedPool, default_pool
from colomem.swap import PendingReloads, SwapHandle, SwapSet, SwapStats, offloaded, swap
from colomem.swap_mapped import MappedSet
from colomem.optim_mapped import MappedOptimizerState
from colomem.units import format_bytes, parse_bytes


def build_info() -> dict:
    """How colomem._C was built (CUDA or host-only, CUDA version, archs, sanitizers) and what it sees now."""
    return dict(_C.build_info())


__all__ = [
    "Block", "MappedOptimizerState", "MappedSet", "PendingReloads", "PinnedPool", "SwapHandle", "SwapSet",
    "SwapStats", "__version__", "build_info",
    "default_pool", "format_bytes", "offloaded", "parse_bytes", "swap",
]
