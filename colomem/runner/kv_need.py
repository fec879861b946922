"""How much KV cache a step's rollout can hold at most, and what a smaller cache would save.

vLLM takes its KV cache from --gpu-memory-utilization, whatever the rollout needs: at 0.85 on a 141 GB GPU a
1.5B model gets over 100 GiB, while 256 sequences of at most 512 tokens hold 3.5 GiB of it. Such a cache may
be what forces the trainer to move every step. After the first step the planner knows what moves; this
module bounds what the rollout holds (every sequence of the step at once, each at max_model_len, in whole
blocks), says which placement a cache of that size would allow, and sizes the cache so when asked
(--kv-cache-bytes auto).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from colomem.errors import ConfigError
from colomem.units import format_bytes

from .placement import MemoryFigures, Placement, candidates, choose

BLOCK_TOKENS = 16          # vLLM's default KV block: a sequence holds whole blocks
HEADROOM = 1.25            # a cache this much above the bound (vLLM's own rounding, a longer prompt)


def kv_layout(model_path: str, trust_remote_code: bool = False, dtype_bytes: int = 2) -> Optional[tuple[int, int]]:
    """(K and V bytes one token takes in every layer of the model, all tensor-parallel shards together; its
    KV heads); None when the model's config cannot be read or lacks the fields."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  (no figure: the callers say what that leaves out)
        return None
    cfg = getattr(cfg, "text_config", None) or cfg
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return int(layers) * 2 * int(kv_heads) * int(head_dim) * dtype_bytes, int(kv_heads)


def kv_bytes_per_token(model_path: str, trust_remote_code: bool = False, dtype_bytes: int = 2) -> Optional[int]:
    """K and V bytes one token takes in every layer of the model (all tensor-parallel shards together);
    None when the model's config cannot be read or lacks the fields."""
    layout = kv_layout(model_path, trust_remote_code, dtype_bytes)
    return layout[0] if layout else None


def rollout_kv_bound(sequences: int, max_model_len: int, per_token: int) -> int:
    """The most KV cache a rank's rollout can hold: all its sequences at once, each max_model_len tokens in
    whole blocks, at per_token bytes a token (one GPU's share under tensor parallelism: rollout_kv_need)."""
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
            f"still hold it, and then: {q.label} (now {p.label}); --kv-cache-bytes auto sizes the cache to what "
            "the rollout holds")


def rollout_kv_need(sequences: int, max_model_len: int, per_token: int, kv_heads: int,
                    tensor_parallel_size: int = 1) -> int:
    """The most KV cache one GPU holds for a rank's rollout of `sequences` (rollout_kv_bound, split over the
    engine's GPUs by its heads). Tensor parallelism puts ceil(kv_heads / TP) heads of the engine's sequences
    (as many ranks' as its GPUs) on each GPU: the rank's own share when the heads divide, more when there are
    fewer heads than GPUs (each holds a copy of one)."""
    tp = max(1, int(tensor_parallel_size))
    per_gpu_token = per_token * -(-kv_heads // tp) / kv_heads * tp
    return int(rollout_kv_bound(sequences, max_model_len, 1) * per_gpu_token)


def auto_kv_cache_bytes(sequences: int, max_model_len: int, per_token: int, kv_heads: int,
                        tensor_parallel_size: int = 1) -> int:
    """--kv-cache-bytes auto: the KV cache one GPU's engine needs to hold `sequences` at once (the most a rank
    generates in one call), each at max_model_len (rollout_kv_need), with HEADROOM, in whole MiB."""
    need = rollout_kv_need(sequences, max_model_len, per_token, kv_heads, tensor_parallel_size) * HEADROOM
    return int(-(-need // (1 << 20))) << 20


def resolve_kv_cache(cfg, model_path: str, world_size: int) -> tuple[Optional[int], str]:
    """(bytes, the line that says so) for the run's --kv-cache-bytes: (None, "") unless it is auto, which
    is sized from the model's config for a rank's rollout (cfg.rows_per_rank); ConfigError when that config
    lacks the fields."""
    if cfg.kv_cache_bytes != "auto":
        return None, ""
    layout = kv_layout(model_path, cfg.trust_remote_code)
    if layout is None:
        raise ConfigError(f"--kv-cache-bytes auto needs the model's layers, KV heads and head size from its config "
                          f"({model_path}/config.json); give a size instead (--kv-cache-bytes 4GiB)")
    rows = cfg.rows_per_rank(world_size)
    size = auto_kv_cache_bytes(rows, cfg.max_model_len, layout[0], layout[1], cfg.tensor_parallel_size)
    return size, (f"[colomem] KV cache: {format_bytes(size)} on each GPU (--kv-cache-bytes auto: {rows} sequences "
                  f"at once, each at --max-model-len {cfg.max_model_len}, and a quarter more), not "
                  f"--gpu-memory-utilization's share")


__all__ = ["auto_kv_cache_bytes", "kv_bytes_per_token", "kv_layout", "kv_shrink_hint", "resolve_kv_cache",
           "rollout_kv_bound", "rollout_kv_need"]
