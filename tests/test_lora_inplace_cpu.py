"""The LoRA adapter written into vLLM's slot in place, on CPU: peft names to vLLM's layers and parts, the
transform vLLM's loader applies (cast, then B scaled in the LoRA dtype) on plain tensors shaped like vLLM 0.24's
stacked buffers, the refusals that send an adapter to the file path, and the fallback of a rollout whose
engine has no LoRA slot to write into. The GPU test (tests/gpu/test_lora_inplace_gpu.py) compares against
vLLM's own load."""

from __future__ import annotations

import types

import pytest
import torch

from colomem.engines.vllm.lora_adapter import peft_adapter_name
from colomem.engines.vllm.lora_inplace import (part_map, peft_module, plan_copies, slot_target, write_adapter,
                                               write_copies)
from colomem.errors import AdapterLayoutError, InvalidArgumentError

from fakes.vllm import install_vllm_stubs, make

SLOTS, RANK, HIDDEN, KV, INTER = 2, 8, 16, 8, 24      # max_loras, max_lora_rank, q/o width, k/v width, mlp width
LAYER = "model.layers.0"
PACKED = {f"{LAYER}.self_attn.qkv_proj": [f"{LAYER}.self_attn.{p}_proj" for p in "qkv"],
          f"{LAYER}.mlp.gate_up_proj": [f"{LAYER}.mlp.gate_proj", f"{LAYER}.mlp.up_proj"]}
# vLLM's LoRA layer -> the (in, out) of each of its parts
LAYERS = {f"{LAYER}.self_attn.qkv_proj": [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV)],
          f"{LAYER}.self_attn.o_proj": [(HIDDEN, HIDDEN)],
          f"{LAYER}.mlp.gate_up_proj": [(HIDDEN, INTER), (HIDDEN, INTER)],
          f"{LAYER}.mlp.down_proj": [(INTER, HIDDEN)]}


def stacked(dtype=torch.bfloat16):
    """{layer: ([lora_a_stacked per part], [lora_b_stacked per part])}, zeros as vLLM creates them."""
    return {m: ([torch.zeros(SLOTS, 1, RANK, i, dtype=dtype) for i, _ in parts],
                [torch.zeros(SLOTS, 1, o, RANK, dtype=dtype) for _, o in parts]) for m, parts in LAYERS.items()}


