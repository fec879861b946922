"""A reload that re-grows a set's storages piece by piece while the copies of the pieces before it run.

Re-growing a storage after its memory went back to the driver is one cudaMalloc through torch's caching
allocator: tens of microseconds each, 8-14 ms for a 250-tensor set of 3-15 GB. Growing every storage before
the first copy puts all of it in front of the transfer, where the caller waits for it. Here the storages are
grown in pieces, each piece submitted to the copy engine as soon as it is grown; the next piece is grown
while those copies run. The first piece is small and of few storages (its growth is what is left in front),
each next one `PIECE_GROWTH` times the previous, so every piece's growth fits inside the copy of the one
before, also for memory the process never used before (about twice as slow to map). The pieces are cut from
the storages by size, not in the set's order (`head_first`): a model's embedding comes first in its order,
and grown first it alone would be hundreds of MB in front of the first copy.

All pieces queue on the engine's one H2D stream, in order; the current stream waits for the last one (when
`ordered`), so work queued after the reload sees every byte. Only a set whose storages all move on their own
takes this path (`Layout.direct`); staging chunks keep the grow-everything-first path (swap_coalesce), whose
scatter kernels need every storage grown.

A failure part way (no memory for a piece, a failed submission) shrinks the storages grown so far once
nothing queued writes into them any more, so the set is offloaded again with its bytes in the pool, as after
a failed grow-everything-first reload.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

from colomem import _torch
from colomem.errors import TransferTimeoutError
from colomem.swap_coalesce import FAILURE_WAIT_S, Transfers, _direct_copies, _done, _settle
from colomem.swap_submit import park_failed
from colomem.units import format_bytes

if TYPE_CHECKING:
    from colomem.swap import SwapSet, _Entry

MiB = 1 << 20
FIRST_PIECE_BYTES = 64 * MiB  # what is grown before the first copy starts
PIECE_GROWTH = 2              # each next piece's bytes over the previous one's
BY_SIZE = True                # pieces cut by size (head_first); False: in the set's order (benchmarks compare)


def pieces(entries: list["_Entry"], first: Optional[int] = None, growth: Optional[int] = None) -> list[list]:
    """The entries, in order, cut into pieces of at least first, first*growth, ... bytes (the last takes the
    rest; defaults: FIRST_PIECE_BYTES, PIECE_GROWTH). A storage larger than its piece's target ends that
    piece; storages are never split."""
    first = FIRST_PIECE_BYTES if first is None else first
    growth = PIECE_GROWTH if growth is None else growth
    out: list[list] = []
    run: list = []
    run_bytes, target = 0, first
    for e in entries:
        run.append(e)
        run_bytes += e.nbytes
        if run_bytes >= target:
            out.append(run)
            run, run_bytes, target = [], 0, target * growth
    if run:
        out.append(run)
    return out


def head_first(entries: list["_Entry"], first: Optional[int] = None) -> list["_Entry"]:
    """The entries in the order a pipelined transfer cuts them: first the fewest storages of at most `first`
    bytes that reach it (the largest of them first; the smallest larger storage when they do not reach it),
    then the others smallest first, each size in the set's order. The first piece (pieces()) is then those few
    storages whatever the set's order, and each piece after it holds storages no smaller than the one before."""
    first = FIRST_PIECE_BYTES if first is None else first
    by_size = sorted(range(len(entries)), key=lambda i: entries[i].nbytes)      # stable: the set's order within
    head: list[int] = []
    total = 0
    for i in sorted((i for i in by_size if entries[i].nbytes <= first), key=lambda i: -entries[i].nbytes):
        if total >= first:
            break
        head.append(i)
        total += entries[i].nbytes
    if total < first:
        head += [i for i in by_size if entries[i].nbytes > first][:1]
    taken = set(head)
    return [entries[i] for i in head] + [entries[i] for i in by_size if i not in taken]


def reload_pieces(entries: list["_Entry"]) -> list[list]:
    """The pieces a reload grows and copies, in order (head_first, then pieces())."""
    return pieces(head_first(entries) if BY_SIZE else entries)


def layout_pieces(layout) -> list[list]:
    """reload_pieces of a layout's storages, cut once per layout (a set keeps its layout across cycles, and
    cutting a model's 250 storages takes ~60 us of Python in front of the first copy)."""
    key = (FIRST_PIECE_BYTES, PIECE_GROWTH, BY_SIZE)
    memo = getattr(layout, "pieces_memo", None)
    direct = layout.direct                  # this cycle's entries (a kept layout is rebound to each offload's)
    if memo is None or memo[0] != key:
        at = {id(e): i for i, e in enumerate(direct)}
        memo = (key, [[at[id(e)] for e in p] for p in reload_pieces(direct)])
        layout.pieces_memo = memo
    return [[direct[i] for i in p] for p in memo[1]]


