"""Held-out evaluation (--eval-dataset, --eval-every, --eval-prompts) on the CPU path: greedy completions
through the run's own rollout engine, at the right steps, in metrics.jsonl, TensorBoard and summary.json;
a bad eval set stops the run before any engine starts; a resumed run keeps the schedule."""
import json
import time

import pytest
import torch

from colomem.errors import ConfigError, PhaseOrderError
from colomem.runner import PhaseMachine, run_job
from colomem.runner.backends import build_engines
from colomem.runner.config import config_from_dict
from colomem.runner.phases import CYCLE, SWITCH_PHASES, WORK_PHASES
from colomem.runner.timeline import read_jsonl

from runner_cpu_helpers import awake_cpu_rollout
from test_dataset_job import TEMPLATE, successor_rows, write_jsonl

pytest.importorskip("transformers")


def cfg(out, **kw):
    data = {"backend": "cpu", "steps": 4, "prompts_per_step": 4, "micro_batch": 8, "progress": False,
            "plots": False, "report_to": ["none"], "out": str(out), "grpo": {"group_size": 4}, **kw}
    return config_from_dict(data)


def evals(out):
    return [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "eval"]


def test_a_dataset_job_evaluates_on_schedule_into_metrics_tensorboard_and_summary(job_env, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard comes with colomem[grpo]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = write_jsonl(tmp_path / "train.jsonl", successor_rows(16))
    held = write_jsonl(tmp_path / "eval.jsonl", [{**r, "source": "held-out"} for r in successor_rows(8, seed=1)])

    def slow_on_held_out(prompts, completions, answer, source, **columns):
        if source and source[0] == "held-out":
            time.sleep(0.6)           # an evaluation far longer than the step's own gaps between phases
        return [float(c.strip() == a) for c, a in zip(completions, answer)]
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE)
    out = tmp_path / "run"
    res = run_job(cfg(out, dataset=str(train), eval_dataset=str(held), eval_every=2, eval_prompts=6,
                      chat_template=str(tpl), rewards=["exact_match"], report_to=["tensorboard"],
                      grpo={"group_size": 4, "max_new_tokens": 3}),
                  reward_fns=[slow_on_held_out], print_fn=lambda *_: None)
    assert res.summary["status"] == "ok"
    lines = evals(out)
    # the initial weights, after steps 2 and 4 (the last: its own window after the run)
    assert [e["step"] for e in lines] == [0, 2, 4]
    for e in lines:
        assert e["eval/n"] == 6 and 0 <= e["eval/reward_mean"] <= 1 and 0 <= e["eval/accuracy"] <= 1
        assert e["eval/completion_len"] > 0 and e["eval/seconds"] > 0
        assert e["samples"][0]["prompt"].endswith(">")              # rendered through the chat template
    assert set(lines[-1]["cycle_s"]) == {"offload", "barrier_wake", "wake_weights", "sync", "check", "wake_kv",
                                         "eval", "sleep", "barrier_train", "reload"}
    # the first six rows in file order, the same at every evaluation
    first = [r["prompt"][0]["content"] + ">" for r in successor_rows(2, seed=1)]
    assert [s["prompt"] for s in lines[0]["samples"]] == first
    # every completion of every evaluation in its own file, in prompt order, with its token ids
    assert sorted(p.name for p in (out / "evals").iterdir()) == ["step-0.jsonl", "step-2.jsonl", "step-4.jsonl"]
    rows = read_jsonl(out / "evals" / "step-4.jsonl")
    assert [r["index"] for r in rows] == list(range(6)) and all(r["token_ids"] for r in rows)
    assert rows[0]["completion"] == lines[-1]["samples"][0]["completion"]

    # inside a step: after its rollout, neither switch nor training time, and not in the step's seconds
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "phase_s" in r]
    assert ["eval" in r["phase_s"] for r in steps] == [True, False, True, False]
    assert "eval" not in SWITCH_PHASES and "eval" not in WORK_PHASES
    for r in steps:
        ph = list(r["phase_s"])
        if "eval" in ph:
            assert ph.index("eval") == ph.index("rollout") + 1 and ph[ph.index("eval") + 1] == "sleep"
        assert r["switch_s"] == pytest.approx(sum(r["phase_s"].get(p, 0.0) for p in SWITCH_PHASES))
    for r, nxt in zip(steps, steps[1:]):          # the step's seconds leave the evaluation out
        assert r["step_s"] + r["phase_s"].get("eval", 0.0) <= nxt["time"] - r["time"] + 0.05

    acc = EventAccumulator(res.summary["files"]["tensorboard"])
    acc.Reload()
    tb = acc.Scalars("eval/reward_mean")
    assert [e.step for e in tb] == [0, 2, 4]
    assert [e.value for e in tb] == pytest.approx([e["eval/reward_mean"] for e in lines], rel=1e-6)
    assert {"eval/accuracy", "eval/n", "eval/completion_len"} <= set(acc.Tags()["scalars"])
    assert "phase/offload" in acc.Tags()["scalars"] and "phase/eval" in acc.Tags()["scalars"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_first"]["step"] == 0 and summary["eval_last"]["step"] == 4
    assert summary["eval_last"]["eval/reward_mean"] == pytest.approx(lines[-1]["eval/reward_mean"])


def test_greedy_evaluations_of_the_same_weights_agree(job_env, tmp_path):
    """Temperature 0 is greedy on the CPU rollout: the same completions whatever the seed, each token the
    model's most likely one; two evaluations of the same weights give the same completions."""
    from colomem.grpo.rewards import RewardSpec, resolve
    from colomem.runner import Ranks
    from colomem.runner.evaluation import Evaluator, plan

    c = cfg(tmp_path / "g", eval_every=1, eval_prompts=12)
    with awake_cpu_rollout(c) as (eng, tok, task):
        r = eng.rollout
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in (">345", ">78")]
        a = r.generate(prompts, n=2, max_new_tokens=4, temperature=0.0, top_p=0.5, seed=1)
        b = r.generate(prompts, n=2, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=99)
        assert [[x.token_ids for x in g] for g in a] == [[x.token_ids for x in g] for g in b]
        assert all(g[0].token_ids == g[1].token_ids for g in a)
        with torch.no_grad():
            logits = r.model(torch.tensor([prompts[0]])).logits[0, -1]
        assert a[0][0].token_ids[0] == int(logits.argmax())
        assert a[0][0].logprobs[0] == pytest.approx(float(torch.log_softmax(logits.float(), -1).max()), abs=1e-5)

        specs = [RewardSpec(resolve("char_match"))]
        metrics = [("accuracy", RewardSpec(resolve("exact_match"), name="accuracy"))]
        samples = plan(c, task).samples(tok, 3, lambda *_: None)
        ev = Evaluator(c, samples, tokenizer=tok, ranks=Ranks(), reward_specs=specs, metric_specs=metrics,
                       max_new_tokens=3, say=lambda *_: None)
        one = ev.evaluate(r, 0, log=False)
        first = list(ev.last_completions)
        ev.done.clear()
        two = ev.evaluate(r, 0, log=False)
        assert ev.last_completions == first and len(first) == 12
        assert {k: v for k, v in one.items() if k not in ("time", "eval/seconds")} == \
               {k: v for k, v in two.items() if k not in ("time", "eval/seconds")}
        # the held-out sample is fixed and not the stream training draws its prompts from
        assert [s.prompt for s in samples] == [s.prompt for s in plan(c, task).samples(tok, 3, print)]
        assert samples[:4] != task.samples(4, seed=c.seed, step=0)


