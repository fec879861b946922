"""The placement planner's choices run through the CPU loop: what moves and when, and that every placement
trains exactly as moving everything does."""
import contextlib
import json

import torch

from bench_module import load_benchmark
from colomem.runner import run_job
from colomem.runner.phase_runner import PhaseRunner
from colomem.runner.placement import ALL_CATEGORIES
from fakes.placement import figs, job, seven_b
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)


def test_nothing_moving_trains_exactly_as_moving_everything(job_env, tmp_path):
    moved = run_job(job(tmp_path / "all", offload="all", rollout_sleep="always"), print_fn=lambda *_: None)
    still = run_job(job(tmp_path / "none", offload="none", rollout_sleep="never"), print_fn=lambda *_: None)
    kept = run_job(job(tmp_path / "opt", offload="optimizer"), print_fn=lambda *_: None)
    for r in (moved, still, kept):
        assert r.summary["status"] == "ok"
    assert still.summary["placement"]["label"] == "nothing moves"
    assert moved.summary["placement"]["label"] == "trainer offloaded, rollout sleeps"
    assert kept.summary["placement"]["keep"] == ["params", "other", "grads"]
    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    # nothing moved: no trainer offload report, and the rollout never slept after its first wake
    assert not any("trainer_offload/seconds" in x for x in lines(tmp_path / "none"))
    assert all("trainer_offload/seconds" in x for x in lines(tmp_path / "all") if "reward_mean" in x)
    moved_bytes = lambda out: [x["trainer_offload/moved_bytes"] for x in lines(out) if "reward_mean" in x]  # noqa: E731
    # offload optimizer moves the AdamW state only (none before the first step creates it)
    opt, everything = moved_bytes(tmp_path / "opt"), moved_bytes(tmp_path / "all")
    assert opt[0] == 0 and 0 < opt[-1] < everything[-1]
    weights = {k: torch.load(tmp_path / k / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
               for k in ("all", "none", "opt")}
    for k in ("none", "opt"):
        assert all(torch.equal(weights["all"]["model"][n], weights[k]["model"][n]) for n in weights["all"]["model"])
    rewards = lambda out: [x["reward_mean"] for x in lines(out) if "reward_mean" in x]  # noqa: E731
    assert rewards(tmp_path / "all") == rewards(tmp_path / "none") == rewards(tmp_path / "opt")


def test_auto_on_the_cpu_measures_once_then_says_why_everything_moves(job_env, tmp_path):
    said = []
    res = run_job(job(tmp_path / "auto"), print_fn=said.append)
    assert res.summary["status"] == "ok"
    assert res.summary["placement"]["label"] == "trainer offloaded, rollout sleeps"
    assert "CPU backend" in res.summary["placement"]["why"]
    events = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()
              if '"placement"' in x and '"event"' in x]
    assert len(events) == 1 and events[0]["from_step"] == 1
    assert sum("placement" in s for s in said) == 2          # the first step's, then the plan's


def test_the_plan_prints_and_records_the_micro_batch_hint_from_gpu_figures(job_env, tmp_path, monkeypatch):
    # the CPU loop with GPU-like figures after its first step: the planner's own path, the hint included
    from colomem.runner import train_memory_plan

    f = figs(peak=53)                                 # 8 GB of activations at micro-batch 4: 2 GB a row
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda memory, by_cat, total, **_: f)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)
    said = []
    res = run_job(job(tmp_path / "hint", micro_batch=4, placement_margin="2GB"), print_fn=said.append)
    assert res.summary["status"] == "ok" and res.summary["placement"]["label"] == "nothing moves"
    line = [s for s in said if s.startswith("[colomem] training: ")]
    assert len(line) == 1 and "--micro-batch up to 16 (now 4)" in line[0], said
    event = [json.loads(x) for x in (tmp_path / "hint" / "metrics.jsonl").read_text().splitlines()
             if '"placement"' in x and '"event"' in x][-1]
    assert event["micro_batch_hint"] == line[0][len("[colomem] training: "):]


