"""--report-to: TensorBoard gets the same numbers as metrics.jsonl; unknown or missing reporters are
config errors before anything starts."""
import pytest

from colomem.errors import ConfigError
from colomem.runner import run_job
from colomem.runner.config import config_from_dict
from colomem.runner.reporters import resolve, scalars
from colomem.runner.timeline import read_jsonl


def test_tensorboard_events_hold_the_metrics_of_every_step(job_env, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard comes with colomem[grpo]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config_from_dict({"backend": "cpu", "steps": 3, "prompts_per_step": 4, "micro_batch": 8,
                            "progress": False, "out": str(tmp_path / "run"), "grpo": {"group_size": 4},
                            "report_to": ["tensorboard"]})
    res = run_job(cfg, print_fn=lambda *_: None)
    acc = EventAccumulator(res.summary["files"]["tensorboard"])
    acc.Reload()
    lines = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    events = acc.Scalars("reward_mean")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx([r["reward_mean"] for r in lines], rel=1e-6)
    assert {"phase/train", "phase/sync", "switch_s", "train/loss"} <= set(acc.Tags()["scalars"])


def test_report_to_choices_are_checked_with_the_config():
    assert resolve(["none"]) == [] and resolve(["auto", "none"]) == []
    with pytest.raises(ConfigError, match="unknown"):
        config_from_dict({"report_to": ["tensorbored"]})
    import importlib.util

    if importlib.util.find_spec("wandb") is None:      # asked for by name and missing: said before the run
        with pytest.raises(ConfigError, match="wandb package is not installed"):
            config_from_dict({"report_to": ["wandb"]})


def test_scalars_flatten_a_metrics_line():
    line = {"step": 1, "rank": 0, "time": 123.0, "reward_mean": 0.5, "samples": [1], "flag": True,
            "nan": float("nan"), "phase_s": {"train": 1.5}, "memory": {"sleep": {"driver_used": 10, "allocated": None}},
            "step_s": 2.0}
    assert scalars(line) == {"reward_mean": 0.5, "phase/train": 1.5, "memory/sleep/driver_used": 10.0,
                             "step_s": 2.0}
