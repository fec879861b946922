"""--rollout-sleep auto with nothing moving and --trim-recompute (colomem.runner.sleep_trade): vLLM sleeps while
training when the recompute its sleep takes out costs more than the sleep and wake the measuring step took,
and stays awake otherwise; the line and the placement event say the figures and the choice; without a timing
the planner says what it says today. Given memory figures and seconds; the CPU loop runs both choices."""
import json
from types import SimpleNamespace

import pytest

from colomem.engines.layer_timing import LAYER_STEP_KEY, LayerTimes
from colomem.runner import placement as pl
from colomem.runner import run_job
from colomem.runner.recompute_plan import RecomputeProbe
from colomem.runner.sleep_trade import moved_share, recompute_cost, switch_seconds, weigh_rollout_sleep
from colomem.runner.timeline import StepRecord
from fakes.placement import GB, figs, job
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)

GiB = 1 << 30
MARGIN = 2 * GiB
# 28 layers, 1 GiB each at a micro-batch of 8 rows; nothing moving leaves about 14.8 GiB free while training
# (every other layer keeps its activations: 14 recomputed), vLLM asleep about 79 GiB (none recomputed)
PROBE = RecomputeProbe(per_layer_row=GiB / 8, layers=28, checkpointed=28, width=261)
FIGS = [figs(peak=53, rollout=70)]
CFG = SimpleNamespace(offload="auto", micro_batch=8, micro_batch_tokens=None)
PHASES = {"sleep": 0.10, "wake_weights": 0.25, "wake_kv": 0.05, "sync": 0.40, "check": 0.02, "offload": 1.5,
          "reload": 1.0}       # sleep and wake: 0.4 s; the sync and the trainer's moves are not the trade's


def measured(layer_step_s, phases=PHASES):
    return StepRecord(step=0, phase_s=dict(phases), metrics={} if layer_step_s is None else
                      {LAYER_STEP_KEY: layer_step_s})


def weigh(rec, pr=PROBE, others=(), figures=FIGS, taken=0):
    ranks = SimpleNamespace(exchange=lambda mine: [mine, *others])
    awake = pl.choose("auto", "auto", figures, MARGIN)
    assert awake.label == "nothing moves"
    return awake, weigh_rollout_sleep(CFG, ranks, awake, figures, MARGIN, taken, pr, rec, True, 261)


def test_vllm_sleeps_when_the_recompute_it_takes_out_costs_more_than_its_sleep_and_wake():
    awake, trade = weigh(measured(0.05))               # 14 layers x 0.05 s = 0.7 s a step > 0.4 s
    assert (trade.recomputed_awake, trade.recomputed_asleep, trade.layers) == (14, 0, 28)
    assert trade.switch_s == pytest.approx(0.4) and trade.saved_s == pytest.approx(0.7) and trade.rollout_sleeps
    chosen = trade.placement(awake)
    assert chosen.label == "trainer resident, rollout sleeps" and chosen.rollout_sleeps
    assert "nothing moving fits too" in chosen.why and pl.fits(chosen, FIGS, MARGIN)
    line = trade.line(2)
    assert line.startswith("vLLM sleeps while training from step 2 on (trainer resident, rollout sleeps; "
                           "--rollout-sleep auto): the backward then recomputes 0 of the 28 decoder layers "
                           "instead of 14, which saves 14 x 0.050 s = 0.700 s a step"), line
    assert line.endswith("more than the 0.400 s its sleep and wake took in the measuring step"), line
    event = trade.to_dict(2)
    assert event["rollout_sleeps"] is True and event["layer_step_s"] == 0.05 and event["line"] == line
    assert (event["recomputed_awake"], event["recomputed_asleep"]) == (14, 0)
    assert event["switch_s"] == pytest.approx(0.4) and event["saved_s"] == pytest.approx(0.7)


