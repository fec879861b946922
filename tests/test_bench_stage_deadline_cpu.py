"""A bench inside a bounded GPU stage: each run's bound ends before the stage does, with time left to write
the report, and a run that would have too little time is skipped, the report written all the same
(benchmarks/stage_deadline.py); a call cut short still gets its report, read from the runs' folders
(bench_grpo --figures-only)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_module import load_benchmark
from child_env import child_env

REPO = Path(__file__).resolve().parents[1]


sd = load_benchmark("stage_deadline")


def test_a_run_is_bounded_to_end_before_the_stage_with_time_to_write(monkeypatch):
    monkeypatch.delenv("STAGE_DEADLINE_EPOCH", raising=False)
    assert sd.deadline() is None and sd.run_bound(480.0) == 480.0          # no stage bound: as asked
    now = 1_000_000.0
    assert sd.run_bound(480.0, end=now + 2000, now=now) == 480.0             # room enough: as asked
    left = 300.0 - sd.FINISH_MARGIN_S
    assert sd.run_bound(480.0, end=now + 300, now=now) == pytest.approx(left)  # cut to end before the stage
    assert sd.run_bound(480.0, end=now + sd.FINISH_MARGIN_S + sd.MIN_RUN_S - 1, now=now) is None   # skipped
    monkeypatch.setenv("STAGE_DEADLINE_EPOCH", "1234.5")
    assert sd.deadline() == 1234.5
    for bad in ("", "soon", "0", "-5"):
        monkeypatch.setenv("STAGE_DEADLINE_EPOCH", bad)
        assert sd.deadline() is None


def _step(i, step_s, switch_s):
    return {"step": i, "step_s": step_s, "switch_s": switch_s,
            "phase_s": {"rollout": 4.0, "train": step_s - 4.0 - switch_s, "reload_step": switch_s - 0.3}}


def test_figures_only_reads_a_cut_run_into_the_report(tmp_path):
    run = tmp_path / "full7b_colomem"
    run.mkdir()
    lines = [{"event": "start", "time": 0.0}, _step(0, 34.0, 2.3), _step(1, 27.0, 1.6), _step(2, 29.0, 1.6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    mapped = tmp_path / "full7b_mapped"             # the moments in mapped memory: a mode of its own
    mapped.mkdir()
    lines = [{"event": "start", "time": 0.0}, _step(0, 33.0, 2.2), _step(1, 26.0, 1.0), _step(2, 28.0, 1.0)]
    (mapped / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "full7b_prepare").mkdir()            # a folder without step lines is not a run
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_grpo.py"), "--out", str(tmp_path),
                        "--figures-only"], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    report = json.loads((tmp_path / "grpo_bench.json").read_text())
    assert sorted(report["runs"]) == ["full7b_colomem", "full7b_mapped"]
    res = report["runs"]["full7b_colomem"]["result"]
    assert res["steps_done"] == 3 and res["step_s"] == pytest.approx(28.0)     # the first step left out
    assert report["offload_needed_switch_fraction"] == pytest.approx((1.6 / 27.0 + 1.6 / 29.0) / 2)
    assert report["full7b_step_s"] == pytest.approx(28.0)
    assert report["full7b_step_s_mapped"] == pytest.approx(27.0)
    assert report["full7b_switch_fraction_by_mode"]["mapped"] == pytest.approx((1.0 / 26.0 + 1.0 / 28.0) / 2)
    assert "--figures-only" in (tmp_path / "grpo_bench.md").read_text()


def test_a_bench_at_its_stage_end_skips_its_runs_and_still_writes_its_report(tmp_path):
    env = {**child_env(), "STAGE_DEADLINE_EPOCH": str(int(time.time()))}
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_inrank.py"), "--out", str(tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("skipped, too little time left in the stage") == 4
    assert json.loads((tmp_path / "inrank_bench.json").read_text())["runs"] == {}


def test_figures_only_reports_each_checkpoint_the_run_waited_for_against_its_write(tmp_path):
    run = tmp_path / "full_saved"
    run.mkdir()
    lines = [{"event": "start", "time": 0.0}, _step(0, 12.0, 0.9), _step(1, 8.0, 0.1),
             {**_step(2, 8.5, 0.1), "checkpoint/started": 2},
             {**_step(3, 8.2, 0.1), "checkpoint/step": 2, "checkpoint/seconds": 0.6,
              "checkpoint/write_seconds": 7.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_grpo.py"), "--out", str(tmp_path),
                        "--figures-only"], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "grpo_bench.json").read_text())["runs"]["full_saved"]["result"]
    assert res["checkpoints"] == [{"step": 2, "seconds": 0.6, "write_seconds": 7.5}]


def test_a_calls_first_run_gets_the_time_it_fills_vllms_compile_cache_in(tmp_path, monkeypatch):
    """The first run of a call compiles vLLM's model on a fresh machine (the runs after it load the cache): its
    bound has --first-run-extra-s more, the others their own bound, the peer's too."""
    bench = load_benchmark("bench_grpo")
    monkeypatch.delenv("STAGE_DEADLINE_EPOCH", raising=False)
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)     # no imports to warm here
    bounds = {}

    def fake_run(name, args, out_dir, timeout_s, *rest, **kw):
        bounds[name] = timeout_s
        return {"rc": 0, "wall_s": 1.0, "result": {"status": "ok"}}
    monkeypatch.setattr(bench, "run_one", fake_run)
    monkeypatch.setattr(bench, "run_peer", lambda mode, name, args, out_dir, timeout_s: fake_run(name, args, out_dir,
                                                                                                 timeout_s))
    monkeypatch.setattr(bench, "analyse", lambda d: {"status": "ok"})
    assert bench.main(["--out", str(tmp_path), "--configs", "full", "--modes", "colomem,trl", "--rounds", "2",
                       "--run-timeout-s", "200", "--peer-timeout-s", "210", "--first-run-extra-s", "60"]) == 0
    assert bounds == {"full_prepare": 200, "full_colomem": 260, "full_trl": 210, "full_colomem_r2": 200,
                      "full_trl_r2": 210}, bounds
