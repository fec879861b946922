"""mypy over colomem/ (settings in pyproject.toml) finds no error: every engine the runner builds satisfies
the Rollout / Trainer protocol it is used as (colomem/runner/backends.py types them so), and no module calls
a member that does not exist."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_finds_no_error_in_colomem():
    pytest.importorskip("mypy", reason="mypy comes with the test extras: pip install -e '.[test]'")
    env = {**os.environ, "MYPY_CACHE_DIR": os.environ.get("MYPY_CACHE_DIR", str(ROOT / ".mypy_cache"))}
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
