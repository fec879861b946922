"""The planner's checkpointing hint (colomem.runner.recompute_plan): the settings it weighs, the one it names
for the memory left free while training (the fewest checkpointed layers whose measured extra activations
fit), none when nothing fits or nothing would change, and the probe run on a trainer's own model; with
--trim-recompute that setting applied to the trainer's model."""
from types import SimpleNamespace

import pytest
import torch

from colomem.runner import placement as pl
from colomem.engines.recompute import fewer_checkpointed
from colomem.runner.recompute_plan import RecomputeProbe, asleep_trade, no_fit_reason, probe, recompute_hint
from colomem.runner.train_memory_plan import recompute_line
from test_recompute import small_qwen2

GiB = 1 << 30


def test_the_options_are_the_settings_with_fewer_checkpointed_layers_fewest_first():
    assert fewer_checkpointed(28, 28) == [("--gradient-checkpointing false", 0, 0), ("--checkpoint-every 28", 1, 28),
                                          ("--checkpoint-every 4", 7, 4), ("--checkpoint-every 3", 10, 3),
                                          ("--checkpoint-every 2", 14, 2)]
    assert fewer_checkpointed(28, 14) == fewer_checkpointed(28, 28)[:4]          # already every other layer
    assert fewer_checkpointed(4, 2) == [("--gradient-checkpointing false", 0, 0), ("--checkpoint-every 4", 1, 4)]
    assert fewer_checkpointed(4, 0) == []


def test_the_hint_names_the_fewest_checkpointed_layers_that_fit():
    pr = RecomputeProbe(per_layer_row=GiB / 8, layers=28, checkpointed=28, width=261)   # 1 GiB a layer at 8 rows
    assert "--gradient-checkpointing false would fit" in recompute_hint(40 * GiB, pr, 8)   # 28 GiB more
    assert "--checkpoint-every 4 would fit" in recompute_hint(21 * GiB, pr, 8)            # 21 layers: 21 GiB
    hint = recompute_hint(15 * GiB, pr, 8)
    assert "--checkpoint-every 2 would fit" in hint and "recomputes 14 layers instead of 28" in hint
    assert recompute_hint(13 * GiB, pr, 8) == ""                                          # 14 GiB: not even that
    assert recompute_hint(40 * GiB, RecomputeProbe(GiB / 8, 28, 0, 261), 8) == ""           # nothing to recompute less
    assert "--gradient-checkpointing false" in recompute_hint(40 * GiB, pr, 4)              # half the rows: half


def test_when_no_setting_fits_the_reason_names_what_the_cheapest_would_take():
    pr = RecomputeProbe(per_layer_row=GiB / 8, layers=28, checkpointed=28, width=261)   # 1 GiB a layer at 8 rows
    why = no_fit_reason(13 * GiB, pr, 8)                   # the cheapest, every other layer: 14 layers, 14 GiB
    assert "13.00 GiB left free while training holds none" in why and "--checkpoint-every 2" in why
    assert "14 more layers' activations, 14.00 GiB at a micro-batch of 8 rows of 261 tokens" in why
    assert "nothing is left free" in no_fit_reason(0, pr, 8)
    assert "another GPU" in no_fit_reason(40 * GiB, pr, 8, others_short=True)
    assert "no setting takes fewer" in no_fit_reason(40 * GiB, RecomputeProbe(GiB / 8, 28, 0, 261), 8)
    assert "could not be measured" in no_fit_reason(40 * GiB, None, 8)


def test_asleep_trade_names_what_vllm_asleep_would_take_out_of_the_recompute():
    pr = RecomputeProbe(per_layer_row=GiB / 8, layers=28, checkpointed=28, width=261)   # 1 GiB a layer at 8 rows
    said = asleep_trade(15 * GiB, 40 * GiB, pr, 8, 0.048)     # awake: every other layer; asleep: none
    assert "would recompute 0 of the 28 layers instead of 14 (--gradient-checkpointing false)" in said
    assert "the 0.048 s its sleep and wake took" in said and "recomputing 14 layers" in said
    assert asleep_trade(40 * GiB, 80 * GiB, pr, 8, 0.05) == ""          # awake already recomputes none
    assert asleep_trade(15 * GiB, 16 * GiB, pr, 8, 0.05) == ""          # asleep would not take more out
    assert "instead of 28" in asleep_trade(5 * GiB, 40 * GiB, pr, 8, 0.05)   # awake: no trim fits at all


