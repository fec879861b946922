"""A merged rollout on the shared base, on a GPU (colomem.engines.base_restore.BaseRestore): the merge written
into the bf16 base in place equals merge_adapters' out-of-place merge bit for bit; the restore source held in
GPU memory (hold_on_device) takes the adapted weights' bytes on the base's GPU, and the base comes back from it
bit for bit after a merge wrote into it, as it does from the host copy.

Run: python -m pytest -m gpu tests/gpu/test_base_restore_gpu.py
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu]
peft = pytest.importorskip("peft")


def _model(bf16_adapters=False):
    """peft keeps the adapters of a bf16 base in fp32; bf16_adapters casts them as DeepSpeed's bf16 engine does
    (on a GPU the merge still goes through fp32: cuBLAS's bf16 GEMM would round twice)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    base = Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    if bf16_adapters:
        model.to(torch.bfloat16)
    with torch.no_grad():                      # a trained adapter (B starts at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("bf16_adapters", [False, True], ids=["fp32-adapters", "bf16-adapters"])
def test_the_merge_in_place_equals_merge_adapters_bit_for_bit_on_the_gpu(bf16_adapters):
    from colomem.engines.base_restore import BaseRestore
    from colomem.engines.lora import merge_adapters, merged_adapters, walk_modules

    model = _model(bf16_adapters)
    layers = [(p, m) for p, m, params in walk_modules(model) if params is None]
    want = [merge_adapters(m, m.base_layer.weight, [(m.lora_A[a].weight, m.lora_B[a].weight)
                                                    for a in merged_adapters(m)], merged_adapters(m))
            for _, m in layers]
    # every path is an fp32 sum rounded once: within half a bf16 step of the exact sum (float64, no TF32 in
    # the reference), plus what summing the K + 1 terms in fp32 in any order may stray (more than a bf16 step of
    # a result whose terms nearly cancel)
    for (_, m), w in zip(layers, want):
        (a,) = merged_adapters(m)
        W, A, B = (t.double() for t in (m.base_layer.weight, m.lora_A[a].weight, m.lora_B[a].weight))
        exact = W + m.scaling[a] * (B @ A)
        order = (A.shape[0] + 2) * 2 ** -24 * (W.abs() + abs(m.scaling[a]) * (B.abs() @ A.abs()))
        half_step = 2 ** -8 * (1 + 2 ** -7) * torch.maximum(w.double().abs(), exact.abs())
        assert torch.all((w.double() - exact).abs() <= half_step + order)
    original = [m.base_layer.weight.detach().clone() for _, m in layers]
    r = BaseRestore(model)
    named = r.merge_in_place(model)
    torch.cuda.synchronize()
    assert r.last_merge_s > 0                          # the merge's kernels, timed by events on the GPU
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for _, t in named)
    assert all(torch.equal(t, w) for (_, t), w in zip(named, want))
    assert all(t.data_ptr() == m.base_layer.weight.data_ptr() for (_, t), (_, m) in zip(named, layers))
    r.restore()
    assert all(torch.equal(m.base_layer.weight, w) for (_, m), w in zip(layers, original))


def test_the_base_comes_back_bit_for_bit_from_its_copy_in_gpu_memory():
    from colomem.engines.base_restore import BaseRestore
    from colomem.engines.lora import walk_modules

    model = _model()
    layers = [m for _, m, params in walk_modules(model) if params is None]
    original = [m.base_layer.weight.detach().clone() for m in layers]
    r = BaseRestore(model)
    assert all(not t.is_cuda for t in r.host)            # the first copy is on the host
    want = r.device_bytes()
    assert want >= r.nbytes > 0
    before = torch.cuda.memory_allocated()
    assert r.hold_on_device() == want and r.on_device
    assert torch.cuda.memory_allocated() - before >= r.nbytes
    assert all(t.is_cuda for t in r.source) and r.device_bytes() == 0 and r.hold_on_device() == 0
    for _ in range(2):                                   # a merge writes the base, the restore gives it back
        with torch.no_grad():
            for m in layers:
                m.base_layer.weight.add_(torch.randn_like(m.base_layer.weight))
        r.merged = True
        assert r.restore() >= 0 and not r.merged
        assert all(torch.equal(m.base_layer.weight, w) for m, w in zip(layers, original))
    assert r.restores == 2


def test_the_copy_moves_only_while_the_base_holds_no_merge():
    from colomem.engines.base_restore import BaseRestore
    from colomem.errors import SharedBaseError

    r = BaseRestore(_model())
    r.merged = True
    with pytest.raises(SharedBaseError, match="no merge"):
        r.hold_on_device()
    assert not r.on_device
