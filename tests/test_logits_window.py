"""Logits only where the loss reads them: a forward with logits_to_keep from the first completion token on
gives the same logprobs, loss and gradients as one over every position, and its lm_head sees fewer rows."""
from dataclasses import replace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from colomem.errors import InvalidArgumentError
from colomem.grpo.batch import Completion, build_batch, first_loss_position
from colomem.grpo.config import GRPOConfig
from colomem.grpo.loss import token_entropy, token_logprobs
from colomem.grpo.step import accumulate_gradients, compute_loss

VOCAB = 64


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).float()


def _batch(prompt_lens=(9, 12, 7, 12), completion_lens=(5, 3, 6, 0), seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    groups = [[Completion(torch.randint(1, VOCAB, (n,), generator=g).tolist(),
                          logprobs=[-1.0] * n)] for n in completion_lens]
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0])[:len(prompts)]
    return build_batch(prompts, groups, adv, pad_id=0)


def test_windowed_logits_give_the_full_logprobs_and_entropy():
    torch.manual_seed(0)
    B, T, V = 3, 10, 17
    logits = torch.randn(B, T, V)
    ids = torch.randint(0, V, (B, T))
    full = token_logprobs(logits, ids, temperature=0.8)
    for keep in (1, 2, 6, T):
        got = token_logprobs(logits[:, T - keep:], ids, temperature=0.8)
        first = T - keep + 1
        assert torch.equal(got[:, first:], full[:, first:])
        assert not got[:, :first].any()
        ent = token_entropy(logits[:, T - keep:], 0.8, input_ids=ids)
        assert torch.equal(ent[:, first:], token_entropy(logits, 0.8)[:, first:])
    with pytest.raises(InvalidArgumentError, match="last K <= T"):
        token_logprobs(torch.randn(B, T + 1, V), ids)


def test_select_records_the_first_loss_position():
    b = _batch()
    assert b.loss_from is None                   # build_batch leaves it to select()
    sub = b.select(slice(0, 4))
    assert sub.loss_from == 7                    # the shortest prompt's completion starts at 7
    assert b.select([1, 3]).loss_from == 12      # row 3 has no completion: row 1 decides
    assert b.select([3]).loss_from is None
    assert first_loss_position(torch.zeros(2, 5)) is None


def _lm_head_rows(model):
    rows = []
    model.lm_head.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[1]))
    return rows


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_loss_and_gradients_match_the_full_forward(entropy_coef):
    cfg = GRPOConfig(clip_eps=0.2, kl_coef=0.0, loss_norm="token", entropy_coef=entropy_coef, log_entropy=True)
    batch = _batch().select(slice(0, 4))
    grads = {}
    for windowed in (True, False):
        model = _model()
        rows = _lm_head_rows(model)
        mb = batch if windowed else replace(batch, loss_from=None)
        loss, metrics = compute_loss(model, mb, cfg)
        loss.backward()
        grads[windowed] = ([p.grad.clone() for p in model.parameters()], float(loss.detach()), metrics)
        T = batch.input_ids.shape[1]
        assert rows == [T - 7 + 1 if windowed else T]
    (g_w, l_w, m_w), (g_f, l_f, m_f) = grads[True], grads[False]
    assert l_w == pytest.approx(l_f, rel=1e-6, abs=1e-7)
    for a, b in zip(g_w, g_f):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert m_w["entropy"] == pytest.approx(m_f["entropy"], rel=1e-6)
    assert m_w["rollout_logprob_gap"] == pytest.approx(m_f["rollout_logprob_gap"], rel=1e-6)


def test_micro_batches_each_keep_their_own_window():
    cfg = GRPOConfig(clip_eps=0.2, kl_coef=0.0, loss_norm="token")
    model = _model()
    rows = _lm_head_rows(model)
    batch = _batch(prompt_lens=(20, 3, 20, 20), completion_lens=(4, 4, 4, 4))
    accumulate_gradients(model, batch, cfg, micro_batch=2, backward=lambda loss: loss.backward())
    # longest rows first: (0, 2) skip their 20-token prompts, (3, 1) need the logits from row 1's 3rd token on
    assert rows == [24 - 20 + 1, 24 - 3 + 1]


def test_a_model_without_logits_to_keep_gets_every_position():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, VOCAB)

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return (self.emb(input_ids),)

    batch = _batch().select(slice(0, 4))
    loss, _ = compute_loss(Plain(), batch, GRPOConfig(clip_eps=0.2, kl_coef=0.0))
    loss.backward()
    assert torch.isfinite(loss)


def test_a_peft_model_passes_the_window_through():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rows = _lm_head_rows(model.get_base_model())
    batch = _batch().select(slice(0, 4))
    loss, _ = compute_loss(model, batch, GRPOConfig(clip_eps=0.2, kl_coef=0.0))
    loss.backward()
    assert rows == [batch.input_ids.shape[1] - 7 + 1]
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
