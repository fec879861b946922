"""Will a model fit the CPU stand-ins? Checked before the model is built or loaded, so a GPU-sized config on a
machine without a GPU says so instead of running out of host memory minutes later."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from colomem.errors import NotAvailableError
from colomem.units import format_bytes

# fp32 weights + gradients + AdamW's two moments (trainer) + the rollout's own fp32 copy, per parameter
CPU_BYTES_PER_PARAM = 4 + 4 + 8 + 4
CPU_MEMORY_SHARE = 0.8        # of the memory available now; the rest is left for activations and the OS


def params_of_config(cfg: dict) -> int:
    """Parameters of a decoder-only transformer from its HF config fields (embeddings, attention with
    grouped KV heads, gated MLP, untied head); close enough to decide what fits."""
    h = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0)
    inter = int(cfg.get("intermediate_size") or 4 * h)
    vocab = int(cfg.get("vocab_size") or 0)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    kv_dim = h // max(heads, 1) * kv
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * inter
    head = 0 if cfg.get("tie_word_embeddings", True) else vocab * h
    return vocab * h + head + layers * per_layer


def available_host_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_cpu_fits(config: dict, what: str, available: Optional[int] = None) -> None:
    """NotAvailableError when the CPU stand-ins would need more host memory than is available."""
    available = available_host_bytes() if available is None else available
    if not available:
        return
    params = params_of_config(config)
    need = params * CPU_BYTES_PER_PARAM
    if need > CPU_MEMORY_SHARE * available:
        raise NotAvailableError(
            f"{what} has about {params / 1e9:.2f} B parameters: the CPU backend would need about "
            f"{format_bytes(need)} of host memory (fp32 weights, gradients, AdamW state and the rollout's copy), "
            f"and {format_bytes(available)} is available. This job is for the GPU path (a CUDA GPU with vllm and "
            f"deepspeed installed); on this machine use a smaller model (the default --model-shape tiny)")


def model_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
