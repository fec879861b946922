"""The environment of a child interpreter that a test starts.

The child must import the colomem this process imported: under the sanitizer run the caller's PYTHONPATH
names the instrumented build, so it stays first and the checkout comes after it (a child that runs a
script from elsewhere still finds colomem). Every test that builds a child's environment goes through here.
"""
import os
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[1]


def child_pythonpath(environ: Optional[dict] = None) -> str:
    """The caller's PYTHONPATH, then the checkout; no empty entry (it would put the child's working
    directory on sys.path ahead of both) and no duplicate."""
    environ = os.environ if environ is None else environ
    parts = []
    for p in [*environ.get("PYTHONPATH", "").split(os.pathsep), str(ROOT)]:
        if p and p not in parts:
            parts.append(p)
    return os.pathsep.join(parts)


def child_env(drop: Iterable[str] = (), **set_vars: str) -> dict:
    """os.environ without the names in `drop`, with `set_vars` set and PYTHONPATH from child_pythonpath."""
    env = {k: v for k, v in os.environ.items() if k not in set(drop)}
    env.update(set_vars)
    env["PYTHONPATH"] = child_pythonpath(env)
    return env
