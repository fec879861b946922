"""A merged rollout on the shared base (--shared-base-rollout merged), colomem.engines.base_restore: the merge
written into the base in place with merge_adapters' arithmetic; the restore source held in GPU memory only
where the planner finds it fits beside the placement and what the memory was already given to, and the runner
then hands it to the shared base. The GPU copy itself runs on a GPU: tests/gpu/test_base_restore_gpu.py."""
import json

import pytest
import torch

from colomem.runner.placement import choose
from colomem.runner.train_memory_plan import restore_copy_fits
from fakes.placement import GB, figs

pytest.importorskip("peft")


def test_the_copy_is_held_only_where_it_fits_beside_the_placement_and_what_was_given_out():
    roomy = [figs()]                              # nothing moves: 104 GB of 140 in use
    p = choose("auto", "auto", roomy, margin=2 * GB)
    assert p.label == "nothing moves"
    assert restore_copy_fits(p, roomy, 2 * GB, 0, 13 * GB)
    assert not restore_copy_fits(p, roomy, 2 * GB, 0, 35 * GB)          # 104 + 2 + 35 > 140
    assert not restore_copy_fits(p, roomy, 2 * GB, 25 * GB, 13 * GB)    # a trim took most of what was free
    assert not restore_copy_fits(p, roomy, 2 * GB, 0, 0)                # nothing to hold (a CPU base)
    # every GPU must hold it
    assert not restore_copy_fits(p, roomy + [figs(rollout=90)], 2 * GB, 0, 13 * GB)   # 134 + 2 + 13 > 140