def test_bad_eval_input_stops_the_run_before_any_engine_starts(job_env, tmp_path):
    built = []

    def factory(c, b, m, t, r, g):
        built.append(1)
        return build_engines(c, b, m, t, r, grad_accum=g)

    train = write_jsonl(tmp_path / "train.jsonl", successor_rows(8, chat=False))
    with pytest.raises(ConfigError, match="does not exist"):
        run_job(cfg(tmp_path / "a", dataset=str(train), eval_dataset=str(tmp_path / "nope.jsonl"),
                    rewards=["exact_match"], grpo={"group_size": 4, "max_new_tokens": 3}),
                engines_factory=factory, print_fn=lambda *_: None)
    no_col = write_jsonl(tmp_path / "q.jsonl", [{"question": "123>", "answer": "45"}])
    with pytest.raises(ConfigError, match="no column 'prompt'"):
        run_job(cfg(tmp_path / "b", eval_dataset=str(no_col)), engines_factory=factory, print_fn=lambda *_: None)
    chat = write_jsonl(tmp_path / "chat.jsonl", successor_rows(2))      # chat messages, and no template
    with pytest.raises(ConfigError, match="no chat template"):
        run_job(cfg(tmp_path / "c", eval_dataset=str(chat)), engines_factory=factory, print_fn=lambda *_: None)
    assert built == []
    with pytest.raises(ConfigError, match="--eval-every with --dataset needs --eval-dataset"):
        cfg(tmp_path / "d", dataset=str(train), eval_every=2, rewards=["exact_match"],
            grpo={"group_size": 4, "max_new_tokens": 3})
    with pytest.raises(ConfigError, match="--eval-prompts needs --eval-every or --eval-dataset"):
        cfg(tmp_path / "e", eval_prompts=4)
    with pytest.raises(ConfigError, match="eval_every = 0"):
        cfg(tmp_path / "f", eval_every=0)


