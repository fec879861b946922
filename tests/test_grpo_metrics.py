"""A step's metrics stay on the device until its micro-batches are done (colomem.grpo.metrics): the loss hands
them over as tensors, the accumulator reads them once per update, and the numbers are the ones the float
path gives, an optional metric counting only where a micro-batch had it."""
import math

import pytest
import torch

from colomem.grpo import metrics as gm
from colomem.grpo.config import GRPOConfig
from colomem.grpo.step import accumulate_gradients, compute_loss, split_micro_batches
from test_grpo_loss import _random_batch, _TinyLM


@pytest.mark.parametrize("correction", ["none", "token", "sequence"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_the_lazy_metrics_average_to_the_float_paths_numbers_with_one_read_per_update(micro, correction,
                                                                                    monkeypatch):
    cfg = GRPOConfig(group_size=2, loss_norm="token", log_entropy=True, dual_clip=3.0, log_ratio_clamp=20.0,
                     **({"old_logprobs": "rollout"} if correction == "none" else
                        {"is_correction": correction, "is_cap": 1.5}))
    b = _random_batch(3)
    model = _TinyLM()
    # the float path, by hand: each micro-batch's metrics read as floats, averaged in Python
    by_hand = gm.MetricAccumulator()
    for mb in split_micro_batches(b, micro, cfg.loss_norm):
        loss, m = compute_loss(model, mb, cfg)
        assert all(isinstance(v, float) for v in m.values())
        by_hand.add(m, mb.loss_weight / b.loss_weight)
    want = by_hand.result()

    reads = []
    real = gm._read_all
    monkeypatch.setattr(gm, "_read_all", lambda values: reads.append(len(values)) or real(values))
    got = accumulate_gradients(model, b, cfg, micro_batch=micro, backward=lambda l: l.backward())
    assert len(reads) == 1                               # one read for the whole update, none per micro-batch
    assert {k: got[k] for k in want} == want             # the same float64 arithmetic: equal, not close
    assert {"loss", "entropy", "rollout_logprob_gap", "ratio_max", "clip_frac_dual"} <= set(want)
    if correction != "none":
        assert {"is_weight_mean", "is_weight_min", "is_weight_max", "is_truncated_frac"} <= set(want)


def test_compute_loss_hands_its_metrics_over_unread():
    cfg = GRPOConfig(group_size=2, old_logprobs="rollout", log_entropy=True)
    _, m = compute_loss(_TinyLM(), _random_batch(4), cfg, lazy=True)
    assert isinstance(m["loss"], torch.Tensor) and isinstance(m["entropy"], torch.Tensor)
    value, present = m["rollout_logprob_gap"]
    assert isinstance(value, torch.Tensor) and float(present) == 1.0


def test_an_optional_metric_counts_only_where_a_micro_batch_had_it():
    acc = gm.MetricAccumulator()
    acc.add({"gap": gm.optional(torch.tensor(2.0), torch.tensor(True)), "x": torch.tensor(1.0),
             "y_max": torch.tensor(3.0), "z_min": 5.0, "loss": torch.tensor(0.25)}, 0.25)
    acc.add({"gap": gm.optional(torch.tensor(float("nan")), torch.tensor(False)), "x": 3.0,
             "y_max": 2.0, "z_min": torch.tensor(4.0), "loss": 0.5}, 0.75)
    out = acc.result()
    assert out["gap"] == 2.0                       # the second micro-batch had none: not a 0 in the mean
    assert out["x"] == pytest.approx(2.5) and out["y_max"] == 3.0 and out["z_min"] == 4.0 and out["loss"] == 0.75
    none = gm.MetricAccumulator()
    none.add({"gap": gm.optional(torch.tensor(0.0), torch.tensor(False))}, 1.0)
    assert none.result() == {}                      # no micro-batch had it: left out, as the float path does
    assert gm.read({"a": torch.tensor(1.5), "b": 2.0, "c": gm.optional(torch.tensor(1.0), torch.tensor(False))}) \
        == {"a": 1.5, "b": 2.0}


def test_a_nan_loss_stays_a_nan():
    acc = gm.MetricAccumulator()
    acc.add({"loss": torch.tensor(float("nan")), "pg_loss": torch.tensor(float("nan"))}, 1.0)
    out = acc.result()
    assert math.isnan(out["loss"]) and math.isnan(out["pg_loss"])
