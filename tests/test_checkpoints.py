"""Checkpoints and resume on the CPU path: 6 steps in one run and 3 + resume 3 give the same weights bit for
bit; the saved model loads with transformers; bad checkpoints are clear errors."""
import json

import pytest
import torch

from colomem.errors import ConfigError
from colomem.runner import run_job
from colomem.runner.config import config_from_dict


def cfg(out, **kw):
    data = {"backend": "cpu", "steps": 6, "prompts_per_step": 4, "micro_batch": 8, "progress": False,
            "plots": False, "report_to": ["none"], "out": str(out), "grpo": {"group_size": 4}, **kw}
    return config_from_dict(data)


def final_weights(out, step):
    return torch.load(out / "checkpoints" / f"step-{step}" / "trainer.pt", weights_only=True)


def test_resume_continues_the_run_bit_for_bit(job_env, tmp_path):
    whole = run_job(cfg(tmp_path / "whole", save_every=6), print_fn=lambda *_: None)
    assert whole.summary["status"] == "ok"
    first = run_job(cfg(tmp_path / "split", steps=3, save_every=3), print_fn=lambda *_: None)
    assert first.summary["status"] == "ok"
    second = run_job(cfg(tmp_path / "split", resume="auto", save_every=3), print_fn=lambda *_: None)
    assert second.summary["status"] == "ok" and [r.step for r in second.records] == [3, 4, 5]
    a, b = final_weights(tmp_path / "whole", 6), final_weights(tmp_path / "split", 6)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])          # weights
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in ("exp_avg", "exp_avg_sq"))   # Adam moments
    rewards = lambda out: [json.loads(l)["reward_mean"] for l in (out / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                           if '"reward_mean"' in l]
    assert rewards(tmp_path / "whole") == rewards(tmp_path / "split")       # the same curve, lines appended
    state = json.loads((tmp_path / "split" / "checkpoints" / "step-6" / "state.json").read_text())
    assert state["step"] == 6 and state["weight_version"] == 6


def test_saved_model_loads_in_transformers_and_old_checkpoints_are_dropped(job_env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_job(cfg(tmp_path / "r", steps=4, save_every=1, keep_checkpoints=2), print_fn=lambda *_: None)
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert names == ["step-3", "step-4"]                                   # the newest two, no temporaries
    model_dir = tmp_path / "r" / "checkpoints" / "step-4" / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    saved = final_weights(tmp_path / "r", 4)["model"]
    assert all(torch.equal(p, saved[n]) for n, p in model.state_dict().items() if n in saved)
    assert tok.eos_token_id is not None


def test_bad_resumes_are_clear_errors_before_anything_starts(job_env, tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint under"):
        run_job(cfg(tmp_path / "none", resume="auto"), print_fn=lambda *_: None)
    with pytest.raises(ConfigError, match="not a checkpoint folder"):
        run_job(cfg(tmp_path / "x", resume=str(tmp_path)), print_fn=lambda *_: None)
    run_job(cfg(tmp_path / "r", steps=2, save_every=2), print_fn=lambda *_: None)
    ckpt = tmp_path / "r" / "checkpoints" / "step-2"
    with pytest.raises(ConfigError, match="of another run: seed 0 there, 1 here"):
        run_job(cfg(tmp_path / "r2", resume=str(ckpt), seed=1), print_fn=lambda *_: None)
    with pytest.raises(ConfigError, match="nothing is left to run"):
        run_job(cfg(tmp_path / "r", resume="auto", steps=2), print_fn=lambda *_: None)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "format": 99}))
    with pytest.raises(ConfigError, match="format 99.*upgrade colomem"):
        run_job(cfg(tmp_path / "r3", resume=str(ckpt)), print_fn=lambda *_: None)


def test_sigterm_finishes_the_step_saves_and_stops_as_interrupted(job_env, tmp_path):
    import os
    import signal

    calls = {"n": 0}

    def term_in_step_two(prompt, completion, **meta):
        calls["n"] += 1
        if calls["n"] == 17:                         # first sample of the second step
            os.kill(os.getpid(), signal.SIGTERM)
        return 0.5
    res = run_job(cfg(tmp_path / "t"), reward_fns=[term_in_step_two], print_fn=lambda *_: None)
    assert res.summary["status"] == "interrupted" and "SIGTERM" in res.summary["error"]
    assert [r.step for r in res.records] == [0, 1]             # the step under way finished
    ckpts = sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir())
    assert ckpts == ["step-2"]                                  # saved although --save-every was not reached
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # handlers given back
    again = run_job(cfg(tmp_path / "t", resume="auto", steps=3), reward_fns=[lambda p, c, **m: 0.5],
                    print_fn=lambda *_: None)
    assert again.summary["status"] == "ok" and [r.step for r in again.records] == [2]
