"""The one table of real model shapes.

The benchmarks move tensors of these sizes (`SHAPES`, the sets `python -m colomem.bench --sets` takes), the
budget tool estimates from them (`QWEN2_5_FAMILY`, see colomem.budget) and the config-built models of the
runner take their dimensions from them (colomem.grpo.tiny_model). Values are the models' published configs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer in the Qwen2 / Llama layout (GQA attention, gated MLP, RMSNorm)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool
    qkv_bias: bool = True          # Qwen2 has q/k/v biases; Llama has none

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def tensors(self, biases: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter; biases off by default, as in the 255-tensor 7B set the transfer
        benchmark moves (biases are small and only add tensors)."""
        kv = self.kv_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (self.hidden, self.hidden)),
                    (p + "self_attn.k_proj.weight", (kv, self.hidden)),
                    (p + "self_attn.v_proj.weight", (kv, self.hidden)),
                    (p + "self_attn.o_proj.weight", (self.hidden, self.hidden)),
                    (p + "mlp.gate_proj.weight", (self.intermediate, self.hidden)),
                    (p + "mlp.up_proj.weight", (self.intermediate, self.hidden)),
                    (p + "mlp.down_proj.weight", (self.hidden, self.intermediate)),
                    (p + "input_layernorm.weight", (self.hidden,)),
                    (p + "post_attention_layernorm.weight", (self.hidden,))]
            if biases and self.qkv_bias:
                out += [(p + "self_attn.q_proj.bias", (self.hidden,)), (p + "self_attn.k_proj.bias", (kv,)),
                        (p + "self_attn.v_proj.bias", (kv,))]
        out.append(("model.norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        return out

    def params(self) -> int:
        """Parameters of the whole model, biases included (the count a model card gives)."""
        return sum(_numel(s) for _, s in self.tensors(biases=True))

    def nbytes(self, itemsize: int = 2) -> int:
        """Bytes of the benchmark set (`tensors()`, no biases) at `itemsize` bytes per element."""
        return sum(_numel(s) for _, s in self.tensors()) * itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# Qwen2.5 kept Qwen2's dimensions at 0.5B, 1.5B, 7B and 72B: one entry serves both generations.
QWEN2_0P5B = ModelShape(vocab=151936, hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, tied=True)
QWEN2_1P5B = ModelShape(vocab=151936, hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, tied=True)
QWEN2_7B = ModelShape(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, tied=False)
QWEN2_72B = ModelShape(vocab=152064, hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8, tied=False)
QWEN2_5_3B = ModelShape(vocab=151936, hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, tied=True)
QWEN2_5_14B = ModelShape(vocab=152064, hidden=5120, intermediate=13824, layers=48, heads=40, kv_heads=8, tied=False)
QWEN2_5_32B = ModelShape(vocab=152064, hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8, tied=False)
LLAMA3_8B = ModelShape(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, tied=False,
                       qkv_bias=False)
# Small enough for a CPU-only machine: the host path is exercised on this one (not a published model).
TINY = ModelShape(vocab=8192, hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=2, tied=False)

# The sizes the budget tool picks the nearest of when only a parameter count is given.
QWEN2_5_FAMILY = (QWEN2_0P5B, QWEN2_1P5B, QWEN2_5_3B, QWEN2_7B, QWEN2_5_14B, QWEN2_5_32B, QWEN2_72B)

# The benchmark sets, by the name `--sets` takes.
SHAPES = {"7b": QWEN2_7B, "1.5b": QWEN2_1P5B, "0.5b": QWEN2_0P5B, "llama3-8b": LLAMA3_8B, "tiny": TINY}
