"""VLLMRollout without vLLM: the phase and version guards, the bucket plumbing into the worker extension, the
pool backup, error mapping and LoRA adapter files, with a fake engine (tests/fakes/vllm.py) that calls the real
ColomemWorkerExtension in-process on CPU tensors (vLLM's pieces the adapter imports are stubbed). An engine
that hangs or dies, and the transports: test_vllm_engine_faults_cpu.py; the worker's own tests:
test_vllm_worker_cpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from child_env import child_env
from colomem.engines import SyncStats
from colomem.engines.protocols import Rollout
from colomem.engines.vllm import WORKER_EXTENSION, VLLMConfig
from colomem.engines.vllm.worker import ColomemWorkerExtension
from colomem.errors import (CudaOutOfMemoryError, InvalidArgumentError, PhaseOrderError, StaleWeightsError,
                            WeightCheckError)
from fakes.vllm import FakeRollout, make, model_of, trainer_weights
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)

# ------------------------------------------------------------------------------------------------ tests
def test_llm_kwargs_defaults_and_worker_extension():
    r = make()
    kw = r.built_with
    assert kw["trust_remote_code"] is False
    assert kw["enable_sleep_mode"] is True
    assert kw["worker_extension_cls"] == WORKER_EXTENSION == "colomem.engines.vllm.worker.ColomemWorkerExtension"
    assert kw["enforce_eager"] is True and kw["gpu_memory_utilization"] == 0.3 and kw["max_model_len"] == 256
    assert "enable_lora" not in kw
    assert kw["logprobs_mode"] == "processed_logprobs"             # log-softmax(logits / T), as GRPO computes
    assert isinstance(r, Rollout)
    r.close()


def test_the_old_worker_path_still_names_the_extension():
    from colomem.engines import vllm_worker

    assert vllm_worker.ColomemWorkerExtension is ColomemWorkerExtension


def test_options_as_a_config_object():
    cfg = VLLMConfig(gpu_memory_utilization=0.3, max_model_len=256, bucket_bytes="1KiB", sleep_level=2)
    r = FakeRollout("/models/tiny", config=cfg)
    assert r.config is cfg and r.bucket_bytes == 1024 and r.sleep_level == 2
    assert r.built_with["max_model_len"] == 256
    r.close()
    with pytest.raises(InvalidArgumentError, match="not both"):
        FakeRollout("/models/tiny", config=cfg, seed=3)


def test_config_imports_neither_vllm_nor_the_rollout():
    code = ("import sys; import colomem.engines.vllm.config as c; c.VLLMConfig(sync_transport='direct', "
            "engine_in_process=True); print(sorted(m for m in sys.modules if m == 'vllm' or "
            "m.startswith(('vllm.', 'colomem.engines.vllm.rollout', 'colomem.engines.vllm.worker'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=child_env())
    assert out.stdout.strip() == "[]"


def test_config_errors_name_the_field_and_what_it_allows():
    with pytest.raises(InvalidArgumentError, match="sync_transport must be one of 'listener'.*'direct'.*'rpc'"):
        VLLMConfig(sync_transport="rpc")
    with pytest.raises(InvalidArgumentError, match="nope: not a VLLMRollout option"):
        VLLMConfig(nope=1)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        VLLMConfig(max_model_len="long")


@pytest.mark.parametrize("bad", [dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5),
                                 dict(max_model_len=0), dict(sleep_level=3), dict(weights_backup="disk"),
                                 dict(lora_mode="sideways"), dict(verify="maybe"), dict(tensor_parallel_size=0),
                                 dict(rpc_timeout_s=0), dict(lora_mode="adapter"),
                                 dict(logprobs_mode="raw_logits"), dict(sync_transport="socket"),
                                 dict(sync_transport="rpc"), dict(bucket_buffers=0), dict(unknown_option=1)])
def test_argument_validation(bad):
    kw = dict(gpu_memory_utilization=0.3, max_model_len=256)
    kw.update(bad)
    with pytest.raises(InvalidArgumentError):
        FakeRollout("/models/tiny", **kw)


def test_adapter_mode_refuses_a_sleep_that_discards_the_base():
    lora = types.SimpleNamespace(r=8, alpha=16.0, target_modules=["q_proj"])
    with pytest.raises(InvalidArgumentError, match="sleep_level=1, weights_backup='pool'"):
        make(lora=lora, lora_mode="adapter", sleep_level=2)
    r = make(lora=lora, lora_mode="adapter", sleep_level=2, weights_backup="pool")
    assert r.built_with["enable_lora"] is True and r.built_with["max_lora_rank"] == 8
    with pytest.raises(InvalidArgumentError):
        r.weights_backup = "vllm"
    r.close()


def test_sync_writes_the_trainer_bytes_in_buckets_and_acks_each():
    r = make(sync_transport="listener")
    m = model_of(r)
    for version in (1, 2, 3):       # the first sync records load_weights, the next ones replay its copies
        w = trainer_weights(version)
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(-1.0)       # as after a level-2 sleep: nothing of the old bytes may leak through
        stats = r.load_weights(w.items(), version=version)
        assert isinstance(stats, SyncStats)
        assert torch.equal(m.qkv_proj.detach(), torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]))
        assert torch.equal(m.o_proj.detach(), w["o_proj"]) and torch.equal(m.norm.detach(), w["norm"])
        assert torch.equal(m.embed.detach(), w["embed"])               # reassembled from parts in 5+ buckets
        assert stats.ntensors == 6 and stats.nbytes == sum(t.numel() * 4 for t in w.values())
        assert stats.complete is True and r.weight_version == version
        ack = r._worker._colomem().last_ack
        assert ack["total_tensors"] == 6
        assert ack["replayed_tensors"] == (0 if version == 1 else 6)
        assert ack["load_plan"]["replayable"] == 6
        # version 2 replays (and compiles) each bucket layout; version 3 applies every bucket as raw ranges
        importer = r._worker._colomem().importer
        assert importer.copied_out == (stats.nbuckets if version == 3 else 0)
        importer.copied_out = 0
    calls = r.llm.calls         # no RPC per sync: the buckets went over the (fake) socket to the listener
    assert calls.count("colomem_listen") == 1 and calls.count("colomem_attach") == 1 and stats.nbuckets >= 7
    r.check()                                   # trainer checksums vs the worker's bytes
    r.check(reference=w.items())
    with pytest.raises(WeightCheckError, match="differ"):
        r.check(reference=trainer_weights(2).items())
    r.close()


def test_version_guard():
    r = make()
    r.load_weights(trainer_weights(1).items(), version=1)
    assert r.generate([[1, 2]], n=1, max_new_tokens=3)
    r.expect_version(2)
    with pytest.raises(StaleWeightsError, match="version 1 .* version 2"):
        r.generate([[1, 2]], n=1, max_new_tokens=3)
    with pytest.raises(InvalidArgumentError):
        r.expect_version(1)                     # announcements never go backwards
    with pytest.raises(InvalidArgumentError):
        r.load_weights(trainer_weights(0).items(), version=0)   # nor do synced versions
    r.load_weights(trainer_weights(2).items(), version=2)
    assert r.generate([[1, 2]], n=1, max_new_tokens=3)
    r.close()


def test_generate_returns_completions_with_logprobs(fake_vllm):
    r = make()
    out = r.generate([[1, 2, 3], [4]], n=2, max_new_tokens=4, temperature=1.0, top_p=0.9, seed=5)
    assert len(out) == 2 and all(len(c) == 2 for c in out)
    c = out[0][1]
    assert c.token_ids == [(3 + 1 + k) % 7 for k in range(4)]      # sorted by index, not vLLM's order
    assert c.logprobs == [-0.5, -1.0, -1.5, -2.0] and c.finish == "length"
    with pytest.raises(InvalidArgumentError):
        r.generate([[]], n=1, max_new_tokens=2)
    with pytest.raises(InvalidArgumentError):
        r.generate([[1]], n=0, max_new_tokens=2)
    r.close()


def test_logprobs_are_asked_flat_and_read_from_either_form():
    from colomem.engines.vllm.sampling import _sampled_logprobs
    from fakes.vllm import flat_logprobs

    toks = [3, 5, 0]
    want = [-0.5, -1.0, -1.5]
    flat = flat_logprobs(toks)
    assert _sampled_logprobs(types.SimpleNamespace(logprobs=flat), toks) == want
    flat.token_ids[2], flat.token_ids[3] = flat.token_ids[3], flat.token_ids[2]   # sampled token not first
    flat.logprobs[2], flat.logprobs[3] = flat.logprobs[3], flat.logprobs[2]
    assert _sampled_logprobs(types.SimpleNamespace(logprobs=flat), toks) == want
    dicts = [{t: types.SimpleNamespace(logprob=lp)} for t, lp in zip(toks, want)]
    assert _sampled_logprobs(types.SimpleNamespace(logprobs=dicts), toks) == want
    short = _sampled_logprobs(types.SimpleNamespace(logprobs=flat_logprobs(toks[:2])), toks)
    assert short[:2] == want[:2] and short[2] != short[2]                          # NaN where none came


def test_generate_asks_for_flat_logprobs_only_when_it_wants_them(fake_vllm, monkeypatch):
    seen = []
    r = make()
    real = r.llm.generate
    monkeypatch.setattr(r.llm, "generate", lambda prompts, params, **kw: seen.extend(params) or real(prompts, params, **kw))
    r.generate([[1, 2]], n=1, max_new_tokens=2)
    r.generate([[1, 2]], n=1, max_new_tokens=2, logprobs=False)
    assert [p.flat_logprobs for p in seen] == [True, False]
    r.close()


def test_phase_order_is_enforced(fake_vllm):
    r = make()
    with pytest.raises(PhaseOrderError):
        r.wake_weights()                         # not asleep
    r.sleep()
    with pytest.raises(PhaseOrderError):
        r.generate([[1]], max_new_tokens=2)
    with pytest.raises(PhaseOrderError):
        r.load_weights(trainer_weights(1).items(), version=1)
    with pytest.raises(PhaseOrderError):
        r.wake_kv()                              # weights first
    r.wake_weights()
    r.load_weights(trainer_weights(1).items(), version=1)
    with pytest.raises(PhaseOrderError):
        r.generate([[1]], max_new_tokens=2)      # KV still asleep
    r.wake_kv()
    assert r.generate([[1]], max_new_tokens=2)
    assert [c for c in r.llm.calls if isinstance(c, str) and c.startswith(("sleep", "wake"))] == \
        ["sleep1", "wake['weights']", "wake['kv_cache']"]
    r.close()


def test_level2_sleep_without_backup_refuses_until_a_full_sync(fake_vllm):
    r = make(sleep_level=2)
    r.load_weights(trainer_weights(1).items(), version=1)
    r.sleep()
    r.wake_weights()
    with pytest.raises(WeightCheckError, match="discarded"):
        r.check()
    w = trainer_weights(2)
    with pytest.raises(WeightCheckError, match="missing"):
        r.load_weights([("o_proj", w["o_proj"])], version=2)      # a partial sync cannot fix garbage
    r.wake_kv()
    with pytest.raises(StaleWeightsError, match="level-2"):
        r.generate([[1]], max_new_tokens=2)
    r.load_weights(w.items(), version=2)
    r.check()
    assert r.generate([[1]], max_new_tokens=2)
    r.close()


def test_level1_sleep_keeps_weights_and_check_passes(fake_vllm):
    r = make(sleep_level=1)
    w = trainer_weights(3)
    r.load_weights(w.items(), version=1)
    r.sleep()
    r.wake()
    r.check()
    assert torch.equal(model_of(r).o_proj.detach(), w["o_proj"])
    r.close()


def test_pool_backup_restores_exact_bytes_after_a_level2_sleep(fake_vllm):
    r = make(weights_backup="pool")
    w = trainer_weights(4)
    r.load_weights(w.items(), version=1)
    before = [p.detach().clone() for p in model_of(r).parameters()]
    for _ in range(3):
        r.sleep()                                # worker copies into its pinned pool, then vLLM level 2
        assert "sleep2" in r.llm.calls and float(model_of(r).norm.detach().abs().sum()) == 0.0
        r.wake_weights()                         # vLLM maps again, worker copies the bytes back
        r.check()
        r.wake_kv()
        assert all(torch.equal(a, b.detach()) for a, b in zip(before, model_of(r).parameters()))
    pool = r._worker._colomem().backup.pool
    nparams = len(list(model_of(r).parameters()))
    assert pool.stats()["allocs"] == nparams     # one block per allocation, kept across cycles
    r.close()


def test_pool_wake_without_restore_requires_a_full_sync(fake_vllm):
    r = make(weights_backup="pool")
    r.load_weights(trainer_weights(1).items(), version=1)
    r.sleep()
    r.wake_weights(restore=False)
    assert "colomem_restore_weights_from_pool" not in r.llm.calls
    with pytest.raises(WeightCheckError):
        r.check()
    r.load_weights(trainer_weights(2).items(), version=2)
    r.check()
    r.close()


def test_check_catches_bytes_changed_behind_its_back(fake_vllm):
    r = make(sleep_level=1)
    r.load_weights(trainer_weights(5).items(), version=1)
    r.sleep()
    r.llm.level = 2                               # vLLM "forgets" the backup: garbage after the wake
    r.wake_weights()
    with pytest.raises(WeightCheckError, match="differ"):
        r.check()
    r.close()


def test_a_worker_error_arrives_as_its_class_in_the_trainer_process():
    r = make(sync_transport="direct", engine_in_process=True)
    r.load_weights(trainer_weights(1).items(), version=1)

    def broken(*a, **k):
        raise WeightCheckError("bytes looked wrong")

    r._worker.model_runner.model.load_weights = broken
    w = trainer_weights(2)
    w["o_proj"] = w["o_proj"].t()                # not contiguous: through the model's load_weights
    with pytest.raises(WeightCheckError, match="bytes looked wrong"):
        r.load_weights(w.items(), version=2)
    assert r.weight_version == 1
    r.close()


def test_oom_at_wake_rolls_back_and_names_the_knob(fake_vllm):
    r = make()
    r.sleep()
    r.llm.wake_error = "CUDA Error: out of memory at cumem_allocator.cpp:100"
    with pytest.raises(CudaOutOfMemoryError, match="offload more of the trainer"):
        r.wake_weights()
    assert r._worker.rollbacks == [(["weights"], True)] and r.phase == "asleep"
    r.llm.wake_error = None
    r.wake_weights()
    r.llm.wake_error = "CUDA Error: out of memory"
    with pytest.raises(CudaOutOfMemoryError, match="gpu_memory_utilization"):
        r.wake_kv()
    assert r._worker.rollbacks[-1] == (["kv_cache"], False) and r.phase == "weights"
    r.close()


def test_oom_precheck_leaves_vllm_asleep(fake_vllm, monkeypatch):
    r = make()
    r.sleep()
    from colomem.engines.vllm import wake_memory
    monkeypatch.setattr(wake_memory, "free_bytes", lambda device: 1 << 20)   # 1 MiB free, the weights need more
    n = len(r.llm.calls)
    with pytest.raises(CudaOutOfMemoryError, match="still asleep"):
        r.wake_weights()
    assert r.llm.calls[n:] == [] and r.phase == "asleep"
    r.close()


def test_lora_adapter_mode_writes_a_peft_adapter_and_swaps_ids(fake_vllm):
    from safetensors.torch import load_file

    lora = types.SimpleNamespace(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    r = make(lora=lora, lora_mode="adapter", sleep_level=1)
    a = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.randn(4, 16),
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.randn(16, 4)}
    st = r.load_weights(a.items(), version=1)
    assert st.adapter_tensors == 2 and st.ntensors == 0
    req1 = r._adapter.request
    files = load_file(os.path.join(req1.lora_path, "adapter_model.safetensors"))
    assert sorted(files) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    with open(os.path.join(req1.lora_path, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["target_modules"] == ["q_proj"]         # what the adapter holds, whatever the spec says
    r.generate([[1]], max_new_tokens=2)
    assert r.llm.calls[-1] == ("generate", req1.lora_int_id)
    r.load_weights(a.items(), version=2)
    req2 = r._adapter.request
    assert req2.lora_int_id != req1.lora_int_id and list(r.llm.loras) == [req2.lora_int_id]
    assert not os.path.exists(req1.lora_path)
    r.sleep()
    r.wake_weights()                               # re-registered after the wake (a wake may drop it)
    assert r._adapter.request.lora_int_id not in (req1.lora_int_id, req2.lora_int_id)
    d = r._adapter.request.lora_path
    r.close()
    assert not os.path.exists(d)