def peft_adapter(r, seed, dtype=torch.float32, modules=None):
    """A peft state dict (names as the trainer's peft model gives them) for every sub-layer, rank r."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer, parts in LAYERS.items():
        for i, (n_in, n_out) in enumerate(parts):
            sub = PACKED[layer][i] if layer in PACKED else layer
            if modules is not None and sub.rsplit(".", 1)[-1] not in modules:
                continue
            out.append((f"base_model.model.{sub}.lora_A.default.weight", torch.randn(r, n_in, generator=g, dtype=dtype)))
            out.append((f"base_model.model.{sub}.lora_B.default.weight",
                        torch.randn(n_out, r, generator=g, dtype=dtype)))
    return [(peft_adapter_name(n), t) for n, t in out]


def targets_for(bufs, adapter, slot):
    """The targets of an adapter "activated" with these shapes: what manager_targets reads off vLLM."""
    parts = part_map(LAYERS, PACKED)
    shapes: dict = {}
    for name, t in adapter:
        module, is_a = peft_module(name)
        shapes.setdefault(parts[module], [None, None])[0 if is_a else 1] = tuple(t.shape)
    return parts, {k: slot_target(k[0], k[1], bufs[k[0]][0][k[1]], bufs[k[0]][1][k[1]], slot, a, b)
                   for k, (a, b) in shapes.items()}


# ------------------------------------------------------------------------------------------------ names
def test_peft_names_map_to_vllms_fused_layers_and_parts():
    parts = part_map(LAYERS, PACKED)
    assert parts[f"{LAYER}.self_attn.k_proj"] == (f"{LAYER}.self_attn.qkv_proj", 1)
    assert parts[f"{LAYER}.self_attn.v_proj"] == (f"{LAYER}.self_attn.qkv_proj", 2)
    assert parts[f"{LAYER}.mlp.up_proj"] == (f"{LAYER}.mlp.gate_up_proj", 1)
    assert parts[f"{LAYER}.self_attn.o_proj"] == (f"{LAYER}.self_attn.o_proj", 0)
    assert f"{LAYER}.self_attn.qkv_proj" not in parts          # a fused layer is reached through its parts only
    name = peft_adapter_name(f"base_model.model.{LAYER}.self_attn.q_proj.lora_B.default.weight")
    assert peft_module(name) == (f"{LAYER}.self_attn.q_proj", False)
    assert peft_module(f"{LAYER}.mlp.down_proj.lora_A.weight") == (f"{LAYER}.mlp.down_proj", True)
    mapped = peft_module(name, lambda n: "language_model." + n)   # the model's hf_to_vllm name map
    assert mapped == (f"language_model.{LAYER}.self_attn.q_proj", False)


@pytest.mark.parametrize("name, why", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding adapter"),
    ("base_model.model.lm_head.lora_A.weight", "lm_head"),
    ("base_model.model.model.layers.0.self_attn.q_proj.weight", "not a peft LoRA weight name"),
])
def test_names_that_are_not_linear_lora_weights_are_refused(name, why):
    with pytest.raises(AdapterLayoutError, match=why):
        peft_module(name)
    assert issubclass(AdapterLayoutError, InvalidArgumentError)


# ------------------------------------------------------------------------------------------- transform
def test_the_write_casts_a_and_scales_b_in_the_lora_dtype_and_leaves_the_rest_of_the_slot():
    bufs = stacked()
    for A, B in bufs.values():               # the other slot holds something that must survive
        for t in (*A, *B):
            t[0].normal_()
    other = {m: ([a[0].clone() for a in A], [b[0].clone() for b in B]) for m, (A, B) in bufs.items()}
    adapter = peft_adapter(r=4, seed=1)       # rank 4 in slots of rank 8: the rows beyond r stay zero
    parts, targets = targets_for(bufs, adapter, slot=1)
    copies = plan_copies(adapter, parts, targets)
    assert len(copies) == 7
    write_copies(copies, scaling=3.0, timeout=5.0)
    by_name = dict(adapter)
    for layer, (A, B) in bufs.items():
        for i in range(len(A)):
            sub = PACKED[layer][i] if layer in PACKED else layer
            a = by_name[f"base_model.model.{sub}.lora_A.weight"]
            b = by_name[f"base_model.model.{sub}.lora_B.weight"]
            # vLLM's loader: tensor.to(lora_dtype), then LoRALayerWeights.optimize: lora_b *= alpha / r
            want_b = b.to(torch.bfloat16)
            want_b *= 3.0
            assert torch.equal(A[i][1, 0, :4], a.to(torch.bfloat16))
            assert torch.equal(B[i][1, 0, :, :4], want_b)
            assert not A[i][1, 0, 4:].any() and not B[i][1, 0, :, 4:].any()
            assert torch.equal(A[i][0], other[layer][0][i]) and torch.equal(B[i][0], other[layer][1][i])
    b = by_name[f"base_model.model.{LAYER}.mlp.down_proj.lora_B.weight"]
    assert not torch.equal((b * 3.0).to(torch.bfloat16), b.to(torch.bfloat16) * 3.0)  # the order is observable


def test_scaling_one_copies_b_as_it_is():
    bufs = stacked(torch.float32)
    adapter = peft_adapter(r=8, seed=2, modules={"o_proj"})
    parts, targets = targets_for(bufs, adapter, slot=0)
    write_copies(plan_copies(adapter, parts, targets), scaling=1.0, timeout=5.0)
    assert torch.equal(bufs[f"{LAYER}.self_attn.o_proj"][1][0][0, 0], dict(adapter)[
        f"base_model.model.{LAYER}.self_attn.o_proj.lora_B.weight"])
    assert write_copies([], scaling=2.0, timeout=5.0) == 0.0


# -------------------------------------------------------------------------------------------- refusals
def _refused(adapter, parts, targets, match):
    before = {k: (t.a.clone(), t.b.clone()) for k, t in targets.items()}
    with pytest.raises(AdapterLayoutError, match=match):
        plan_copies(adapter, parts, targets)
    assert all(torch.equal(t.a, before[k][0]) and torch.equal(t.b, before[k][1]) for k, t in targets.items())


def test_an_adapter_that_differs_from_the_active_one_is_refused_naming_the_module():
    bufs = stacked()
    active = peft_adapter(r=4, seed=3, modules={"q_proj", "v_proj", "o_proj"})
    parts, targets = targets_for(bufs, active, slot=0)
    new = peft_adapter(r=4, seed=4, modules={"q_proj", "v_proj", "o_proj"})
    assert len(plan_copies(new, parts, targets)) == 3
    _refused(peft_adapter(r=8, seed=4, modules={"q_proj", "v_proj", "o_proj"}), parts, targets,
             r"q_proj.*lora_A is \(8, 16\), the active adapter's is \(4, 16\)")
    _refused(peft_adapter(r=4, seed=4, modules={"q_proj", "k_proj", "v_proj", "o_proj"}), parts, targets,
             "k_proj.*has no weights there")
    _refused(peft_adapter(r=4, seed=4, modules={"q_proj", "o_proj"}), parts, targets,
             r"lacks 1 module\(s\).*v_proj")
    _refused(new + [("base_model.model.model.layers.0.self_attn.rotary.lora_A.weight", torch.zeros(4, 16))],
             parts, targets, "no LoRA layer for 'model.layers.0.self_attn.rotary'")
    _refused([p for p in new if "o_proj.lora_B" not in p[0]], parts, targets, "o_proj.*lora_B is missing")
    _refused(new + new[:1], parts, targets, "given twice")
    _refused([(n, t.to(torch.int32)) if "o_proj.lora_A" in n else (n, t) for n, t in new], parts, targets,
             "not a floating-point tensor")
    _refused([(n, t.to("meta")) if "q_proj.lora_B" in n else (n, t) for n, t in new], parts, targets,
             "on meta, vLLM's slot on cpu")


def test_a_slot_that_cannot_hold_the_adapter_is_refused():
    a, b = torch.zeros(SLOTS, 1, RANK, HIDDEN), torch.zeros(SLOTS, 1, HIDDEN, RANK)
    with pytest.raises(AdapterLayoutError, match="does not fit slot 0"):
        slot_target("o_proj", 0, a, b, 0, (16, HIDDEN), (HIDDEN, 16))     # rank 16 in slots of rank 8
    with pytest.raises(AdapterLayoutError, match="does not fit slot 2"):
        slot_target("o_proj", 0, a, b, SLOTS, (4, HIDDEN), (HIDDEN, 4))
    with pytest.raises(AdapterLayoutError, match=r"not \(r, in\) and \(out, r\)"):
        slot_target("o_proj", 0, a, b, 0, (4, HIDDEN), (HIDDEN, 2))
    with pytest.raises(AdapterLayoutError, match="not \\[slots, 1, rank, in\\]"):
        slot_target("o_proj", 0, a[:, 0], b, 0, (4, HIDDEN), (HIDDEN, 4))
    with pytest.raises(AdapterLayoutError, match="runs without LoRA"):
        write_adapter(None, 1, [], 2.0, 5.0)


# --------------------------------------------------------------------------------------------- rollout
def test_an_in_process_engine_without_a_lora_slot_to_write_loads_files(monkeypatch):
    """The fake worker is the real ColomemWorkerExtension without vLLM's model runner: no LoRA manager, so the
    in-place write is refused in the worker (the class crosses the RPC) and the adapter goes through files."""
    install_vllm_stubs(monkeypatch)
    lora = types.SimpleNamespace(r=4, alpha=8.0, target_modules=["q_proj"])
    r = make(lora=lora, lora_mode="adapter", sleep_level=1, engine_in_process=True, sync_transport="direct")
    a = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16),
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4)}
    st1 = r.load_weights(a.items(), version=1)
    assert st1.adapter_inplace is False and "colomem_lora_write" not in r.llm.calls   # no adapter yet: files
    req1 = r._adapter.request
    st2 = r.load_weights(a.items(), version=2)
    assert "colomem_lora_write" in r.llm.calls and st2.adapter_inplace is False
    assert "runs without LoRA" in r._adapter.inplace_refused
    assert r._adapter.request.lora_int_id != req1.lora_int_id and st2.to_dict()["adapter_inplace"] is False
    r.generate([[1]], max_new_tokens=2)
    assert r.llm.calls[-1] == ("generate", r._adapter.request.lora_int_id)
    r.close()
