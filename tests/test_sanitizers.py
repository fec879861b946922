"""The whole CPU suite passes with colomem._C built with AddressSanitizer + UndefinedBehaviorSanitizer, and
every child process the suite starts runs that build too.

Builds colomem._C once more (COLOMEM_FORCE_CPU=1 COLOMEM_SANITIZE=address,undefined) into a temporary
directory and runs tests/ against it in a fresh pytest with libasan preloaded. tests/sanitized_site comes
first on that run's PYTHONPATH: its sitecustomize makes every Python process of the run (the test process,
`python -c` children, bridge peers, torchrun agents and workers, multiprocessing spawn workers, the CLI)
refuse a colomem._C that is not the instrumented build and leave a record of the one it loaded. Sanitizer
reports of every process go to files, so a child whose failure its test expects cannot hide one.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANITIZERS = "address,undefined"
SITE = ROOT / "tests" / "sanitized_site"

# Left out of the sanitized run, each with the reason it cannot run there (GPU tests skip by themselves:
# the sanitized build is host-only).
EXCLUDED = {
    # this test: it would build and run the suite again inside itself
    "tests/test_sanitizers.py",
    # Inductor builds its CPU kernels with g++, which inherits the preloaded libasan here: minutes on a cold
    # kernel cache (a fresh CI machine), for tests whose subject is torch's compiler; the pool, offload and
    # reload calls they make are the ones the trainer and swap tests already run in this build
    "tests/test_torch_compile_cpu.py",
    # a thousand steps of the same loop, pool and swap calls the loop tests make in this build; its subject is
    # the runner's host memory over time, which ASan's own allocator and quarantine would swamp
    "tests/test_soak_cpu.py",
}

# ASan: leak checking is off (CPython and torch keep allocations alive until exit on purpose);
# alloc_dealloc_mismatch and new_delete_type_mismatch are off because torch's uninstrumented libraries free
# with a different call than allocated (libasan intercepts every process's allocator, not just ours).
# abort_on_error / halt_on_error: the first report ends that process (its test then fails too).
ASAN = "detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0"
UBSAN = "print_stacktrace=1:halt_on_error=1"

# Kinds of child process the suite starts, by what their command line holds; each must have loaded the
# instrumented build at least once (a kind missing here means the check itself no longer sees it).
CHILD_KINDS = {
    "the test process": lambda r: "pytest" in " ".join(r["argv"]),
    "a `python -c` child": lambda r: "-c" in r["argv"][1:2] and not _spawned(r),
    "a bridge peer script": lambda r: any(a.endswith("_bridge_peer.py") for a in r["argv"]),
    "a torchrun worker": lambda r: r["torchrun"],
    "a rank process started with RANK/WORLD_SIZE": lambda r: r["rank"] and not r["torchrun"],
    "a multiprocessing spawn worker": lambda r: _spawned(r),
    "the CLI (python -m colomem.runner)": lambda r: r["argv"][1:3] == ["-m", "colomem.runner"],
}


def _spawned(record) -> bool:
    return "--multiprocessing-fork" in record["argv"]


def _runtime(name):
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if not cc:
        return None
    out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if out and os.path.isabs(out) and os.path.exists(out) else None


def _build(tmp_path) -> Path:
    """The instrumented host-only build plus the package's Python files, in a folder of their own."""
    lib, build = tmp_path / "lib", tmp_path / "build"
    env = dict(os.environ, COLOMEM_FORCE_CPU="1", COLOMEM_SANITIZE=SANITIZERS)
    b = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(lib), "--build-temp",
                        str(build)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    src = ROOT / "colomem"
    for f in [*src.rglob("*.py"), src / "_C.pyi", src / "py.typed"]:
        dst = lib / "colomem" / f.relative_to(src)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dst)
    return lib


def _reports(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}" for p in sorted(folder.iterdir()))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_cpu_suite_passes_under_asan_and_ubsan_in_every_process(tmp_path):
    # libstdc++ is preloaded too: ASan's __cxa_throw interceptor must find it at start-up, and python
    # itself does not link it (without it the first C++ exception aborts the process).
    libasan, libstdcxx = _runtime("libasan.so"), _runtime("libstdc++.so")
    if libasan is None or libstdcxx is None:
        pytest.skip("no libasan.so for the C++ compiler (install gcc's sanitizer runtime)")
    lib = _build(tmp_path)
    records, reports, work = tmp_path / "loaded", tmp_path / "reports", tmp_path / "work"
    for d in (records, reports, work):
        d.mkdir()
    run_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(lib)]),
                   LD_PRELOAD=f"{libasan} {libstdcxx}",
                   ASAN_OPTIONS=f"{ASAN}:log_path={reports / 'asan'}",
                   UBSAN_OPTIONS=f"{UBSAN}:log_path={reports / 'ubsan'}",
                   COLOMEM_TEST_SANITIZERS=SANITIZERS, COLOMEM_TEST_SANITIZER_LOG=str(records))
    # the working directory is not the checkout: `python -c` and `-m` put it first on sys.path, where the
    # checkout's own colomem (the uninstrumented build) would win over PYTHONPATH
    ignore = [f"--ignore={ROOT / p}" for p in sorted(EXCLUDED)]
    t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=5",
                        "-rfE", *ignore, str(ROOT / "tests")], cwd=work, env=run_env,
                       capture_output=True, text=True, timeout=3300)
    # what a failure needs: the failures' own sections (the summary of skips follows them), then the end
    failures = t.stdout.partition("= FAILURES =")[2].partition("short test summary info")[0]
    tail = failures[:12000] + "\n...\n" + t.stdout[-3000:] + t.stderr[-3000:]
    found = list(reports.iterdir())
    assert not found, "sanitizer reports:\n" + _reports(reports) + "\n" + tail
    assert t.returncode == 0, tail
    assert " passed" in t.stdout, tail

    loaded = [json.loads(p.read_text()) for p in records.iterdir()]
    wrong = [r for r in loaded if r["sanitizers"] != SANITIZERS or not r["origin"].startswith(str(lib))]
    assert not wrong, "processes that loaded another colomem._C:\n" + "\n".join(map(json.dumps, wrong))
    missing = [kind for kind, is_kind in CHILD_KINDS.items() if not any(is_kind(r) for r in loaded)]
    assert not missing, f"no record of {missing} among {len(loaded)} processes that loaded colomem._C"


def test_a_process_of_the_sanitized_run_refuses_another_build_and_says_so(tmp_path):
    """The check the sanitized run relies on: a process that would import an uninstrumented colomem._C
    (here this process's own build, copied) fails at the import and leaves a record naming it."""
    from colomem import _C

    if _C.build_info()["sanitizers"] == SANITIZERS:
        pytest.skip("this process runs the instrumented build itself")
    src, copy, records = Path(_C.__file__).parent, tmp_path / "other" / "colomem", tmp_path / "loaded"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    records.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(copy.parent)]),
               COLOMEM_TEST_SANITIZERS=SANITIZERS, COLOMEM_TEST_SANITIZER_LOG=str(records))
    r = subprocess.run([sys.executable, "-c", "import colomem"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "needs 'address,undefined'" in r.stderr, r.stderr[-3000:]
    [record] = [json.loads(p.read_text()) for p in records.iterdir()]
    assert record["sanitizers"] == _C.build_info()["sanitizers"] and record["origin"].startswith(str(copy))
    assert record["argv"][1:] == ["-c", "import colomem"]
