"""Reusing a batch (num_iterations passes of mini_batches mini-batches): every optimizer step's ratio is
against the batch's first-pass logprobs, checked against a loop written out here with plain SGD."""
import copy

import pytest
import torch

from colomem.errors import InvalidArgumentError
from colomem.grpo.config import GRPOConfig
from colomem.grpo.loss import grpo_loss
from colomem.grpo.step import (combine_updates, policy_logprobs, split_mini_batches, train_on_batch,
                               with_first_logprobs)
from test_grpo_loss import _random_batch, _TinyLM


def _sgd(model, lr=0.5):
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"grad_norm": 1.0}
    return step


@pytest.mark.parametrize("iterations,minis", [(1, 1), (3, 1), (2, 3)])
@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_every_update_clips_against_the_first_pass(iterations, minis, norm):
    b = _random_batch(7)
    cfg = GRPOConfig(group_size=2, num_iterations=iterations, mini_batches=minis, loss_norm=norm, clip_eps=0.1)
    model, ref = _TinyLM(), _TinyLM()
    m = train_on_batch(model, b, cfg, micro_batch=2, backward=lambda l: l.backward(), optimizer_step=_sgd(model))
    assert m["optimizer_steps"] == iterations * minis and m["grad_norm"] == 1.0

    # by hand: old = the untouched model's logprobs; each mini-batch its own normalisation, one SGD step each
    with torch.no_grad():
        first = policy_logprobs(ref, b)
    step = _sgd(ref)
    B = len(b)
    cuts = [i * B // minis for i in range(minis + 1)]
    ratios = []
    for _ in range(iterations):
        for lo, hi in zip(cuts, cuts[1:]):
            rows = list(range(lo, hi))
            mb = b.select(rows)
            mb.old_logprobs = first[rows][:, :mb.input_ids.shape[1]]
            loss, mm = grpo_loss(policy_logprobs(ref, mb), mb, clip_eps=0.1, loss_norm=norm)
            loss.backward()
            step()
            ratios.append(mm["ratio_max"])
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert ratios[0] == pytest.approx(1.0)                  # the first update is on-policy
    if iterations * minis > 1:
        assert max(ratios[1:]) > 1.0                         # later ones see the moved policy
        assert m["ratio_max"] == pytest.approx(max(ratios), abs=1e-6)


def test_rollout_old_logprobs_stay_the_ratios_denominator_on_every_pass():
    b = _random_batch(8)
    cfg = GRPOConfig(group_size=2, num_iterations=2, old_logprobs="rollout")
    model, ref = _TinyLM(), _TinyLM()
    train_on_batch(model, b, cfg, micro_batch=8, backward=lambda l: l.backward(), optimizer_step=_sgd(model))
    step = _sgd(ref)
    for _ in range(2):
        loss, _ = grpo_loss(policy_logprobs(ref, b), b, clip_eps=0.2)
        loss.backward()
        step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_first_pass_logprobs_fill_the_padded_batch():
    b = _random_batch(9)
    model = _TinyLM()
    got = with_first_logprobs(model, b, GRPOConfig(group_size=2), micro_batch=2).first_logprobs
    with torch.no_grad():
        want = policy_logprobs(model, b) * b.completion_mask
    assert got.shape == b.input_ids.shape and torch.allclose(got, want, atol=1e-6)


def test_first_pass_computes_the_reference_once():
    b = _random_batch(10)
    calls = []
    frozen = copy.deepcopy(_TinyLM())

    def ref_fn(mb):
        calls.append(len(mb))
        return policy_logprobs(frozen, mb)
    cfg = GRPOConfig(group_size=2, kl_coef=0.1, num_iterations=3)
    model = _TinyLM()
    m = train_on_batch(model, b, cfg, micro_batch=4, backward=lambda l: l.backward(), optimizer_step=_sgd(model),
                       ref_logprobs_fn=ref_fn)
    assert sum(calls) == len(b) and m["kl"] > 0            # one pass over the rows, not one per update


def test_mini_batch_split():
    b = _random_batch(11)                                    # 6 rows
    assert [len(x) for x in split_mini_batches(b, 4)] == [1, 2, 1, 2]
    assert split_mini_batches(b, 1)[0] is b
    with pytest.raises(InvalidArgumentError, match="mini_batches=7 but this rank trains on 6 rows"):
        split_mini_batches(b, 7)


def test_combined_metrics():
    out = combine_updates([{"loss": 1.0, "ratio_max": 1.0, "is_weight_min": 0.5, "reload_wait_s": 0.25},
                           {"loss": 3.0, "ratio_max": 1.4, "is_weight_min": 0.2, "reload_wait_s": 0.0}])
    assert out == {"loss": 2.0, "ratio_max": 1.4, "is_weight_min": 0.2, "reload_wait_s": 0.25}


def test_each_update_runs_its_micro_batches_inside_the_accumulation_context_and_steps_outside():
    """accumulation() (DeepSpeed: one gradient reduction per update) is entered once per optimizer step, holds
    every backward of that step's micro-batches and is left before the step; the update is unchanged."""
    from contextlib import contextmanager

    b = _random_batch(11)
    cfg = GRPOConfig(group_size=2, num_iterations=2, mini_batches=2)
    events = []

    @contextmanager
    def accumulation():
        events.append("enter")
        yield
        events.append("exit")

    model, ref = _TinyLM(), copy.deepcopy(_TinyLM())
    ref.load_state_dict(model.state_dict())
    sgd, sgd_ref = _sgd(model), _sgd(ref)

    def step():
        events.append("step")
        return sgd()

    def backward(loss):
        events.append("backward")
        loss.backward()

    m = train_on_batch(model, b, cfg, micro_batch=2, backward=backward, optimizer_step=step,
                       accumulation=accumulation)
    train_on_batch(ref, b, cfg, micro_batch=2, backward=lambda l: l.backward(), optimizer_step=sgd_ref)
    per_update = -(-(len(b) // 2) // 2)               # micro-batches of 2 rows in a mini-batch of half the rows
    assert m["optimizer_steps"] == 4 and per_update == 2
    assert events == (["enter"] + ["backward"] * per_update + ["exit", "step"]) * 4
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
