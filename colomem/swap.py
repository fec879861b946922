"""SwapSet: move a group of tensors between GPU memory and the pinned pool, keeping every tensor object.

The unit of a swap is a storage. Offload copies each unique storage into a pool block (chunked, on the
engine's D2H stream, after the producer stream's work), then shrinks the storage to zero bytes, which hands
the memory back to the caching allocator (and to the driver with release=True). Reload re-grows the storage
and copies the bytes back. Parameters, views, optimizer references and DeepSpeed's flat buffers all keep
pointing at the same storage objects, so nothing outside has to be re-wired.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional, cast

import torch

from colomem import _torch, swap_coalesce, swap_pipeline, swap_slab, swap_sources
from colomem.errors import (
    CudaOutOfMemoryError,
    DeviceMismatchError,
    ForeignTensorError,
    InvalidArgumentError,
    PhaseOrderError,
    PoolClosedError,
)
from colomem.pool import Block, PinnedPool, default_pool
from colomem.swap_handles import DEFAULT_TIMEOUT_S, PendingReloads, SwapHandle, SwapStats, wait_seconds
from colomem.swap_pairs import offloaded, swap
from colomem.swap_sources import TensorSource
from colomem.units import format_bytes

__all__ = ["DEFAULT_TIMEOUT_S", "PendingReloads", "SwapHandle", "SwapSet", "SwapStats", "offloaded", "swap",
           "wait_seconds"]


RESIDENT, OFFLOADING, OFFLOADED, RELOADING = "resident", "offloading", "offloaded", "reloading"
DISCARDED = "discarded"  # offloaded, then its pool copy dropped on purpose: the tensors hold no bytes


@dataclass
class _Entry:
    name: str
    storage: torch.UntypedStorage
    nbytes: int
    block: Optional[Block] = None
    offset: int = 0  # where its bytes start in `block` (shared by the storages of one staging chunk)


class SwapSet:
    """A group of tensors offloaded and reloaded together (see the module docstring).

    source: tensors, (name, tensor) pairs, a dict, or a callable returning one of those; a callable is
        evaluated at each offload, so tensors that appear later (gradients, optimizer state) are included.
    pool: the PinnedPool that holds the bytes while offloaded (default: colomem.default_pool()).
    device: 'cuda', 'cuda:N' or 'cpu' (the host path: memcpy, for CPU-only runs and tests). Default: the
        device of the first tensor, which must then be CUDA.
    release: after offload, return freed memory to the driver (torch.cuda.empty_cache()).
    keep_blocks: keep the pool blocks across cycles, so the next offload allocates nothing.
    skip_other_devices: silently leave out tensors on other devices (e.g. Adam's CPU `step` scalars).
    coalesce_below: storages smaller than this many bytes move in staging chunks of up to `staging_bytes`,
        one copy per chunk (colomem/swap_coalesce.py; swap_coalesce.COALESCE_BELOW_ON = 1 MiB is the measured
        choice); 0 (the default for now) copies every storage on its own.
    pack_small: storages smaller than this many bytes are re-homed, once, onto shared slab storages, so each
        cycle resizes and copies a few slabs instead of every storage (colomem/swap_slab.py: which storages
        qualify, and what sharing a storage changes for callers); swap_slab.PACK_SMALL_ON = 1 MiB is the
        intended choice; 0 (the default for now) leaves every storage where it is. Independent of
        coalesce_below, which still applies to the storages that stay off the slabs.
    pipeline: a reload grows the storages piece by piece behind the copies of the pieces before, instead of
        all of them before the first copy, and an offload frees each piece's memory as its copy ends while
        later pieces copy (colomem/swap_pipeline.py); only for sets without staging chunks.
    expandable: a reload re-grows the storages in torch's expandable segments (the process's allocator
        setting is switched for the re-growth only): their release then does not wait for copies in flight,
        so an offload's pieces are freed behind the later pieces' copies, and copies into memory mapped
        back right after a release run at the link's rate (_torch.expandable_segments). On by default
        (COLOMEM_SWAP_EXPANDABLE=0 turns it off for every set made without expandable=); a process started
        with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True has the same effect for all of its memory.
    """

    def __init__(self, source: TensorSource, pool: Optional[PinnedPool] = None, *, name: str = "swapset",
                 device=None, release: bool = True, keep_blocks: bool = True, skip_other_devices: bool = False,
                 coalesce_below: Optional[int] = None,
                 staging_bytes: int = swap_coalesce.STAGING_BYTES_DEFAULT, pack_small: Optional[int] = None,
                 pipeline: bool = True, expandable: Optional[bool] = None):
        self.name = name
        self._source = source
        self._pool = pool if pool is not None else default_pool()
        self._device = torch.device(device) if device is not None else None
        if self._device is not None and self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.release = release
        self.pipeline = bool(pipeline)
        self.expandable = _torch.swap_expandable_default() if expandable is None else bool(expandable)
        self.keep_blocks = keep_blocks
        self.skip_other_devices = skip_other_devices
        if coalesce_below is None:          # read here, so the module's default can change under a test
            coalesce_below = swap_coalesce.COALESCE_BELOW_DEFAULT
        if not (isinstance(coalesce_below, int) and isinstance(staging_bytes, int) and coalesce_below >= 0
                and staging_bytes > 0):
            raise InvalidArgumentError(f"coalesce_below must be bytes >= 0 and staging_bytes bytes > 0, got "
                                       f"{coalesce_below!r} and {staging_bytes!r}")
        self.coalesce_below, self.staging_bytes = coalesce_below, staging_bytes
        if pack_small is None:
            pack_small = swap_slab.PACK_SMALL_DEFAULT
        if not (isinstance(pack_small, int) and pack_small >= 0):
            raise InvalidArgumentError(f"pack_small must be bytes >= 0, got {pack_small!r}")
        self._packer = swap_slab.Packer(pack_small) if pack_small else None
        self._layout: Optional[swap_coalesce.Layout] = None  # how the last offload grouped the storages
        self._memo = swap_sources.PlanMemo()                  # the last plan, while its storages stay
        self.state = RESIDENT
        self._entries: list[_Entry] = []
        self._kept: list[Block] = []
        self.last_stats: Optional[SwapStats] = None
        self._pending: Optional[SwapHandle] = None  # the offload or reload in flight, until it is finished
        # Serialises the state transitions (check, then submit with the GIL released) between threads; a
        # caller that finds the set mid-transition gets PhaseOrderError. Re-entrant: swap() holds it around
        # offload_async / reload_async.
        self._lock = threading.RLock()

    # -- constructors for what users hold -----------------------------------------------------------------
    @classmethod
    def from_module(cls, module: torch.nn.Module, pool: Optional[PinnedPool] = None, *, params: bool = True,
                    buffers: bool = True, grads: bool = False, **kw) -> "SwapSet":
        """A module's parameters and buffers (and their gradients with grads=True, found at each offload)."""
        kw.setdefault("name", type(module).__name__)
        return cls(swap_sources.module_tensors(module, params, buffers, grads), pool, **kw)

    @classmethod
    def from_grads(cls, module: torch.nn.Module, pool: Optional[PinnedPool] = None, **kw) -> "SwapSet":
        """Only the gradients of a module's parameters (those present at offload time)."""
        kw.setdefault("name", type(module).__name__ + ".grads")
        return cls.from_module(module, pool, params=False, buffers=False, grads=True, **kw)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, pool: Optional[PinnedPool] = None,
                       **kw) -> "SwapSet":
        """The tensors of an optimizer's state (exp_avg, exp_avg_sq, ...), found at each offload."""
        kw.setdefault("name", type(optimizer).__name__ + ".state")
        kw.setdefault("skip_other_devices", True)
        return cls(swap_sources.optimizer_tensors(optimizer), pool, **kw)

    @classmethod
    def from_tensors(cls, source: TensorSource, pool: Optional[PinnedPool] = None, **kw) -> "SwapSet":
        return cls(source, pool, **kw)

    # -- introspection ------------------------------------------------------------------------------------
    @property
    def device(self) -> Optional[torch.device]:
        return self._device

    @property
    def pool(self) -> PinnedPool:
        return self._pool

    @property
    def nbytes(self) -> int:
        """Bytes moved by the last (or current) offload."""
        return sum(e.nbytes for e in self._entries)

    @property
    def host_bytes(self) -> int:
        """Pool bytes this set holds now (kept blocks included)."""
        held = {b.block_id: b.nbytes for b in self._kept}
        held.update((e.block.block_id, e.block.nbytes) for e in self._entries if e.block is not None)
        return sum(held.values())

    def release_kept_blocks(self) -> int:
        """Gives back the pool blocks a resident set keeps for its next offload (keep_blocks); returns their
        bytes. For a caller that knows the next offload moves other tensors: the blocks would not be reused,
        and another set's offload may need the pool memory first. Nothing happens unless the set is resident."""
        with self._lock:
            if self.state != RESIDENT or not self._kept:
                return 0
            n = sum(b.nbytes for b in self._kept)
            self._drop_kept()
            return n

    def __repr__(self) -> str:
        return f"SwapSet({self.name!r}, {self.state}, {len(self._entries)} storages, {format_bytes(self.nbytes)})"

    # -- planning -----------------------------------------------------------------------------------------
    def _check_tensor(self, name: str, t) -> bool:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{self.name}: {name} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided or t.is_quantized or t.is_meta:
            raise InvalidArgumentError(f"{self.name}: {name} has layout {t.layout} on {t.device}; only dense "
                                       "strided tensors can be swapped")
        dev = t.device      # read once: each read builds a new torch.device (the plan's costliest check)
        if self._device is None:
            if dev.type != "cuda" and self.skip_other_devices:
                return False  # e.g. Adam's CPU `step` scalars ahead of the CUDA state
            if dev.type != "cuda":
                raise DeviceMismatchError(
                    f"{self.name}: {name} is on {dev}; offload moves CUDA tensors to host memory. For the "
                    "host path (CPU-only runs and tests) create the set with device='cpu'")
            self._device = dev
        if dev != self._device:
            if self.skip_other_devices:
                return False
            raise DeviceMismatchError(f"{self.name}: {name} is on {dev} but the set moves tensors of "
                                      f"{self._device}; make one set per device")
        return True

    def _plan(self, source=None, groups: Optional[dict] = None) -> list[_Entry]:
        """One entry per storage to move. source: the source already read (default: read it now); groups:
        filled with the set's tensors by storage data pointer (for swap_slab). A set read from its own source
        reuses its last plan while the tensors sit on the same storages (swap_sources.PlanMemo)."""
        items = list(swap_sources.iter_named(self._source if source is None else source))
        memo = self._memo if source is None and groups is None else None
        if memo is not None:
            same = memo.lookup(items)
            if same is not None:
                return [_Entry(e.name, e.storage, e.nbytes) for e in same]
        planned = self._plan_items(items, groups)
        if memo is not None:
            memo.remember(items, planned)
        return planned

    def _plan_items(self, items: list, groups: Optional[dict]) -> list[_Entry]:
        entries: dict[int, _Entry] = {}
        for name, t in items:
            if not self._check_tensor(name, t):
                continue
            st = t.untyped_storage()
            n = st.nbytes()
            if n == 0:
                continue  # nothing to move (e.g. ZeRO-3's released full params)
            ptr = st.data_ptr()
            if groups is not None:
                groups.setdefault(ptr, []).append(t)
            if ptr in entries:
                continue  # shared storage: moved once, every view follows
            if not st.resizable():
                raise ForeignTensorError(
                    f"{self.name}: {name} lives in memory colomem cannot free and re-grow (from_blob, DLPack, "
                    "vLLM's cumem pool or an IPC mapping); copy its bytes with colomem.copy_* instead")
            entries[ptr] = _Entry(name, st, n)
        if not entries and self._device is None:
            self._device = torch.device("cpu")  # empty set: nothing to move anywhere
        return list(entries.values())

    def _take_blocks(self, entries: list) -> None:
        """Gives each entry (a storage, or a chunk of them) a pool block, reusing kept ones when the layout is
        unchanged."""
        if self._kept and len(self._kept) == len(entries) \
                and all(b.nbytes >= e.nbytes for b, e in zip(self._kept, entries)):
            for e, b in zip(entries, self._kept):
                e.block = b
            return
        self._drop_kept()
        taken: list[Block] = []
        try:
            for e in entries:
                e.block = self._pool.alloc(e.nbytes)
                taken.append(e.block)
        except BaseException:
            for b in taken:
                b.release()
            for e in entries:
                e.block = None
            raise
        if self.keep_blocks:
            self._kept = taken

    def _drop_kept(self) -> None:
        if self._kept and not self._pool.closed:
            for b in self._kept:
                b.release()
        self._kept = []

    def _give_back_blocks(self) -> None:
        if not self.keep_blocks and not self._pool.closed:
            for b in {e.block.block_id: e.block for e in self._entries if e.block is not None}.values():
                b.release()  # once each: the storages of a chunk share one
        for e in self._entries:
            e.block = None

    # -- offload ------------------------------------------------------------------------------------------
    def _busy_hint(self) -> str:
        if self.state in (OFFLOADING, RELOADING):
            return (f"; its {self.state[:-3]} is still in flight (a wait timed out or was not made yet): "
                    "call wait_pending() first")
        return ""

    def _check_offloadable(self) -> None:
        if self.state not in (RESIDENT, DISCARDED):
            raise PhaseOrderError(f"{self.name}: offload while {self.state}; reload it (or wait) first"
                                  f"{self._busy_hint()}")

    def offload_async(self, *, timing: bool = False) -> SwapHandle:
        """Starts copying the set to the pool. GPU memory is freed when the handle's wait() returns."""
        with self._lock:  # the state check, the plan and the submission as one step for other threads
            self._check_offloadable()
            self._pool.check_open()
            entries = self._plan() if self._packer is None else self._packer.plan(self)
            layout = swap_coalesce.layout_for(self._layout, entries, self.coalesce_below, self.staging_bytes)
            self._take_blocks(layout.units())
            self._entries, self._layout = entries, layout
            device = cast(torch.device, self._device)       # _plan() found the set's device
            t0 = time.perf_counter()

            def undo() -> None:  # a failed offload returns its blocks, kept ones included (keep_blocks=True)
                self._give_back_blocks()
                self._drop_kept()
                self._entries, self._layout = [], None

            release: Optional[swap_pipeline.Release] = None
            if self.pipeline and swap_pipeline.offload_applies(self, layout):
                # each piece's memory is freed as its copy ends, while later pieces copy (swap_pipeline.py)
                transfer, token, cut = swap_pipeline.submit_offload(self, layout, undo, timing=timing)
                release = swap_pipeline.Release(self, transfer, cut)
            else:
                transfer, token = swap_coalesce.submit(self, "d2h", layout, undo, timing=timing)
            self.state = OFFLOADING
            free_before = _torch.mem_get_info(device)[0]

            def finish() -> SwapStats:  # called once, under the set's lock, after the copies completed
                self._pool._copies.end(token)
                self._pending = None
                if self._pool.closed and release is not None and release.freed:
                    # closed while this offload was being waited on, after pieces were freed: those pieces'
                    # only copy went with the pool
                    for e in self._entries:
                        e.storage.resize_(0)
                    self._entries, self._kept, self._layout = [], [], None
                    self.state = DISCARDED
                    raise PoolClosedError(f"{self.name}: the pool was closed while this offload was being "
                                          "waited on; the set's bytes went with it (the set is discarded). "
                                          "Close a pool only once no set waits on it")
                if self._pool.closed:
                    # closed after the copy finished (close() waits for copies in flight): the pool copy is
                    # gone but the storages were never shrunk, so the set is simply still resident
                    self._entries, self._kept, self._layout = [], [], None
                    self.state = RESIDENT
                    raise PoolClosedError(f"{self.name}: the pool was closed before this offload was waited on; "
                                          "the tensors are still resident with their bytes. Offload again into "
                                          "an open pool")
                for e in self._entries:
                    e.storage.resize_(0)  # the D2H of this storage completed: its memory can go
                if self.release and device.type == "cuda":
                    torch.cuda.empty_cache()
                self.state = OFFLOADED
                stats = SwapStats("d2h", transfer.nbytes, len(entries), time.perf_counter() - t0,
                                  transfer.elapsed_ms() if timing else 0.0,
                                  max(0, _torch.mem_get_info(device)[0] - free_before))
                self.last_stats = stats
                return stats

            handle = SwapHandle(self, transfer, finish, t0, advance=None if release is None else release.advance)
            self._pending = handle
            return handle

    def offload(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S, *, timing: bool = False) -> SwapStats:
        """Copies the set to the pool and frees its GPU memory; the tensors stay valid objects. On
        TransferTimeoutError the copy keeps running: wait_pending() (or the error's .handle.wait()) ends it."""
        wait_seconds(timeout)  # a bad timeout is refused before anything starts
        return self.offload_async(timing=timing).wait(timeout)

    def wait_pending(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> Optional[SwapStats]:
        """Waits for the offload or reload still in flight (one whose wait timed out, or an async one) and
        finishes it; None when nothing is in flight. TransferTimeoutError again if it is still not done."""
        handle = self._pending
        return None if handle is None else handle.wait(timeout)

    # -- reload -------------------------------------------------------------------------------------------
    def _regrow(self) -> None:
        grown = []
        try:
            with _torch.expandable_segments(self._device if self.expandable else None):
                for e in self._entries:
                    e.storage.resize_(e.nbytes)
                    grown.append(e)
        except torch.OutOfMemoryError as exc:
            for e in grown:
                e.storage.resize_(0)  # roll back: the set stays fully offloaded, bytes safe in the pool
            raise self._reload_oom(exc) from exc

    def _reload_oom(self, exc: BaseException) -> CudaOutOfMemoryError:
        need = sum(e.nbytes for e in self._entries)
        free, total = _torch.mem_get_info(cast(torch.device, self._device))
        return CudaOutOfMemoryError(
            f"{self.name}: reload needs {format_bytes(need)} on {self._device} but only {format_bytes(free)} "
            f"of {format_bytes(total)} is free. Free GPU memory first (put the rollout engine to sleep, "
            f"lower gpu_memory_utilization or the micro-batch) and call reload() again; the data is still "
            f"in the pinned pool. ({exc})")

    def _check_reloadable(self) -> None:
        if self.state != OFFLOADED:
            raise PhaseOrderError(f"{self.name}: reload while {self.state}; offload it first{self._busy_hint()}")
        if self._pool.closed:
            raise PoolClosedError(f"{self.name}: its pool was closed while the set was offloaded; the data is gone")

    def _shrink(self) -> None:
        """Undoes a re-grow: the set is offloaded again, its bytes still in the pool."""
        for e in self._entries:
            e.storage.resize_(0)

    def _timed_regrow(self) -> float:
        t0 = time.perf_counter()
        self._regrow()
        return (time.perf_counter() - t0) * 1e3

    def reload_async(self, *, timing: bool = False, ordered: bool = True,
                     _grown_ms: Optional[float] = None) -> SwapHandle:
        """Re-grows the storages and starts copying the bytes back; later work on the current stream waits.

        ordered=False: later work does not wait (a prefetch behind other kernels): nothing may read the set
        before the handle's wait() returned (see PendingReloads)."""
        with self._lock:  # the state check, the re-grow and the submission as one step for other threads
            layout = cast(swap_coalesce.Layout, self._layout)
            if _grown_ms is None:  # (swap() grows them itself, before either direction starts)
                self._check_reloadable()
            if _grown_ms is None and self.pipeline and swap_pipeline.applies(self, layout):
                # the storages grow piece by piece behind the copies of the pieces before (swap_pipeline.py)
                t0 = time.perf_counter()
                transfer, token, alloc_ms = swap_pipeline.submit_reload(
                    self, layout, ordered=ordered, timing=timing, oom_error=self._reload_oom)
            else:
                alloc_ms = self._timed_regrow() if _grown_ms is None else _grown_ms
                t0 = time.perf_counter()
                # Wait for the current stream first (the allocator may hand out memory it still reads), and
                # make it wait for the copies, so kernels queued after reload() see the restored bytes. A
                # failure shrinks the storages back (the set stays offloaded), once no copy writes into them.
                transfer, token = swap_coalesce.submit(self, "h2d", layout, self._shrink, ordered=ordered,
                                                       timing=timing)
            self.state = RELOADING

            def finish() -> SwapStats:  # called once, under the set's lock, after the copies completed
                self._pool._copies.end(token)
                self._pending = None
                stats = SwapStats("h2d", transfer.nbytes, len(self._entries), time.perf_counter() - t0,
                                  transfer.elapsed_ms() if timing else 0.0, alloc_ms=alloc_ms)
                self._give_back_blocks()
                self.state = RESIDENT
                self.last_stats = stats
                return stats

            handle = SwapHandle(self, transfer, finish, t0)
            self._pending = handle
            return handle

    def reload(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S, *, timing: bool = False) -> SwapStats:
        """Copies the set back; on TransferTimeoutError the copy keeps running: wait_pending() ends it."""
        wait_seconds(timeout)  # a bad timeout is refused before anything starts
        return self.reload_async(timing=timing).wait(timeout)

    # -- while offloaded ----------------------------------------------------------------------------------
    def host_view(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A CPU tensor over the pool copy of `t` (same dtype, shape, strides), valid while offloaded;
        None when `t` has no offloaded copy here. Read it, e.g. to sync weights without a reload."""
        raw = self.host_storage(t)
        if raw is None:
            return None
        return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def host_storage(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The pool copy of `t`'s whole storage as CPU uint8 (checkpoints save storages byte for byte),
        valid while offloaded; None when `t` has no offloaded copy here. A tensor on a slab (pack_small) has
        the slab as its storage: this is the whole slab, `t` at its storage offset in it."""
        if self.state != OFFLOADED:
            return None
        if self._pool.closed:  # the pool copy was unmapped with it: a view would read freed memory
            raise PoolClosedError(f"{self.name}: its pool was closed while the set was offloaded; the data is gone")
        key = t.untyped_storage()._cdata
        for e in self._entries:
            if e.storage._cdata == key and e.block is not None:
                return e.block.as_tensor(e.nbytes, e.offset)
        return None

    def discard(self) -> None:
        """Drops the pool copy of an offloaded set without reloading it: its tensors keep no bytes."""
        with self._lock:
            if self.state != OFFLOADED:
                raise PhaseOrderError(f"{self.name}: discard() while {self.state}; only an offloaded set"
                                      f"{self._busy_hint()}")
            self._give_back_blocks()
            self._drop_kept()
            self._entries, self._layout = [], None
            self._memo.forget()
            self.state = DISCARDED

    # -- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Gives the set's pool blocks back. Refused while offloaded: the pool holds the only copy."""
        with self._lock:
            if self.state not in (RESIDENT, DISCARDED):
                raise PhaseOrderError(f"{self.name}: close() while {self.state}; reload (or discard()) first so "
                                      f"no data is lost by accident{self._busy_hint()}")
            self._drop_kept()
            self._entries, self._layout = [], None
            self._memo.forget()
