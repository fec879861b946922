"""The pinned pool under bad input and faults: sizes that would wrap, alignments and caps that must hold,
views after close, pre-faulting without threads, and a failed offload that must give its blocks back.

Cases that crashed the process before their fix run in a child interpreter, so a regression fails the test
instead of killing pytest.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import colomem
from child_env import child_env
from colomem import _C
from colomem.errors import InvalidArgumentError, PoolClosedError, PoolExhaustedError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = os.sysconf("SC_PAGESIZE")


def _pool(initial=0, **kw):
    kw.setdefault("pin", False)
    kw.setdefault("huge_pages", False)
    return colomem.PinnedPool(initial, **kw)


def _run_child(code: str, env_extra=None, timeout=120) -> subprocess.CompletedProcess:
    env = child_env(**(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


# ---------------------------------------------------------------------------------- sizes that would wrap
@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**64 - PAGE, 2**63, 64 * GiB + 1])
def test_alloc_of_an_impossible_size_is_refused_not_a_zero_byte_block(nbytes):
    with _pool("1MiB") as pool:
        before = pool.stats()
        with pytest.raises(InvalidArgumentError, match="bytes|64 GiB"):
            pool.alloc(nbytes)
        after = pool.stats()
        assert after["blocks"] == 0 and after["in_use_bytes"] == 0
        assert after["reserved_bytes"] == before["reserved_bytes"]


@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**64 - PAGE, 2**63 + 1])
def test_core_alloc_checks_its_own_rounding(nbytes):
    # The core is checked on its own too: the Python layer is not its only guard.
    core = _C.HostPool(initial_bytes=MiB, pin=False, huge_pages=False)
    with pytest.raises(InvalidArgumentError):
        core.alloc(nbytes)
    assert core.stats()["blocks"] == 0
    with pytest.raises(InvalidArgumentError):
        core.reserve(nbytes)
    assert core.stats()["reserved_bytes"] == MiB
    core.close()


@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**64 - PAGE, 2**64, 2**70])
def test_reserve_near_two_to_the_64_is_refused(nbytes):
    with _pool() as pool:
        with pytest.raises(InvalidArgumentError):
            pool.reserve(nbytes)
        s = pool.stats()
        assert s["reserved_bytes"] == 0 and s["segments"] == 0


def test_reserve_above_the_largest_block_names_the_limit_instead_of_clamping():
    with _pool() as pool:
        with pytest.raises(InvalidArgumentError, match="64 GiB") as ei:
            pool.reserve("100GiB")
        assert "initial" in str(ei.value)  # says how to get a larger pool
        assert pool.stats()["reserved_bytes"] == 0  # nothing was mapped, 64 GiB least of all


def test_segment_bytes_above_the_segment_limit_is_refused_not_clamped():
    with pytest.raises(InvalidArgumentError, match="64 GiB"):
        _pool(segment_bytes="100GiB")
    with pytest.raises(InvalidArgumentError, match="64 GiB"):
        _C.HostPool(segment_bytes=65 * GiB, pin=False)


def test_initial_larger_than_the_host_is_refused_before_anything_is_faulted_in():
    phys = os.sysconf("SC_PHYS_PAGES") * PAGE
    with pytest.raises(PoolExhaustedError, match="RAM"):
        _pool(phys + 64 * GiB)


# -------------------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("alignment", [4 * MiB, 16 * MiB, 32 * MiB])
def test_alignments_above_two_mib_are_honoured_for_every_block(alignment):
    with _pool(0, alignment=alignment, segment_bytes=4 * alignment) as pool:
        blocks = [pool.alloc(n) for n in (1, PAGE, alignment - 1, alignment, alignment + 1, 3, 5000, 7)]
        assert all(b.address % alignment == 0 for b in blocks), [hex(b.address) for b in blocks]
        for b in blocks[::2]:
            b.release()
        again = [pool.alloc(n) for n in (1, alignment + 1, 2)]
        assert all(b.address % alignment == 0 for b in again)
        # the blocks hold their bytes: write a pattern into each and read it back
        for i, b in enumerate(blocks[1::2] + again):
            b.as_tensor().fill_(i + 1)
        for i, b in enumerate(blocks[1::2] + again):
            t = b.as_tensor()
            assert int(t.min()) == int(t.max()) == i + 1
        for b in blocks[1::2] + again:
            b.release()


@pytest.mark.parametrize("alignment", [0, 3, 3000, 2 * GiB, 2**40])
def test_bad_alignment_is_refused_by_both_layers(alignment):
    with pytest.raises(InvalidArgumentError, match="power of two"):
        _pool(alignment=alignment)
    if alignment > 0:
        with pytest.raises(InvalidArgumentError, match="power of two"):
            _C.HostPool(alignment=alignment, pin=False)


# ---------------------------------------------------------------------------------------------- the cap
@pytest.mark.parametrize("cap", [PAGE + 100, 3 * PAGE + 1, 5 * PAGE - 1, 2 * MiB + 123, 2 * MiB - 1])
@pytest.mark.parametrize("huge_pages", [False, True])
def test_a_cap_that_is_not_a_page_multiple_is_never_exceeded(cap, huge_pages):
    with _pool(0, max_bytes=cap, segment_bytes=PAGE, huge_pages=huge_pages) as pool:
        blocks = []
        for n in [1, PAGE, 3 * PAGE, 100, 2 * PAGE + 1] * 200:
            try:
                blocks.append(pool.alloc(n))
            except PoolExhaustedError:
                pass
            assert pool.stats()["reserved_bytes"] <= cap
        assert pool.stats()["reserved_bytes"] == cap // PAGE * PAGE  # filled to the cap, in whole pages
        with pytest.raises(PoolExhaustedError):
            pool.reserve(PAGE)
        assert pool.stats()["reserved_bytes"] <= cap
        for b in blocks:
            b.release()


def test_initial_at_a_cap_that_is_not_a_page_multiple_stays_under_it():
    with _pool(PAGE, max_bytes=PAGE + 100, huge_pages=True) as pool:
        assert pool.stats()["reserved_bytes"] == PAGE
    with pytest.raises(InvalidArgumentError, match="larger than max_bytes"):
        _pool(PAGE + 100, max_bytes=PAGE + 100)  # rounded up to pages it would be past the cap


@pytest.mark.parametrize("cap", [1, 100, PAGE - 1])
def test_a_cap_below_one_page_is_refused(cap):
    with pytest.raises(InvalidArgumentError, match="less than one page"):
        _pool(0, max_bytes=cap)
    with pytest.raises(InvalidArgumentError, match="less than one page"):
        _pool(cap, max_bytes=cap)


def test_a_cap_of_zero_is_refused_not_read_as_no_cap():
    with pytest.raises(InvalidArgumentError, match="max_bytes=None"):
        _pool(0, max_bytes=0)


# ------------------------------------------------------------------------------- untyped errors, typed
BAD_SIZES = [-1, -4096, 2**64, 2**80, float("nan"), float("inf"), -1.0, 1e30, "abc", "12 parsecs", "-5MiB",
             "1e400", None, [], object(), b"4096", 1j]


@pytest.mark.parametrize("value", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("field", ["initial", "max_bytes", "segment_bytes"])
def test_bad_constructor_sizes_raise_invalid_argument(field, value):
    if field == "max_bytes" and value is None:
        pytest.skip("max_bytes=None means no cap")
    kw = {"initial": 0, field: value}
    initial = kw.pop("initial")
    with pytest.raises(InvalidArgumentError, match=field):
        _pool(initial, **kw)


@pytest.mark.parametrize("value", [-1, 2**64, 2**70, 1.5, 4096.0, float("nan"), "4096", None, True, [], object()],
                         ids=repr)
def test_bad_alloc_sizes_raise_invalid_argument(value):
    with _pool("1MiB") as pool:
        with pytest.raises(InvalidArgumentError, match="nbytes"):
            pool.alloc(value)
        assert pool.stats()["blocks"] == 0


@pytest.mark.parametrize("value", [-1, 2**64, float("nan"), float("inf"), "lots", None, []], ids=repr)
def test_bad_reserve_sizes_raise_invalid_argument(value):
    with _pool() as pool:
        with pytest.raises(InvalidArgumentError, match="nbytes"):
            pool.reserve(value)


@pytest.mark.parametrize("kw", [{"prefault_threads": -1}, {"prefault_threads": 2**40}, {"prefault_threads": 1.5},
                                {"prefault_threads": "4"}, {"prefault_threads": None}, {"alignment": 4096.0},
                                {"alignment": "4096"}, {"alignment": None}, {"huge_pages": "yes"},
                                {"pin": "yes"}, {"prefault": "never"}], ids=repr)
def test_bad_constructor_options_raise_invalid_argument(kw):
    with pytest.raises(InvalidArgumentError):
        colomem.PinnedPool(0, **{"pin": False, **kw})


def test_integer_like_sizes_still_work():
    import numpy as np

    with _pool(np.int64(MiB), max_bytes="4MiB", segment_bytes=1.0 * MiB) as pool:
        b = pool.alloc(np.uint32(5000))
        assert b.nbytes == 2 * PAGE if PAGE == 4096 else b.nbytes >= 5000
        assert b.as_tensor(np.int64(10)).numel() == 10
        b.release()
        pool.reserve("2MiB")


def test_free_and_as_tensor_refuse_what_is_not_theirs():
    with _pool("1MiB") as pool:
        with pytest.raises(InvalidArgumentError, match="Block"):
            pool.free("block 1")
        b = pool.alloc(100)
        with pytest.raises(InvalidArgumentError, match="nbytes"):
            b.as_tensor(-1)
        with pytest.raises(InvalidArgumentError, match="nbytes"):
            b.as_tensor(2**64)
        b.release()
        with pytest.raises(InvalidArgumentError, match="released"):
            b.as_tensor()


# ----------------------------------------------------------------------------------- views after close
def test_block_as_tensor_after_a_forced_close_raises_pool_closed():
    pool = _pool("1MiB")
    b = pool.alloc(PAGE)
    b.as_tensor().fill_(3)
    pool.close(force=True)
    with pytest.raises(PoolClosedError, match="closed"):
        b.as_tensor()
    with pytest.raises(PoolClosedError, match="closed"):
        b.as_tensor(16)


def test_swapset_host_views_after_a_forced_close_raise_pool_closed():
    pool = _pool("1MiB")
    t = torch.arange(1000, dtype=torch.float32)
    s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
    s.offload()
    assert torch.equal(s.host_view(t), torch.arange(1000, dtype=torch.float32))  # readable while open
    pool.close(force=True)
    with pytest.raises(PoolClosedError, match="pool was closed"):
        s.host_view(t)
    with pytest.raises(PoolClosedError, match="pool was closed"):
        s.host_storage(t)


def test_reading_after_a_forced_close_does_not_crash_the_process():
    # Before the fix the view pointed into unmapped memory and reading it was a segfault.
    r = _run_child("""
        import torch, colomem
        from colomem.errors import PoolClosedError
        pool = colomem.PinnedPool("4MiB", pin=False)
        t = torch.ones(1 << 18)
        s = colomem.SwapSet.from_tensors([t], pool, device="cpu")
        s.offload()
        b = pool.alloc(4096)
        pool.close(force=True)
        for f in (lambda: s.host_view(t).sum(), lambda: s.host_storage(t).sum(), lambda: b.as_tensor().sum()):
            try:
                f()
            except PoolClosedError:
                pass
            else:
                raise SystemExit("a view of a closed pool was returned")
        print("typed")
    """)
    assert r.returncode == 0 and "typed" in r.stdout, r.stdout + r.stderr[-3000:]


# ------------------------------------------------------------------------- pre-fault without threads
_NO_THREADS_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

/* pthread_create fails with EAGAIN (what RLIMIT_NPROC gives) once COLOMEM_TEST_THREADS_LEFT is set and
   that many threads were started after it; unset, threads start as usual (so the interpreter can start). */
typedef int (*create_fn)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  static create_fn real;
  const char* left = getenv("COLOMEM_TEST_THREADS_LEFT");
  if (left) {
    int n = atoi(left);
    if (n <= 0) return EAGAIN;
    static char buf[16];
    snprintf(buf, sizeof buf, "%d", n - 1);
    setenv("COLOMEM_TEST_THREADS_LEFT", buf, 1);
  }
  if (!real) real = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
  return real(t, a, f, arg);
}
"""

