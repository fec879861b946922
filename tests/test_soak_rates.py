"""The soak's leak test: the RSS slope over the second half of the steps keeps a leak's rate and sees a
warm-up that flattened as flat."""
from bench_module import load_benchmark

soak = load_benchmark("soak")


def test_a_leak_keeps_its_rate_and_a_warm_up_is_flat():
    steps = list(range(400))
    leak = [1e9 + 10_240 * x for x in steps]                      # 10 KiB a step, to the end
    warm = [1e9 + 20_480 * min(x, 150) for x in steps]           # grows for 150 steps, then flat
    assert abs(soak.rate_per_step(steps, leak, 5) - 10_240) < 1e-6
    assert abs(soak.rate_per_step(steps, warm, 5)) < 1e-6
    s = {"step": steps, "rss_bytes": warm, "driver_used_bytes": [0] * 400, "open_fds": [9] * 400,
         "pool_bytes": [0] * 400, "step_s": [0.5] * 400}
    out = soak.summarize(s, {"step": steps, "rss_bytes": leak, "open_fds": [3] * 400}, 5, 200.0)
    assert abs(out["soak_rss_kib_per_step_second_half"]) < 1e-6
    assert abs(out["engine_rss_kib_per_step_second_half"] - 10.0) < 1e-6


def test_too_few_points_give_none():
    assert soak.rate_per_step([0, 1, 2], [1, 2, 3], 0) is None
    assert soak.rate_per_step(list(range(10)), [None] * 10, 0) is None
