"""The logprob of each sampled token from the logits, keeping no fp32 copy of the logits for the backward.

log softmax(logits / temperature)[token] = logit[token] / temperature - logsumexp(logits / temperature).

Written with torch ops on fp32 chunks, autograd keeps every chunk's fp32 copy (4 bytes a logit) for the
logsumexp's backward, on top of the model's bf16 logits: with a 152k-token vocabulary that is 0.6 MB a token,
2.5 GB for 4096 tokens. This function keeps only the logits as the model gave them and one fp32 logsumexp per
token, and in the backward recomputes the softmax chunk by chunk:

    d logprob / d logit_v = (onehot(token)_v - softmax_v) / temperature

The same formula and order of operations as autograd's own backward through the chunks, so the gradients
match it (tests/test_selected_logprobs.py). The token's entropy comes from the same chunks when asked for
(the metric, or an entropy bonus: d entropy / d logit_v = -softmax_v (log softmax_v + entropy) / temperature),
instead of a second pass over the logits that would keep its own fp32 log-softmax for the backward. Chunks
are whole rows of positions when a row is shorter than the chunk, else pieces of one row: never a [B, T, V]
fp32 tensor, and no strided copy of the logits.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor

# logits turned into fp32 at once (rows x positions): bounds the transient fp32 chunk for big vocabularies
CHUNK_POSITIONS = 4096


def _blocks(B: int, P: int, chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """(b0, b1, p0, p1) blocks covering [B, P] with at most `chunk` positions each."""
    if P <= 0:
        return
    if P <= chunk:
        rows = max(1, chunk // P)
        for b0 in range(0, B, rows):
            yield b0, min(b0 + rows, B), 0, P
    else:
        for b in range(B):
            for p0 in range(0, P, chunk):
                yield b, b + 1, p0, min(p0 + chunk, P)


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """fp32 for bf16 / fp16 / fp32 logits (fp64 stays fp64)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled(logits: Tensor, b0: int, b1: int, p0: int, p1: int, temperature: float) -> Tensor:
    c = logits[b0:b1, p0:p1].to(_compute_dtype(logits))
    return c / temperature if temperature != 1.0 else c


# what the function computes beside the logprobs: no entropy, the entropy as a metric, the entropy with its
# gradient (an entropy bonus in the loss)
NO_ENTROPY, ENTROPY_METRIC, ENTROPY_GRAD = 0, 1, 2


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int, entropy: int):
        B, P = targets.shape
        dt = _compute_dtype(logits)
        out = torch.empty(B, P, dtype=dt, device=logits.device)
        lse = torch.empty(B, P, dtype=dt, device=logits.device)
        ent = torch.empty(B, P if entropy else 0, dtype=dt, device=logits.device)
        for b0, b1, p0, p1 in _blocks(B, P, chunk):
            c = _scaled(logits, b0, b1, p0, p1, temperature)
            part = torch.logsumexp(c, dim=-1)
            out[b0:b1, p0:p1] = c.gather(-1, targets[b0:b1, p0:p1, None]).squeeze(-1) - part
            lse[b0:b1, p0:p1] = part
            if entropy:                  # from the same chunk: lse - sum(softmax * scaled logits)
                probs = (c - part[..., None]).exp_()
                ent[b0:b1, p0:p1] = part - torch.linalg.vecdot(probs, c)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        if entropy != ENTROPY_GRAD:
            ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out: Optional[Tensor], grad_ent: Optional[Tensor]):
        logits, targets, lse, ent = ctx.saved_tensors
        t = ctx.temperature
        B, P = targets.shape
        grad = torch.zeros_like(logits)             # the window's last position predicts nothing: 0 there
        if grad_ent is not None and ent.numel() == 0:
            grad_ent = None
        if grad_out is None and grad_ent is None:
            return grad, None, None, None, None
        for b0, b1, p0, p1 in _blocks(B, P, ctx.chunk):
            c = _scaled(logits, b0, b1, p0, p1, t)
            g = grad_out[b0:b1, p0:p1, None].to(c.dtype) if grad_out is not None else None
            logp = c - lse[b0:b1, p0:p1, None]
            probs = logp.exp()
            if grad_ent is None:
                assert g is not None
                part = probs.mul_(-g)                                          # logsumexp's backward
            else:
                # d entropy / d scaled logit v = -p_v (log p_v + entropy)
                coef = logp.add_(ent[b0:b1, p0:p1, None]).mul_(-grad_ent[b0:b1, p0:p1, None].to(c.dtype))
                part = probs.mul_(coef.sub_(g) if g is not None else coef)
            if g is not None:
                part.scatter_add_(-1, targets[b0:b1, p0:p1, None], g)            # the picked logit's
            if t != 1.0:
                part.div_(t)
            grad[b0:b1, p0:p1] = part
        return grad, None, None, None, None


def _apply(logits: Tensor, targets: Tensor, temperature: float, chunk: Optional[int], entropy: int):
    return _SelectedLogprobs.apply(logits, targets, float(temperature), int(chunk or CHUNK_POSITIONS), entropy)


def selected_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, *,
                      chunk: Optional[int] = None) -> Tensor:
    """[B, P + 1 or more, V] logits, [B, P] targets -> [B, P] fp32 (fp64 for fp64 logits): position p's
    log softmax(logits / temperature) at targets[:, p]. Positions past P (the last one, which predicts nothing)
    get no gradient. chunk: positions turned into fp32 at once (default CHUNK_POSITIONS)."""
    return _apply(logits, targets, temperature, chunk, NO_ENTROPY)[0]


def selected_logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0, *,
                                  chunk: Optional[int] = None, grad: bool = False) -> tuple[Tensor, Tensor]:
    """selected_logprobs and, from the same fp32 chunks, each position's entropy of softmax(logits /
    temperature): one pass over the logits instead of two. grad=False: the entropy is a metric (no gradient);
    True: differentiable (an entropy bonus), its backward recomputing the softmax from the kept logits too."""
    return _apply(logits, targets, temperature, chunk, ENTROPY_GRAD if grad else ENTROPY_METRIC)


__all__ = ["CHUNK_POSITIONS", "selected_logprobs", "selected_logprobs_and_entropy"]
