"""benchmarks/warm_imports.py: the kit's packages imported once in a fresh interpreter before any timed run;
modules that are not installed are left out, a failed import is reported with its error, never raised, and
an import that hangs is cut at its bound."""
import sys

from bench_module import load_benchmark

wi = load_benchmark("warm_imports")


def test_installed_modules_are_imported_and_missing_ones_left_out():
    r = wi.warm(["json", "no_such_module_here", "json"], timeout_s=60)
    assert r["modules"] == ["json"] and r["rc"] == 0 and r["error_tail"] is None and r["seconds"] > 0


def test_nothing_installed_is_no_import_at_all():
    assert wi.warm(["no_such_module_here"], timeout_s=60) == {"modules": [], "seconds": 0.0, "rc": None,
                                                              "error_tail": None}


def test_a_failing_import_is_reported_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_for_warm.py").write_text("raise RuntimeError('this package is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = wi.warm(["broken_for_warm"], timeout_s=60, cwd=tmp_path)
    assert r["rc"] not in (0, None) and "this package is broken" in r["error_tail"]


def test_an_import_that_hangs_is_cut_at_its_bound(tmp_path, monkeypatch):
    (tmp_path / "slow_for_warm.py").write_text("import time\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = wi.warm(["slow_for_warm"], timeout_s=1, cwd=tmp_path)
    assert r["rc"] == "timeout" and r["seconds"] < 20
    assert sys.modules.get("slow_for_warm") is None        # imported in the child only
