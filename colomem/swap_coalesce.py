"""Small storages of a SwapSet moved as staging chunks: one copy per chunk instead of one per storage.

Tens of thousands of small storages (biases, norms, LoRA adapters, optimizer scalars) copied one by one leave
the link mostly idle: each copy pays the driver's per-copy cost. Below `coalesce_below` bytes a storage joins
a chunk (up to `staging_bytes`); on offload the chunk's storages are gathered on the device into one staging
buffer (one batched kernel) and copied to one pool block in one D2H; on reload one H2D fills the staging
buffer and a kernel scatters it back into the re-grown storages.

Where it runs: the gathers and scatters are queued on the copy engine's own stream of that direction, between
the chunk copies, so stream order alone keeps one staging buffer safe to reuse chunk after chunk and the
copies of the other direction (swap()) run beside them. On the host path (device='cpu') each chunk copy is
waited for before its staging buffer is reused or scattered, so that path is synchronous.

What it costs: one staging buffer of at most `staging_bytes` per set while its offload or reload runs, freed
(returned to the caching allocator) when the last chunk was queued; the pool block of a chunk holds its
storages back to back, each at a 256-byte aligned offset. When the staging buffer cannot be allocated (the
device is full) the chunk storages are copied one by one straight from and to their place in the block
instead: slower, no extra memory.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from colomem import _torch
from colomem.pool import Block
from colomem.swap_handles import DEFAULT_TIMEOUT_S
from colomem.swap_submit import park_failed, submit_copies
from colomem.units import format_bytes

if TYPE_CHECKING:
    from colomem.swap import SwapSet, _Entry

MiB = 1 << 20
# Storages smaller than COALESCE_BELOW_ON are copied as part of a staging chunk when a set asks for it
# (coalesce_below=...). Off unless asked (COALESCE_BELOW_DEFAULT 0) until its GPU tests and the transfer
# benchmark have run on a GPU: every SwapSet (the trainers' offloads) would otherwise take this path.
COALESCE_BELOW_ON = 1 * MiB
COALESCE_BELOW_DEFAULT = 0
STAGING_BYTES_DEFAULT = 64 * MiB   # the largest chunk, and so the staging buffer's size
FAILURE_WAIT_S = 30.0              # how long a failed operation waits for its queued copies before it parks them
ALIGN = 256                        # each storage's offset in a chunk: keeps the copy kernel's loads vectorized


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Chunk:
    """Storages moved together through one staging buffer; they share one pool block at their offsets."""

    def __init__(self, entries: list["_Entry"]):
        self.entries = entries
        self.offsets: list[int] = []
        at = 0
        for e in entries:
            self.offsets.append(at)
            at += _pad(e.nbytes)
        self.nbytes = at  # the block's and the staging buffer's bytes
        self.views: Optional[list[torch.Tensor]] = None   # uint8 over each whole storage, made at first use
        self.parts: Optional[list[torch.Tensor]] = None   # the matching slices of the layout's staging buffer

    @property
    def block(self) -> Optional[Block]:
        return self.entries[0].block

    @block.setter
    def block(self, b: Optional[Block]) -> None:
        for e, off in zip(self.entries, self.offsets):
            e.block, e.offset = b, off

    def storage_views(self) -> list[torch.Tensor]:
        # The views follow their storage through resize_: one made at the first offload still reads and writes
        # the memory a later reload re-grew, so they are made once per layout.
        if self.views is None:
            self.views = [torch.empty(0, dtype=torch.uint8, device=e.storage.device).set_(e.storage)
                          for e in self.entries]
        return self.views


class Layout:
    """Which storages move on their own and which in chunks; kept across cycles while the storages are the same
    ones, so the views and the staging buffer's slices are made once."""

    def __init__(self, entries: list["_Entry"], below: int, staging_bytes: int):
        self.below, self.staging_bytes = below, staging_bytes
        self.key = [(e.storage._cdata, e.nbytes) for e in entries]
        self.direct: list["_Entry"] = []
        self.chunks: list[Chunk] = []
        run: list["_Entry"] = []
        run_bytes = 0
        for e in entries:
            if e.nbytes >= below or below <= 0:
                self.direct.append(e)
                continue
            if run and run_bytes + _pad(e.nbytes) > staging_bytes:
                self._close(run)
                run, run_bytes = [], 0
            run.append(e)
            run_bytes += _pad(e.nbytes)
        self._close(run)
        self._staging: Optional[torch.Tensor] = None  # sized to the largest chunk; its storage is grown per use
        self.fallback = False  # the last operation found no room for the staging buffer (one copy per storage)
        self.pieces_memo: Optional[tuple] = None  # swap_pipeline.layout_pieces: the pipelined pieces, cut once

    def _close(self, run: list["_Entry"]) -> None:
        if len(run) == 1:
            self.direct.append(run[0])  # a chunk of one would only add a kernel and a staging buffer
        elif run:
            self.chunks.append(Chunk(run))

    def matches(self, entries: list["_Entry"], below: int, staging_bytes: int) -> bool:
        return (below, staging_bytes) == (self.below, self.staging_bytes) and len(entries) == len(self.key) \
            and all((e.storage._cdata, e.nbytes) == k for e, k in zip(entries, self.key))

    def rebind(self, entries: list["_Entry"]) -> None:
        """Points the layout at this offload's entries (the same storages as the ones it was made for)."""
        by_key = {e.storage._cdata: e for e in entries}
        self.direct = [by_key[e.storage._cdata] for e in self.direct]
        for c in self.chunks:
            c.entries = [by_key[e.storage._cdata] for e in c.entries]

    def units(self) -> list:
        """What gets a pool block of its own: each direct storage and each chunk."""
        return [*self.direct, *self.chunks]

    # -- the staging buffer -------------------------------------------------------------------------------
    def grow_staging(self, device: torch.device) -> torch.Tensor:
        """The staging buffer, grown now (on the current stream); torch.OutOfMemoryError when it does not fit."""
        need = max(c.nbytes for c in self.chunks)
        if self._staging is None:
            self._staging = torch.empty(0, dtype=torch.uint8, device=device)
        st = self._staging.untyped_storage()
        st.resize_(need)
        if self._staging.numel() != need:
            self._staging.set_(st)
            for c in self.chunks:
                c.parts = None
        return self._staging

    def staging_ptr(self) -> int:
        assert self._staging is not None
        return self._staging.data_ptr()

    def release_staging(self) -> None:
        if self._staging is not None:
            self._staging.untyped_storage().resize_(0)

    def staging_parts(self, c: Chunk) -> list[torch.Tensor]:
        if c.parts is None:
            assert self._staging is not None
            sizes: list[int] = []
            for e in c.entries:
                sizes += [e.nbytes, _pad(e.nbytes) - e.nbytes]
            c.parts = list(self._staging[:c.nbytes].split(sizes)[::2])
        return c.parts


