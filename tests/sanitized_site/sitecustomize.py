"""Imported at start-up by every Python process of the sanitizer run (this folder is first on PYTHONPATH
there, nowhere else): colomem._C must be the instrumented build, in the test process and in every child
it starts (subprocess, multiprocessing spawn, torchrun workers).

COLOMEM_TEST_SANITIZERS names the sanitizers the build must report; COLOMEM_TEST_SANITIZER_LOG is a folder
where each process that loads colomem._C leaves one JSON record, so the sanitizer test can show that the
children really loaded it, and which one did not (a child whose failure its test expects would hide it).
This module shadows a system-wide sitecustomize in those processes only (Debian's installs an apport crash
hook, nothing the tests need).
"""
import json
import os
import sys
from importlib.machinery import ExtensionFileLoader, PathFinder

_WANT = os.environ.get("COLOMEM_TEST_SANITIZERS", "")
_LOG = os.environ.get("COLOMEM_TEST_SANITIZER_LOG", "")


def _record(origin, sanitizers):
    entry = {"pid": os.getpid(), "argv": list(getattr(sys, "orig_argv", sys.argv)), "origin": origin,
             "sanitizers": sanitizers, "torchrun": "TORCHELASTIC_RUN_ID" in os.environ, "rank": "RANK" in os.environ}
    with open(os.path.join(_LOG, f"{os.getpid()}.json"), "w") as f:
        json.dump(entry, f)


class _CheckedLoader(ExtensionFileLoader):
    def exec_module(self, module):
        super().exec_module(module)
        got = module.build_info().get("sanitizers", "")
        _record(self.path, got)
        if got != _WANT:
            raise ImportError(f"colomem._C at {self.path} reports sanitizers {got!r}, the sanitizer run needs "
                              f"{_WANT!r}: a child's PYTHONPATH does not start with the caller's")


class _Finder:
    """Finds colomem._C as the import system would and hands it to the checking loader."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "colomem._C":
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and isinstance(spec.loader, ExtensionFileLoader):
            spec.loader = _CheckedLoader(spec.loader.name, spec.loader.path)
        return spec


if _WANT and _LOG:
    sys.meta_path.insert(0, _Finder())