def test_a_rollout_that_stays_awake_retires_its_prefix_cache_after_each_rollout(job_env, tmp_path, monkeypatch):
    # nothing moves: new weights come after every train phase, so the loop lets vLLM drop its prefix cache
    # while the trainer trains; a rollout that sleeps drops it in its sleep, and is not asked
    from colomem.engines.hf_rollout import HFRollout

    seen: list = []
    monkeypatch.setattr(HFRollout, "retire_prefix_cache", lambda self: seen.append(self.phase), raising=False)
    still = run_job(job(tmp_path / "none", offload="none", rollout_sleep="never"), print_fn=lambda *_: None)
    assert still.summary["status"] == "ok" and len(seen) == 3 and set(seen) == {"awake"}
    seen.clear()
    moved = run_job(job(tmp_path / "all", offload="all", rollout_sleep="always"), print_fn=lambda *_: None)
    assert moved.summary["status"] == "ok" and seen == []


def test_alternate_runs_both_resident_layouts_in_turn_and_trains_the_same(job_env, tmp_path):
    """--rollout-sleep alternate: vLLM sleeps through every even step's training and stays awake through
    every odd one's; each step says which, and whether its rollout followed a wake. The weights and rewards
    are those of a run where nothing moves."""
    alternate_figures = load_benchmark("grpo_alternate").alternate_figures

    still = run_job(job(tmp_path / "none", offload="none", rollout_sleep="never", steps=5), print_fn=lambda *_: None)
    alt = run_job(job(tmp_path / "alt", offload="none", rollout_sleep="alternate", steps=5), print_fn=lambda *_: None)
    assert still.summary["status"] == alt.summary["status"] == "ok", alt.summary
    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    steps = [x for x in lines(tmp_path / "alt") if "reward_mean" in x]
    assert [x["placement/rollout_sleeps"] for x in steps] == [1, 0, 1, 0, 1]
    # the first rollout wakes from the start; then a rollout wakes only after a step that slept
    assert [x["rollout/woke"] for x in steps] == [1, 1, 0, 1, 0]
    assert [("sleep" in x["phase_s"]) and x["phase_s"]["sleep"] >= 0 for x in steps] == [True] * 5
    rewards = lambda out: [x["reward_mean"] for x in lines(out) if "reward_mean" in x]  # noqa: E731
    assert rewards(tmp_path / "alt") == rewards(tmp_path / "none")
    a, b = (torch.load(tmp_path / k / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
            for k in ("none", "alt"))
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])
    fig = alternate_figures(steps)
    assert [r["step"] for r in fig["steps"]] == [1, 2, 3, 4]
    assert fig["resident"]["step_s"] > 0 and fig["still"]["step_s"] > 0
    assert fig["speedup_vs_resident"] == fig["resident"]["step_s"] / fig["still"]["step_s"]


def test_the_runner_reloads_at_the_step_when_the_plan_says_so_and_trains_the_same(job_env, tmp_path, monkeypatch):
    from colomem.runner import train_memory_plan

    ref = run_job(job(tmp_path / "overlap", offload="all", rollout_sleep="always"), print_fn=lambda *_: None)
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda memory, by_cat, total, **_: seven_b())
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: seven_b().total)
    said = []
    res = run_job(job(tmp_path / "auto"), print_fn=said.append)
    assert ref.summary["status"] == res.summary["status"] == "ok"
    assert any(s.startswith("[colomem] optimizer state: comes back inside the optimizer step") for s in said), said
    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    event = [x for x in lines(tmp_path / "auto") if x.get("event") == "placement"][-1]
    assert event["optimizer_reload"] == "step" and "inside the step" in event["optimizer_reload_why"]
    steps = [x for x in lines(tmp_path / "auto") if "reward_mean" in x]
    # the first step measures (no state in the pool yet); the later ones reload the AdamW state at the step,
    # a switch phase of its own
    assert "reload_step" not in steps[0]["phase_s"] and all(x["phase_s"]["reload_step"] > 0 for x in steps[1:])
    rewards = lambda out: [x["reward_mean"] for x in lines(out) if "reward_mean" in x]  # noqa: E731
    assert rewards(tmp_path / "auto") == rewards(tmp_path / "overlap")
    a, b = (torch.load(tmp_path / k / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
            for k in ("overlap", "auto"))
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])