def test_the_probe_runs_on_the_trainers_model_and_not_on_zero3():
    model = small_qwen2(layers=6)
    trainer = SimpleNamespace(model=model, device=torch.device("cpu"))
    assert probe(trainer, 40) is None                             # no checkpointing: nothing to weigh
    from colomem.engines.recompute import enable_recompute

    enable_recompute(model, 2)
    pr = probe(trainer, 40)
    assert pr.layers == 6 and pr.checkpointed == 3 and pr.width == 40 and pr.per_layer_row > 0
    assert probe(SimpleNamespace(model=model, device=torch.device("cpu"), zero_stage=3), 40) is None


def test_the_runner_weighs_the_free_training_memory_at_the_planned_width():
    model = small_qwen2(layers=6)
    from colomem.engines.recompute import enable_recompute

    enable_recompute(model, 1)
    total = 80 * GiB
    fig = pl.MemoryFigures(total=total, rollout_used=20 * GiB, trainer_left=GiB, train_peak=30 * GiB,
                           state={"params": 2 * GiB, "other": 0, "grads": 2 * GiB, "master": 4 * GiB,
                                  "optim": 8 * GiB}, train_other=GiB)
    cfg = SimpleNamespace(gradient_checkpointing=True, micro_batch=4, micro_batch_tokens=None)
    trainer = SimpleNamespace(model=model, device=torch.device("cpu"))
    placement = pl.choose("auto", "auto", [fig], margin=2 * GiB)

    def weigh(train_width=40, width=40):
        return recompute_line(cfg, trainer, None, placement, [fig], 2 * GiB, 0, train_width=train_width, width=width)
    said = weigh()
    hint = said.line
    assert "--gradient-checkpointing false would fit" in hint and said.probe.checkpointed == 6
    assert said.probe.width == 40 and said.trimmed is None and said.extra == 0
    # a job whose rows can be wider than the measured step's: the probe measures at the widest
    assert weigh(width=80).probe.width == 80
    # a token budget of 160 holds 4 rows of 40: the same hint
    cfg.micro_batch, cfg.micro_batch_tokens = 64, 160
    assert weigh().line == hint
    assert weigh(train_width=0).line == ""                        # no batch trained on yet: no probe
    cfg.gradient_checkpointing = False
    assert weigh().line == ""


