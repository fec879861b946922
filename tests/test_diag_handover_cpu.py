"""benchmarks/diag_handover.py on a CPU: its summary of the rows, its refusals, and no run without a GPU."""
import pytest
import torch
from bench_module import load_benchmark


def _load():
    return load_benchmark("diag_handover")


def test_the_summary_gives_each_condition_its_medians_over_the_ceiling():
    d = _load()
    rows = [{"condition": "fresh", "alloc_s": 0.5, "gbps": 50.0},
            {"condition": "own", "alloc_s": 0.01, "gbps": 54.0}, {"condition": "other", "alloc_s": 0.2, "gbps": 45.0},
            {"condition": "own", "alloc_s": 0.03, "gbps": 52.0}, {"condition": "other", "alloc_s": 0.4, "gbps": 47.0}]
    s = d.summarize(rows, ceiling_gbps=55.0)
    assert s["fresh"]["n"] == 1 and s["own"]["n"] == 2 and s["other"]["n"] == 2
    assert s["own"]["copy_vs_ceiling"] == pytest.approx(53.0 / 55.0)
    assert s["other"]["alloc_s"] == pytest.approx(0.3) and s["other"]["alloc_s_range"] == [0.2, 0.4]
    assert s["other"]["copy_vs_ceiling_range"] == [pytest.approx(45 / 55), pytest.approx(47 / 55)]


def test_bad_arguments_are_refused_and_no_gpu_means_nothing_measured(tmp_path, monkeypatch):
    d = _load()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")      # main() sets it for its run: restored after
    with pytest.raises(SystemExit):
        d.main(["--out", str(tmp_path), "--gib", "0"])
    if not torch.cuda.is_available():
        assert d.main(["--out", str(tmp_path)]) == 2
        assert not (tmp_path / "diag_handover.json").exists()