def test_nothing_moves_when_the_sleep_and_wake_cost_more_than_the_recompute_they_take_out():
    awake, trade = weigh(measured(0.02))               # 14 x 0.02 s = 0.28 s a step < 0.4 s
    assert not trade.rollout_sleeps and trade.placement(awake) is awake
    line = trade.line(2)
    assert line.startswith("vLLM stays awake while training (--rollout-sleep auto): asleep, it would let the "
                           "backward recompute 0 of the 28 decoder layers instead of 14, which would save "
                           "14 x 0.020 s = 0.280 s a step"), line
    assert "no more than the 0.400 s its sleep and wake took" in line
    assert trade.to_dict(2)["rollout_sleeps"] is False
    # every other layer checkpointed already: awake, none stays recomputed; vLLM asleep has nothing to take out
    assert weigh(measured(1.0), pr=RecomputeProbe(GiB / 8, 28, 14, 261))[1] is None
    # more free beside the awake rollout (about 24.8 GiB): every fourth layer recomputed awake, 7 to take out
    _, trade = weigh(measured(0.05), figures=[figs(peak=53, rollout=60)])
    assert (trade.recomputed_awake, trade.recomputed_asleep) == (7, 0) and not trade.rollout_sleeps


def test_without_a_timing_or_a_probe_on_any_rank_nothing_is_weighed():
    assert weigh(measured(None))[1] is None                      # no timing (no checkpointing, no layers)
    assert weigh(measured(0.05), pr=None)[1] is None            # the probe could not run (ZeRO-3)
    assert weigh(measured(0.05), others=[None])[1] is None      # another rank lacks one: every rank the same


def test_a_bucket_grown_for_nothing_moving_must_fit_beside_the_sleeping_rollout_too():
    # a trainer whose whole state (51 GB) is larger than its training peak (40 GB): resident beside the awake
    # rollout it leaves less free (about 16.9 GB) than nothing moving does (about 28.9 GB)
    roomy = [figs(peak=40, rollout=70, optim=30)]
    assert weigh(measured(0.1), figures=roomy)[1].rollout_sleeps
    assert weigh(measured(0.1), figures=roomy, taken=10 * GB)[1].rollout_sleeps
    assert weigh(measured(0.1), figures=roomy, taken=20 * GB)[1] is None     # the buffers would not fit


def test_every_rank_weighs_the_largest_figures():
    # another rank: slower layers, a slower wake, and a probe that left it only every fourth layer awake
    _, trade = weigh(measured(0.02), others=[(21, 0, 0.05, 0.9)])
    assert (trade.recomputed_awake, trade.layer_step_s, trade.switch_s) == (21, 0.05, 0.9)
    assert trade.saved_s == pytest.approx(21 * 0.05) and trade.rollout_sleeps


def test_the_sleep_and_wake_cost_counts_the_trainer_moves_only_of_a_placement_that_makes_them():
    resident = pl.Placement(pl.ALL_CATEGORIES, True)
    assert moved_share(resident, FIGS) == 0 and switch_seconds(PHASES, resident, FIGS) == pytest.approx(0.4)
    keeps_weights = pl.Placement(("params", "other"), True)         # 42 of its 45 GB of state move
    share = moved_share(keeps_weights, FIGS)
    assert share == pytest.approx(42 / 45)
    assert switch_seconds(PHASES, keeps_weights, FIGS) == pytest.approx(0.4 + share * 2.5)
    optim_out = pl.Placement(pl.ALL_CATEGORIES, True, optim_out=True)   # Adam's moments, 24 GB
    assert moved_share(optim_out, FIGS) == pytest.approx(24 / 45)


def test_the_cost_of_the_layers_still_recomputed_is_said_when_timed():
    assert recompute_cost({LAYER_STEP_KEY: 0.05}, 14) == ("recomputing 14 layers costs about 14 x 0.050 s = "
                                                          "0.700 s a step (each layer's forwards, as timed in "
                                                          "the measuring step)")
    assert "0.400 ms" in recompute_cost({LAYER_STEP_KEY: 0.0004}, 1)     # a small model's: in milliseconds
    assert recompute_cost({}, 14) == "" and recompute_cost({LAYER_STEP_KEY: 0.05}, 0) == ""