def test_trim_recompute_applies_the_setting_to_the_trainers_model_and_says_so():
    """--trim-recompute: the setting the hint would name is applied to the trainer's model from the given step
    (every layer keeps its activations when they all fit; every other layer when only three of six do), the
    line and recompute_trimmed say what changed, and nothing changes when nothing fits."""
    from colomem.engines.recompute import checkpointed_layers, enable_recompute

    fig = pl.MemoryFigures(total=80 * GiB, rollout_used=20 * GiB, trainer_left=GiB, train_peak=30 * GiB,
                           state={"params": 2 * GiB, "other": 0, "grads": 2 * GiB, "master": 4 * GiB,
                                  "optim": 8 * GiB}, train_other=GiB)
    placement = pl.choose("auto", "auto", [fig], margin=2 * GiB)

    def trainer():
        model = small_qwen2(layers=6)
        enable_recompute(model, 1)
        return SimpleNamespace(model=model, device=torch.device("cpu"))
    cfg = SimpleNamespace(gradient_checkpointing=True, micro_batch=4, micro_batch_tokens=None, trim_recompute=True)

    def trim(t, taken=0, others=()):
        ranks = SimpleNamespace(exchange=lambda x: [x, *others])
        return recompute_line(cfg, t, ranks, placement, [fig], 2 * GiB, taken, train_width=40, width=40, trim_from=2)
    t = trainer()
    said = trim(t)
    assert said.line.startswith("--gradient-checkpointing false from step 2 on (--trim-recompute: the backward "
                                "recomputes 0 of the 6 decoder layers instead of 6")
    assert checkpointed_layers(t.model) == 0 and said.trimmed == (6, 0)
    per_layer = probe(trainer(), 40).per_layer_row * 4
    assert said.extra == int(6 * per_layer)                       # what a grown micro-batch must leave them
    # room for three more layers' activations (and a half): every other layer stays checkpointed
    t = trainer()
    spare = pl.train_spare(placement, [fig], 2 * GiB, 0)
    said = trim(t, spare - int(3.5 * per_layer))
    assert said.line.startswith("--checkpoint-every 2 from step 2 on") and said.trimmed == (6, 3)
    assert [m.gradient_checkpointing for m in t.model.model.layers] == [True, False] * 3
    t = trainer()                                                  # not one layer's activations fit
    said = trim(t, spare - int(0.5 * per_layer))                   # not even that: said
    assert said.line.startswith("the backward keeps recomputing") and "left free while training holds none" in said.line
    assert checkpointed_layers(t.model) == 6 and said.trimmed is None and said.extra == 0
    # several ranks: each applies the setting that keeps the most layers checkpointed over all of them, and
    # none trims when one rank's memory fits none
    t = trainer()
    said = trim(t, others=[(3, 2, 1, "--checkpoint-every 2")])
    assert said.line.startswith("--checkpoint-every 2 from step 2") and said.trimmed == (6, 3)
    t = trainer()
    said = trim(t, others=[None])
    assert "another GPU's free memory holds none" in said.line and checkpointed_layers(t.model) == 6


def test_trim_recompute_needs_checkpointing_and_a_measured_placement():
    from colomem.errors import ConfigError
    from colomem.runner.config import config_from_dict

    base = {"backend": "cpu", "gradient_checkpointing": True, "trim_recompute": True}
    assert config_from_dict(base).trim_recompute
    assert config_from_dict({**base, "grow_micro_batch": True}).grow_micro_batch    # they share the memory
    for other, what in (({"gradient_checkpointing": False}, "without --gradient-checkpointing"),
                        ({"offload": "none", "rollout_sleep": "never"}, "measures in the first step")):
        with pytest.raises(ConfigError, match=what):
            config_from_dict({**base, **other})


def test_trim_recompute_auto_trims_wherever_the_placement_is_measured_and_checkpointing_is_on():
    """The default, auto: the planner trims where it measures the memory (the same gradients, less work),
    never asks for it where it cannot (a fixed placement, the timesplit baseline, no checkpointing), and
    false keeps every checkpointed layer; the flag takes true, false or auto, nothing else."""
    from colomem.errors import ConfigError
    from colomem.runner.config import config_from_dict, load_run_config

    on = {"backend": "cpu", "gradient_checkpointing": True}
    assert config_from_dict({}).trim_recompute == "auto"
    assert config_from_dict(on).trims_recompute
    assert config_from_dict({**on, "offload": "none"}).trims_recompute           # the rollout's sleep measured
    for off in ({"gradient_checkpointing": False}, {"offload": "none", "rollout_sleep": "never"},
                {"offload": "all", "rollout_sleep": "always"}, {"switch": "timesplit"}, {"trim_recompute": False}):
        assert not config_from_dict({**on, **off}).trims_recompute, off
    cli = ["--backend", "cpu", "--gradient-checkpointing", "true"]
    assert load_run_config(cli + ["--trim-recompute"]).trim_recompute is True
    assert load_run_config(cli + ["--no-trim-recompute"]).trim_recompute is False
    assert load_run_config(cli + ["--trim-recompute", "auto"]).trim_recompute == "auto"
    with pytest.raises(ConfigError, match="should be true, false or auto"):
        load_run_config(cli + ["--trim-recompute", "maybe"])
