"""The LoRA adapter written into vLLM's slot in place (GPU host, vLLM 0.24): an in-process engine in
lora_mode="adapter" serves five versions of a peft adapter on every linear layer of a tiny Qwen2 (fused q/k/v
and gate/up parts included). The first version goes through files, the next ones in place; after each,
vLLM's greedy tokens equal transformers' for base + adapter; the slot written in place equals bytewise what
vLLM's own loader puts there for the same adapter; a level-1 sleep keeps what was written; a version written
while awake does not reuse KV blocks cached with the old one (vLLM keys them by the adapter, which keeps its
name and id). The in-place time per version is printed,
never asserted.

Rank 4 in vLLM's rank-8 slots (rows beyond r must stay zero) and alpha / r = 3 (B is rounded after the cast,
as vLLM's loader does: the bytes differ otherwise).
"""

from __future__ import annotations

import random

import pytest
import torch

from test_vllm_adapter import GPU_UTIL, assert_greedy_matches, build_tiny, greedy   # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VERSIONS = 5


def peft_model(d, spec):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    base = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
    m = get_peft_model(base, LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=0.0,
                                        target_modules=list(spec.target_modules), task_type="CAUSAL_LM"))
    return m.eval()


def new_adapter(m, seed):
    """The "trainer" moved: new random LoRA weights in place (peft keeps them in float32)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.05)


def adapter_tensors(m):
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(m).items())


def slot_bytes(r):
    """{(layer, part, "A" | "B"): the whole slot row, copied} of the adapter vLLM serves now."""
    lid = r._adapter.request.lora_int_id

    def read(worker):
        mgr = worker.model_runner.lora_manager._adapter_manager
        slot = mgr.lora_index_to_id.index(lid)
        out = {}
        for name, layer in mgr.modules.items():
            if not isinstance(layer.lora_a_stacked, tuple):
                continue                               # not a linear layer (lm_head keeps one tensor)
            for i, (a, b) in enumerate(zip(layer.lora_a_stacked, layer.lora_b_stacked)):
                out[(name, i, "A")], out[(name, i, "B")] = a[slot].clone(), b[slot].clone()
        return out

    return r._calls.call(lambda llm: llm.collective_rpc(read), r.rpc_timeout_s, "read the LoRA slot")[0]


def tokens(out):
    return [c.token_ids for c in out]


def test_adapter_versions_go_in_place_and_match_transformers_and_vllms_own_load(tmp_path_factory):
    from colomem.engines.vllm import VLLMRollout
    from colomem.grpo.config import LoraSpec

    d = str(tmp_path_factory.mktemp("tiny-qwen2-lora-inplace"))
    cfg, ntok = build_tiny(d)
    rng = random.Random(3)
    # longer than a KV block (16 tokens), so the prefix cache holds blocks of them
    prompts = [[rng.randrange(10, ntok) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    spec = LoraSpec(r=4, alpha=12.0, target_modules=TARGETS)
    r = VLLMRollout(d, gpu_memory_utilization=GPU_UTIL, max_model_len=256, max_num_seqs=16, seed=0,
                    lora=spec, lora_mode="adapter", sleep_level=1, engine_in_process=True,
                    sync_transport="direct")
    timings = []
    try:
        base = tokens(greedy(r, prompts))
        m = peft_model(d, spec)
        for version in range(1, VERSIONS + 1):
            new_adapter(m, seed=version)
            ts = adapter_tensors(m)
            assert len(ts) == cfg.num_hidden_layers * len(TARGETS) * 2
            if version < VERSIONS:
                r.sleep()
                r.wake_weights()               # files still current re-register under a new id here
            lid = r._adapter.request.lora_int_id if r._adapter.request is not None else None
            st = r.load_weights(ts, version=version)   # the last one awake: version 4's prompt KV is cached
            if version < VERSIONS:
                r.check()
                r.wake_kv()
            assert st.adapter_inplace is (version > 1), r._adapter.inplace_refused
            if version > 1:
                assert r._adapter.request.lora_int_id == lid, "an in-place write keeps the adapter's id"
                timings.append((version, st.adapter_seconds, r._adapter.last_write["seconds"]))
            out = greedy(r, prompts)
            assert_greedy_matches(m, prompts, out)
            if version == 1:
                assert tokens(out) != base, "the adapter changed nothing"
            if version == 2:                           # what went in place survives a level-1 sleep
                r.sleep()
                r.wake()
                r.check()
                assert r._adapter.request.lora_int_id == lid
                assert tokens(greedy(r, prompts)) == tokens(out)
            if version == 3:                           # the same adapter through vLLM's own loader
                written = slot_bytes(r)
                r._adapter.load_files(ts, version)
                assert r._adapter.request.lora_int_id != lid
                loaded = slot_bytes(r)
                # every layer: qkv_proj (3 parts), o_proj, gate_up_proj (2 parts), down_proj; A and B of each
                assert written.keys() == loaded.keys() and len(written) == cfg.num_hidden_layers * 7 * 2
                differ = [k for k in written
                          if not torch.equal(written[k].contiguous().view(torch.uint8),
                                             loaded[k].contiguous().view(torch.uint8))]
                assert not differ, f"{len(differ)} slot buffers differ from vLLM's own load, e.g. {differ[:3]}"
                assert tokens(greedy(r, prompts)) == tokens(out)
    finally:
        r.close()
    print("\nLoRA adapter written in place (tiny Qwen2, r=4, every linear layer):")
    for version, total, worker in timings:
        print(f"  version {version}: {total * 1e3:.2f} ms in load_weights, {worker * 1e3:.2f} ms of copies")
