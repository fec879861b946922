"""The GRPO loss against hand-computed values: clipping on both sides, masking, normalisation, k3 KL,
micro-batch accumulation."""
import math
from types import SimpleNamespace

import pytest
import torch

from colomem.errors import InvalidArgumentError
from colomem.grpo import selected_logprobs as selected
from colomem.grpo.batch import Completion, GRPOBatch, build_batch
from colomem.grpo.config import GRPOConfig
from colomem.grpo.loss import grpo_loss, kl_k3, token_logprobs
from colomem.grpo.step import accumulate_gradients, compute_loss, split_micro_batches


def _one_row(adv, old, lp_values, prompt_len=2):
    """One row: prompt of prompt_len tokens, then len(lp_values) completion tokens."""
    T = prompt_len + len(lp_values)
    mask = torch.zeros(1, T)
    mask[0, prompt_len:] = 1
    old_t = torch.zeros(1, T)
    old_t[0, prompt_len:] = torch.tensor(old)
    lp = torch.zeros(1, T)
    lp[0, prompt_len:] = torch.tensor(lp_values)
    lp.requires_grad_(True)
    b = GRPOBatch(torch.zeros(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.long), mask,
                  torch.tensor([float(adv)]), old_logprobs=old_t)
    return lp, b


# ------------------------------------------------------------------------------------------ token_logprobs
def test_token_logprobs_hand_values():
    logits = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [0.0, 0.0, 5.0]]])
    ids = torch.tensor([[1, 2, 0]])
    lp = token_logprobs(logits, ids)
    l1 = 0.0 - math.log(3.0)                                       # uniform row predicts token 2
    l2 = 1.0 - math.log(math.e ** 1 + math.e ** 2 + math.e ** 3)   # row 1 predicts token 0
    assert lp[0].tolist() == pytest.approx([0.0, l1, l2], abs=1e-6)


def test_token_logprobs_temperature_and_chunks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g)
    ids = torch.randint(0, 11, (3, 7), generator=g)
    want = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    monkeypatch.setattr(selected, "CHUNK_POSITIONS", 4)      # several chunks, one partial
    got = token_logprobs(logits, ids, temperature=0.7)
    assert torch.allclose(got[:, 1:], want, atol=1e-6) and got[:, 0].abs().max() == 0


def test_token_logprobs_shape_check():
    with pytest.raises(InvalidArgumentError):
        token_logprobs(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))


# ------------------------------------------------------------------------------------------ clipped loss
def test_positive_advantage_inside_and_above_the_clip():
    # ratios 1.1 (inside [0.8, 1.2]) and 1.5 (above): terms -1.1*2 and -min(3.0, 2.4) = -2.4
    lp, b = _one_row(2.0, [-1.0, -2.0], [-1.0 + math.log(1.1), -2.0 + math.log(1.5)])
    loss, m = grpo_loss(lp, b, clip_eps=0.2)
    assert float(loss.detach()) == pytest.approx((-2.2 - 2.4) / 2, abs=1e-6)
    loss.backward()
    # d/dlp of -ratio*A/2 = -ratio*A/2; the clipped token gets none
    assert lp.grad[0].tolist() == pytest.approx([0, 0, -1.1, 0.0], abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5) and m["clip_frac_high"] == pytest.approx(0.5)
    assert m["clip_frac_low"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.3, abs=1e-6)


def test_negative_advantage_below_and_above_the_clip():
    # A = -1: ratio 0.5 is clipped (below 0.8: pushing down stops); ratio 1.5 is not (the min keeps it)
    lp, b = _one_row(-1.0, [0.0, 0.0], [math.log(0.5), math.log(1.5)])
    loss, m = grpo_loss(lp, b, clip_eps=0.2)
    assert float(loss.detach()) == pytest.approx((0.8 + 1.5) / 2, abs=1e-6)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0, 0, 0.0, 1.5 / 2], abs=1e-6)
    assert m["clip_frac_low"] == pytest.approx(0.5) and m["clip_frac_high"] == 0.0


def test_asymmetric_upper_clip():
    lp, b = _one_row(1.0, [0.0], [math.log(1.25)])
    loss, _ = grpo_loss(lp, b, clip_eps=0.2, clip_eps_high=0.28)      # 1.25 < 1.28: not clipped
    assert float(loss.detach()) == pytest.approx(-1.25, abs=1e-6)
    loss2, _ = grpo_loss(lp, b, clip_eps=0.2)                           # 1.25 > 1.2: clipped
    assert float(loss2.detach()) == pytest.approx(-1.2, abs=1e-6)


def test_on_policy_value_and_gradient():
    # old_logprobs None: ratio 1; the gradient is the plain policy gradient -A / n_tokens
    lp, b = _one_row(0.5, [0.0, 0.0, 0.0], [-0.3, -0.2, -0.1])
    b.old_logprobs = None
    loss, m = grpo_loss(lp, b, clip_eps=0.2)
    assert float(loss.detach()) == pytest.approx(-0.5)
    loss.backward()
    assert lp.grad[0, 2:].tolist() == pytest.approx([-0.5 / 3] * 3)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0


