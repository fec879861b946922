"""Tensor plumbing between torch and the pointer-level core (the core never sees a tensor)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Optional

import torch

from colomem import _C
from colomem.units import parse_bytes

CUDA_STREAM_LEGACY = 0x1  # cudaStreamLegacy
_engines: dict[int, "_C.CopyEngine"] = {}
_engines_lock = threading.Lock()


def chunk_bytes_default() -> int:
    return parse_bytes(os.environ.get("COLOMEM_CHUNK_BYTES", "64MiB"))


def small_copy_bytes_default() -> int:
    return parse_bytes(os.environ.get("COLOMEM_SMALL_COPY_BYTES", "1MiB"))


_EXPANDABLE_ON = "expandable_segments:True"


def _allocator_settings() -> str:
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    seen = get() if get is not None else ""
    return ",".join([seen or "", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                     os.environ.get("PYTORCH_ALLOC_CONF", "")])


def _set_allocator_settings(conf: str) -> None:
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if put is not None:
        put(conf)
    else:
        torch.cuda.memory._set_allocator_settings(conf)


def process_expandable() -> bool:
    """Whether the process's CUDA memory comes from torch's expandable segments (its environment or a
    switch at run time)."""
    return _EXPANDABLE_ON in _allocator_settings()


@contextlib.contextmanager
def expandable_segments(device: Optional[torch.device]) -> Iterator[None]:
    """CUDA memory allocated inside comes from torch's expandable segments (physical chunks mapped into one
    reserved range), then the process's setting is back. Such memory goes back to the driver (an unmap)
    without waiting for copies running on other streams, where a cudaMalloc'd segment's cudaFree waits for
    them, and copies into it right after a release run at the link's rate (benchmarks/diag_release.py,
    diag_reload.py). Nothing changes where the process already uses expandable segments, on the host, or
    where the allocator refuses the setting."""
    if device is None or device.type != "cuda" or process_expandable():
        yield
        return
    try:
        _set_allocator_settings(_EXPANDABLE_ON)
    except RuntimeError:  # an allocator backend without expandable segments (cudaMallocAsync)
        yield
        return
    try:
        yield
    finally:
        _set_allocator_settings("expandable_segments:False")


def use_expandable_segments() -> bool:
    """The process's CUDA memory allocated from now on comes from torch's expandable segments (what
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True gives a process from its start, without changing the
    environment its child processes inherit). False where it already did or the allocator refuses it."""
    if process_expandable():
        return False
    try:
        _set_allocator_settings(_EXPANDABLE_ON)
    except RuntimeError:  # an allocator backend without expandable segments (cudaMallocAsync)
        return False
    return True


def swap_expandable_default() -> bool:
    """SwapSet(expandable=None): the re-growth in expandable segments, on unless COLOMEM_SWAP_EXPANDABLE=0
    turns it off for every set of the process (a trainer's too) without a code change."""
    v = os.environ.get("COLOMEM_SWAP_EXPANDABLE", "1").strip().lower()
    if v not in ("0", "1", "true", "false", ""):
        raise _C.InvalidArgumentError(f"COLOMEM_SWAP_EXPANDABLE must be 1 or 0, got {v!r}")
    return v not in ("0", "false")


# CUDA graphs captured in this process (an in-process vLLM engine's) keep the address of the cuBLAS workspace of
# the stream they were captured on and write into it at every replay. torch's clearCublasWorkspaces frees every
# workspace to the caching allocator, which may hand the memory out again or give it back to the driver: the
# next replay then corrupts memory or faults. An owner of such graphs holds the workspaces while it lives.
_workspace_holders: set[int] = set()
_workspace_lock = threading.Lock()


def hold_cublas_workspaces(owner: object) -> None:
    """From now on clear_cublas_workspaces leaves torch's cuBLAS workspaces in place, until `owner` lets go."""
    with _workspace_lock:
        _workspace_holders.add(id(owner))


def let_go_cublas_workspaces(owner: object) -> None:
    with _workspace_lock:
        _workspace_holders.discard(id(owner))


def clear_cublas_workspaces() -> bool:
    """Frees torch's cuBLAS workspaces (one per handle and stream, 32 MiB each on Hopper, out of any Python
    object's reach; the next matmul makes them again) unless CUDA graphs of this process may still replay
    over them (hold_cublas_workspaces). Returns whether they were freed."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    with _workspace_lock:
        if clear is None or _workspace_holders:
            return False
        clear()
    return True


def release_cached(device: torch.device) -> None:
    """The caching allocator's unused memory back to the driver (a CUDA device only)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_index(device: torch.device) -> int:
    """-1 for the host backend, else the CUDA device index (current device when unspecified)."""
    if device.type == "cpu":
        return -1
    if device.type != "cuda":
        raise ValueError(f"unsupported device {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def engine_for(device: torch.device) -> "_C.CopyEngine":
    """One copy engine (two streams) per device per process, shared by every set."""
    idx = device_index(device)
    with _engines_lock:
        eng = _engines.get(idx)
        if eng is None:
            eng = _C.CopyEngine(idx, chunk_bytes_default(), small_copy_bytes_default())
            _engines[idx] = eng
        return eng


def stream_handle(device: torch.device, stream: Optional[torch.cuda.Stream] = None) -> int:
    """The integer handle of `stream` (default: the current stream of `device`); 0 for the host."""
    if device.type != "cuda":
        return 0
    s = stream if stream is not None else torch.cuda.current_stream(device)
    # torch's default stream is the legacy default stream, handle 0; the core reads 0 as "no stream",
    # so it is passed as cudaStreamLegacy (0x1), which names the same stream.
    return int(s.cuda_stream) or CUDA_STREAM_LEGACY


def driver_memory(device: Optional[int]) -> Optional[tuple[int, int]]:
    """(free, total) bytes of CUDA device `device` as the driver reports them (cudaMemGetInfo: what every
    process on the GPU holds counts); None for no device (the CPU backend) or where CUDA is not available.
    The runner's timeline, the vLLM wake check and mem_get_info below all read it here."""
    if device is None or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def mem_get_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes as the driver sees them; (0, 0) on the host."""
    if device.type != "cuda":
        return (0, 0)
    return driver_memory(device_index(device)) or (0, 0)


def read_back_words(t: torch.Tensor, timeout_s: float = 60.0) -> torch.Tensor:
    """A CPU copy of a small int64/float64 tensor: on CUDA stored into pinned memory by a kernel in the current
    stream's order, then waited for (bounded). A copy back through torch (.cpu(), .item()) runs on a copy
    engine, where it waits behind a long copy this process has in flight in that direction, such as the
    optimizer state copying out behind the weight sync."""
    if t.device.type != "cuda":
        return t.detach().clone()
    if t.element_size() != 8:
        raise ValueError(f"read_back_words needs 8-byte elements, got {t.dtype}")
    src = t.detach().contiguous()
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    if src.numel():
        stream = torch.cuda.current_stream(src.device)
        _C.store_words(src.data_ptr(), src.numel(), host.data_ptr(), stream.cuda_stream, device_index(src.device))
        done = torch.cuda.Event()
        done.record(stream)
        from colomem.bridge.buffers import wait_event

        wait_event(done, timeout_s, "a small result read back from the GPU")
    return host


class _CudaArray:
    """Exposes raw device memory through __cuda_array_interface__ so torch can view it without a copy."""

    def __init__(self, address: int, shape: tuple, typestr: str, owner=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False),
                                         "version": 3, "strides": None, "stream": None}
        self._owner = owner  # keeps the mapping alive as long as a view exists


def device_bytes(address: int, nbytes: int, device: torch.device, owner=None) -> torch.Tensor:
    """A uint8 CUDA tensor viewing `nbytes` at `address` on `device` (no copy, not resizable)."""
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(address, (nbytes,), "|u1", owner), device=device)


def ranges_tensor(ops) -> torch.Tensor:
    """(n, 3) int64 CPU tensor of (dst, src, nbytes) triples, the argument of copy_ranges."""
    t = torch.tensor(ops, dtype=torch.int64) if not isinstance(ops, torch.Tensor) else ops
    return t.reshape(-1, 3).contiguous()


def copy_ranges(ops: torch.Tensor, device: torch.device, dst_base: int = 0, src_base: int = 0) -> None:
    """Runs the raw copies of `ops` (see ranges_tensor; each dst/src plus its base) on the current stream of
    `device` with one call into the core (batched on CUDA), or with memcpy for CPU memory. The copies may
    run concurrently: no destination may overlap another range."""
    if ops.dtype != torch.int64 or ops.device.type != "cpu" or ops.dim() != 2 or ops.shape[1] != 3 \
            or not ops.is_contiguous():
        raise ValueError("copy_ranges needs a contiguous (n, 3) int64 CPU tensor of (dst, src, nbytes)")
    if ops.shape[0]:
        _C.copy_ranges(ops.data_ptr(), ops.shape[0], dst_base, src_base, stream_handle(device),
                       device_index(device))
