"""A SwapSet's copy submissions: registered with the pool, and a failed one parked until the copies it had
queued are done (SwapSet, swap_coalesce and swap_pipeline submit through here)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, cast

import torch

from colomem import _torch
from colomem.swap_handles import SwapHandle, SwapStats
from colomem.units import format_bytes

if TYPE_CHECKING:
    from colomem.swap import SwapSet


def submit_copies(s: "SwapSet", direction: str, copies: list, nbytes: int, undo: Callable[[], None], **kw):
    """Submits the copies, registered with the pool so it is not closed under them; -> (transfer, token).

    A failed submission runs `undo` (which gives blocks back or shrinks storages) only once none of its
    copies runs: at once, or, when the core reports copies it had queued still running (the error's
    `.transfer`), when those are done. Until then the set stays mid-transition and the error carries a
    handle as `.handle`: its wait() (or wait_pending()) waits for them, undoes, and raises the error."""
    device = cast(torch.device, s._device)
    what = f"SwapSet {s.name!r} {'offload' if direction == 'd2h' else 'reload'} of {format_bytes(nbytes)}"
    try:
        eng = _torch.engine_for(device)
        token = s._pool._copies.begin(s._pool, what)
    except BaseException:
        undo()
        raise
    try:
        transfer = eng.submit(direction, copies, **kw)
    except BaseException as exc:
        running = getattr(exc, "transfer", None)
        if running is None:
            s._pool._copies.end(token)
            undo()
        else:
            s._pool._copies.attach(token, running)  # pool.close() waits for those copies too
            park_failed(s, direction, exc, running, token, undo)
        raise
    s._pool._copies.attach(token, transfer)
    return transfer, token


def park_failed(s: "SwapSet", direction: str, exc: BaseException, running, token: int,
                undo: Callable[[], None]) -> None:
    """Parks a failed submission whose queued copies still run (see submit_copies) behind a handle."""
    from colomem.swap import OFFLOADING, RELOADING

    before = s.state
    s.state = OFFLOADING if direction == "d2h" else RELOADING

    def finish() -> SwapStats:  # called once, under the set's lock, after those copies completed
        s._pool._copies.end(token)
        s._pending = None
        undo()
        s.state = before
        raise exc

    handle = SwapHandle(s, running, finish, time.perf_counter())
    s._pending = handle
    setattr(exc, "handle", handle)
    add_note = getattr(exc, "add_note", None)  # Python 3.11+; .handle carries the same on older ones
    if add_note is not None:
        add_note(f"{s.name}: copies queued before this failure were still running, so the set keeps its "
                 "pool blocks and storages until they finish: wait_pending() (or this error's .handle.wait()) "
                 "waits for them, then raises this error again and the set is usable")