def test_a_resumed_run_measures_with_the_optimizer_state_brought_back_at_the_step(job_env, tmp_path, monkeypatch):
    """A resume's first (measuring) step already has Adam's moments: reloaded before the optimizer step, a job
    that fits only with them reloaded inside it would run out of memory before the planner could choose. So
    auto brings them back at that step, and the plan counts them as absent from the measured peak."""
    from colomem.runner import train_memory_plan

    first = run_job(job(tmp_path / "a", steps=2, save_every=2), print_fn=lambda *_: None)
    assert first.summary["status"] == "ok"
    seen = []

    def figures(memory, by_cat, total, **kw):
        seen.append(kw)
        # the moments counted as absent from the measured peak (as on the GPU, at their 7.6B size), or not
        return seven_b() if kw.get("optim_created") else seven_b(optim_created=0)
    monkeypatch.setattr(train_memory_plan, "figures_from_step", figures)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: seven_b().total)
    said = []
    res = run_job(job(tmp_path / "a", steps=4, save_every=4, resume="auto"), print_fn=said.append)
    assert res.summary["status"] == "ok", res.summary
    steps = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
             if "reward_mean" in x]
    resumed = [x for x in steps if x.get("step", 0) >= 2]
    # every resumed step, the measuring one included, reloaded the AdamW state inside the optimizer step
    assert resumed and all(x["phase_s"].get("reload_step", 0) > 0 for x in resumed), resumed
    assert len(seen) == 1 and seen[0]["optim_created"] > 0
    assert any("comes back inside the optimizer step" in s for s in said)


