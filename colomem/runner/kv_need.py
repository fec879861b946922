"""How much KV cache a step's rollout can hold at most, and what a smaller cache would save.

vLLM takes its KV cache from --gpu-memory-utilization, whatever the rollout needs: at 0.85 on a 141 GB GPU a
1.5B model gets over 100 GiB, while 256 sequences of at most 512 tokens hold 3.5 GiB of it. Such a cache may
be what forces the trainer to move every step. After the first step the planner knows what moves; this
module bounds what the rollout holds (every sequence of the step at once, each at max_model_len, in whole
blocks) and says which placement a cache of that size would allow.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from colomem.units import format_bytes

from .placement import MemoryFigures, Placement, candidates, choose

BLOCK_TOKENS = 16          # vLLM's default KV block: a sequence holds whole blocks
HEADROOM = 1.25            # a cache this much above the bound (vLLM's own rounding, a longer prompt)


def kv_bytes_per_token(model_path: str, trust_remote_code: bool = False, dtype_bytes: int = 2) -> Optional[int]:
    """K and V bytes one token takes in every layer of the model (all tensor-parallel shards together);
    None when the model's config cannot be read or lacks the fields."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  (a hint only: no figure, no hint)
        return None
    cfg = getattr(cfg, "text_config", None) or cfg
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return int(layers) * 2 * int(kv_heads) * int(head_dim) * dtype_bytes


def rollout_kv_bound(sequences: int, max_model_len: int, per_token: int) -> int:
    """The most KV cache one GPU's rollout can hold: all its sequences at once, each max_model_len tokens in
    whole blocks (tensor parallelism splits the sequences' bytes over the engine's GPUs and the engine's
    sequences are those of as many ranks, so the per-GPU figure is the rank's own)."""
    blocks = -(-int(max_model_len) // BLOCK_TOKENS)
    return int(sequences) * blocks * BLOCK_TOKENS * int(per_token)


def kv_shrink_hint(p: Placement, figures: Sequence[MemoryFigures], offload: str, rollout_sleep: str,
                   utilization: float, margin: Optional[int] = None, optim_out: bool = True) -> str:
    """When the rollout's KV cache is far larger than it can hold and a smaller one would let less move: the
    --gpu-memory-utilization that gives that, and the placement it would allow. Empty otherwise (nothing
    moves already, no figures, or no gain)."""
    if not figures or any(f.kv_cache <= 0 or f.kv_need <= 0 for f in figures):
        return ""
    allowed = candidates(offload, rollout_sleep, optim_out)

    def rank(q: Placement) -> Optional[int]:
        """Where q stands among the allowed placements, cheapest first."""
        return next((i for i, c in enumerate(allowed)
                     if (c.keep, c.rollout_sleeps, c.optim_out) == (q.keep, q.rollout_sleeps, q.optim_out)), None)
    here = rank(p)
    if here is None or here == 0:
        return ""
    spare = min(f.kv_cache - int(f.kv_need * HEADROOM) for f in figures)
    if spare < 1 << 30:
        return ""
    smaller = [replace(f, rollout_used=f.rollout_used - spare) for f in figures]
    q = choose(offload, rollout_sleep, smaller, margin, optim_out)
    better = rank(q)
    if better is None or better >= here or "does not fit" in q.why:
        return ""
    total = min(f.total for f in figures)
    worst = max(figures, key=lambda f: f.kv_need)
    return (f"the rollout holds at most {format_bytes(worst.kv_need)} of KV cache (its sequences at once, each "
            f"at --max-model-len), and vLLM keeps {format_bytes(worst.kv_cache)} for it: "
            f"--gpu-memory-utilization {max(0.01, utilization - spare / total):.2f} (now {utilization:.2f}) would "
            f"still hold it, and then: {q.label} (now {p.label})")


__all__ = ["kv_bytes_per_token", "kv_shrink_hint", "rollout_kv_bound"]