_GROW_IN_CHILD = """
    import ctypes, os, colomem
    os.environ["COLOMEM_TEST_THREADS_LEFT"] = "{left}"
    pool = colomem.PinnedPool("{initial}", pin=False, prefault_threads=8, prefault="{prefault}")
    b = pool.alloc(3 << 20)       # grows the pool by a second segment, again without threads
    ctypes.memset(b.address, 7, b.nbytes)  # (no torch op here: its OpenMP would want threads too)
    assert ctypes.string_at(b.address, b.nbytes) == bytes([7]) * b.nbytes
    assert pool.stats()["segments"] == 2
    b.release()
    pool.close()
    print("pool ok")
"""


@pytest.fixture(scope="module")
def no_threads_shim(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the pthread_create shim")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(_NO_THREADS_SHIM)
    so = d / "libnothreads.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(d / "shim.c"), "-ldl"], check=True)
    return so


@pytest.mark.parametrize("left", [0, 1, 3])
@pytest.mark.parametrize("prefault", ["touch", "populate"])
def test_pool_grows_when_no_prefault_thread_can_start(no_threads_shim, left, prefault):
    # `left` threads start, the others fail: before the fix a failure after one started was std::terminate.
    preload = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(no_threads_shim)) if p)
    r = _run_child(_GROW_IN_CHILD.format(left=left, initial="2MiB", prefault=prefault),
                   {"LD_PRELOAD": preload})
    assert r.returncode == 0 and "pool ok" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "terminate" not in r.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="RLIMIT_NPROC does not bind root; the shim test covers this")