def test_the_runner_sends_the_optimizer_state_out_behind_the_rollout_and_trains_the_same(job_env, tmp_path,
                                                                                         monkeypatch):
    """The moments start copying out at the switch, deferred; the rollout's KV cache wakes while they copy
    (the plan counted them in the rollout's memory), and training starts only after the copy is over."""
    from colomem.engines.hf_rollout import HFRollout
    from colomem.engines.stand_ins import TorchTrainer
    from colomem.runner import train_memory_plan

    gib = 1 << 30
    f = seven_b(rollout_used=20 * gib, pre_step_peak=78 * gib, step_start_peak=100 * gib)
    ref = run_job(job(tmp_path / "moves", offload="all", rollout_sleep="always"), print_fn=lambda *_: None)
    seen = []

    def figures(memory, by_cat, total, **kw):
        seen.append(kw)
        return f
    monkeypatch.setattr(train_memory_plan, "figures_from_step", figures)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)
    events: list = []

    def spy(cls, name, label):
        real = getattr(cls, name)

        def wrapped(self, *a, **kw):
            held = name == "start_offload" and self._deferred is not None and self._deferred[1] is None
            if (name != "finish_offload" or self.offload_pending) and (name != "start_offload" or held):
                events.append(label(self, kw) if callable(label) else label)
            return real(self, *a, **kw)
        monkeypatch.setattr(cls, name, wrapped)
    spy(TorchTrainer, "offload", lambda t, kw: ("offload", tuple(sorted(kw.get("keep", ()))), kw.get("defer"),
                                                kw.get("hold")))
    spy(TorchTrainer, "start_offload", "start")
    spy(TorchTrainer, "finish_offload", lambda t, kw: ("finished", kw.get("background", False)))
    spy(TorchTrainer, "train_step", "train")
    spy(HFRollout, "wake_weights", "wake_weights")
    spy(HFRollout, "wake_kv", "wake_kv")
    said = []
    res = run_job(job(tmp_path / "out"), print_fn=said.append)
    assert ref.summary["status"] == res.summary["status"] == "ok", res.summary
    assert res.summary["placement"]["label"].endswith("optimizer state out behind the rollout"), said
    assert "pre_step_peak" in seen[0] and "step_start_peak" in seen[0]     # the peaks are reported with the plan
    assert any("would fit back before the step" in s for s in said), said
    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    steps = [x for x in lines(tmp_path / "out") if "reward_mean" in x]
    # after the measuring step nothing moves before the rollout; the AdamW state comes back inside the step
    assert all(x["phase_s"].get("reload_step", 0) > 0 for x in steps[1:]), steps
    assert all(x["phase_s"].get("offload", 0) < 0.5 for x in steps[1:])
    assert not any("offload_wait" in x["phase_s"] for x in steps[1:])     # nothing waits before the KV cache
    kept = tuple(sorted(c for c in ALL_CATEGORIES if c != "optim"))
    # the moments start copying out once the rollout is awake (not beside the wakes or the sync), their end
    # runs in a thread during the rollout, and the step's reload waits for it
    cycle = [("offload", kept, True, True), "wake_weights", "wake_kv", "start", ("finished", True),
             ("finished", False), "train"]
    first = events.index(cycle[0])
    # (the last checkpoint is read from the pool: one more offload, whose held copy its save starts and waits for)
    assert first > events.index("train") and events[first:] == cycle * (len(steps) - 1) + [cycle[0],
        ("finished", False), "start"], events
    rewards = lambda out: [x["reward_mean"] for x in lines(out) if "reward_mean" in x]  # noqa: E731
    assert rewards(tmp_path / "out") == rewards(tmp_path / "moves")
    a, b = (torch.load(tmp_path / k / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
            for k in ("moves", "out"))
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])
    # the AdamW moments that went out and came back every step are the same bits as the moved ones
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_an_evaluation_between_steps_with_the_optimizer_state_out_behind_the_rollout_trains_the_same(
        job_env, tmp_path, monkeypatch):
    """An evaluation's awake window sends the moments out behind it too; the next step's offload first brings
    back the moments no optimizer step took back (the state must be whole before it moves again): the
    evaluations and the training match a run that moves everything."""
    from colomem.runner import train_memory_plan

    f = seven_b(rollout_used=20 * (1 << 30))
    ref = run_job(job(tmp_path / "moves", offload="all", rollout_sleep="always", eval_every=1),
                  print_fn=lambda *_: None)
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda *a, **kw: f)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)
    res = run_job(job(tmp_path / "out", eval_every=1), print_fn=lambda *_: None)
    assert ref.summary["status"] == res.summary["status"] == "ok", res.summary
    assert res.summary["placement"]["label"].endswith("optimizer state out behind the rollout")
    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    evals = lambda out: [{k: v for k, v in x.items() if k.startswith("eval/") and k != "eval/seconds"}  # noqa: E731
                         for x in lines(out) if any(k.startswith("eval/") for k in x)]
    assert evals(tmp_path / "out") == evals(tmp_path / "moves") and len(evals(tmp_path / "out")) >= 3
    a, b = (torch.load(tmp_path / k / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
            for k in ("moves", "out"))
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_trimmed_recompute_then_a_grown_micro_batch_share_the_free_memory(job_env, tmp_path, monkeypatch):
    """--trim-recompute (its default, auto, where the placement is measured) with --grow-micro-batch: the trim
    goes first (it takes work out of every step), the micro-batch grows in what is left, each row now holding
    the activations of the layers no longer checkpointed; both lines are printed and the placement event
    records both changes. --trim-recompute false keeps every layer checkpointed."""
    from colomem.engines.recompute import checkpointed_layers, decoder_layers
    from colomem.runner import train_memory_plan
    from colomem.runner.recompute_plan import RecomputeProbe

    GiB = 1 << 30
    f = figs(peak=53)           # 26 GiB free while training; 8 GiB of activations at micro-batch 4: 2 GiB a row
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda memory, by_cat, total, **_: f)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)
    seen = {}

    def probe(trainer, width):   # the tiny model's layers keep a few KiB: stand in for a large model's
        seen["model"] = trainer.model
        layers = len(decoder_layers(trainer.model))
        return RecomputeProbe(per_layer_row=seen.get("per_row", GiB) / layers, layers=layers, checkpointed=layers,
                              width=width)
    monkeypatch.setattr(train_memory_plan, "probe", probe)
    # no layer timing: the plan as on a trainer that could not time its layers (the tiny model's forwards on
    # the CPU against a stand-in vLLM's sleep would weigh nothing real; test_sleep_trade.py weighs given ones)
    monkeypatch.setattr(PhaseRunner, "layer_timing", lambda self, rec: contextlib.nullcontext())

    def run(name, **kw):
        said = []
        res = run_job(job(tmp_path / name, micro_batch=4, placement_margin="2GB", gradient_checkpointing=True,
                          **kw), print_fn=said.append)
        assert res.summary["status"] == "ok", res.summary
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        event = [x for x in lines if x.get("event") == "placement"][-1]
        recomputed = [x["train/recomputed_layers"] for x in lines if "reward_mean" in x]
        return [s for s in said if s.startswith("[colomem] training: --")], event, recomputed

    # growing alone: 26 GiB at 2 GiB a row buys 13 rows more: 16, a divisor of the 16 rows a step
    lines, event, recomputed = run("grow", grow_micro_batch=True, trim_recompute=False)
    assert event["micro_batch_grown"] == [4, 16] and event["recompute_trimmed"] is None
    layers = recomputed[0]
    assert layers > 0 and recomputed == [layers] * 3    # every step recomputed every layer
    # trimmed first: no layer checkpointed takes 1 GiB a row (4 GiB at 4 rows); the 22 GiB left at 3 GiB a row
    # buy 7 rows more: 8, the largest divisor of 16 up to 11
    lines, event, recomputed = run("both", grow_micro_batch=True)
    assert event["recompute_trimmed"][1] == 0 and event["micro_batch_grown"] == [4, 8], event
    assert layers == len(decoder_layers(seen["model"])) and recomputed == [layers, 0, 0]   # then none
    assert checkpointed_layers(seen["model"]) == 0
    assert len(lines) == 2 and lines[0].startswith("[colomem] training: --gradient-checkpointing false from step 2")
    # the default's line says it was the default and how to keep every layer checkpointed
    assert "(--trim-recompute auto: " in lines[0] and "--trim-recompute false recomputes every one)" in lines[0]
    assert lines[1].startswith("[colomem] training: --micro-batch 4 -> 8 from step 2 on")
    # a model whose activations do not fit: the default says it keeps recomputing every layer, and why
    seen["per_row"] = 16 * GiB      # the cheapest setting keeps half the layers' activations: 32 GiB at 4 rows
    lines, event, recomputed = run("none", grow_micro_batch=False)
    assert event["recompute_trimmed"] is None and recomputed == [layers] * 3
    said = event["recompute_hint"]        # the line printed, as the placement event records it
    assert said.startswith(f"the backward keeps recomputing {layers} of the {layers} decoder layers "
                           "(--trim-recompute auto: the ") and "left free while training holds none" in said, said
    # nothing moves, but vLLM awake through training leaves room for part of the trim only: the line says what
    # vLLM asleep while training would take out of the recompute, against its measured sleep and wake
    f = figs(peak=53, rollout=75)         # nothing moving: about 11 free while training; vLLM asleep: about 85
    seen["per_row"] = 4 * GiB            # every layer's activations: 16 GiB at 4 rows
    lines, event, recomputed = run("awake", grow_micro_batch=False)
    assert event["label"] == "nothing moves" and 0 < recomputed[-1] < layers, (event, recomputed)
    said = event["recompute_hint"]
    assert f"; with vLLM asleep while training (--rollout-sleep always) the backward would recompute 0 of the " \
           f"{layers} layers instead of {recomputed[-1]} (--gradient-checkpointing false), for the " in said, said


