"""benchmarks/host_speed.py: the machine's speed figures, GPU ones null where there is no GPU."""
import json

import torch

from bench_module import load_benchmark


def test_host_speed_writes_its_figures_and_leaves_the_gpu_ones_null_without_a_gpu(tmp_path):
    hs = load_benchmark("host_speed")
    assert hs.main(["--out", str(tmp_path), "--label", "here", "--reps", "2"]) == 0
    report = json.loads((tmp_path / "host_speed_here.json").read_text())
    assert report["python_loop_s"] > 0 and report["cpus"] >= 1 and len(report["loadavg"]) == 3
    if not torch.cuda.is_available():
        assert all(report[k] is None for k in ("launch_us", "matmul_tflops", "h2d_gbs", "d2h_gbs"))
        assert "gpu_clocks" not in report
