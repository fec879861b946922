"""The in-loop sync benchmark (benchmarks/bench_sync_inloop.py) on the host path: a tiny set offloaded into
a pool, synced from its host views to a consumer process through host buckets, bytes checked, JSON written."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_benchmark_syncs_a_pool_backed_set_and_checks_its_bytes(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_sync_inloop.py"), "--out", str(tmp_path), "--sets",
           "tiny", "--buckets", "loop,4MiB", "--reps", "2", "--device", "cpu"]
    p = subprocess.run(cmd, env=child_env(CUDA_VISIBLE_DEVICES=""), cwd=REPO, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads((tmp_path / "bench_sync_inloop.json").read_text())
    assert out["errors"] == [] and out["device"] == "cpu"
    assert "sync_inloop_vs_peak" not in out  # no H2D peak without a GPU: no ratio is made up
    tiny = out["sets"]["tiny"]
    loop, small = tiny["configs"]["loop (64.00 MiB)"], tiny["configs"]["4MiB"]
    for row in (loop, small, loop["resident"]):
        assert row["verified"] and row["reps"] == 2 and row["nbytes"] == tiny["nbytes"]
        assert row["ms_min"] <= row["ms_median"] <= row["ms_max"]
        assert row["local_bytes"] == tiny["nbytes"] and row["pinned_bytes"] == row["torch_bytes"] == 0
    assert loop["messages"] == 1 and small["messages"] >= -(-tiny["nbytes"] // (4 << 20))
    assert sum(b["nbytes"] for b in small["buckets_last"]) >= tiny["nbytes"]
