"""Parameter shapes of real model families, to benchmark on tensors of the sizes users move."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Qwen2Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool

    def tensors(self, biases: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter; biases off by default, as in the anchors' 255-tensor 7B set."""
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
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
            if biases:
                out += [(p + "self_attn.q_proj.bias", (self.hidden,)), (p + "self_attn.k_proj.bias", (kv,)),
                        (p + "self_attn.v_proj.bias", (kv,))]
        out.append(("model.norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        return out

    def nbytes(self, itemsize: int = 2) -> int:
        n = 0
        for _, s in self.tensors():
            k = 1
            for d in s:
                k *= d
            n += k
        return n * itemsize


QWEN2_7B = Qwen2Shape(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, tied=False)
QWEN2_1P5B = Qwen2Shape(vocab=151936, hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, tied=True)
# Small enough for a CPU-only machine: the host path is exercised on this one.
TINY = Qwen2Shape(vocab=8192, hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=2, tied=False)

SHAPES = {"7b": QWEN2_7B, "1.5b": QWEN2_1P5B, "tiny": TINY}