def test_a_builtin_task_evaluates_and_a_resumed_run_keeps_the_schedule(job_env, tmp_path):
    whole = run_job(cfg(tmp_path / "whole", eval_every=2, eval_prompts=8), print_fn=lambda *_: None)
    assert whole.summary["status"] == "ok"
    w = evals(tmp_path / "whole")
    assert [e["step"] for e in w] == [0, 2, 4] and all(e["eval/n"] == 8 for e in w)
    assert all("eval/accuracy" in e for e in w)              # the task's accuracy metric (exact match)

    split = tmp_path / "split"
    first = run_job(cfg(split, steps=2, save_every=2, eval_every=2, eval_prompts=8), print_fn=lambda *_: None)
    assert first.summary["status"] == "ok" and [e["step"] for e in evals(split)] == [0, 2]
    second = run_job(cfg(split, resume="auto", eval_every=2, eval_prompts=8), print_fn=lambda *_: None)
    assert second.summary["status"] == "ok" and [r.step for r in second.records] == [2, 3]
    s = evals(split)
    assert [e["step"] for e in s] == [0, 2, 4]                # step 2's weights not evaluated twice
    steps = [r for r in read_jsonl(split / "metrics.jsonl") if "phase_s" in r]
    assert not any("eval" in r["phase_s"] for r in steps[2:])
    # resume continues exactly: the same evaluations as the unbroken run
    keys = [k for k in w[0] if k.startswith("eval/") and k != "eval/seconds"]
    assert [[e[k] for k in keys] for e in s] == [[e[k] for k in keys] for e in w]


def test_phase_machine_allows_eval_only_in_the_awake_window():
    m = PhaseMachine()
    for p in CYCLE[:CYCLE.index("rollout") + 1]:
        m.enter(p)
        m.leave()
    assert m.allowed == ("eval", "sleep")
    m.enter("eval")
    m.leave()
    with pytest.raises(PhaseOrderError, match="'sleep' comes next"):
        m.enter("barrier_train")
    for p in CYCLE[CYCLE.index("sleep"):]:
        m.enter(p)
        m.leave()
    for p in CYCLE[:CYCLE.index("wake_kv") + 1]:               # the window after the last step: no rollout
        m.enter(p)
        m.leave()
    m.enter("eval")
    m.leave()
    with pytest.raises(PhaseOrderError, match="cannot start 'eval' after 'eval'"):
        m.enter("eval")
    m2 = PhaseMachine()
    with pytest.raises(PhaseOrderError, match="cannot start 'eval' after 'train'"):
        m2.enter("eval")