def test_the_plan_counts_activations_at_the_widest_row_the_job_can_train_on(job_env, tmp_path, monkeypatch):
    """A step whose rows were narrower than the job's widest (here: prompts up to 11 tokens, where the measured
    step's were 4) plans for the widest: its activations count twice, so the micro-batch grows half as far, and
    the runner says so."""
    from colomem.grpo.tasks import SuccessorTask
    from colomem.runner import train_memory_plan

    f = figs(peak=53)                                 # 8 GB of activations at micro-batch 4: 2 GB a row
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda memory, by_cat, total, **_: f)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)

    def run(name):
        said = []
        res = run_job(job(tmp_path / name, micro_batch=4, placement_margin="2GB", grow_micro_batch=True),
                      print_fn=said.append)
        assert res.summary["status"] == "ok", res.summary
        event = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                 if '"placement"' in x and '"event"' in x][-1]
        return said, event

    said, event = run("measured")                     # the successor task's rows: 4 prompt + 3 answer tokens
    assert (event["measured_width"], event["planned_width"]) == (7, 7) and event["micro_batch_grown"] == [4, 16]
    assert not any("planned for rows" in s for s in said)
    monkeypatch.setattr(SuccessorTask, "longest_prompt_tokens", property(lambda self: 11))
    said, event = run("wide")
    assert (event["measured_width"], event["planned_width"]) == (7, 14)
    assert event["micro_batch_grown"] == [4, 8]       # 18 GB free at 4 GB a row
    assert any(s.startswith("[colomem] placement: planned for rows of up to 14 tokens") for s in said), said


