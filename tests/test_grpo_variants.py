"""The loss variants against formulas written out here: GSPO's sequence ratio, dual-clip, clamped log-ratios
and KL, the ratio-corrected KL, the entropy bonus, the rollout importance weights (truncate / mask, token /
sequence), and that the defaults leave the loss as it was."""
import math
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from colomem.errors import InvalidArgumentError
from colomem.grpo.batch import GRPOBatch
from colomem.grpo.config import GRPOConfig
from colomem.grpo.loss import grpo_loss, kl_k3, rollout_is_weights, token_entropy, token_logprobs
from colomem.grpo.step import compute_loss, policy_logprobs
from test_grpo_loss import _one_row, _random_batch, _TinyLM


def _rows(adv, old, lps, lengths):
    """Rows of completion lengths `lengths` after a one-token prompt; old/lps: one list per row."""
    T = 1 + max(lengths)
    B = len(lengths)
    mask, o, lp = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)
    for b, n in enumerate(lengths):
        mask[b, 1:1 + n] = 1
        o[b, 1:1 + n] = torch.tensor(old[b])
        lp[b, 1:1 + n] = torch.tensor(lps[b])
    lp.requires_grad_(True)
    batch = GRPOBatch(torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long), mask,
                      torch.tensor(adv, dtype=torch.float32), old_logprobs=o)
    return lp, batch


# ------------------------------------------------------------------------------------------------ GSPO
def test_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
    # log-ratios 0.1 and -0.3: s = exp(-0.1); A = 2 inside the clip: loss -s * A, d/dlp_t = -A * s / 2
    lp, b = _one_row(2.0, [-1.0, -2.0], [-0.9, -2.3])
    loss, m = grpo_loss(lp, b, clip_eps=0.2, importance_level="sequence")
    s = math.exp(-0.1)
    assert float(loss.detach()) == pytest.approx(-2 * s, abs=1e-6)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0, 0, -s, -s], abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(s, abs=1e-6)


def test_sequence_ratio_clips_the_whole_completion():
    # log-ratios 0.5, 0.1: s = exp(0.3) = 1.35 > 1.2, A > 0: clipped, no token gets gradient; the token view
    # would have clipped only the first token
    lp, b = _one_row(1.0, [0.0, 0.0], [0.5, 0.1])
    loss, m = grpo_loss(lp, b, clip_eps=0.2, importance_level="sequence")
    assert float(loss.detach()) == pytest.approx(-1.2, abs=1e-6)
    loss.backward()
    assert lp.grad.abs().max() == 0 and m["clip_frac_high"] == 1.0
    lp.grad = None
    tok, _ = grpo_loss(lp, b, clip_eps=0.2)
    tok.backward()
    assert lp.grad[0, 2] == 0 and lp.grad[0, 3] != 0


def test_sequence_ratio_with_token_norm_weights_completions_by_length():
    # row 0: 1 token, log-ratio 0.1; row 1: 3 tokens, mean log-ratio -0.1; A = +1, -1; token norm: (1*pg0 + 3*pg1)/4
    lp, b = _rows([1.0, -1.0], [[0.0], [0.0, 0.0, 0.0]], [[0.1], [-0.2, 0.0, -0.1]], [1, 3])
    loss, _ = grpo_loss(lp, b, clip_eps=0.2, importance_level="sequence", loss_norm="token")
    pg0, pg1 = -math.exp(0.1), math.exp(-0.1)
    assert float(loss.detach()) == pytest.approx((pg0 + 3 * pg1) / 4, abs=1e-6)


# ------------------------------------------------------------------------------------------------ dual-clip
def test_dual_clip_caps_the_loss_of_negative_advantages():
    # A = -1: ratio 4 -> PPO loss max(4, 1.2) = 4; dual-clip c = 3 caps it at 3 (no gradient); ratio 2 < 3 is kept
    lp, b = _one_row(-1.0, [0.0, 0.0], [math.log(4.0), math.log(2.0)])
    loss, m = grpo_loss(lp, b, clip_eps=0.2, dual_clip=3.0)
    assert float(loss.detach()) == pytest.approx((3.0 + 2.0) / 2, abs=1e-6)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0, 0, 0.0, 2.0 / 2], abs=1e-6)
    assert m["clip_frac_dual"] == pytest.approx(0.5)
    plain, _ = grpo_loss(lp, b, clip_eps=0.2)
    assert float(plain.detach()) == pytest.approx((4.0 + 2.0) / 2, abs=1e-6)


def test_dual_clip_leaves_positive_advantages_alone():
    lp, b = _one_row(1.0, [0.0], [math.log(4.0)])
    a, _ = grpo_loss(lp, b, clip_eps=0.2, dual_clip=3.0)
    c, _ = grpo_loss(lp, b, clip_eps=0.2)
    assert float(a.detach()) == float(c.detach()) == pytest.approx(-1.2)
    with pytest.raises(InvalidArgumentError, match="dual_clip"):
        grpo_loss(lp, b, clip_eps=0.2, dual_clip=1.0)


