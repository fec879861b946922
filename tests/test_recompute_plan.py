"""The planner's checkpointing hint (colomem.runner.recompute_plan): the settings it weighs, the one it names
for the memory left free while training (the fewest checkpointed layers whose measured extra activations
fit), none when nothing fits or nothing would change, and the probe run on a trainer's own model."""
from types import SimpleNamespace

import torch

from colomem.runner import placement as pl
from colomem.runner.phase_runner import PhaseRunner
from colomem.engines.recompute import fewer_checkpointed
from colomem.runner.recompute_plan import RecomputeProbe, probe, recompute_hint
from test_recompute import small_qwen2

GiB = 1 << 30


def test_the_options_are_the_settings_with_fewer_checkpointed_layers_fewest_first():
    assert fewer_checkpointed(28, 28) == [("--gradient-checkpointing false", 0), ("--checkpoint-every 28", 1),
                               ("--checkpoint-every 4", 7), ("--checkpoint-every 3", 10), ("--checkpoint-every 2", 14)]
    assert fewer_checkpointed(28, 14) == fewer_checkpointed(28, 28)[:4]          # already every other layer
    assert fewer_checkpointed(4, 2) == [("--gradient-checkpointing false", 0), ("--checkpoint-every 4", 1)]
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


def test_the_probe_runs_on_the_trainers_model_and_not_on_zero3():
    model = small_qwen2(layers=6)
    trainer = SimpleNamespace(model=model, device=torch.device("cpu"))
    assert probe(trainer, 40) is None                             # no checkpointing: nothing to weigh
    from colomem.engines.recompute import enable_recompute

    enable_recompute(model, 2)
    pr = probe(trainer, 40)
    assert pr.layers == 6 and pr.checkpointed == 3 and pr.width == 40 and pr.per_layer_row > 0
    assert probe(SimpleNamespace(model=model, device=torch.device("cpu"), zero_stage=3), 40) is None


def test_the_runner_weighs_the_free_training_memory_at_the_measured_width():
    model = small_qwen2(layers=6)
    from colomem.engines.recompute import enable_recompute

    enable_recompute(model, 1)
    total = 80 * GiB
    fig = pl.MemoryFigures(total=total, rollout_used=20 * GiB, trainer_left=GiB, train_peak=30 * GiB,
                           state={"params": 2 * GiB, "other": 0, "grads": 2 * GiB, "master": 4 * GiB,
                                  "optim": 8 * GiB}, train_other=GiB)
    runner = SimpleNamespace(cfg=SimpleNamespace(gradient_checkpointing=True, micro_batch=4, micro_batch_tokens=None),
                             train_width=40,
                             trainer=SimpleNamespace(model=model, device=torch.device("cpu")), recompute_probe=None,
                             placement=pl.choose("auto", "auto", [fig], margin=2 * GiB))
    hint = PhaseRunner._recompute_hint(runner, [fig], 2 * GiB, 0)
    assert "--gradient-checkpointing false would fit" in hint and runner.recompute_probe.checkpointed == 6
    # a token budget of 160 holds 4 rows of 40: the same hint
    runner.cfg.micro_batch, runner.cfg.micro_batch_tokens = 64, 160
    assert PhaseRunner._recompute_hint(runner, [fig], 2 * GiB, 0) == hint
    runner.train_width = 0                                        # no batch trained on yet: no probe
    assert PhaseRunner._recompute_hint(runner, [fig], 2 * GiB, 0) == ""
    runner.cfg.gradient_checkpointing, runner.train_width = False, 40
    assert PhaseRunner._recompute_hint(runner, [fig], 2 * GiB, 0) == ""