def layout_for(previous: Optional[Layout], entries: list["_Entry"], below: int, staging_bytes: int) -> Layout:
    if previous is not None and previous.matches(entries, below, staging_bytes):
        previous.rebind(entries)
        return previous
    return Layout(entries, below, staging_bytes)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    # One multi-tensor kernel launch per batch of tensors on CUDA (all uint8, same sizes pairwise).
    torch._foreach_copy_(dst, src)


# -- several engine submissions as one transfer ---------------------------------------------------------------
class Transfers:
    """The engine submissions of one offload or reload (direct copies, then a submission per chunk), seen as
    one transfer by the handle and the pool. They run in order on the engine's stream of their direction.
    `keep` holds what the copies read or write until this object goes (the host path's staging buffer)."""

    def __init__(self, parts: Sequence, nbytes: int, keep=None):
        self.parts = list(parts)
        self.nbytes = nbytes
        self._keep = keep

    def done(self) -> bool:
        return all(p.done() for p in self.parts)

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s if math.isfinite(timeout_s) else math.inf
        for p in self.parts:
            p.wait(max(0.0, deadline - time.monotonic()) if math.isfinite(deadline) else math.inf)

    def elapsed_ms(self) -> float:
        return span_ms(self)

    def span_ms(self, others: Sequence) -> float:
        return span_ms(self, *others)


def _flat(transfers) -> list:
    out: list = []
    for t in transfers:
        out += t.parts if isinstance(t, Transfers) else [t]
    return out


def span_ms(*transfers) -> float:
    """Device ms from the first start to the last end over the transfers (timed, finished)."""
    flat = _flat(transfers)
    if len(flat) == 1:
        return flat[0].elapsed_ms()
    return flat[0].span_ms(flat[1:])


# -- submission ----------------------------------------------------------------------------------------------
def submit(s: "SwapSet", direction: str, layout: Layout, undo: Callable[[], None], *, ordered: bool = True,
           timing: bool = False):
    """Submits an offload ('d2h') or reload ('h2d') of the set's entries; -> (transfer, token), as
    swap_submit.submit_copies (which moves a set without chunks, or one whose staging buffer does not fit).

    A failure part way (a chunk's submission, a gather or scatter) runs `undo` once nothing that was queued
    still runs: at once, or through the handle swap_submit.park_failed parks on the error."""
    device = s._device
    assert device is not None
    d2h = direction == "d2h"
    cur = _torch.stream_handle(device)
    nbytes = sum(e.nbytes for e in s._entries)
    layout.fallback = False
    if layout.chunks:
        try:
            eng = _torch.engine_for(device)
            lane = None if device.type != "cuda" else torch.cuda.ExternalStream(eng.stream(direction), device=device)
            # Allocated on the engine's stream, the staging buffer goes back to the allocator in that stream's
            # order: only later work of that stream (the next chunk, the next operation) can get its memory.
            _run(lane, lambda: layout.grow_staging(device))
        except torch.OutOfMemoryError:
            layout.fallback = True  # no room for a staging buffer: one copy per storage, no extra memory
        except BaseException:
            undo()
            raise
        else:
            return _submit_chunks(s, eng, lane, direction, layout, undo, nbytes, cur, ordered, timing)
    return submit_copies(s, direction, _direct_copies(s._entries, d2h), nbytes, undo, wait_stream=cur,
                     signal_stream=cur if ordered and not d2h else 0, timing=timing)


