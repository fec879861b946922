"""benchmarks/targets.py: every performance target's figure is read from a committed result file."""
import json
import statistics
from pathlib import Path

from bench_module import load_benchmark

REPO = Path(__file__).resolve().parents[1]


def _targets():
    return load_benchmark("targets")


def test_every_target_reads_a_figure_from_its_result_file():
    t = _targets()
    report = t.evaluate()
    for k, d in report["detail"].items():
        assert "error" not in d, (k, d)
        assert isinstance(report[k], float), (k, report[k])
        assert (REPO / d["source"]).is_file()
        if d["target"] is not None:
            assert d["met"] in (True, False)
    # the figures are those of the files, not typed in
    first = t.TARGETS[0]
    ratios = []
    for src in (first.source, *first.more):
        steps = json.loads((t.RESULTS / src).read_text())["step_s_by_mode"]
        ratios.append(steps["trl"] / steps["colomem"])
    assert report[first.key] == statistics.median(ratios)
    if first.more:    # each round's own figure stands beside the median
        assert sorted(report["detail"][first.key]["rounds"].values()) == sorted(ratios)
    lora = next(x for x in t.TARGETS if x.key == "lora7b_speedup_vs_trl")
    assert report[lora.key] == json.loads((t.RESULTS / lora.source).read_text())["lora7b_shared_merged_speedup_vs_trl"]


def test_a_missing_file_leaves_the_figure_empty_and_says_why(tmp_path):
    report = _targets().evaluate(tmp_path)
    assert all(v is None for k, v in report.items() if k != "detail")
    assert all("error" in d and d["met"] is None for d in report["detail"].values())


def test_the_table_lists_every_target(tmp_path):
    t = _targets()
    assert t.main(["--out", str(tmp_path / "t.json")]) == 0
    table = (tmp_path / "t.md").read_text()
    assert all(f"`{x.key}`" in table for x in t.TARGETS)
    assert json.loads((tmp_path / "t.json").read_text()).keys() >= {x.key for x in t.TARGETS}