# ------------------------------------------------------------------------------------------------ clamps
def test_k3_at_a_log_ratio_of_28_clamped_at_20():
    p, r = torch.tensor([0.0]), torch.tensor([28.0])
    assert float(kl_k3(p, r)) == pytest.approx(math.exp(28) - 29, rel=1e-5)            # 1.45e12
    assert float(kl_k3(p, r, log_ratio_clamp=20.0)) == pytest.approx(math.exp(20) - 21, rel=1e-5)
    assert float(kl_k3(p, r, log_ratio_clamp=20.0, max_value=10.0)) == 10.0
    assert float(kl_k3(p, torch.tensor([-28.0]), log_ratio_clamp=20.0)) == pytest.approx(math.exp(-20) + 19)


def test_clamped_policy_log_ratio_caps_the_ratio_and_passes_no_gradient():
    # A = -1 (no PPO clip on the high side): log-ratio 25 -> ratio e^20, no gradient through the clamp
    lp, b = _one_row(-1.0, [0.0, 0.0], [25.0, 0.1])
    loss, m = grpo_loss(lp, b, clip_eps=0.2, log_ratio_clamp=20.0)
    assert float(loss.detach()) == pytest.approx((math.exp(20) + math.exp(0.1)) / 2, rel=1e-6)
    loss.backward()
    assert lp.grad[0, 2] == 0 and lp.grad[0, 3] == pytest.approx(math.exp(0.1) / 2, abs=1e-6)
    assert m["log_ratio_clamped_frac"] == pytest.approx(0.5)


def test_ratio_corrected_kl():
    # kl_t * ratio_t, ratio = exp(p - o): value and d/dp = ratio * (1 - exp(r - p)) + kl * ratio
    lp, b = _one_row(0.0, [-1.0], [-0.8])
    ref = torch.zeros(1, 3)
    ref[0, 2] = -1.3
    b.ref_logprobs = ref
    loss, m = grpo_loss(lp, b, clip_eps=0.2, kl_coef=1.0, kl_ratio_correction=True)
    ratio, d = math.exp(0.2), -1.3 + 0.8
    kl = math.exp(d) - d - 1
    assert float(loss.detach()) == pytest.approx(kl * ratio, abs=1e-6) and m["kl"] == pytest.approx(kl * ratio)
    loss.backward()
    assert float(lp.grad[0, 2]) == pytest.approx(ratio * (1 - math.exp(d)) + kl * ratio, abs=1e-6)


# ------------------------------------------------------------------------------------------------ entropy
def test_entropy_bonus_matches_the_softmax_formula():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 5, generator=g, requires_grad=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    b = GRPOBatch(ids, torch.ones(1, 4, dtype=torch.long), mask, torch.tensor([0.0]))
    lp = token_logprobs(logits, ids)
    ent = token_entropy(logits, grad=True)
    loss, _ = grpo_loss(lp, b, clip_eps=0.2, entropy=ent, entropy_coef=0.1)
    loss.backward()
    got = logits.grad.clone()
    logits.grad = None
    q = torch.softmax(logits[0, :3], dim=-1)                   # positions 0..2 predict tokens 1..3
    want = -0.1 * (-(q * q.log()).sum(-1)).mean()             # A = 0: only the bonus is left
    assert float(loss.detach()) == pytest.approx(float(want.detach()), abs=1e-6)
    want.backward()
    assert torch.allclose(got, logits.grad, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="entropy"):
        grpo_loss(lp, b, clip_eps=0.2, entropy_coef=0.1)


def test_entropy_coef_in_compute_loss():
    b = _random_batch(4)
    model = _TinyLM()
    base, m0 = compute_loss(model, b, GRPOConfig(group_size=2))
    bonus, m1 = compute_loss(model, b, GRPOConfig(group_size=2, entropy_coef=0.5))
    # sequence norm: the same entropy the metric reports is averaged per completion, then over completions
    with torch.no_grad():
        ent = token_entropy(model(input_ids=b.input_ids).logits)
        mask = b.completion_mask
        per_row = (ent * mask).sum(1) / mask.sum(1).clamp(min=1)
    assert float((bonus - base).detach()) == pytest.approx(-0.5 * float(per_row.mean()), abs=1e-6)
    assert m1["entropy"] == pytest.approx(m0["entropy"], abs=1e-7)


