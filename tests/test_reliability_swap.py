"""SwapSet and copy-engine reliability on the host path: several threads on one set, closing the pool under a
copy in flight, timed-out waits that can be waited again, unbounded and invalid timeouts, fork(), and
offloaded() when one set cannot come back.

Cases that crashed the interpreter (a segfault or a heap use-after-free) before they were fixed run in a
child interpreter, so a regression fails its test instead of killing pytest."""

import json
import math
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import colomem
from colomem import _C, _torch
from colomem.errors import (InvalidArgumentError, PhaseOrderError, PoolBusyError, PoolClosedError,
                            TransferTimeoutError)
from colomem.swap import SwapStats

# A copy this large takes tens of milliseconds at least (it also faults in fresh pool pages), so a wait with
# timeout=0 right after its submission finds it still running.
BIG = 256 << 20
CHILD_TIMEOUT_S = 120  # generous: a child that hangs fails the test instead of blocking the suite


def run_child(code: str) -> dict:
    """Runs `code` in a fresh interpreter; it prints one JSON line last, returned here."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# a child's set: one BIG tensor in an unpinned pool, and a copy of its bytes to compare with
ONE_SET_CHILD = f"""
import json, torch, colomem
pool = colomem.PinnedPool(0, pin=False)
t = torch.arange({BIG // 8}, dtype=torch.int64)
want = t.clone()
s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
"""


def big_tensor() -> torch.Tensor:
    return torch.arange(BIG // 8, dtype=torch.int64)  # every 8 bytes distinct: a misplaced chunk shows


def drain_host_engine() -> None:
    """Waits for every copy queued on the process's host engine (its workers run FIFO, so an empty transfer
    per direction finishes after them): a failed test must not leave a copy running into memory that its
    teardown frees."""
    eng = _torch.engine_for(torch.device("cpu"))
    for direction in ("d2h", "h2d"):
        eng.submit(direction, []).wait(60.0)


@pytest.fixture
def pool():
    p = colomem.PinnedPool(0, pin=False)
    yield p
    drain_host_engine()
    p.close(force=True)


# -- item: two threads driving one SwapSet ---------------------------------------------------------------
@pytest.mark.parametrize("keep_blocks", [True, False], ids=["keep_blocks", "fresh_blocks"])
def test_threads_hammering_one_set_keep_bytes_and_raise_only_phase_errors(keep_blocks):
    out = run_child(f"""
        import json, random, threading
        import torch, colomem
        from colomem.errors import PhaseOrderError
        torch.set_num_threads(1)
        pool = colomem.PinnedPool("64MiB", pin=False)
        gen = torch.Generator().manual_seed(0)
        ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
              for n in (1 << 20, 3 << 20, 12345, 4 << 20, 1)]
        before = [t.clone() for t in ts]
        s = colomem.SwapSet.from_tensors(ts, pool, device="cpu", keep_blocks={keep_blocks})
        counts = {{"ok": 0, "phase": 0}}
        other = []
        lock = threading.Lock()

        def worker(seed):
            rnd = random.Random(seed)
            for _ in range(150):
                op = rnd.choice([s.offload, s.reload, s.reload, s.offload, s.close])
                try:
                    op() if op == s.close else op(60)
                    key = "ok"
                except PhaseOrderError:
                    key = "phase"
                except BaseException as exc:
                    with lock:
                        other.append(repr(exc))
                    continue
                with lock:
                    counts[key] += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if s.state == "offloaded":
            s.reload(60)
        print(json.dumps({{"counts": counts, "other": other, "state": s.state,
                          "intact": all(torch.equal(a, b) for a, b in zip(ts, before)),
                          "in_use": pool.stats()["in_use_bytes"]}}))
    """)
    assert out["other"] == [], out["other"]  # only PhaseOrderError for a set found mid-transition
    assert out["state"] == "resident"
    assert out["intact"], "bytes changed across the threaded offload/reload cycles"
    assert out["counts"]["ok"] > 0 and out["counts"]["phase"] > 0  # both outcomes met: the threads collided
    if not keep_blocks:
        assert out["in_use"] == 0  # every block taken by an offload went back after its reload


def test_one_handle_waited_from_several_threads_finishes_once(pool):
    t = big_tensor()
    want = t.clone()
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    h = s.offload_async()
    got, errors = [], []

    def waiter():
        try:
            got.append(h.wait(60))
        except BaseException as exc:  # recorded, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and len(got) == 4 and all(g is got[0] for g in got)
    assert s.state == "offloaded" and t.untyped_storage().nbytes() == 0
    s.reload(60)
    assert torch.equal(t, want)


# -- item: closing the pool under a copy in flight -------------------------------------------------------
def test_force_close_waits_for_the_offload_in_flight_and_the_set_stays_resident():
    out = run_child(ONE_SET_CHILD + textwrap.dedent("""
        from colomem.errors import PoolClosedError
        h = s.offload_async()
        running_at_close = not h.done()
        pool.close(force=True)          # waits for the copy, then unmaps the pool
        try:
            h.wait(60)
            err = None
        except PoolClosedError as exc:
            err = str(exc)
        print(json.dumps({"running_at_close": running_at_close, "closed": pool.closed, "err": err,
                          "state": s.state, "intact": torch.equal(t, want)}))
    """))
    assert out["running_at_close"], "the copy had finished before close(): the case was not exercised"
    assert out["closed"]
    assert out["err"] and "still resident" in out["err"]
    assert out["state"] == "resident" and out["intact"]


def test_close_refuses_with_pool_busy_naming_the_copy_when_it_outlasts_the_bound(pool):
    t = big_tensor()
    want = t.clone()
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu", name="weights")
    h = s.offload_async()
    with pytest.raises(PoolBusyError, match="'weights' offload"):
        pool.close(force=True, timeout=0)
    assert not pool.closed  # refused: the pool stays usable
    h.wait(60)
    s.reload(60)
    assert torch.equal(t, want)
    s.close()     # its kept blocks go back
    pool.close()  # nothing in flight, no block holding data: closes
    assert pool.closed


def test_reload_finished_before_close_completes_normally():
    out = run_child(ONE_SET_CHILD + textwrap.dedent("""
        s.offload(60)
        h = s.reload_async()
        pool.close(force=True)          # waits for the reload's copy first
        h.wait(60)
        print(json.dumps({"state": s.state, "intact": torch.equal(t, want)}))
    """))
    assert out == {"state": "resident", "intact": True}


# -- item: a synchronous call that times out can be waited again -------------------------------------------
def test_timed_out_offload_and_reload_keep_their_handle_and_the_set_recovers(pool):
    t = big_tensor()
    want = t.clone()
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    with pytest.raises(TransferTimeoutError) as info:
        s.offload(timeout=0)
    assert isinstance(info.value.handle, colomem.SwapHandle)
    assert s.state == "offloading"
    for call in (s.offload, s.reload, s.discard, s.close):
        with pytest.raises(PhaseOrderError, match="wait_pending"):
            call()
    stats = s.wait_pending(None)
    assert isinstance(stats, SwapStats) and stats.direction == "d2h" and stats.nbytes == BIG
    assert s.state == "offloaded" and s.wait_pending() is None

    with pytest.raises(TransferTimeoutError) as info:
        s.reload(timeout=0)
    assert s.state == "reloading"
    assert info.value.handle.wait(60).direction == "h2d"
    assert s.state == "resident" and torch.equal(t, want)
    s.offload(60)  # usable again: a full cycle
    s.reload(60)
    assert torch.equal(t, want)


# -- item: unbounded, invalid timeouts -------------------------------------------------------------------
@pytest.mark.parametrize("timeout", [1e10, math.inf, 1e300, None], ids=["1e10", "inf", "1e300", "None"])
def test_huge_and_infinite_timeouts_wait_for_the_copy(pool, timeout):
    t = big_tensor()
    want = t.clone()
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    assert s.offload_async().wait(timeout).nbytes == BIG  # not a TransferTimeoutError at once
    assert s.reload_async().wait(timeout).nbytes == BIG
    assert torch.equal(t, want)


@pytest.mark.parametrize("timeout", [1e10, math.inf])
def test_core_transfer_wait_treats_huge_timeouts_as_no_bound(timeout):
    src, dst = big_tensor(), torch.zeros(BIG // 8, dtype=torch.int64)
    tr = _C.CopyEngine(-1).submit("d2h", [(dst.data_ptr(), src.data_ptr(), BIG)])
    try:
        tr.wait(timeout)
        assert tr.done() and torch.equal(dst, src)
    finally:
        tr.wait(60.0)  # never free the tensors under a running copy


@pytest.mark.parametrize("timeout", [math.nan, -1.0, -1e-9, -math.inf])
def test_core_transfer_wait_refuses_nan_and_negative_timeouts(timeout):
    src, dst = big_tensor(), torch.zeros(BIG // 8, dtype=torch.int64)
    tr = _C.CopyEngine(-1).submit("h2d", [(dst.data_ptr(), src.data_ptr(), BIG)])
    try:
        with pytest.raises(InvalidArgumentError, match="timeout"):
            tr.wait(timeout)
    finally:
        tr.wait(60.0)  # the refused wait lost nothing (and the tensors outlive the copy)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("timeout", [math.nan, -1, -0.5, "5", True], ids=["nan", "-1", "-0.5", "str", "bool"])
def test_swap_waits_refuse_invalid_timeouts_before_anything_starts(pool, timeout):
    t = torch.arange(1000, dtype=torch.float32)
    want = t.clone()
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    with pytest.raises(InvalidArgumentError, match="timeout"):
        s.offload(timeout)
    assert s.state == "resident"  # nothing was submitted
    h = s.offload_async()
    with pytest.raises(InvalidArgumentError, match="timeout"):
        h.wait(timeout)
    h.wait(60)  # the handle is still good
    with pytest.raises(InvalidArgumentError, match="timeout"):
        s.reload(timeout)
    assert s.state == "offloaded"
    s.reload(60)
    assert torch.equal(t, want)


# -- item: fork() --------------------------------------------------------------------------------------
def test_offload_in_a_fork_child_raises_not_available_at_once():
    out = run_child("""
        import json, math, os, sys, time
        import torch, colomem
        from colomem import _torch
        from colomem.errors import NotAvailableError
        torch.set_num_threads(1)
        pool = colomem.PinnedPool("16MiB", pin=False)
        t = torch.arange(100000, dtype=torch.float32)
        want = t.clone()
        s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
        s.offload(60)
        s.reload(60)                    # the copy engine (and its threads) exist now, in this process
        dst = torch.zeros_like(t)
        started = _torch.engine_for(torch.device("cpu")).submit("h2d", [(dst.data_ptr(), t.data_ptr(), 400000)])
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            res = {}
            t0 = time.monotonic()
            try:
                s.offload(None)         # no bound: before the fix this waited for ever
                res["offload"] = "no error"
            except NotAvailableError as exc:
                res["offload"] = str(exc)
            try:
                started.wait(math.inf)  # a transfer of the parent: no thread here will finish it
                res["wait"] = "no error"
            except NotAvailableError as exc:
                res["wait"] = str(exc)
            res["seconds"] = time.monotonic() - t0
            res["state"] = s.state
            res["intact"] = torch.equal(t, want)
            os.write(w, json.dumps(res).encode())
            sys.exit(0)                 # a normal exit: tearing the engine down must not hang either
        os.close(w)
        child = json.loads(os.read(r, 1 << 16).decode())
        _, status = os.waitpid(pid, 0)
        started.wait(60)
        s.offload(60)                   # the parent's engine is untouched
        s.reload(60)
        print(json.dumps({"child": child, "status": status, "parent_ok": torch.equal(t, want)}))
    """)
    child = out["child"]
    assert out["status"] == 0 and out["parent_ok"]
    assert "fork()" in child["offload"] and "spawn" in child["offload"]
    assert "fork()" in child["wait"]
    assert child["seconds"] < 30  # at once, not after some timeout
    assert child["state"] == "resident" and child["intact"]


def test_fork_before_the_first_copy_then_swapping_in_the_child_works():
    out = run_child("""
        import json, os, sys
        import torch, colomem
        torch.set_num_threads(1)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            pool = colomem.PinnedPool("16MiB", pin=False)
            t = torch.arange(100000, dtype=torch.float32)
            want = t.clone()
            s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
            s.offload(60)
            s.reload(60)
            os.write(w, json.dumps({"intact": torch.equal(t, want)}).encode())
            sys.exit(0)
        os.close(w)
        child = json.loads(os.read(r, 1 << 16).decode())
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"child": child, "status": status}))
    """)
    assert out == {"child": {"intact": True}, "status": 0}


# -- item: offloaded() when one reload fails -------------------------------------------------------------
def test_offloaded_reloads_every_set_and_raises_the_first_error():
    pa, pb = colomem.PinnedPool(0, pin=False), colomem.PinnedPool(0, pin=False)
    a, b = torch.arange(5000, dtype=torch.float64), torch.arange(7000, dtype=torch.int32)
    want_a = a.clone()
    sa = colomem.SwapSet.from_tensors([a], pa, device="cpu", name="a")
    sb = colomem.SwapSet.from_tensors([b], pb, device="cpu", name="b")
    try:
        with pytest.raises(PoolClosedError, match="b: its pool was closed"):
            with colomem.offloaded(sa, sb, timeout=60):
                assert sa.state == sb.state == "offloaded"
                pb.close(force=True)  # b cannot come back now; a still can
        assert sa.state == "resident" and torch.equal(a, want_a)
        assert sb.state == "offloaded"
    finally:
        pa.close(force=True)
        pb.close(force=True)
