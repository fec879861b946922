"""A reload that re-grows a set's storages piece by piece while the copies of the pieces before it run.

Re-growing a storage after its memory went back to the driver is one cudaMalloc through torch's caching
allocator: tens of microseconds each, 8-14 ms for a 250-tensor set of 3-15 GB. Growing every storage before
the first copy puts all of it in front of the transfer, where the caller waits for it. Here the storages are
grown in pieces in their order, each piece submitted to the copy engine as soon as it is grown; the next
piece is grown while those copies run. The first piece is small (its growth is what is left in front), each
next one `PIECE_GROWTH` times the previous, so every piece's growth fits inside the copy of the one before.

All pieces queue on the engine's one H2D stream, in order; the current stream waits for the last one (when
`ordered`), so work queued after the reload sees every byte. Only a set whose storages all move on their own
takes this path (`Layout.direct`); staging chunks keep the grow-everything-first path (swap_coalesce), whose
scatter kernels need every storage grown.

A failure part way (no memory for a piece, a failed submission) shrinks the storages grown so far once
nothing queued writes into them any more, so the set is offloaded again with its bytes in the pool, as after
a failed grow-everything-first reload.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

from colomem import _torch
from colomem.swap_coalesce import Transfers, _direct_copies, _done, _settle
from colomem.units import format_bytes

if TYPE_CHECKING:
    from colomem.swap import SwapSet, _Entry

MiB = 1 << 20
FIRST_PIECE_BYTES = 64 * MiB  # what is grown before the first copy starts
PIECE_GROWTH = 4              # each next piece's bytes over the previous one's


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


def applies(s: "SwapSet", layout) -> bool:
    """Whether a reload of `s` with this layout takes the pipelined path: a set moved storage by storage that
    makes more than one piece (on the host path too, where the engine's worker thread copies while the next
    piece is allocated)."""
    return s._device is not None and not layout.chunks and len(pieces(layout.direct)) > 1


def submit_reload(s: "SwapSet", layout, *, ordered: bool, timing: bool,
                  oom_error: Callable[[BaseException], BaseException]):
    """Grows and submits piece by piece; -> (transfer, token, grow_ms: the host time spent growing, most of it
    behind the copies). On failure the grown storages are shrunk (at once or, while queued copies still run,
    through the handle SwapSet._undo_when_done parks on the error) and the error raised: an out-of-memory
    from the allocator as `oom_error(exc)`."""
    device = s._device
    assert device is not None
    pool = s._pool
    entries = layout.direct
    nbytes = sum(e.nbytes for e in entries)
    cur = _torch.stream_handle(device)
    eng = _torch.engine_for(device)
    token = pool._copies.begin(pool, f"SwapSet {s.name!r} reload of {format_bytes(nbytes)}")
    parts: list = []
    grown: list["_Entry"] = []
    grow_s = 0.0
    cut = pieces(entries)
    try:
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
    s._undo_when_done("h2d", err, both, token, shrink)
