"""The host-only core built with AddressSanitizer + UndefinedBehaviorSanitizer passes the CPU suite.

Builds colomem._C once more (COLOMEM_FORCE_CPU=1 COLOMEM_SANITIZE=address,undefined) into a temporary
directory and runs the core's CPU tests against it in a fresh interpreter with libasan preloaded.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE_TESTS = ["tests/test_pool.py", "tests/test_swap.py", "tests/test_copy_engine.py", "tests/test_reliability_pool.py",
              "tests/test_reliability_swap.py", "tests/test_reliability_bridge.py",
              "tests/test_reliability_sockets.py"]


def _runtime(name):
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if not cc:
        return None
    out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if out and os.path.isabs(out) and os.path.exists(out) else None


@pytest.mark.slow
def test_cpu_suite_passes_under_asan_and_ubsan(tmp_path):
    # libstdc++ is preloaded too: ASan's __cxa_throw interceptor must find it at start-up, and python
    # itself does not link it (without it the first C++ exception aborts the process).
    libasan, libstdcxx = _runtime("libasan.so"), _runtime("libstdc++.so")
    if libasan is None or libstdcxx is None:
        pytest.skip("no libasan.so for the C++ compiler (install gcc's sanitizer runtime)")
    lib, build = tmp_path / "lib", tmp_path / "build"
    env = dict(os.environ, COLOMEM_FORCE_CPU="1", COLOMEM_SANITIZE="address,undefined")
    b = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(lib), "--build-temp",
                        str(build)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    for py in (ROOT / "colomem").rglob("*.py"):
        dst = lib / "colomem" / py.relative_to(ROOT / "colomem")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(py, dst)
    run_env = dict(os.environ, PYTHONPATH=str(lib), LD_PRELOAD=f"{libasan} {libstdcxx}",
                   ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    probe = subprocess.run([sys.executable, "-c", "import colomem; print(colomem.build_info()['sanitizers'], "
                            "colomem.__file__)"], cwd=tmp_path, env=run_env, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.startswith("address,undefined " + str(lib)), probe.stdout
    t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        *[str(ROOT / p) for p in CORE_TESTS]], cwd=tmp_path, env=run_env, capture_output=True,
                       text=True, timeout=900)
    tail = t.stdout[-4000:] + t.stderr[-4000:]
    assert t.returncode == 0, tail
    assert "passed" in t.stdout and "ERROR: AddressSanitizer" not in tail and "runtime error:" not in tail