def run_loop(tmp_path, monkeypatch, name, layer_step_s):
    """The CPU loop with GPU-like figures (nothing moves; vLLM asleep leaves room for every layer's
    activations, awake for part of them) and a given timing of the measuring step's layers."""
    from colomem.engines.recompute import decoder_layers
    from colomem.runner import train_memory_plan

    f = figs(peak=53, rollout=75)         # nothing moving: about 10 GiB free while training; asleep: about 79
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda memory, by_cat, total, **_: f)
    monkeypatch.setattr(train_memory_plan, "gpu_total", lambda device: f.total)

    def probe(trainer, width):       # the tiny model's layers at a large model's size: 16 GiB in all at 4 rows
        layers = len(decoder_layers(trainer.model))
        return RecomputeProbe(per_layer_row=4 * GiB / layers, layers=layers, checkpointed=layers, width=width)
    monkeypatch.setattr(train_memory_plan, "probe", probe)
    monkeypatch.setattr(LayerTimes, "layer_step_s", property(lambda self: layer_step_s))
    said = []
    res = run_job(job(tmp_path / name, micro_batch=4, placement_margin="2GB", gradient_checkpointing=True),
                  print_fn=said.append)
    assert res.summary["status"] == "ok", res.summary
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    event = [x for x in lines if x.get("event") == "placement"][-1]
    steps = [x for x in lines if "reward_mean" in x]
    return said, event, steps


def test_the_loop_lets_vllm_sleep_when_the_measured_recompute_costs_more(job_env, tmp_path, monkeypatch):
    said, event, steps = run_loop(tmp_path, monkeypatch, "sleeps", 10.0)    # far more than any CPU sleep
    layers = steps[0]["train/recomputed_layers"]
    assert steps[0][LAYER_STEP_KEY] == 10.0 and LAYER_STEP_KEY not in steps[1]
    assert event["label"] == "trainer resident, rollout sleeps" and "nothing moving fits too" in event["why"]
    trade = event["rollout_sleep_trade"]
    assert trade["rollout_sleeps"] is True and trade["recomputed_asleep"] == 0
    assert 0 < trade["recomputed_awake"] < layers and trade["layer_step_s"] == 10.0
    assert trade["switch_s"] == pytest.approx(sum(steps[0]["phase_s"][k] for k in ("sleep", "wake_weights",
                                                                                    "wake_kv")))
    line = [s for s in said if s.startswith("[colomem] rollout sleep: ")]
    assert line == [f"[colomem] rollout sleep: {trade['line']}"] and "vLLM sleeps while training" in line[0]
    assert [x["train/recomputed_layers"] for x in steps] == [layers, 0, 0]
    assert [x["rollout/woke"] for x in steps[1:]] == [1, 1]          # it slept through each training since
    assert event["recompute_trimmed"] == [layers, 0]


def test_the_loop_keeps_nothing_moving_when_the_measured_recompute_costs_less(job_env, tmp_path, monkeypatch):
    said, event, steps = run_loop(tmp_path, monkeypatch, "awake", 1e-12)   # less than any sleep and wake
    layers = steps[0]["train/recomputed_layers"]
    assert event["label"] == "nothing moves"
    trade = event["rollout_sleep_trade"]
    assert trade["rollout_sleeps"] is False and trade["recomputed_asleep"] == 0
    assert [x["train/recomputed_layers"] for x in steps][1:] == [trade["recomputed_awake"]] * 2
    assert 0 < trade["recomputed_awake"] < layers
    assert [s for s in said if s.startswith("[colomem] rollout sleep: ")] == [
        f"[colomem] rollout sleep: {trade['line']}"]
    assert "vLLM stays awake while training" in trade["line"]
    # the trim line no longer leaves the choice open: the rollout sleep line made it
    assert "the faster of the two depends" not in event["recompute_hint"]
    assert [x["rollout/woke"] for x in steps[1:]] == [1, 0]     # woken after the measuring step, then awake
