"""Tiny models for CPU tests: a Qwen2 built from a config (random weights) and a peft LoRA model over it."""
import pytest
import torch

from colomem.engines import deepspeed as dsa
from colomem.grpo.config import LoraSpec


def tiny_qwen2(seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def lora_model(seed=0):
    peft = pytest.importorskip("peft")
    spec = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(tiny_qwen2(seed), dsa.build_lora_config(spec))
    with torch.no_grad():                  # B starts at zero: make the adapter do something
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model, spec
