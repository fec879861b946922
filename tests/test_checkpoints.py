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


def test_a_step_that_fails_after_a_stop_signal_keeps_the_step_before_and_stops_as_interrupted(job_env, tmp_path):
    # a SIGTERM to the whole process group also ends vLLM's engine, so the step under way fails: before any
    # training the trainer's state is the last finished step's, which is saved; the run is interrupted, not failed
    import os
    import signal

    calls = {"n": 0}

    def engine_gone_in_step_two(prompt, completion, **meta):
        calls["n"] += 1
        if calls["n"] == 17:
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("engine gone")
        return 0.5
    said = []
    res = run_job(cfg(tmp_path / "g"), reward_fns=[engine_gone_in_step_two], print_fn=said.append)
    assert res.summary["status"] == "interrupted", res.summary["error"]
    err = res.summary["error"]
    assert err.startswith("interrupted (SIGTERM) after step 1: step 2 could not finish after SIGTERM (score: ")
    assert "engine gone" in err and err.endswith("; step 1 saved")
    assert [r.step for r in res.records] == [0]
    assert sorted(p.name for p in (tmp_path / "g" / "checkpoints").iterdir()) == ["step-1"]
    assert any("a signal to the whole process group?" in s for s in said)
    again = run_job(cfg(tmp_path / "g", resume="auto", steps=3), reward_fns=[lambda p, c, **m: 0.5],
                    print_fn=lambda *_: None)
    assert again.summary["status"] == "ok" and [r.step for r in again.records] == [1, 2]
    # without a stop signal the same failure is the run's
    with pytest.raises(RuntimeError, match="boom"):
        run_job(cfg(tmp_path / "f"), reward_fns=[lambda p, c, **m: (_ for _ in ()).throw(RuntimeError("boom"))],
                print_fn=lambda *_: None)


DISK_FULL_JOB = """
import json, resource, signal, sys
from colomem.runner import run_job
from colomem.runner.config import config_from_dict
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)            # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
try:
    run_job(config_from_dict(json.loads(sys.argv[2])), print_fn=lambda *_: None)
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
    sys.exit(3)
"""


