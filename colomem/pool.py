"""PinnedPool: page-locked host memory reserved once and reused by every offload of the run."""

from __future__ import annotations

import ctypes
import math
import operator
import threading
import time
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from colomem import _C
from colomem.errors import InvalidArgumentError, PoolBusyError, PoolClosedError
from colomem.units import format_bytes, parse_bytes

Size = Union[int, float, str]
CLOSE_WAIT_S = 60.0  # how long close() waits for copies still running into or out of the pool's blocks


def _resolve_pin(pin) -> bool:
    if pin == "auto":
        return _C.device_count() > 0
    if isinstance(pin, bool):
        return pin
    raise InvalidArgumentError(f"pin must be True, False or 'auto', got {pin!r}")


# What crosses into the core as a size_t: anything larger cannot be represented there.
_SIZE_LIMIT = 2**64


def _size(name: str, value) -> int:
    """A byte size as users write it (int, '16GiB', 1.5e9), checked so the core never sees a bad one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite byte size, got {value!r}")
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            n = parse_bytes(value)
        except (ValueError, OverflowError) as exc:
            raise InvalidArgumentError(f"{name}: {exc}") from None
    else:
        n = _index(name, value)
    if n < 0:
        raise InvalidArgumentError(f"{name} must be >= 0 bytes, got {value!r}")
    if n >= _SIZE_LIMIT:
        raise InvalidArgumentError(f"{name} of {value!r} is not a byte size this host can hold (2**64 or more)")
    return n


def _index(name: str, value) -> int:
    """An exact integer (int, numpy integer; not bool, not float), for counts and sizes given in bytes."""
    if isinstance(value, bool) or value is None:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def _block_bytes(name: str, value) -> int:
    n = _index(name, value)
    if not 0 <= n < _SIZE_LIMIT:
        raise InvalidArgumentError(f"{name} must be from 0 to 2**64 - 1 bytes, got {n}")
    return n


@dataclass(frozen=True)
class Block:
    """A sub-allocation of the pool. `address` is valid until `release()` or the pool closes."""

    pool: "PinnedPool"
    block_id: int
    address: int
    nbytes: int

    def release(self) -> None:
        self.pool.free(self)

    def as_tensor(self, nbytes: Optional[int] = None, offset: int = 0):
        """A CPU uint8 torch tensor viewing `nbytes` of the block from `offset` (no copy), its own storage
        starting there (so as_strided offsets count from it). Keep the block alive while it is used.

        PoolClosedError once the pool was closed (its memory is unmapped then); InvalidArgumentError once
        the block was released (its bytes may belong to another block)."""
        import torch

        off = _block_bytes("offset", offset)
        n = self.nbytes - off if nbytes is None else _block_bytes("nbytes", nbytes)
        if off + n > self.nbytes:
            raise InvalidArgumentError(f"view of {n} bytes from offset {off} on a block of {self.nbytes}")
        self.pool.check_live(self)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer((ctypes.c_uint8 * n).from_address(self.address + off), dtype=torch.uint8)


class _Running(Protocol):
    """A transfer as the pool sees it (a core Transfer, or several as one: swap_coalesce.Transfers)."""

    def done(self) -> bool: ...


class _CopiesInFlight:
    """The copies still running into or out of a pool's blocks (SwapSet registers each submission), so close()
    never unmaps memory a copy thread or DMA engine is still using."""

    def __init__(self):
        self._cond = threading.Condition()
        # token -> (what, transfer; None while submitting)
        self._items: dict[int, tuple[str, Optional[_Running]]] = {}
        self._next = 0
        self._closing = False

    def begin(self, pool: "PinnedPool", what: str) -> int:
        """Registers a copy about to be submitted; waits out a close() in progress, then PoolClosedError if
        it closed the pool."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closing)
            pool.check_open()
            self._next += 1
            self._items[self._next] = (what, None)
            return self._next

    def attach(self, token: int, transfer: _Running) -> None:
        with self._cond:
            if token in self._items:
                self._items[token] = (self._items[token][0], transfer)
            self._cond.notify_all()

    def end(self, token: int) -> None:
        with self._cond:
            self._items.pop(token, None)
            self._cond.notify_all()

    def _running(self) -> list[str]:
        """Drops finished copies; returns what is still running (or still being submitted)."""
        running = []
        for token, (what, transfer) in list(self._items.items()):
            try:
                finished = transfer is not None and transfer.done()
            except Exception:  # a failed copy (CUDA error) or one of a parent process: nothing runs here
                finished = True
            if finished:
                del self._items[token]
            else:
                running.append(what)
        return running

    def close_when_idle(self, close, timeout: float) -> None:
        """Runs close() once no copy is in flight, holding off new ones meanwhile; PoolBusyError naming the
        copies if some still run after `timeout` seconds (the pool then stays open)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._cond.wait_for(lambda: not self._closing)
            self._closing = True
            try:
                while True:
                    running = self._running()
                    left = deadline - time.monotonic()
                    if not running or left <= 0:
                        break
                    self._cond.wait(min(left, 0.005))  # woken by end(); polled for copies never waited on
                if running:
                    raise PoolBusyError(
                        f"cannot close the pinned pool: {len(running)} copies into or out of its blocks are still "
                        f"running after {timeout:g} s ({'; '.join(running[:4])}). Wait for them (the handle's "
                        "wait() or SwapSet.wait_pending()) and close again")
                close()
            finally:
                self._closing = False
                self._cond.notify_all()


class PinnedPool:
    """Host memory for offloaded tensors, page-locked once (`pin='auto'`: when a GPU is visible).

    initial: bytes reserved now ('16GiB', an int, ...), pinned with parallel pre-faulting and huge pages.
    max_bytes: cap on what the pool may grow to (None: no cap); beyond it `alloc` raises
        PoolExhaustedError. segment_bytes: size of each growth step (a larger request gets its own size).
    prefault: 'touch' (threads write each page; 16 GB pinned in 0.83 s on the H200 host) or 'populate'
        (MADV_POPULATE_WRITE from several threads; 5.0 s there, slower in-kernel with huge pages).
    """

    def __init__(self, initial: Size = 0, *, max_bytes: Optional[Size] = None, segment_bytes: Size = "1GiB",
                 pin="auto", huge_pages: bool = True, prefault_threads: int = 0, alignment: int = 4096,
                 prefault: str = "touch"):
        if prefault not in ("populate", "touch"):
            raise InvalidArgumentError(f"prefault must be 'populate' or 'touch', got {prefault!r}")
        if not isinstance(huge_pages, bool):
            raise InvalidArgumentError(f"huge_pages must be True or False, got {huge_pages!r}")
        threads = _index("prefault_threads", prefault_threads)
        if not 0 <= threads <= 1024:
            raise InvalidArgumentError(f"prefault_threads must be from 0 (one per core, at most 16) to 1024, "
                                       f"got {threads}")
        align = _index("alignment", alignment)
        if align <= 0 or align & (align - 1) or align > 2**30:
            raise InvalidArgumentError(f"alignment must be a power of two from 1 to 1 GiB, got {align}")
        cap = None if max_bytes is None else _size("max_bytes", max_bytes)
        if cap == 0:
            raise InvalidArgumentError("max_bytes of 0 bytes could hold nothing; pass max_bytes=None for no cap")
        self._pin = _resolve_pin(pin)
        self._core = _C.HostPool(
            initial_bytes=_size("initial", initial),
            max_bytes=0 if cap is None else cap,
            segment_bytes=_size("segment_bytes", segment_bytes),
            pin=self._pin, huge_pages=huge_pages, prefault_threads=threads, alignment=align,
            populate=prefault == "populate",
        )
        self._live: dict[int, Block] = {}
        self._lock = threading.Lock()
        self._copies = _CopiesInFlight()

    # -- blocks -------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Block:
        """A block of at least `nbytes` (rounded up to the alignment). InvalidArgumentError for a size that is
        not a non-negative integer or above 64 GiB, the largest block; PoolExhaustedError at the cap."""
        block_id, address, size = self._core.alloc(_block_bytes("nbytes", nbytes))
        block = Block(self, block_id, address, size)
        with self._lock:
            self._live[block_id] = block
        return block

    def free(self, block: Block) -> None:
        if not isinstance(block, Block):
            raise InvalidArgumentError(f"free() takes a Block from alloc(), got {type(block).__name__}")
        if block.pool is not self:
            raise InvalidArgumentError("this block belongs to another pool")
        self._core.free(block.block_id)  # DoubleReleaseError on a second release
        with self._lock:
            self._live.pop(block.block_id, None)

    # -- state --------------------------------------------------------------------------------------------
    @property
    def pinned(self) -> bool:
        return self._pin

    @property
    def closed(self) -> bool:
        return self._core.closed

    def check_open(self) -> None:
        if self._core.closed:
            raise PoolClosedError("this pinned pool was closed; create a new PinnedPool")

    def check_live(self, block: Block) -> None:
        """Raises unless `block` may be read now: PoolClosedError after close() (its memory is unmapped),
        InvalidArgumentError after its release."""
        if self._core.closed:
            raise PoolClosedError(f"block {block.block_id} belonged to a pinned pool that was closed (its memory "
                                  "is unmapped); read blocks before closing the pool")
        with self._lock:
            live = self._live.get(block.block_id) is block
        if not live:
            raise InvalidArgumentError(f"block {block.block_id} was released; its bytes may belong to another "
                                       "block now")

    def reserve(self, nbytes: Size) -> None:
        """Grows the pool now so a block of `nbytes` can be allocated later without pinning. InvalidArgumentError
        above 64 GiB (the largest block: pass `initial` for a larger pool); PoolExhaustedError at the cap."""
        self._core.reserve(_size("nbytes", nbytes))

    def stats(self) -> dict:
        return self._core.stats()

    def close(self, force: bool = False, timeout: float = CLOSE_WAIT_S) -> None:
        """Releases all memory. PoolBusyError while blocks still hold data, unless force=True. Even with
        force=True, copies still running into or out of the pool's blocks are waited for first (up to
        `timeout` seconds; PoolBusyError naming them after that, and the pool stays open)."""

        def close_core():
            self._core.close(bool(force))
            with self._lock:
                self._live.clear()

        self._copies.close_when_idle(close_core, timeout)

    def __enter__(self) -> "PinnedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)

    def __repr__(self) -> str:
        if self.closed:
            return "PinnedPool(closed)"
        s = self.stats()
        return (f"PinnedPool(reserved={format_bytes(s['reserved_bytes'])}, in_use={format_bytes(s['in_use_bytes'])},"
                f" pinned={s['pinned']}, segments={s['segments']})")


_default_pool: Optional[PinnedPool] = None
_default_lock = threading.Lock()


def default_pool() -> PinnedPool:
    """The process-wide pool used when a SwapSet is given none; it grows in 1 GiB segments, no cap."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            _default_pool = PinnedPool(0)
        return _default_pool