def applies(s: "SwapSet", layout) -> bool:
    """Whether a reload of `s` with this layout takes the pipelined path: a set moved storage by storage that
    makes more than one piece (on the host path too, where the engine's worker thread copies while the next
    piece is allocated)."""
    return s._device is not None and not layout.chunks and len(layout_pieces(layout)) > 1


# Above what the driver reports free, a reload's growth also needs each storage rounded up to the allocator's
# 2 MiB granule and room for the allocator's own rounding of large blocks.
RELEASE_MARGIN_BYTES = 64 * MiB


def release_first(device: torch.device, nbytes: int) -> bool:
    """Whether a pipelined reload of `nbytes` should give the allocator's cache back before its first piece:
    on a CUDA device whose memory is in torch's default (cudaMalloc'd) segments, when the driver reports less
    free than the set needs. With expandable segments a release unmaps without waiting for the copies."""
    if device.type != "cuda" or _torch.process_expandable():
        return False
    return _torch.mem_get_info(device)[0] < nbytes + RELEASE_MARGIN_BYTES


def submit_reload(s: "SwapSet", layout, *, ordered: bool, timing: bool,
                  oom_error: Callable[[BaseException], BaseException]):
    """Grows and submits piece by piece; -> (transfer, token, grow_ms: the host time spent growing, most of it
    behind the copies). On failure the grown storages are shrunk (at once or, while queued copies still run,
    through the handle swap_submit.park_failed parks on the error) and the error raised: an out-of-memory
    from the allocator as `oom_error(exc)`."""
    device = s._device
    assert device is not None
    pool = s._pool
    entries = layout.direct
    nbytes = sum(e.nbytes for e in entries)
    cur = _torch.stream_handle(device)
    eng = _torch.engine_for(device)
    # Memory the process holds cached in torch's default segments goes back to the driver now, before any
    # piece is queued, when the driver alone cannot give the set's bytes: otherwise a later piece's growth
    # finds no room, the allocator frees its cache (a cudaFree, which waits for every copy in flight) and that
    # piece and every one after it start only once the pieces before them copied. Here it waits only for the
    # work already queued, none of this reload's copies among it.
    if release_first(device, nbytes):
        _torch.release_cached(device)
    token = pool._copies.begin(pool, f"SwapSet {s.name!r} reload of {format_bytes(nbytes)}")
    parts: list = []
    grown: list["_Entry"] = []
    grow_s = 0.0
    cut = layout_pieces(layout)
    try:
        # the allocator's setting switched once for all pieces (each switch parses torch's settings again)
        with _torch.expandable_segments(device if s.expandable else None):
            for i, piece in enumerate(cut):
                t0 = time.perf_counter()
                for e in piece:
                    e.storage.resize_(e.nbytes)
                    grown.append(e)
                grow_s += time.perf_counter() - t0
                last = i == len(cut) - 1
                # Each piece waits for the current stream (the allocator may hand out memory that stream still
                # reads); the current stream waits for the last piece, behind every other on the engine's stream.
                parts.append(eng.submit("h2d", _direct_copies(piece, False), wait_stream=cur,
                                        signal_stream=cur if ordered and last else 0, timing=timing))
    except BaseException as exc:
        err = oom_error(exc) if isinstance(exc, torch.OutOfMemoryError) else exc
        _fail(s, exc, err, parts, grown, token)
        if err is exc:
            raise
        raise err from exc
    transfer = Transfers(parts, nbytes)
    pool._copies.attach(token, transfer)
    return transfer, token, grow_s * 1e3


def _fail(s: "SwapSet", exc: BaseException, err: BaseException, parts: list, grown: list, token: int) -> None:
    queued: Optional[object] = getattr(exc, "transfer", None)  # what the core had queued of a failed submission
    running = parts + ([queued] if queued is not None else [])

    def shrink() -> None:  # the set is offloaded again, its bytes still in the pool
        for e in grown:
            e.storage.resize_(0)

    _settle(running)
    if all(_done(p) for p in running):
        s._pool._copies.end(token)
        shrink()
        return
    both = Transfers(running, 0)
    s._pool._copies.attach(token, both)
    park_failed(s, "h2d", err, both, token, shrink)


# -- offload: each piece's memory freed as soon as its copy ended ----------------------------------------------
# With torch's expandable segments, freeing memory (cuMemUnmap) does not wait for copies running on another
# stream (benchmarks/diag_release.py: a 12 MiB free returns in 0.13 ms while a 4 GiB copy runs, the copy not
# slowed), so an offload in pieces frees each piece while the next ones copy, and what is left after the last
# copy is the last piece's release. A cudaMalloc'd segment's cudaFree waits for the device's copies: there the
# first piece's release waits for every copy and the pieces cost what one release of the set would.


