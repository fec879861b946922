"""The trainer's frozen LoRA base as views of a vLLM-shaped model's fused weights (CPU): the same logits, no
memory of its own, adapter-only training, and a guard that catches a write into the base."""
import copy

import pytest
import torch

from colomem.engines.base_guard import BaseChecksum
from colomem.engines.shared_base import (alias_base, base_storages, check_still_shared, shared_tensors,
                                         trainer_base_is_frozen, vllm_param_dict)
from colomem.errors import BaseWrittenError, SharedBaseError
from fakes.vllm_shaped import vllm_shaped

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qwen2(tied, seed=0, dtype=torch.float32):
    cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()


def with_lora(model, seed=1):
    m = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


IDS = torch.tensor([[1, 5, 9, 33, 70, 99, 2, 4]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def extent(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("lora_wrapped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aliased_model_gives_the_same_logits_and_holds_no_base_memory(tied, lora_wrapped, dtype):
    model = with_lora(qwen2(tied, dtype=dtype))
    reference = copy.deepcopy(model)
    vllm = vllm_shaped(model.get_base_model(), lora_wrapped=lora_wrapped)   # vLLM's own copy of the weights
    want = logits(reference)
    report = alias_base(vllm, model)

    assert torch.equal(logits(model), want)
    vparams = vllm_param_dict(vllm)
    ranges = [extent(t) for t in vparams.values()]
    base = [(n, p) for n, p in model.named_parameters() if "lora_" not in n]
    for n, p in base:                                   # every base byte lies inside one of vLLM's tensors
        lo, hi = extent(p)
        assert any(a <= lo and hi <= b for a, b in ranges), n
        assert not p.requires_grad
    vllm_storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in vparams.values()}
    assert set(base_storages(model)) <= set(vllm_storages)          # no storage of the trainer's own
    together = {**vllm_storages, **base_storages(model)}
    assert sum(together.values()) == sum(vllm_storages.values())

    assert len(report.mapped) == len(base) and not report.not_mapped and not report.vllm_unused
    assert report.bytes_shared == sum(p.numel() * p.element_size() for _, p in base)
    assert report.adapter_params == 2 * len(TARGETS) * 2
    inner = model.get_base_model()
    assert (inner.lm_head.weight is inner.model.embed_tokens.weight) == tied
    assert inner.model.embed_tokens.weight.shape[0] == 100 < vparams["model.embed_tokens.weight"].shape[0]
    q = vparams["model.layers.1.self_attn.qkv_proj.weight"]
    k = inner.model.layers[1].self_attn.k_proj.base_layer.weight
    assert k.data_ptr() == q.data_ptr() + 32 * q.stride(0) * q.element_size()   # k rows follow the 32 q rows
    up = inner.model.layers[0].mlp.up_proj.base_layer.weight
    assert up.data_ptr() == vparams["model.layers.0.mlp.gate_up_proj.weight"][48:].data_ptr()
    check_still_shared(vllm, model, report)


def test_lora_steps_change_only_the_adapter_and_leave_the_fused_base_unchanged():
    model = with_lora(qwen2(tied=True))
    vllm = vllm_shaped(model.get_base_model())
    report = alias_base(vllm, model)
    guard = BaseChecksum(shared_tensors(vllm, report), parts=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fused_before = {n: t.detach().clone() for n, t in vllm_param_dict(vllm).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)   # every parameter offered to it
    model.train()
    for step in range(4):
        out = model(input_ids=IDS, labels=IDS)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        guard.sampled()
    guard.full()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert all(".lora_A." in n or ".lora_B." in n for n in changed)
    assert all(torch.equal(t, fused_before[n]) for n, t in vllm_param_dict(vllm).items())
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert trainer_base_is_frozen(model)
    check_still_shared(vllm, model, report)
    with torch.no_grad():                          # vLLM's forward reads the same bytes the trainer trained on
        emb = vllm_param_dict(vllm)["model.embed_tokens.weight"]
        assert torch.equal(model.get_base_model().model.embed_tokens.weight, emb[:100])


def test_a_write_into_the_base_is_caught_and_named():
    model = with_lora(qwen2(tied=False))
    vllm = vllm_shaped(model.get_base_model())
    report = alias_base(vllm, model)
    guard = BaseChecksum(shared_tensors(vllm, report), parts=8, sample_words=16)   # the sample misses v[3, 5]
    digest = guard.digest()
    guard.sampled()
    guard.full()
    v = model.get_base_model().model.layers[1].self_attn.v_proj.base_layer.weight
    old = v[3, 5].item()
    with torch.no_grad():
        v[3, 5] += 1.0                             # through the trainer's view, in the middle of qkv_proj
    with pytest.raises(BaseWrittenError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        guard.full()
    caught = 0
    for _ in range(8):                             # the rotating piece reaches it within `parts` calls
        try:
            guard.sampled()
        except BaseWrittenError as e:
            caught += 1
            assert "qkv_proj" in str(e) and "part" in str(e)
    assert caught == 1                             # one of the 8 pieces holds it
    with torch.no_grad():
        v[3, 5] = old                              # the same bytes again: the guard agrees
    guard.full()
    assert guard.digest() == digest
    with torch.no_grad():
        vllm_param_dict(vllm)["model.norm.weight"][0] = 7.0    # word 0: the strided sample reads it every call
    with pytest.raises(BaseWrittenError, match=r"model\.norm\.weight changed \(sample"):
        guard.sampled()


def test_a_meta_model_is_built_on_vllms_memory_with_no_copy_of_its_own():
    accelerate = pytest.importorskip("accelerate")
    src = qwen2(tied=True)
    vllm = vllm_shaped(src)
    want = logits(src)
    with accelerate.init_empty_weights():          # parameters on meta, buffers (rotary) real
        model = transformers.Qwen2ForCausalLM(src.config).eval()
    report = alias_base(vllm, model)               # the base first, then the adapter on real memory
    assert report.replaced == len(report.mapped) > 0 and not report.not_mapped
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), want)
    lora = with_lora(model)
    with torch.no_grad():                          # B = 0: the base alone
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.zero_()
    assert torch.equal(logits(lora), want)
    vptrs = {t.untyped_storage().data_ptr() for t in vllm_param_dict(vllm).values()}
    assert set(base_storages(lora)) <= vptrs and trainer_base_is_frozen(lora)


def test_mismatches_are_refused_by_name_before_anything_changes():
    model = with_lora(qwen2(tied=False))
    good = {n: t for n, t in vllm_param_dict(vllm_shaped(model.get_base_model())).items()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}

    bad = dict(good, **{"model.layers.0.mlp.down_proj.weight": good["model.layers.0.mlp.down_proj.weight"].half()})
    with pytest.raises(SharedBaseError, match=r"down_proj.*float32.*float16"):
        alias_base(bad, model)
    qkv = good["model.layers.1.self_attn.qkv_proj.weight"]
    bad = dict(good, **{"model.layers.1.self_attn.qkv_proj.weight": qkv[: qkv.shape[0] // 2].clone()})
    with pytest.raises(SharedBaseError, match=r"qkv_proj.*rows.*tensor-parallel"):
        alias_base(bad, model)
    bad = dict(good, **{"model.norm.weight": good["model.norm.weight"][:16].clone()})
    with pytest.raises(SharedBaseError, match=r"model\.norm\.weight"):
        alias_base(bad, model)
    with pytest.raises(SharedBaseError, match="tensor_parallel_size=1"):
        alias_base(good, model, tensor_parallel_size=2)
    bad = dict(good, **{"model.embed_tokens.weight": good["model.embed_tokens.weight"].to("meta")})
    with pytest.raises(SharedBaseError, match=r"embed_tokens.*device"):
        alias_base(bad, model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs     # nothing was changed


def test_a_parameter_vllm_lacks_stays_the_trainers_own_frozen_and_reported():
    model = with_lora(qwen2(tied=False))
    named = vllm_param_dict(vllm_shaped(model.get_base_model()))
    named.pop("lm_head.weight")
    named["model.extra.weight"] = torch.zeros(3)
    report = alias_base(named, model)
    assert list(report.not_mapped) == ["base_model.model.lm_head.weight"]
    assert "lm_head" in report.not_mapped["base_model.model.lm_head.weight"]
    assert report.vllm_unused == ["model.extra.weight"]
    assert trainer_base_is_frozen(model)
    assert report.as_dict()["parameters_mapped"] == len(report.mapped)


def test_modules_to_save_is_refused():
    base = qwen2(tied=False)
    vllm = vllm_shaped(base)
    m = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                  modules_to_save=["lm_head"]))
    with pytest.raises(SharedBaseError, match="modules_to_save"):
        alias_base(vllm, m)


def test_a_moved_parameter_is_noticed():
    model = with_lora(qwen2(tied=False))
    vllm = vllm_shaped(model.get_base_model())
    report = alias_base(vllm, model)
    p = model.get_base_model().model.norm.weight
    p.data = p.data.clone()                        # e.g. an engine that flattens parameters into its own buffer
    with pytest.raises(SharedBaseError, match=r"model\.norm\.weight"):
        check_still_shared(vllm, model, report)
