"""One copy of the LoRA base on the GPU (GPU host, vLLM 0.24): the trainer's model built on the meta device and
aliased onto an in-process vLLM engine's weights, its adapter trained and synced to vLLM as a LoRA adapter each
step. vLLM's greedy tokens equal transformers' for base + the current adapter, the base checksum never changes,
and the trainer holds no base memory of its own (measured against a two-copy build of the same model).

The engine never sleeps here: a sleep that keeps the shared weights mapped (KV cache only) is the runner's.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from test_vllm_adapter import GPU_UTIL, assert_greedy_matches, build_tiny, greedy   # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]
STEPS = 20


def vllm_params(rollout):
    """vLLM's model parameters by name, the tensors themselves (the engine runs in this process)."""
    def named(worker):
        return dict(worker.model_runner.model.named_parameters(remove_duplicate=False))
    out = rollout._calls.call(lambda llm: llm.collective_rpc(named), rollout.rpc_timeout_s, "named_parameters")
    return out[0]


def trainer_on(vparams, d, spec):
    """The trainer's peft model with no base memory of its own: parameters on meta, then views of vLLM's."""
    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from colomem.engines.shared_base import alias_base

    cfg = AutoConfig.from_pretrained(d)
    with init_empty_weights():
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    report = alias_base(vparams, base)
    base.to("cuda")                              # the buffers (rotary); the parameters are already there
    model = get_peft_model(base, LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=0.0,
                                            target_modules=list(spec.target_modules), task_type="CAUSAL_LM"))
    return model, report


def adapter_tensors(m):
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(m).items())


def train_step(model, opt, batch):
    model.train()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(loss)


def test_the_trainer_trains_its_adapter_on_vllms_weights_and_vllm_serves_it(tmp_path_factory):
    from colomem.engines.base_guard import BaseChecksum
    from colomem.engines.shared_base import base_storages, check_still_shared, shared_tensors
    from colomem.engines.vllm import VLLMRollout
    from colomem.grpo.config import LoraSpec
    from transformers import AutoModelForCausalLM

    d = str(tmp_path_factory.mktemp("tiny-qwen2-shared"))
    cfg, ntok = build_tiny(d)
    rng = random.Random(2)
    prompts = [[rng.randrange(10, ntok) for _ in range(rng.randint(4, 12))] for _ in range(6)]
    batch = torch.tensor([[rng.randrange(10, ntok) for _ in range(32)] for _ in range(8)], device="cuda")
    spec = LoraSpec(r=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    r = VLLMRollout(d, gpu_memory_utilization=GPU_UTIL, max_model_len=256, max_num_seqs=16, seed=0,
                    lora=spec, lora_mode="adapter", sleep_level=1, engine_in_process=True,
                    sync_transport="direct")
    try:
        vparams = vllm_params(r)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        model, report = trainer_on(vparams, d, spec)
        aliased_bytes = torch.cuda.memory_allocated() - before
        assert not report.not_mapped and report.bytes_shared > 0, report.as_dict()
        vptrs = {t.untyped_storage().data_ptr() for t in vparams.values()}
        assert set(base_storages(model)) <= vptrs
        guard = BaseChecksum(shared_tensors(vparams, report))
        digest = guard.digest()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)

        base_out = [c.token_ids for c in greedy(r, prompts)]
        for step in range(1, STEPS + 1):
            train_step(model, opt, batch)
            guard.sampled()
            check_still_shared(vparams, model, report)
            r.load_weights(adapter_tensors(model), version=step)
            r.check()
            out = greedy(r, prompts)
            assert_greedy_matches(model, prompts, out)
        assert [c.token_ids for c in out] != base_out, "the trained adapter changed nothing in vLLM"
        guard.full()
        assert guard.digest() == digest

        torch.cuda.synchronize()                  # the two-copy build of the same trainer, for the figures
        before = torch.cuda.memory_allocated()
        two_copy = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
        torch.cuda.synchronize()
        two_copy_bytes = torch.cuda.memory_allocated() - before
        copies = 1 + (0 if set(base_storages(model)) <= vptrs else 1)
        figures = {"lora_base_copies_on_gpu": copies, "base_bytes": report.bytes_shared,
                   "trainer_model_bytes_aliased": aliased_bytes, "trainer_model_bytes_two_copy": two_copy_bytes,
                   "guard_bytes": guard.nbytes, "shared_base": report.as_dict()}
        out_dir = os.environ.get("OUT")
        if out_dir:
            with open(os.path.join(out_dir, "shared_base_gpu.json"), "w") as f:
                json.dump(figures, f, indent=1)
        print(json.dumps({k: v for k, v in figures.items() if k != "shared_base"}))
        assert copies == 1
        assert two_copy_bytes >= 0.9 * report.bytes_shared
        assert aliased_bytes <= 0.1 * report.bytes_shared, figures
        del two_copy
    finally:
        r.close()