def test_the_default_trim_of_the_recompute_trains_bit_for_bit_as_recomputing_every_layer(job_env, tmp_path,
                                                                                       monkeypatch):
    """--trim-recompute's default (auto) with checkpointing on and GPU-like figures that leave room: from
    step 2 no layer is recomputed, and the weights and rewards are those of the run that recomputes every
    layer (--trim-recompute false): the trim takes memory, not bits."""
    from colomem.runner import train_memory_plan

    f = figs(peak=53)
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda memory, by_cat, total, **_: f)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)
    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    runs = {}
    for name, kw in (("trim", {}), ("every", {"trim_recompute": False})):
        res = run_job(job(tmp_path / name, micro_batch=4, placement_margin="2GB", gradient_checkpointing=True, **kw),
                      print_fn=lambda *_: None)
        assert res.summary["status"] == "ok", res.summary
        runs[name] = [x for x in lines(tmp_path / name) if "reward_mean" in x]
    layers = runs["every"][0]["train/recomputed_layers"]
    assert layers > 0 and [x["train/recomputed_layers"] for x in runs["every"]] == [layers] * 3
    assert [x["train/recomputed_layers"] for x in runs["trim"]] == [layers, 0, 0]
    assert [x["reward_mean"] for x in runs["trim"]] == [x["reward_mean"] for x in runs["every"]]
    a, b = (torch.load(tmp_path / k / "checkpoints" / "step-3" / "trainer.pt", weights_only=True)
            for k in ("trim", "every"))
    assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])


def test_a_rollout_whose_kv_comes_back_as_a_lent_tail_does_not_wait_for_the_offload(job_env, tmp_path,
                                                                                   monkeypatch):
    """A lent KV tail maps back only as the rollout's blocks run short, so nothing of the switch waits for
    the trainer's copy out before the rollout: no offload_wait phase, and reload() ends the copy instead."""
    from colomem.engines.hf_rollout import HFRollout

    lines = lambda out: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    kw = dict(offload="all", rollout_sleep="always", overlap_offload=True)   # the copy out runs behind the wake
    ref = run_job(job(tmp_path / "whole", **kw), print_fn=lambda *_: None)
    waited = [x for x in lines(tmp_path / "whole") if "reward_mean" in x and "offload_wait" in x["phase_s"]]
    monkeypatch.setattr(HFRollout, "kv_tail_lent", property(lambda self: True), raising=False)
    res = run_job(job(tmp_path / "tail", **kw), print_fn=lambda *_: None)
    assert ref.summary["status"] == res.summary["status"] == "ok"
    steps = [x for x in lines(tmp_path / "tail") if "reward_mean" in x]
    assert waited and not any("offload_wait" in x["phase_s"] for x in steps), waited
    rewards = lambda out: [x["reward_mean"] for x in lines(out) if "reward_mean" in x]  # noqa: E731
    assert rewards(tmp_path / "tail") == rewards(tmp_path / "whole")