def test_pool_grows_under_rlimit_nproc():
    r = _run_child("""
        import ctypes, resource, colomem
        resource.setrlimit(resource.RLIMIT_NPROC, (1, resource.getrlimit(resource.RLIMIT_NPROC)[1]))
        pool = colomem.PinnedPool("2MiB", pin=False, prefault_threads=8)
        b = pool.alloc(3 << 20)
        ctypes.memset(b.address, 1, b.nbytes)
        assert ctypes.string_at(b.address, b.nbytes) == bytes([1]) * b.nbytes
        assert pool.stats()["segments"] == 2
        print("pool ok")
    """)
    assert r.returncode == 0 and "pool ok" in r.stdout, r.stdout + r.stderr[-3000:]


# ------------------------------------------------------------------------- a failed offload's blocks
class _FailingEngine:
    def submit(self, *a, **kw):
        raise colomem.CudaError("injected: the copy could not be queued")


@pytest.mark.parametrize("cycles_before", [0, 1])
@pytest.mark.parametrize("keep_blocks", [True, False])
def test_a_failed_offload_returns_its_pool_blocks(monkeypatch, keep_blocks, cycles_before):
    from colomem import _torch

    pool = _pool("4MiB")
    ts = [torch.arange(1000, dtype=torch.float32), torch.full((300,), 2.5)]
    s = colomem.SwapSet.from_tensors(ts, pool, device="cpu", keep_blocks=keep_blocks)
    for _ in range(cycles_before):  # with keep_blocks, the set now holds kept blocks
        s.offload()
        s.reload()
    real = _torch.engine_for
    monkeypatch.setattr(_torch, "engine_for", lambda device: _FailingEngine())
    with pytest.raises(colomem.CudaError, match="injected"):
        s.offload()
    assert s.state == "resident" and s.host_bytes == 0
    st = pool.stats()
    assert st["blocks"] == 0 and st["in_use_bytes"] == 0  # design.md: a failed offload returns its blocks
    assert torch.equal(ts[0], torch.arange(1000, dtype=torch.float32))  # no GPU (here: host) memory freed
    monkeypatch.setattr(_torch, "engine_for", real)
    s.offload()  # and the set works again
    s.reload()
    assert torch.equal(ts[0], torch.arange(1000, dtype=torch.float32)) and float(ts[1][0]) == 2.5
    s.close()
    assert pool.stats()["blocks"] == 0
    pool.close()


def test_an_infinite_size_says_it_must_be_finite():
    with pytest.raises(InvalidArgumentError, match="finite"):
        _pool(float("inf"))
