"""The sampled tokens' logprobs without an fp32 copy of the logits kept for the backward: the same values and
gradients as autograd through fp32 chunks (every block layout, temperature, a window of positions), and what
autograd keeps is the logits and a logsumexp per token, not 4 more bytes per logit."""
import pytest
import torch

from colomem.grpo import selected_logprobs as sel
from colomem.grpo.loss import token_logprobs


def _reference(logits, ids, temperature):
    """What token_logprobs computed with torch ops: fp32 chunks of rows, gather - logsumexp."""
    B, K, V = logits.shape
    first = ids.shape[1] - K + 1
    pred = logits[:, :-1].reshape(-1, V)
    target = ids[:, first:].reshape(-1)
    parts = []
    for s in range(0, pred.shape[0], 5):
        c = pred[s:s + 5].float()
        if temperature != 1.0:
            c = c / temperature
        parts.append(c.gather(1, target[s:s + 5, None]).squeeze(1) - torch.logsumexp(c, -1))
    lp = torch.cat(parts).view(B, K - 1)
    return torch.cat([lp.new_zeros(B, first), lp], dim=1)


def _case(B, T, V, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, K, V, generator=g)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, ids


@pytest.mark.parametrize("chunk", [3, 7, 64])                # pieces of a row; rows; several rows a block
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_autograd_through_fp32_chunks(monkeypatch, chunk, temperature, dtype):
    monkeypatch.setattr(sel, "CHUNK_POSITIONS", chunk)
    for K in (9, 5, 1):                                      # the whole row, a window, no prediction at all
        logits, ids = _case(3, 9, 23, K, dtype)
        w = torch.randn(3, 9)
        got = token_logprobs(logits, ids, temperature)
        (got * w).sum().backward()
        g_got = logits.grad.clone()
        logits.grad = None
        if K == 1:
            assert not got.any() and not g_got.any()
            continue
        want = _reference(logits, ids, temperature)
        (want * w).sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(g_got, logits.grad, rtol=0, atol=1e-6 if dtype == torch.float32 else 0)
        assert got.dtype == torch.float32 and g_got.dtype == dtype
        assert not g_got[:, -1].any()                        # the last position predicts nothing


def test_gradcheck_in_double():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.randint(0, 5, (2, 5), generator=g)
    for chunk in (2, 16):
        assert torch.autograd.gradcheck(lambda x: sel.selected_logprobs(x, ids, 0.9, chunk=chunk), (logits,))


def _saved_bytes(fn):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved)


def test_the_backward_keeps_the_logits_not_an_fp32_copy():
    logits, ids = _case(4, 65, 1000, 65, torch.bfloat16)
    n = logits.numel()
    _, ours = _saved_bytes(lambda: token_logprobs(logits, ids))
    _, torch_ops = _saved_bytes(lambda: _reference(logits, ids, 1.0))
    assert ours <= 2 * n + 16 * 4 * 65                       # the bf16 logits, the targets and a logsumexp a token
    assert torch_ops >= 4 * n * 64 / 65                      # an fp32 copy of every predicting logit


@pytest.mark.parametrize("chunk", [3, 64])
def test_the_entropy_metric_from_the_same_pass_matches_token_entropy(monkeypatch, chunk):
    from colomem.grpo.loss import token_entropy, token_logprobs_and_entropy

    monkeypatch.setattr(sel, "CHUNK_POSITIONS", chunk)
    for dtype in (torch.float32, torch.bfloat16):
        logits, ids = _case(3, 9, 23, 7, dtype, seed=2)
        lp, ent = token_logprobs_and_entropy(logits, ids, 0.8)
        torch.testing.assert_close(lp, token_logprobs(logits, ids, 0.8), rtol=0, atol=0)
        torch.testing.assert_close(ent, token_entropy(logits.detach(), 0.8, input_ids=ids), rtol=1e-5, atol=1e-5)
        assert not ent.requires_grad and lp.requires_grad
        lp.sum().backward()                                  # the entropy takes no part in the gradient
        g = logits.grad.clone()
        logits.grad = None
        token_logprobs(logits, ids, 0.8).sum().backward()
        assert torch.equal(g, logits.grad)


def test_the_entropy_bonus_gradient_matches_autograd_through_log_softmax():
    from colomem.grpo.loss import token_entropy, token_logprobs_and_entropy

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.randint(0, 5, (2, 6), generator=g)
    for chunk in (2, 16):
        assert torch.autograd.gradcheck(
            lambda y: sel.selected_logprobs_and_entropy(y, ids[:, 1:], 0.9, chunk=chunk, grad=True), (x,))
    for dtype in (torch.float32, torch.bfloat16):
        logits, ids = _case(3, 9, 23, 9, dtype, seed=5)
        lp, ent = token_logprobs_and_entropy(logits, ids, 0.8, grad=True)
        assert ent.requires_grad
        w1, w2 = torch.randn(3, 9), torch.randn(3, 9)
        ((lp * w1).sum() + (ent * w2).sum()).backward()
        got = logits.grad.clone()
        logits.grad = None
        ((_reference(logits, ids, 0.8) * w1).sum()
         + (token_entropy(logits, 0.8, grad=True, input_ids=ids) * w2).sum()).backward()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ent, token_entropy(logits.detach(), 0.8, input_ids=ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.float(), logits.grad.float(), rtol=tol, atol=tol)
