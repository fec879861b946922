"""The sampled tokens' logprobs on a GPU at a real vocabulary: the same values and gradients as autograd
through fp32 chunks, and a lower peak, since the backward keeps the bf16 logits instead of an fp32 copy."""

import pytest
import torch

from colomem.grpo.loss import token_logprobs, token_logprobs_and_entropy

pytestmark = pytest.mark.gpu
VOCAB = 151936


def _reference(logits, ids):
    """token_logprobs written with torch ops (what autograd keeps: every chunk's fp32 copy)."""
    B, K, V = logits.shape
    pred = logits[:, :-1].reshape(-1, V)
    target = ids[:, 1:].reshape(-1)
    parts = []
    for s in range(0, pred.shape[0], 4096):
        c = pred[s:s + 4096].float()
        parts.append(c.gather(1, target[s:s + 4096, None]).squeeze(1) - torch.logsumexp(c, -1))
    return torch.cat([pred.new_zeros(B, 1, dtype=torch.float32), torch.cat(parts).view(B, K - 1)], dim=1)


def _peak(fn, logits, weights):
    """Peak bytes allocated beyond the logits while fn's logprobs go forward and backward, and the gradient."""
    logits.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    (fn() * weights).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, logits.grad.clone()


@pytest.mark.parametrize("rows,length", [(8, 260), (1, 9000)])   # the 1.5B job's micro-batch; one long row
def test_same_gradients_and_a_lower_peak_than_autograd_through_fp32_chunks(rows, length):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(rows, length, VOCAB, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    ids = torch.randint(0, VOCAB, (rows, length), device="cuda", generator=g)
    weights = torch.randn(rows, length, device="cuda", generator=g)
    ours, g_ours = _peak(lambda: token_logprobs(logits, ids), logits, weights)
    theirs, g_theirs = _peak(lambda: _reference(logits, ids), logits, weights)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(logits, ids), _reference(logits, ids), rtol=0, atol=2e-5)
    torch.testing.assert_close(g_ours.float(), g_theirs.float(), rtol=1 / 64, atol=1e-3)   # a bf16 ulp or two
    assert ours < theirs, (ours, theirs)
    # the entropy metric from the same pass gives the same logprobs
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy(logits, ids)
        assert torch.equal(lp, token_logprobs(logits, ids)) and bool((ent[:, 1:] > 0).all())