def test_sequence_and_token_normalisation():
    # row 0: 1 completion token, A=+1; row 1: 3 tokens, A=-1; on-policy terms -A per token
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.float32)
    b = GRPOBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), mask,
                  torch.tensor([1.0, -1.0]))
    lp = torch.zeros(2, 4, requires_grad=True)
    seq, _ = grpo_loss(lp, b, clip_eps=0.2, loss_norm="sequence")
    tok, _ = grpo_loss(lp, b, clip_eps=0.2, loss_norm="token")
    assert float(seq.detach()) == pytest.approx((-1 + 1) / 2)
    assert float(tok.detach()) == pytest.approx((-1 + 3) / 4)
    with pytest.raises(InvalidArgumentError):
        grpo_loss(lp, b, clip_eps=0.2, loss_norm="batch")


def test_loss_weight_scales_the_loss():
    lp, b = _one_row(1.0, [0.0], [0.0])
    b.loss_weight = 0.25
    loss, m = grpo_loss(lp, b, clip_eps=0.2)
    assert float(loss.detach()) == pytest.approx(-0.25) and m["loss"] == pytest.approx(-0.25)
    assert m["pg_loss"] == pytest.approx(-1.0)


# ------------------------------------------------------------------------------------------ masking
def test_prompt_and_padding_get_exactly_zero_gradient():
    V, g = 6, torch.Generator().manual_seed(1)
    prompts = [[1, 2, 3], [4]]
    groups = [[Completion([5, 1], None, "stop")], [Completion([2, 3, 4], None, "length")]]
    b = build_batch(prompts, groups, [1.0, -1.0], pad_id=0)
    logits = torch.randn(2, b.input_ids.shape[1], V, generator=g, requires_grad=True)
    # garbage where nothing may count: NaN old logprobs and absurd ref logprobs outside the mask
    b.old_logprobs = torch.where(b.completion_mask > 0, torch.zeros_like(b.completion_mask), float("nan"))
    b.ref_logprobs = torch.where(b.completion_mask > 0, torch.zeros_like(b.completion_mask), 1e4)
    loss, _ = grpo_loss(token_logprobs(logits, b.input_ids), b, clip_eps=0.2, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    # logits[:, t-1] predict token t: only t inside the completion mask may get a gradient
    counts = torch.zeros_like(b.completion_mask)
    counts[:, :-1] = b.completion_mask[:, 1:]
    per_pos = logits.grad.abs().sum(-1)
    assert per_pos[counts == 0].abs().max() == 0.0
    assert (per_pos[counts > 0] > 0).all()


def test_truncated_completion_counts_unless_masked():
    groups = [[Completion([5, 5], None, "length"), Completion([6, 1], None, "stop")]]
    logits = torch.zeros(2, 4, 8, requires_grad=True)
    b = build_batch([[2, 3]], groups, [1.0, -1.0], pad_id=0)
    loss, m = grpo_loss(token_logprobs(logits, b.input_ids), b, clip_eps=0.2)
    loss.backward()
    assert logits.grad[0].abs().sum() > 0 and m["completion_tokens"] == 4
    logits.grad = None
    bm = build_batch([[2, 3]], groups, [1.0, -1.0], pad_id=0, mask_truncated=True)
    loss, m = grpo_loss(token_logprobs(logits, bm.input_ids), bm, clip_eps=0.2)
    loss.backward()
    assert logits.grad[0].abs().sum() == 0 and logits.grad[1].abs().sum() > 0
    assert m["completion_tokens"] == 2


# ------------------------------------------------------------------------------------------ KL (k3)
def test_k3_hand_values():
    p = torch.tensor([-1.0, -2.0, -0.5])
    r = torch.tensor([-1.0, -1.5, -1.5])
    want = [0.0, math.exp(0.5) - 0.5 - 1, math.exp(-1.0) + 1.0 - 1]
    assert kl_k3(p, r).tolist() == pytest.approx(want, abs=1e-6)
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_k3_is_unbiased_for_kl():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    exact = float((p * (p / q).log()).sum())
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(p, 400_000, replacement=True, generator=g)
    est = float(kl_k3(p.log()[x], q.log()[x]).mean())
    assert est == pytest.approx(exact, abs=0.01)


def test_kl_term_in_the_loss():
    lp, b = _one_row(0.0, [0.0, 0.0], [-1.0, -2.0])        # A = 0: only the KL term is left
    b.old_logprobs = None
    ref = torch.zeros(1, 4)
    ref[0, 2:] = torch.tensor([-1.5, -1.5])
    b.ref_logprobs = ref
    loss, m = grpo_loss(lp, b, clip_eps=0.2, kl_coef=0.5)
    k = [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]
    assert float(loss.detach()) == pytest.approx(0.5 * sum(k) / 2, abs=1e-6)
    assert m["kl"] == pytest.approx(sum(k) / 2, abs=1e-6)
    b.ref_logprobs = None
    with pytest.raises(InvalidArgumentError, match="ref_logprobs"):
        grpo_loss(lp, b, clip_eps=0.2, kl_coef=0.5)


# ------------------------------------------------------------------------------------------ accumulation
class _TinyLM(torch.nn.Module):
    def __init__(self, V=9, H=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        self.mix = torch.nn.Linear(H, H)
        self.out = torch.nn.Linear(H, V)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        h = torch.tanh(self.mix(self.emb(input_ids)))
        h = torch.cumsum(h, dim=1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]   # causal mixing
        return SimpleNamespace(logits=self.out(h))


def _random_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts, groups = [], []
    for i in range(3):
        prompts.append(torch.randint(1, 9, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist())
        grp = []
        for j in range(2):
            n = int(torch.randint(1, 5, (1,), generator=g))
            toks = torch.randint(1, 9, (n,), generator=g).tolist()
            grp.append(Completion(toks, (-torch.rand(n, generator=g)).tolist(), "stop" if j else "length"))
        groups.append(grp)
    adv = torch.randn(6, generator=g)
    return build_batch(prompts, groups, adv, pad_id=0)


@pytest.mark.parametrize("norm", ["sequence", "token"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batches_add_up_to_the_full_batch_gradient(norm, micro):
    cfg = GRPOConfig(group_size=2, loss_norm=norm, old_logprobs="rollout", log_entropy=True)
    b = _random_batch()
    model = _TinyLM()
    full, _ = compute_loss(model, b, cfg)
    full.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    m = accumulate_gradients(model, b, cfg, micro_batch=micro, backward=lambda l: l.backward())
    for w, p in zip(want, model.parameters()):
        assert torch.allclose(w, p.grad, atol=1e-6)
    assert m["loss"] == pytest.approx(float(full.detach()), abs=1e-6)       # weighted micro losses sum to the batch loss
    parts = split_micro_batches(b, micro, norm)
    assert sum(x.loss_weight for x in parts) == pytest.approx(1.0)
    assert m["micro_batches"] == len(parts)


def test_policy_mode_ignores_rollout_logprobs_but_reports_the_gap():
    b = _random_batch(1)
    model = _TinyLM()
    loss_p, m_p = compute_loss(model, b, GRPOConfig(group_size=2))
    assert m_p["ratio_mean"] == pytest.approx(1.0)            # on-policy ratio
    assert m_p["rollout_logprob_gap"] > 0                      # the fake rollout logprobs are not the model's
    loss_r, m_r = compute_loss(model, b, GRPOConfig(group_size=2, old_logprobs="rollout"))
    assert m_r["ratio_mean"] != pytest.approx(1.0)


def test_kl_needs_a_reference():
    b = _random_batch(2)
    with pytest.raises(InvalidArgumentError, match="ref_logprobs_fn"):
        compute_loss(_TinyLM(), b, GRPOConfig(group_size=2, kl_coef=0.1))
    ref_model = _TinyLM()
    from colomem.grpo.step import frozen_reference_fn
    loss, m = compute_loss(_TinyLM(), b, GRPOConfig(group_size=2, kl_coef=0.1),
                           frozen_reference_fn(ref_model))
    assert m["kl"] == pytest.approx(0.0, abs=1e-7)            # same weights: KL 0


def test_micro_batches_by_length_pad_less_and_give_the_same_gradient():
    """Rows of very different lengths: grouped longest first, the micro-batches pad less than consecutive rows,
    and the summed gradient is the same."""
    g = torch.Generator().manual_seed(3)
    lens = [2, 30, 3, 28, 4, 29, 2, 31]
    prompts = [[1, 2, 3]] * 4
    groups = [[Completion(torch.randint(1, 9, (lens[2 * i + j],), generator=g).tolist()) for j in range(2)]
              for i in range(4)]
    b = build_batch(prompts, groups, torch.randn(8, generator=g), pad_id=0)
    cfg = GRPOConfig(group_size=2, loss_norm="token")
    grads, padded = {}, {}
    for by_length in (True, False):
        model = _TinyLM()
        parts = split_micro_batches(b, 2, "token", by_length=by_length)
        assert sum(x.loss_weight for x in parts) == pytest.approx(1.0)
        padded[by_length] = sum(x.input_ids.numel() for x in parts)
        for mb in parts:
            loss, _ = compute_loss(model, mb, cfg)
            loss.backward()
        grads[by_length] = [p.grad.clone() for p in model.parameters()]
    assert padded[True] == 156 and padded[False] == 260     # (34, 33) (32, 31) (7, 6) (5, 5) against pairs in order
    for a, c in zip(grads[True], grads[False]):
        assert torch.allclose(a, c, atol=1e-6)
    m = accumulate_gradients(_TinyLM(), b, cfg, micro_batch=2, backward=lambda l: l.backward())
    assert m["padded_fraction"] == pytest.approx(1 - float(b.attention_mask.sum()) / padded[True])