def resume_on_a_full_disk(out, **kw) -> tuple[str, dict]:
    """One step saved into out, then a resume of it (config kw) in a process whose files may not grow past
    half that step's trainer file, as on a full disk. Its error line, checked to be step 2's failed write,
    and step-1's files as they were before the resume."""
    import subprocess
    import sys

    run_job(cfg(out, steps=1, save_every=1), print_fn=lambda *_: None)
    before = {p.name: p.read_bytes() for p in (out / "checkpoints" / "step-1").iterdir() if p.is_file()}
    big = (out / "checkpoints" / "step-1" / "trainer.pt").stat().st_size
    data = {"backend": "cpu", "prompts_per_step": 4, "micro_batch": 8, "progress": False, "plots": False,
            "report_to": ["none"], "out": str(out), "grpo": {"group_size": 4}, "resume": "auto", **kw}
    proc = subprocess.run([sys.executable, "-c", DISK_FULL_JOB, str(big // 2), json.dumps(data)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    msg = proc.stdout.strip().splitlines()[-1]
    assert msg.startswith("CheckpointError: writing checkpoint step-2") and "File too large" in msg, msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]      # no half checkpoint
    assert {p.name: p.read_bytes() for p in (out / "checkpoints" / "step-1").iterdir() if p.is_file()} == before
    return msg, before


def test_a_disk_that_fills_during_a_save_leaves_the_earlier_checkpoint_and_metrics_intact(job_env, tmp_path):
    """A real failing write (the file-size limit makes the kernel refuse it, as a full disk does)."""
    out = tmp_path / "r"
    msg, _ = resume_on_a_full_disk(out, steps=2, save_every=1)
    assert "free disk space or choose another --out" in msg and "intact: step-1" in msg
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "reward_mean" in x] == [0, 1]              # both steps' lines kept
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "error" and "CheckpointError" in summary["error"]


def test_saves_come_after_the_next_offload_and_lora_saves_adapter_and_merged_model(job_env, tmp_path):
    out = tmp_path / "l"
    res = run_job(cfg(out, steps=3, save_every=1, lora={"r": 4}, save_merged=True), print_fn=lambda *_: None)
    assert res.summary["status"] == "ok"
    # step k's checkpoint starts right after step k+1's offload, from the pool, and is written beside that
    # step; the next step ends it before its own offload; the last one is written at the end
    assert [r.metrics.get("checkpoint/started") for r in res.records] == [None, 1, 2]
    assert [r.metrics.get("checkpoint/step") for r in res.records] == [None, None, 1]
    assert all(r.phase_s["checkpoint"] > 0 for r in res.records[1:]) and "checkpoint_wait" in res.records[2].phase_s
    assert res.summary["final_checkpoint"]["step"] == 3 and len(res.summary["checkpoint_s"]) == 3
    last = out / "checkpoints" / "step-3"
    assert (last / "model" / "adapter_config.json").is_file() and (last / "model" / "adapter_model.safetensors").is_file()
    assert (last / "model-merged" / "config.json").is_file() and (last / "model-merged" / "tokenizer.json").is_file()
    assert (last / "model" / "tokenizer.json").is_file()


def test_cli_says_which_checkpoint_resume_auto_continues_from(tmp_path, capsys):
    from colomem.runner.checkpoints import newest
    from colomem.runner.cli import _say_how_to_resume

    _say_how_to_resume(tmp_path)                          # no checkpoint: nothing to say
    assert capsys.readouterr().err == ""
    for step in (2, 10, 4):
        (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step-{step}" / "state.json").write_text("{}")
    (tmp_path / "checkpoints" / ".tmp-step-12").mkdir()   # a save cut short is no checkpoint
    assert newest(tmp_path / "checkpoints").name == "step-10"
    _say_how_to_resume(tmp_path)
    assert capsys.readouterr().err.strip() == (f"to continue from step-10: run the same command with --resume auto "
                                               f"--out {tmp_path}")


def test_background_writes_overlap_the_next_step_and_hold_the_state_of_their_own(job_env, tmp_path, monkeypatch):
    """Each background write waits until the step after it trained before it writes a byte, so the trainer
    really moved on meanwhile; its files still equal those of a run that waited for every write."""
    import threading

    from colomem.engines import stand_ins, torch_checkpoint

    trained = threading.Event()
    real_train, real_save = stand_ins.TorchTrainer.train_step, torch_checkpoint.save_torch
    overlapped = []

    def train_step(self, batch):
        out = real_train(self, batch)
        trained.set()
        return out

    def save_torch(obj, path):
        if threading.current_thread() is not threading.main_thread():
            trained.clear()
            overlapped.append(trained.wait(60))
        real_save(obj, path)
    monkeypatch.setattr(stand_ins.TorchTrainer, "train_step", train_step)
    monkeypatch.setattr(torch_checkpoint, "save_torch", save_torch)
    bg = run_job(cfg(tmp_path / "bg", steps=4, save_every=1, keep_checkpoints=4), print_fn=lambda *_: None)
    assert bg.summary["status"] == "ok" and overlapped == [True, True, True]    # steps 1-3 in the background
    sync = run_job(cfg(tmp_path / "sync", steps=4, save_every=1, keep_checkpoints=4, save_background=False),
                   print_fn=lambda *_: None)
    assert sync.summary["status"] == "ok" and len(overlapped) == 3
    for step in (1, 2, 3, 4):
        a, b = final_weights(tmp_path / "bg", step), final_weights(tmp_path / "sync", step)
        assert a["steps"] == b["steps"] == step
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i] if isinstance(sa[i][k], torch.Tensor))
        ja, jb = (json.loads((d / "checkpoints" / f"step-{step}" / "state.json").read_text()) for d in
                  (tmp_path / "bg", tmp_path / "sync"))
        assert ja["weight_version"] == jb["weight_version"] == step


def test_a_background_write_that_fails_stops_the_run_at_the_next_offload_and_keeps_the_earlier(job_env, tmp_path):
    """The file-size limit makes the kernel refuse step 2's write, in the writer's thread: the run stops with
    CheckpointError when step 4 would offload, step-1 intact and no half checkpoint left."""
    out = tmp_path / "r"
    resume_on_a_full_disk(out, steps=4, save_every=2)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "step_s" in x]
    assert [x["step"] for x in steps] == [0, 1, 2, 3] and steps[-1]["failed"] == "checkpoint"
    assert steps[2].get("checkpoint/started") == 2
