"""Building the CPU stand-ins' transformers models: from a checkpoint (storages torch owns), or on the meta
device with the base weights taken from the rollout's model (a LoRA job sharing one copy of its base)."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor


def load_model(model_path, dtype, trust_remote_code: bool) -> Any:
    """The causal LM at `model_path` (or `model_path` itself when it is one already), storages owned."""
    from transformers import AutoModelForCausalLM

    if isinstance(model_path, torch.nn.Module):
        return model_path
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype,
                                                 trust_remote_code=bool(trust_remote_code))
    own_memory(model)
    return model


def own_memory(model: torch.nn.Module) -> int:
    """Copies every parameter and buffer whose storage cannot be resized into memory torch owns; returns how
    many storages it copied. A checkpoint loaded in its own dtype on the CPU keeps safetensors' read-only
    file mapping as its storage, which a SwapSet cannot free and re-grow (the trainer offloads it)."""
    copied: dict[int, Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        st = t.untyped_storage()
        if st.resizable() or st.nbytes() == 0:
            continue
        key = st.data_ptr()
        if key not in copied:
            copied[key] = t.data.clone()
        t.data = copied[key] if copied[key].shape == t.shape else t.data.clone()
    return len(copied)


def model_on_base(model_path, base: Mapping[str, Tensor], dtype, trust_remote_code: bool, device, **kw):
    """The model at `model_path` built without weights of its own (parameters on the meta device, buffers
    real), its base parameters then pointed at `base` (the rollout's tensors, by name: colomem.engines.
    shared_base). kw: more arguments of from_config (attn_implementation). Returns (model, SharedBaseReport)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from colomem.engines.shared_base import alias_base

    cfg = AutoConfig.from_pretrained(str(model_path), trust_remote_code=bool(trust_remote_code))
    with init_empty_weights():               # parameters on meta: no second copy of the base ever exists
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=bool(trust_remote_code), **kw)
    report = alias_base(base, model)
    model.to(device)                         # the buffers (rotary tables); the parameters are already there
    return model, report


__all__ = ["load_model", "model_on_base", "own_memory"]