def offload_pieces(layout) -> list[list]:
    """A layout's reload pieces backwards: the largest storages go first, and the last piece is the small one
    of few storages (FIRST_PIECE_BYTES), so the release left after the last copy is the smallest (a model's
    output head, last in its order, would otherwise be released alone after every copy ended)."""
    return list(reversed(layout_pieces(layout)))


def offload_applies(s: "SwapSet", layout) -> bool:
    """Whether an offload of `s` frees piece by piece: a set moved storage by storage, with release=True,
    that makes more than one piece."""
    return s.release and s._device is not None and not layout.chunks and len(layout_pieces(layout)) > 1


def submit_offload(s: "SwapSet", layout, undo: Callable[[], None], *, timing: bool):
    """One engine submission per piece; -> (transfer, token, the pieces). A failed submission runs `undo`
    once nothing queued still runs (at once, or behind the handle swap_submit.park_failed parks)."""
    device = s._device
    assert device is not None
    pool = s._pool
    cut = offload_pieces(layout)
    nbytes = sum(e.nbytes for e in layout.direct)
    cur = _torch.stream_handle(device)
    try:
        eng = _torch.engine_for(device)
        token = pool._copies.begin(pool, f"SwapSet {s.name!r} offload of {format_bytes(nbytes)}")
    except BaseException:
        undo()
        raise
    # What the process holds cached goes back to the driver before any piece is queued: freeing torch's
    # default segments (a trainer's cached activations, a caller's temporaries) is a cudaFree, which waits
    # for every copy in flight, so left to the first piece's release it would wait for the whole transfer.
    # A process whose memory is all in expandable segments frees it later, behind the copies, without waiting.
    if not _torch.process_expandable():
        _torch.release_cached(device)
    parts: list = []
    try:
        for piece in cut:  # each after the current stream's work: the copies read what it wrote
            parts.append(eng.submit("d2h", _direct_copies(piece, True), wait_stream=cur, timing=timing))
    except BaseException as exc:
        queued: Optional[object] = getattr(exc, "transfer", None)
        running = parts + ([queued] if queued is not None else [])
        _settle(running)
        if all(_done(p) for p in running):
            pool._copies.end(token)
            undo()
        else:
            both = Transfers(running, 0)
            pool._copies.attach(token, both)
            park_failed(s, "d2h", exc, both, token, undo)
        raise
    transfer = Transfers(parts, nbytes)
    pool._copies.attach(token, transfer)
    return transfer, token, cut


class Release:
    """Frees the pieces of an offload as their copies end, while the later pieces still copy; the handle's
    wait() drives it (SwapHandle's `advance`). The last piece is freed with the set, by the offload's finish.

    A piece whose copy failed leaves the pieces freed before it re-grown and copied back from the pool (their
    copies had completed), so the set is whole on the GPU as after any failed offload."""

    def __init__(self, s: "SwapSet", transfer: Transfers, cut: list[list]):
        self.s, self.parts, self.cut = s, transfer.parts, cut
        self.freed = 0  # pieces freed so far, in order

    def advance(self, seconds: float) -> None:
        deadline = time.monotonic() + (0.0 if math.isinf(seconds) else seconds)
        while True:
            with self.s._lock:
                k = self.freed
            if k >= len(self.parts) - 1:
                return
            try:
                self.parts[k].wait(seconds if math.isinf(seconds) else max(0.0, deadline - time.monotonic()))
            except BaseException as exc:
                if not isinstance(exc, TransferTimeoutError):
                    self._restore(exc)
                raise
            with self.s._lock:
                if self.freed != k:
                    continue  # another waiter freed it
                if self.s._pool.closed:
                    return  # the offload's finish tells the caller
                for e in self.cut[k]:
                    e.storage.resize_(0)
                device = self.s._device
                if device is not None and device.type == "cuda":
                    torch.cuda.empty_cache()
                self.freed = k + 1

    def _restore(self, exc: BaseException) -> None:
        with self.s._lock:
            back = [e for piece in self.cut[:self.freed] for e in piece]
            self.freed = 0
            if not back:
                return
            device = self.s._device
            assert device is not None
            try:
                for e in back:
                    e.storage.resize_(e.nbytes)
                cur = _torch.stream_handle(device)
                _torch.engine_for(device).submit("h2d", _direct_copies(back, False), wait_stream=cur,
                                                 signal_stream=cur).wait(FAILURE_WAIT_S)
            except BaseException as again:  # noqa: B036  (told on the first error, which is raised)
                note = getattr(exc, "add_note", None)
                if note is not None:
                    note(f"{self.s.name}: {len(back)} storages freed before this failure could not be restored "
                         f"from the pool ({again}); their bytes are still in the pool's blocks")
