"""The learning-rate schedule: its shape in optimizer steps, the flags that set it (bad combinations refused
before anything starts), and a CPU job whose steps use the scheduled rates and whose resume goes on with the
same rates and the same weights bit for bit."""
import json
import math

import pytest
import torch

from colomem.engines.lr_schedule import LrSchedule
from colomem.errors import ConfigError, InvalidArgumentError
from colomem.runner import run_job
from colomem.runner.config import config_from_dict
from runner_cpu_helpers import small_cfg


def rates(schedule: LrSchedule, lr: float, steps: int, start: int = 0) -> list[float]:
    """The rate each optimizer step uses, from a fresh optimizer positioned at `start`."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=123.0)   # the peak comes from `lr`
    sched = schedule.started(opt, lr, start)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return out


def test_warmup_rises_from_zero_and_the_decays_end_where_they_say():
    assert rates(LrSchedule("constant", 0, 5), 0.1, 5) == [0.1] * 5
    assert LrSchedule("constant_with_warmup", 0, 5).is_constant
    warm = rates(LrSchedule("constant_with_warmup", 2, 6), 0.1, 6)
    assert warm[:3] == pytest.approx([0.0, 0.05, 0.1]) and warm[3:] == pytest.approx([0.1] * 3)
    lin = rates(LrSchedule("linear", 0, 4), 1.0, 4)
    assert lin == pytest.approx([1.0, 0.75, 0.5, 0.25])
    cos = rates(LrSchedule("cosine", 0, 4), 1.0, 4)
    assert cos == pytest.approx([0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)])
    floor = rates(LrSchedule("cosine_with_min_lr", 1, 11, 0.2), 1.0, 12)
    assert floor[0] == 0.0 and floor[1] == pytest.approx(1.0) and floor[-1] == pytest.approx(0.2)
    assert min(floor[1:]) == pytest.approx(0.2)


def test_a_scheduler_started_at_a_step_gives_the_rates_of_the_whole_run_from_there():
    s = LrSchedule("cosine_with_min_lr", 3, 20, 0.1)
    whole = rates(s, 3e-4, 20)
    assert rates(s, 3e-4, 12, start=8) == whole[8:]           # the same floats: a closed form of the step


def test_bad_schedules_are_refused():
    with pytest.raises(InvalidArgumentError, match="choose one of"):
        LrSchedule("wsd", 0, 4)
    with pytest.raises(InvalidArgumentError, match="warmup"):
        LrSchedule("linear", 5, 4)
    with pytest.raises(InvalidArgumentError, match="fraction"):
        LrSchedule("cosine_with_min_lr", 0, 4, 1.5)


def run_cfg(out="unused", **kw):
    return small_cfg(out, **{"steps": 6, "plots": False, "report_to": ["none"], **kw})


@pytest.mark.parametrize("kw, msg", [
    ({"lr_scheduler": "cosine", "warmup_steps": 1, "warmup_ratio": 0.1}, "both set the warmup"),
    ({"warmup_steps": 2}, "constant_with_warmup"),
    ({"lr_scheduler": "linear", "min_lr_rate": 0.1}, "cosine_with_min_lr"),
    ({"lr_scheduler": "linear", "warmup_steps": 7}, "longer than the run"),
    ({"lr_scheduler": "step"}, "lr_scheduler"),
])
def test_schedule_flags_that_cannot_work_are_refused_before_anything_starts(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        run_cfg(**kw)


def test_the_schedule_counts_optimizer_steps_and_takes_the_cpu_step_count():
    c = run_cfg(lr_scheduler="cosine_with_min_lr", warmup_ratio=0.5, grpo={"group_size": 4, "mini_batches": 2,
                                                                          "num_iterations": 3})
    assert c.lr_schedule("gpu") == LrSchedule("cosine_with_min_lr", 3 * 6, 6 * 6, 0.1)
    c = config_from_dict({"backend": "cpu", "lr_scheduler": "linear", "warmup_steps": 30, "cpu_steps": 10})
    assert c.lr_schedule("cpu") == LrSchedule("linear", 10, 10) and c.lr_schedule("gpu") == LrSchedule("linear", 30, 40)


def lrs(out):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [m["train/lr"] for m in lines if "train/lr" in m]


def varied(prompt, completion, **meta):
    return (len(completion) % 3) / 2           # a reward that differs between samples: the job learns


def test_a_job_trains_at_the_scheduled_rates_and_resumes_on_them_bit_for_bit(job_env, tmp_path):
    import os
    import signal

    kw = {"lr_scheduler": "cosine_with_min_lr", "warmup_steps": 2, "min_lr_rate": 0.2, "lr": 1e-3,
          "grpo": {"group_size": 4, "mini_batches": 2}}
    said: list = []
    whole = run_job(run_cfg(tmp_path / "whole", save_every=6, **kw), reward_fns=[varied], print_fn=said.append)
    assert whole.summary["status"] == "ok"
    assert any("cosine_with_min_lr to 0.0002 over 12 optimizer steps, 4 warmup steps" in str(s) for s in said)
    want = rates(LrSchedule("cosine_with_min_lr", 4, 12, 0.2), 1e-3, 12)
    per_step = [(a + b) / 2 for a, b in zip(want[::2], want[1::2])]       # a step's two updates, averaged
    assert lrs(tmp_path / "whole") == pytest.approx(per_step) and per_step[0] == pytest.approx(0.125e-3)
    calls = {"n": 0}

    def stop_in_step_three(prompt, completion, **meta):      # the same run, stopped (and saved) after 3 steps
        calls["n"] += 1
        if calls["n"] == 33:
            os.kill(os.getpid(), signal.SIGTERM)
        return varied(prompt, completion)
    first = run_job(run_cfg(tmp_path / "split", **kw), reward_fns=[stop_in_step_three], print_fn=lambda *_: None)
    assert first.summary["status"] == "interrupted" and [r.step for r in first.records] == [0, 1, 2]
    second = run_job(run_cfg(tmp_path / "split", resume="auto", save_every=6, **kw), reward_fns=[varied],
                     print_fn=lambda *_: None)
    assert second.summary["status"] == "ok" and [r.step for r in second.records] == [3, 4, 5]
    assert lrs(tmp_path / "split") == lrs(tmp_path / "whole")             # the same floats
    a, b = [torch.load(o / "checkpoints" / "step-6" / "trainer.pt", weights_only=True)
            for o in (tmp_path / "whole", tmp_path / "split")]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert not all(torch.equal(a["model"][k], b0) for k, b0 in
                   torch.load(tmp_path / "split" / "checkpoints" / "step-3" / "trainer.pt",
                              weights_only=True)["model"].items())          # it trained after the resume


def test_a_resume_takes_a_changed_lr_as_the_new_peak(job_env, tmp_path):
    run_job(run_cfg(tmp_path / "r", steps=2, save_every=2), print_fn=lambda *_: None)
    run_job(run_cfg(tmp_path / "r", steps=3, resume="auto", lr=2e-4), print_fn=lambda *_: None)
    assert lrs(tmp_path / "r") == pytest.approx([5e-4, 5e-4, 2e-4])
