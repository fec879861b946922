"""A module shaped like vLLM's Qwen2 / Llama model at TP 1, built from a transformers model's weights: fused
qkv_proj (q rows, k rows, v rows; biases alike) and gate_up_proj (gate rows, up rows), the vocabulary rows
of embed_tokens / lm_head padded to a multiple of 64 (zeros), a tied lm_head left out as vLLM's
named_parameters leaves it, and optionally vLLM's LoRA naming (`<layer>.base_layer.weight`)."""
import torch

FUSE = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def vllm_named_tensors(hf_model, pad_to=64):
    """{vLLM name: new tensor} from a transformers model's base weights (a peft model's base_layer names read
    as the plain ones; adapters left out); copies: vLLM has its own memory."""
    sd = {n.replace(".base_layer.", "."): p.detach() for n, p in hf_model.named_parameters()   # tied: named once
          if ".lora_" not in n}
    out = {}
    for name, t in sd.items():
        parts = name.split(".")
        if len(parts) >= 2 and any(parts[-2] in members for members in FUSE.values()):
            fused = next(f for f, members in FUSE.items() if parts[-2] in members)
            key = ".".join(parts[:-2] + [fused, parts[-1]])
            if key not in out:
                out[key] = torch.cat([sd[".".join(parts[:-2] + [m, parts[-1]])] for m in FUSE[fused]]).clone()
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = -(-t.shape[0] // pad_to) * pad_to
            padded = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            padded[: t.shape[0]] = t
            out[name] = padded
        else:
            out[name] = t.clone()
    return out


class VllmShaped(torch.nn.Module):
    """Parameters (requires_grad False, like vLLM's) under vLLM's dotted names."""

    def __init__(self, named, lora_wrapped=False):
        super().__init__()
        for name, t in named.items():
            if lora_wrapped and name.rsplit(".", 2)[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                head, tail = name.rsplit(".", 1)
                name = f"{head}.base_layer.{tail}"
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))


def vllm_shaped(hf_model, lora_wrapped=False, pad_to=64):
    return VllmShaped(vllm_named_tensors(hf_model, pad_to), lora_wrapped=lora_wrapped)