def _submit_chunks(s: "SwapSet", eng, lane, direction: str, layout: Layout, undo: Callable[[], None],
                   nbytes: int, cur: int, ordered: bool, timing: bool):
    d2h, pool = direction == "d2h", s._pool
    what = f"SwapSet {s.name!r} {'offload' if d2h else 'reload'} of {format_bytes(nbytes)}"
    try:
        token = pool._copies.begin(pool, what)
    except BaseException:
        layout.release_staging()
        undo()
        raise
    parts: list = []
    try:
        if lane is not None:
            # Everything of this operation queues on the engine's stream: it first waits for the current
            # stream (the producer's kernels on offload; on reload the allocator may hand out memory that
            # stream still reads), then stream order runs chunk copy, kernel, chunk copy... one after another.
            lane.wait_stream(torch.cuda.current_stream(lane.device))
        if layout.direct:
            parts.append(eng.submit(direction, _direct_copies(layout.direct, d2h), timing=timing))
        staging_ptr = layout.staging_ptr()
        for c in layout.chunks:
            block = c.block
            assert block is not None
            if d2h:
                _run(lane, lambda: _copy_all(layout.staging_parts(c), c.storage_views()))
                parts.append(eng.submit("d2h", [(block.address, staging_ptr, c.nbytes)], timing=timing))
            else:
                parts.append(eng.submit("h2d", [(staging_ptr, block.address, c.nbytes)], timing=timing))
            if lane is None:
                parts[-1].wait(DEFAULT_TIMEOUT_S)  # host path: the staging buffer is reused (or scattered) next
            if not d2h:
                _run(lane, lambda: _copy_all(c.storage_views(), layout.staging_parts(c)))
        # An empty submission marks the end of the last kernel on the engine's stream, so the handle is done
        # only once the scatter wrote the storages; on reload it is also what the current stream waits for.
        parts.append(eng.submit(direction, [], signal_stream=cur if ordered and not d2h else 0, timing=timing))
    except BaseException as exc:
        queued = getattr(exc, "transfer", None)  # what the core had queued of the failed submission
        running = parts + ([queued] if queued is not None else [])
        if lane is not None:
            _mark_kernels(eng, lane, direction, running)
        _settle(running)
        if all(_done(p) for p in running):
            pool._copies.end(token)
            layout.release_staging()
            undo()
        else:
            both = Transfers(running, nbytes)
            pool._copies.attach(token, both)

            def undo_after() -> None:
                layout.release_staging()
                undo()

            park_failed(s, direction, exc, both, token, undo_after)
        raise
    # On CUDA the memory goes back in the engine stream's order (see submit); on the host every chunk copy
    # was waited for above.
    layout.release_staging()
    transfer = Transfers(parts, nbytes)
    pool._copies.attach(token, transfer)
    return transfer, token


def _mark_kernels(eng, lane, direction: str, running: list) -> None:
    """After a failure: a gather or scatter queued after the last submission may still run; an empty
    submission behind it lets the rollback wait for it too (a bounded wait, like every other)."""
    try:
        running.append(eng.submit(direction, []))
    except BaseException:  # noqa: B036  (the engine fails too: nothing else can be queued, wait here)
        lane.synchronize()


def _settle(running: list) -> None:
    """After a failure, waits a while for what was queued, as the engine does for a failed submission: most
    often the rollback can then run at once instead of behind the error's handle."""
    try:
        Transfers(running, 0).wait(FAILURE_WAIT_S)
    except Exception:  # noqa: B036  (still running, or a copy failed: _done() tells, the caller parks or undoes)
        pass


def _done(p) -> bool:
    try:
        return bool(p.done())
    except Exception:  # a failed copy: nothing of it runs any more
        return True


def _run(lane, fn: Callable[[], object]) -> None:
    if lane is None:
        fn()
    else:
        with torch.cuda.stream(lane):
            fn()


def _direct_copies(entries: list["_Entry"], d2h: bool) -> list[tuple[int, int, int]]:
    """One copy per storage, to or from its place in its block (a chunk member's place is at its offset)."""
    out = []
    for e in entries:
        block = e.block
        assert block is not None
        host = block.address + e.offset
        dev = e.storage.data_ptr()
        out.append((host, dev, e.nbytes) if d2h else (dev, host, e.nbytes))
    return out