def _model(dtype=torch.float32, adapters=None):
    """peft keeps a bf16 base's adapters in fp32 (its autocast); adapters=bf16 casts them as DeepSpeed's bf16
    engine does, which the merge then does in one GEMM on the CPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(Qwen2ForCausalLM(cfg).to(dtype),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    if adapters is not None:
        model.to(adapters)
    with torch.no_grad():                      # a trained adapter (B starts at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("dtype,adapters", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16-base-fp32-adapters", "bf16"])
def test_the_merge_in_place_is_merge_adapters_bit_for_bit_and_hands_out_the_base_itself(dtype, adapters):
    from colomem.engines.base_restore import BaseRestore
    from colomem.engines.lora import merge_adapters, merged_adapters, walk_modules

    model = _model(dtype, adapters)
    layers = [(p, m) for p, m, params in walk_modules(model) if params is None]
    want = {p + "weight": merge_adapters(m, m.base_layer.weight, [(m.lora_A[a].weight, m.lora_B[a].weight)
                                                                 for a in merged_adapters(m)], merged_adapters(m))
            for p, m in layers}
    original = {p: m.base_layer.weight.detach().clone() for p, m in layers}
    r = BaseRestore(model)
    named = r.merge_in_place(model)
    assert r.merged and [n for n, _ in named] == list(want)
    assert all(t.data_ptr() == m.base_layer.weight.data_ptr() for (_, t), (_, m) in zip(named, layers))
    assert all(torch.equal(t, want[n]) for n, t in named)
    assert any(not torch.equal(m.base_layer.weight, original[p]) for p, m in layers)
    r.restore()
    assert all(torch.equal(m.base_layer.weight, original[p]) for p, m in layers)


def test_several_active_adapters_merge_in_place_as_merge_adapters_does():
    from peft import LoraConfig

    from colomem.engines.base_restore import BaseRestore
    from colomem.engines.lora import merge_adapters, merged_adapters, walk_modules

    model = _model(torch.bfloat16)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"]))
    model.base_model.set_adapter(["default", "second"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    layers = [m for _, m, params in walk_modules(model) if params is None]
    assert all(merged_adapters(m) == ["default", "second"] for m in layers)
    want = [merge_adapters(m, m.base_layer.weight, [(m.lora_A[a].weight, m.lora_B[a].weight)
                                                    for a in merged_adapters(m)], merged_adapters(m)) for m in layers]
    named = BaseRestore(model).merge_in_place(model)
    assert all(torch.equal(t, w) for (_, t), w in zip(named, want))


def test_later_merges_read_the_trained_adapters_without_walking_the_model_again(monkeypatch):
    """The layers are walked once, at construction; each merge reads the adapters' values then, also after
    training changed them in place or an offload gave a parameter other storage (param.data replaced)."""
    import colomem.engines.lora as lora
    from colomem.engines.base_restore import BaseRestore

    model = _model(torch.bfloat16, torch.bfloat16)
    layers = [m for _, m, params in lora.walk_modules(model) if params is None]
    r = BaseRestore(model)
    monkeypatch.setattr(lora, "walk_modules", lambda *a, **k: pytest.fail("the merge walked the model again"))
    for step in range(3):
        with torch.no_grad():
            for m in layers:
                if step == 1:
                    m.lora_B["default"].weight.add_(0.01)
                elif step == 2:                  # other storage for the same parameter
                    m.lora_A["default"].weight.data = m.lora_A["default"].weight.detach().clone() * 2
        want = [lora.merge_adapters(m, m.base_layer.weight,
                                    [(m.lora_A["default"].weight, m.lora_B["default"].weight)], ["default"])
                for m in layers]
        named = r.merge_in_place(model)
        assert all(torch.equal(t, w) for (_, t), w in zip(named, want))
        r.restore()


def test_a_base_on_the_cpu_has_no_copy_to_move_and_still_comes_back_bit_for_bit():
    from colomem.engines.base_restore import BaseRestore
    from colomem.engines.lora import walk_modules

    model = _model()
    r = BaseRestore(model)
    assert r.device_bytes() == 0 and r.hold_on_device() == 0 and not r.on_device
    layers = [m for _, m, params in walk_modules(model) if params is None]
    original = [m.base_layer.weight.detach().clone() for m in layers]
    with torch.no_grad():
        for m in layers:
            m.base_layer.weight.add_(1.0)
    r.merged = True
    r.restore()
    assert all(torch.equal(m.base_layer.weight, w) for m, w in zip(layers, original))


def test_the_runner_holds_the_copy_on_the_gpu_when_the_plan_says_it_fits(job_env, tmp_path, monkeypatch):
    """The CPU loop with GPU-like figures: the plan weighs the shared base's copy, says so, writes it in the
    placement event, and the runner asks the shared base to hold it, once, before the next step."""
    from colomem.runner import train_memory_plan
    from colomem.runner.job import run_job
    from colomem.runner.shared_base_job import SharedBase
    from test_shared_base_job_cpu import job

    held, said = [], []
    monkeypatch.setattr(train_memory_plan, "figures_from_step", lambda *a, **k: figs())
    monkeypatch.setattr(SharedBase, "restore_copy_bytes", lambda self: 3 * GB)
    monkeypatch.setattr(SharedBase, "hold_restore_on_device", lambda self: held.append(1) or 3 * GB)
    res = run_job(job(tmp_path / "m", shared_base_rollout="merged", placement_margin="2GB"),
                  print_fn=said.append)
    assert res.summary["status"] == "ok", res.summary.get("error")
    assert held == [1]
    assert any("comes back from a copy in GPU memory" in x for x in said), said
    lines = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    (plan,) = [x for x in lines if x.get("event") == "placement"]
    assert plan["restore_copy_bytes"] == 3 * GB

    # the same plan without room for it: not held, and the event says 0
    held.clear()
    monkeypatch.setattr(SharedBase, "restore_copy_bytes", lambda self: 60 * GB)
    res = run_job(job(tmp_path / "n", shared_base_rollout="merged", placement_margin="2GB"),
                  print_fn=lambda *_: None)
    assert res.summary["status"] == "ok" and held == []
    lines = [json.loads(x) for x in (tmp_path / "n" / "metrics.jsonl").read_text().splitlines()]
    assert [x["restore_copy_bytes"] for x in lines if x.get("event") == "placement"] == [0]
