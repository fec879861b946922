"""--reward-weights: one weight per reward function (TRL's reward_weights); a sample's reward is their weighted
sum, what each function gave is logged apart, and a count that does not match is refused before the run."""
import json

import pytest

from colomem.errors import ConfigError
from colomem.runner import run_job
from runner_cpu_helpers import small_cfg


def cfg(out="unused", **kw):
    return small_cfg(out, plots=False, report_to=["none"], **kw)


def test_a_weight_count_unlike_the_rewards_is_refused_before_anything_starts(job_env, tmp_path):
    with pytest.raises(ConfigError, match="2 weights for 1 reward functions"):
        cfg(rewards=["char_match"], reward_weights=[1.0, 2.0])
    # the task's own rewards (no --rewards) are known when the job binds them, before any engine starts
    with pytest.raises(ConfigError, match=r"2 weights for 1 reward functions \(char_match\)"):
        run_job(cfg(tmp_path / "r", reward_weights=[1.0, 2.0]), print_fn=lambda *_: None)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_the_reward_is_the_weighted_sum_of_the_functions(job_env, tmp_path):
    res = run_job(cfg(tmp_path / "w", rewards=["char_match", "exact_match"], reward_weights=[0.5, -2]),
                  print_fn=lambda *_: None)
    assert res.summary["status"] == "ok"
    lines = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward_mean" in m]
    assert len(steps) == 2
    for m in steps:
        want = 0.5 * m["reward/char_match"] - 2 * m["reward/exact_match"]
        assert m["reward_mean"] == pytest.approx(want)


def test_the_flag_takes_a_comma_list():
    from colomem.runner.config import load_run_config

    c = load_run_config(["--rewards", "char_match,exact_match", "--reward-weights", "1,0.25"])
    assert c.reward_weights == [1.0, 0.25]
