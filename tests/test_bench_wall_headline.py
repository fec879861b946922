"""The transfer bench's wall-clock headline (--only wall): ratios against the best of the raw and the chunked
peaks of the same run, the worst set reported, the default reload's better run of two, first cycles kept."""
from colomem.bench.__main__ import _wall_headline, headline, parse_args


def run(nbytes, off_ms, rel_ms, first_off_ms=None, first_rel_ms=None):
    gb = nbytes / 1e9
    return {"nbytes": nbytes, "offload_wall_gbps": gb / (off_ms / 1e3), "reload_wall_gbps": gb / (rel_ms / 1e3),
            "first_cycle": {"offload_wall_ms": first_off_ms or off_ms, "reload_wall_ms": first_rel_ms or rel_ms}}


def result():
    peak = {"d2h": {"gbps": 50.0}, "h2d": {"gbps": 50.0}}
    sweep = {"64": {"d2h": 54.0, "h2d": 53.0}, "256": {"d2h": 55.0, "h2d": 52.0}}
    big = {"pipelined": run(55e9, 1000, 1020), "grow_first": run(55e9, 1000, 1100),
           "pipelined_again": run(55e9, 1000, 1010)}
    small = {"pipelined": run(5.5e9, 110, 120, first_rel_ms=130), "grow_first": run(5.5e9, 110, 130),
             "pipelined_again": run(5.5e9, 110, 125)}
    return {"mode": "cuda", "peak": peak, "chunk_sweep_gbps": sweep, "sets": {}, "wall": {"big": big, "small": small}}


def test_the_worst_set_against_the_best_ceiling():
    h = _wall_headline(result())
    assert (h["wall_ceiling_d2h_gbps"], h["wall_ceiling_h2d_gbps"]) == (55.0, 53.0)
    assert h["wall_worst_set"] == "small"
    assert abs(h["offload_wall_vs_peak_worst"] - 50.0 / 55.0) < 1e-9   # 5.5 GB in 110 ms = 50 GB/s
    assert abs(h["reload_wall_vs_peak_worst"] - (5.5 / 0.120) / 53.0) < 1e-9  # the better of 120 and 125 ms
    assert abs(h["reload_wall_vs_peak_first_cycle_worst"] - (5.5 / 0.130) / 53.0) < 1e-9
    row = h["wall_vs_peak_by_set"]["big"]["grow_first"]
    assert abs(row["reload"] - (55 / 1.1) / 53.0) < 1e-9
    assert headline(result()) == h


def test_only_wall_is_an_option():
    assert parse_args(["--only", "wall"]).only == "wall"


def test_the_mapped_sets_figures_are_reported_beside_the_default():
    res = result()
    assert not any(k.startswith("mapped_") for k in _wall_headline(res))  # a run without the mapped variant
    res["wall"]["big"]["mapped"] = run(55e9, 1010, 1030, first_rel_ms=1100)
    res["wall"]["small"]["mapped"] = run(5.5e9, 104, 106, first_off_ms=108)
    h = _wall_headline(res)
    assert abs(h["mapped_offload_wall_vs_peak_worst"] - (5.5 / 0.104) / 55.0) < 1e-9  # the worse of two sets
    assert abs(h["mapped_reload_first_wall_vs_peak_worst"] - (55 / 1.1) / 53.0) < 1e-9  # big's first reload
    assert abs(h["mapped_offload_first_wall_vs_peak_worst"] - (5.5 / 0.108) / 55.0) < 1e-9
    assert h["wall_worst_set"] == "small"  # the default's figures are unchanged by it