# ------------------------------------------------------------------------------------------------ IS weights
def _is_case():
    trainer = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    rollout = torch.tensor([[0.0, -1.5, -2.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    return trainer, rollout, mask


def test_token_is_weights_truncate_and_mask():
    t, r, m = _is_case()
    w = [math.exp(0.5), 1.0, math.exp(-1.5)]                   # trainer / rollout per token
    wt, mt = rollout_is_weights(t, r, m, level="token", mode="truncate", cap=1.5)
    assert wt[0].tolist() == pytest.approx([0.0, 1.5, 1.0, w[2]], abs=1e-6)
    assert mt["is_weight_mean"] == pytest.approx((1.5 + 1.0 + w[2]) / 3, abs=1e-6)
    assert mt["is_weight_min"] == pytest.approx(w[2]) and mt["is_weight_max"] == pytest.approx(1.5)
    assert mt["is_truncated_frac"] == pytest.approx(1 / 3)
    wm, mm = rollout_is_weights(t, r, m, level="token", mode="mask", cap=1.5)
    assert wm[0].tolist() == pytest.approx([0.0, 0.0, 1.0, w[2]], abs=1e-6)
    assert mm["is_masked_frac"] == pytest.approx(1 / 3) and mm["is_weight_min"] == 0.0


def test_sequence_is_weight_is_the_product_over_the_completion():
    t, r, m = _is_case()
    prod = math.exp(0.5 + 0.0 - 1.5)
    w, met = rollout_is_weights(t, r, m, level="sequence", mode="truncate", cap=3.0)
    assert w[0].tolist() == pytest.approx([0.0, prod, prod, prod], abs=1e-6)
    assert met["is_weight_mean"] == pytest.approx(prod) and met["is_truncated_frac"] == 0.0
    w, met = rollout_is_weights(t, r, m, level="sequence", mode="mask", cap=0.3)   # 0.37 > 0.3: masked
    assert w.abs().max() == 0 and met["is_masked_frac"] == 1.0


def test_is_weights_multiply_the_policy_term_only():
    # on-policy, A = 1: loss = -mean_t(w_t), gradient -w_t / n; the KL term is not weighted
    lp, b = _one_row(1.0, [0.0, 0.0], [-0.5, -1.0])
    b.old_logprobs = None
    w = torch.tensor([[0.0, 0.0, 0.5, 2.0]])
    loss, _ = grpo_loss(lp, b, clip_eps=0.2, is_weights=w)
    assert float(loss.detach()) == pytest.approx(-(0.5 + 2.0) / 2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0, 0, -0.25, -1.0], abs=1e-6)


def test_compute_loss_weights_by_the_trainer_over_the_rollout_logprobs():
    b = _random_batch(5)
    model = _TinyLM()
    cfg = GRPOConfig(group_size=2, is_correction="token", is_mode="truncate", is_cap=1.5)
    _, m = compute_loss(model, b, cfg)
    with torch.no_grad():
        ratio = (policy_logprobs(model, b) - b.old_logprobs).exp().clamp(max=1.5)
    mask = b.completion_mask.bool()
    assert m["is_weight_max"] == pytest.approx(float(ratio[mask].max()), abs=1e-6)
    assert m["is_weight_min"] == pytest.approx(float(ratio[mask].min()), abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(1.0)                  # the ratio stays the trainer's own
    no_lp = replace(b, old_logprobs=None)
    with pytest.raises(InvalidArgumentError, match="rollout engine's logprobs"):
        compute_loss(model, no_lp, cfg)
    nan = b.old_logprobs.clone()
    nan[mask.nonzero()[0].tolist()[0], mask.nonzero()[0].tolist()[1]] = float("nan")
    with pytest.raises(InvalidArgumentError, match="NaN"):
        compute_loss(model, replace(b, old_logprobs=nan), cfg)


# ------------------------------------------------------------------------------------------------ defaults
def test_defaults_leave_the_loss_and_its_gradient_as_before():
    """GRPOConfig() turns every new option off, except the log-ratio clamp at 20, which changes nothing
    below that: the loss equals the plain clipped loss bit for bit."""
    b = _random_batch(6)
    cfg = GRPOConfig(group_size=2, old_logprobs="rollout", kl_coef=0.0)
    model = _TinyLM()
    loss, m = compute_loss(model, b, cfg)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp = policy_logprobs(model, b)
    plain, _ = grpo_loss(lp, b, clip_eps=0.2)
    plain.backward()
    assert float(loss.detach()) == float(plain.detach())
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))
    assert not any(k.startswith("is_") for k in m) and "clip_frac_dual" not in m


def test_option_combinations_and_ranges_are_checked():
    with pytest.raises(ValidationError, match="is_correction"):
        GRPOConfig(is_correction="token", old_logprobs="rollout")
    for bad in ({"dual_clip": 1.0}, {"is_cap": 0.5}, {"num_iterations": 0}, {"mini_batches": 0},
                {"entropy_coef": -0.1}, {"importance_level": "group"}, {"is_mode": "clip"}, {"std": "n-1"}):
        with pytest.raises(ValidationError):
            GRPOConfig(**bad)


def test_every_option_is_a_flag():
    from colomem.runner.config import load_run_config

    cfg = load_run_config(["--is-correction", "sequence", "--is-mode", "mask", "--is-cap", "2",
                           "--num-iterations", "2", "--mini-batches", "4", "--importance-level", "sequence",
                           "--dual-clip", "3", "--entropy-coef", "0.01", "--log-ratio-clamp", "none",
                           "--kl-clamp", "10", "--kl-ratio-correction", "--std", "sample"])
    g = cfg.grpo
    assert (g.is_correction, g.is_mode, g.is_cap, g.num_iterations, g.mini_batches) == ("sequence", "mask", 2.0, 2, 4)
    assert (g.importance_level, g.dual_clip, g.entropy_coef) == ("sequence", 3.0, 0.01)
    assert (g.log_ratio_clamp, g.kl_clamp, g.kl_ratio_correction, g.std) == (None, 10.0, True, "sample")
