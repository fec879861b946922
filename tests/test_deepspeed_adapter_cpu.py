"""The DeepSpeed adapter without DeepSpeed: config building, version and argument checks, the distributed env,
the state collection and the swap strategies on a ZeRO-2-shaped stand-in (host path), and the LoRA merge."""

import copy
import gc
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch

import colomem
from colomem.errors import ColomemError
from colomem.engines import deepspeed as dsa
from colomem.engines.deepspeed import state as ds_state
from colomem.engines.deepspeed import strategies
from colomem.engines.deepspeed.strategies import ColomemOffload, ToOffload
from colomem.engines.deepspeed.model import check_model_dir as _check_model_dir
from colomem.engines.deepspeed.weights import SyncSource
from colomem.engines.lora import check_lora_layers
from colomem.errors import InvalidArgumentError, NotAvailableError, PhaseOrderError
from colomem.grpo.config import LoraSpec
from fakes.deepspeed import (Coordinator, StackPushingEngine, bare_trainer, closable_trainer, fake_zero2_engine,
                            fake_zero3_engine)
from fakes.models import lora_model, tiny_qwen2

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("stage", [2, 3])
def test_ds_config_zero_stage_bf16_adamw(stage):
    cfg = dsa.build_ds_config(zero_stage=stage, micro_batch=4, grad_accum=3, world_size=2, lr=2e-5,
                              weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, torch_adam=True, max_grad_norm=0.5)
    assert cfg["zero_optimization"]["stage"] == stage
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["train_batch_size"] == 4 * 3 * 2
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["gradient_clipping"] == 0.5
    opt = cfg["optimizer"]
    assert opt["type"] == "AdamW"
    assert opt["params"] == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True}
    assert "data_types" not in cfg
    assert ("stage3_gather_16bit_weights_on_model_save" in cfg["zero_optimization"]) == (stage == 3)


def test_ds_config_options_and_overrides_merge_deeply():
    cfg = dsa.build_ds_config(zero_stage=3, micro_batch=1, max_grad_norm=None, grad_accum_dtype="fp32",
                              reduce_bucket_size=5e7,
                              overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0},
                                         "steps_per_print": 10})
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 50_000_000
    assert zero["stage3_param_persistence_threshold"] == 0 and zero["contiguous_gradients"] is True
    assert cfg["steps_per_print"] == 10
    assert cfg["gradient_clipping"] == 0.0
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}


def test_lora_config_from_spec():
    pytest.importorskip("peft")
    spec = LoraSpec(r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"])
    lc = dsa.build_lora_config(spec)
    assert (lc.r, lc.lora_alpha, lc.lora_dropout) == (4, 8.0, 0.1)
    assert set(lc.target_modules) == {"q_proj", "v_proj"}
    assert lc.bias == "none"


# ---------------------------------------------------------------------------------------------- version
@pytest.mark.parametrize("version", ["0.19.8", "0.19.0", "0.19.10+abc", "0.19.8.dev0"])
def test_supported_versions_pass(version):
    dsa.check_deepspeed_version(version, environ={})


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "1.0.0", "garbage"])
def test_unsupported_versions_name_the_cause_and_the_fix(version):
    with pytest.raises(NotAvailableError) as e:
        dsa.check_deepspeed_version(version, environ={})
    msg = str(e.value)
    assert f"DeepSpeed {version} is not supported" in msg
    assert "0.19.x" in msg and "deepspeed==0.19.8" in msg and dsa.ALLOW_UNTESTED_ENV in msg


def test_untested_version_allowed_with_a_warning():
    with pytest.warns(RuntimeWarning, match="not supported"):
        dsa.check_deepspeed_version("0.20.1", environ={dsa.ALLOW_UNTESTED_ENV: "1"})


# ------------------------------------------------------------------------------------------- arguments
GOOD = dict(zero_stage=2, micro_batch=2, grad_accum=1, lr=1e-5, offload="colomem")


def test_good_arguments_pass():
    dsa.validate_trainer_args(**GOOD)
    dsa.validate_trainer_args(**{**GOOD, "grad_accum": None})      # RunConfig's "rows per rank / micro_batch"
    dsa.validate_trainer_args(**{**GOOD, "zero_stage": 3, "lora": LoraSpec(), "offload": "to"})


@pytest.mark.parametrize("change, words", [
    ({"zero_stage": 1}, "zero_stage=1"),
    ({"zero_stage": 0}, "ZeRO stage 2 or 3"),
    ({"micro_batch": 0}, "micro_batch=0"),
    ({"micro_batch": 1.5}, "micro_batch=1.5"),
    ({"grad_accum": -1}, "grad_accum=-1"),
    ({"lr": 0}, "lr=0"),
    ({"offload": "cpu"}, "colomem, deepspeed, to"),
    ({"zero_stage": 3, "offload": "deepspeed", "torch_adam": True}, "FusedAdam"),
    ({"betas": (0.9, 1.2)}, "betas"),
    ({"eps": 0}, "eps=0"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"max_grad_norm": 0}, "max_grad_norm"),
    ({"grad_accum_dtype": "fp16"}, "grad_accum_dtype"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"lora": SimpleNamespace(r=8)}, "LoraSpec"),
    ({"lora": LoraSpec(target_modules=[])}, "target_modules is empty"),
    ({"optimizer_state_memory": "mapped", "offload": "deepspeed"}, "needs offload='colomem'"),
    ({"optimizer_state_memory": "vmm"}, "optimizer_state_memory"),
    ({"grad_reduction": "per_step", "zero_stage": 3}, "needs ZeRO-2, not ZeRO-3"),
    ({"grad_reduction": "per_step", "grad_accum_dtype": "fp32"}, "model dtype (grad_accum_dtype None or 'bf16', "
                                                                  "not 'fp32')"),
    ({"grad_reduction": "once"}, "grad_reduction"),
])
def test_bad_arguments_raise_naming_the_argument(change, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        dsa.validate_trainer_args(**{**GOOD, **change})


@pytest.mark.parametrize("options, world_size, per_step", [
    ({}, 1, True),                                      # one rank, ZeRO-2: the same additions, bit for bit
    ({}, 2, False),                                     # several ranks keep DeepSpeed's order of reductions
    ({"zero_stage": 3}, 1, False),
    ({"grad_accum_dtype": "fp32"}, 1, False),           # fp32 accumulation is DeepSpeed's per micro-batch
    ({"grad_accum_dtype": "bf16"}, 1, True),
    ({"grad_reduction": "per_step"}, 4, True),
    ({"grad_reduction": "per_micro_batch"}, 1, False),
])
def test_grad_reduction_resolves_per_step_only_where_asked_or_bit_identical(options, world_size, per_step):
    assert dsa.DeepSpeedConfig(**options).reduces_per_step(world_size) is per_step


def test_config_carries_every_option_and_builds_the_same_ds_config():
    cfg = dsa.DeepSpeedConfig(zero_stage=3, micro_batch=4, grad_accum=None, lr=2e-5, betas=[0.9, 0.95])
    assert cfg.accum_steps == 1 and cfg.betas == (0.9, 0.95) and cfg.offload == "colomem"
    assert cfg.build_ds_config(world_size=2) == dsa.build_ds_config(zero_stage=3, micro_batch=4, world_size=2,
                                                                     lr=2e-5, betas=(0.9, 0.95))
    assert dsa.validate_trainer_args(**GOOD) == dsa.DeepSpeedConfig(**GOOD)
    with pytest.raises(InvalidArgumentError, match="micro_betch: not an option"):
        dsa.DeepSpeedConfig(micro_betch=2)
    with pytest.raises(InvalidArgumentError, match="micro_batch=0"):
        dsa.DeepSpeedConfig(micro_batch=0)


def test_trainer_takes_a_config_or_keywords_not_both(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="not both"):
        dsa.DeepSpeedTrainer(tmp_path, config=dsa.DeepSpeedConfig(), lr=1e-4)
    with pytest.raises(InvalidArgumentError, match="DeepSpeedConfig"):
        dsa.DeepSpeedTrainer(tmp_path, config={"lr": 1e-4})
    with pytest.raises(InvalidArgumentError, match="offload="):
        dsa.DeepSpeedTrainer(tmp_path, offload="cpu")          # checked before the GPU and DeepSpeed


def test_model_dir_checks(tmp_path):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        _check_model_dir(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        _check_model_dir(tmp_path / "weights.bin")
    with pytest.raises(InvalidArgumentError, match="no config.json"):
        _check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="no weights"):
        _check_model_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    _check_model_dir(tmp_path)                     # the trainer needs no tokenizer


def test_trainer_without_gpu_or_deepspeed_says_what_it_needs(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the GPU tests cover construction")
    with pytest.raises(NotAvailableError, match="needs a CUDA GPU"):
        dsa.DeepSpeedTrainer(tmp_path)
    with pytest.raises(NotAvailableError, match="needs a CUDA GPU"):
        dsa.DeepSpeedTrainer(tmp_path, config=dsa.DeepSpeedConfig(zero_stage=3))


# ----------------------------------------------------------------------------------- distributed env
def test_single_process_defaults_fill_only_what_is_missing():
    env = dsa.distributed_env({})
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536
    assert dsa.distributed_env({"MASTER_PORT": "29555"}).get("MASTER_PORT") is None


def test_torchrun_env_is_used_as_is():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    assert dsa.distributed_env(env) == {}


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "torchrun"),
    ({"MASTER_ADDR": "a", "MASTER_PORT": "1", "RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK=4"),
    ({"RANK": "x"}, "RANK='x'"),
])
def test_broken_launcher_env_is_refused(env, words):
    with pytest.raises(InvalidArgumentError, match=words):
        dsa.distributed_env(env)


# ---------------------------------------------------------------------- a ZeRO-2-shaped engine stand-in
def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def state_tensors(engine):
    """What must come back exactly: found independently of the adapter's collector."""
    out = [p for p in engine.module.parameters()] + [b for b in engine.module.buffers()]
    out += engine.optimizer.bit16_groups_flat + engine.optimizer.single_partition_of_fp32_groups
    out += [v for st in engine.optimizer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    out.append(engine.optimizer.new_release_buffer)
    return out


def test_collect_dedups_views_and_sorts_by_category():
    eng = fake_zero2_engine()
    st = dsa.collect_engine_state(eng, CPU)
    names = {c: [n for n, _ in st.groups[c]] for c in dsa.CATEGORIES}
    flat = eng.optimizer.bit16_groups_flat[0]
    assert names["params"][0] == "optimizer.bit16_groups_flat[0]"
    assert "inv_freq" in names["params"]
    assert not any(n.startswith("0.") or n.startswith("1.") for n in names["params"])   # views of the flat
    assert names["master"] == ["optimizer.single_partition_of_fp32_groups[0]"]
    assert sorted(n.rsplit(".", 1)[1] for n in names["optim"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert [n for n, _ in st.scratch] == ["optimizer.ipg_buckets[torch.bfloat16].buffer[0]"]
    assert st.unlisted == [("optimizer.new_release_buffer", 64)]
    assert names["other"] == ["optimizer.new_release_buffer"]
    assert st.sizes["params"] == flat.untyped_storage().nbytes() + 5 * 4
    assert st.sizes["master"] == flat.numel() * 4
    assert st.sizes["scratch"] == 128
    keys = [ds_state.storage_key(t) for _, t in st.swap_items() + st.scratch]
    assert len(keys) == len(set(keys))


def test_collect_skips_other_devices_and_empty_storages():
    eng = fake_zero2_engine()
    eng.optimizer.grads_in_partition = torch.empty(0)
    st = dsa.collect_engine_state(eng, torch.device("meta"))
    assert st.swap_items() == [] and st.scratch == []
    st = dsa.collect_engine_state(eng, CPU)
    assert all(n != "optimizer.grads_in_partition" for n, _ in st.swap_items())


@pytest.fixture
def pool():
    p = colomem.PinnedPool("1MiB", pin=False)
    yield p
    p.close(force=True)


def test_colomem_strategy_round_trip_keeps_objects_and_bytes(pool):
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    params_before = list(eng.module.parameters())
    before = snapshot(tensors)
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    for cycle in range(3):
        move = s.offload()
        assert move.nbytes == sum(move.state.sizes[c] for c in dsa.CATEGORIES)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert eng.optimizer.ipg_buckets[torch.bfloat16].buffer[0].untyped_storage().nbytes() == 0
        # the pool copy is readable while offloaded, with the tensor's own layout
        w = eng.module[0].weight
        hv = s.host_view(w)
        assert hv.dtype == w.dtype and hv.shape == w.shape and torch.equal(hv, before[0])
        s.reload()
        assert list(eng.module.parameters()) == params_before            # the same objects
        for t, b in zip(tensors, before):
            assert torch.equal(t, b), "bytes changed over a swap"
        assert eng.optimizer.ipg_buckets[torch.bfloat16].buffer[0].numel() == 64
        assert s.host_view(eng.module[0].weight) is None                  # views die with the reload
    # the params are still views into the flat buffer: an update of the flat is seen by the model
    eng.optimizer.bit16_groups_flat[0].fill_(1.0)
    assert torch.all(eng.module[1].bias == 1.0)
    s.close()


def test_a_new_placement_gives_the_old_layouts_blocks_back_before_it_offloads():
    """The sets keep their pool blocks for the next offload of the same tensors. When the placement changes
    (the plan after the measuring step keeps the weights and moves the moments), those blocks would not be
    reused: they go back first, so the new offload fits in the memory the first one pinned."""
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    before = snapshot(tensors)
    pool = colomem.PinnedPool("1MiB", segment_bytes="64KiB", pin=False)
    try:
        s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
        s.offload()                                  # everything moves (the measuring step)
        s.reload()
        assert s.swapset.host_bytes > 0 and s.late.host_bytes > 0        # kept for an offload like it
        reserved = pool.stats()["reserved_bytes"]
        s.keep = ("params", "other", "grads", "master")
        assert s.swapset.host_bytes == 0 and s.late.host_bytes == 0
        assert pool.stats()["in_use_bytes"] == 0
        move = s.offload()                           # the moments alone
        assert move.nbytes == move.state.sizes["optim"]
        assert pool.stats()["reserved_bytes"] == reserved                # nothing new pinned
        s.reload()
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)
        s.keep = ("params", "grads", "other", "master")                  # the same placement: blocks stay
        assert s.late.host_bytes > 0
        s.close()
    finally:
        pool.close(force=True)


def _moments_only_strategy(pool):
    """A ZeRO-2 stand-in engine, its state's tensors and their bytes, Adam's moments, and a strategy that moves
    only those moments (everything else kept)."""
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    moments = [v for st in eng.optimizer.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.numel() > 1]
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.keep = ("params", "other", "grads", "master")
    return tensors, snapshot(tensors), moments, s


def test_the_moments_out_behind_training_come_back_inside_the_step_with_their_bytes(pool):
    """optimizer_out_until_step's strategy calls: the moments start copying out while the rest stays; the
    trainer counts them outstanding at once (the step's hook is armed while they still copy), and bringing
    them back first waits for the copy out."""
    tensors, before, moments, s = _moments_only_strategy(pool)
    move = s.offload(defer_late=True)
    assert move.nbytes == 0 and s.pending_bytes == move.state.sizes["optim"] > 0     # all of it deferred
    s.reload(late=False)
    assert s.late_outstanding                       # copying out still counts: the hook arms now
    assert s.reload_late() == move.state.sizes["optim"]
    assert not s.late_outstanding and s.pending_bytes == 0
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    assert all(m.untyped_storage().nbytes() > 0 for m in moments)
    s.close()


def _refuse_late_copies(monkeypatch, s: ColomemOffload, real_async) -> None:
    """From now on the strategy's LATE set cannot start a copy (the other set still can)."""
    def refuse(self, *a, **kw):
        if self is s.late:
            raise ColomemError("no copy today")
        return real_async(self, *a, **kw)
    monkeypatch.setattr(type(s.late), "offload_async", refuse)


def test_a_deferred_offload_moves_the_rest_before_it_starts_and_a_failed_start_leaves_the_engine_whole(
        pool, monkeypatch):
    """The rest of the state is offloaded, and waited for, before the moments start copying: waited for after
    them it would queue behind their whole copy on the same copy engine. When the moments' copy cannot start,
    the rest comes back: the engine stays trainable, its bytes unchanged."""
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    before = snapshot(tensors)
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.keep = ("grads", "other")                     # the parameters move first, the rest is deferred
    calls = []
    real_off, real_async = type(s.swapset).offload, type(s.late).offload_async

    def offload(self, *a, **kw):
        calls.append(("offload", self.name))
        return real_off(self, *a, **kw)

    def offload_async(self, *a, **kw):
        if self is s.late:                          # (offload() itself goes through offload_async too)
            calls.append(("async", self.name, s.swapset.state))
        return real_async(self, *a, **kw)
    monkeypatch.setattr(type(s.swapset), "offload", offload)
    monkeypatch.setattr(type(s.late), "offload_async", offload_async)
    monkeypatch.setattr(strategies, "release_cached_memory", lambda: calls.append(("release",)))
    move = s.offload(defer_late=True)
    # the cache goes back between the two: after the deferred copy started, a cudaFree would wait for it
    assert calls == [("offload", s.swapset.name), ("release",), ("async", s.late.name, "offloaded")]
    moved, sizes, pending = move.nbytes, dict(move.state.sizes), s.pending_bytes    # (no tensors in a repr)
    assert moved == sizes["params"] > 0 and pending == sizes["master"] + sizes["optim"] > 0, (moved, sizes, pending)
    s.finish_late()
    s.reload()
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    _refuse_late_copies(monkeypatch, s, real_async)
    with pytest.raises(ColomemError, match="no copy today"):
        s.offload(defer_late=True)
    assert s.swapset.state == s.late.state == "resident" and s.pending_bytes == 0
    for t, b in zip(tensors, before):
        assert torch.equal(t, b) and t.untyped_storage().nbytes() > 0
    s.close()


def test_a_held_deferred_offload_starts_only_when_asked_and_a_failed_start_leaves_the_moments_whole(
        pool, monkeypatch):
    """hold_late: the rest moves, the moments stay where they are (counted as pending, and outstanding for
    the step's reload) until start_late(); finish_late() starts them itself when nobody did. A start that
    fails leaves them on the GPU with their bytes, and a reload then has nothing of them to bring back."""
    tensors, before, moments, s = _moments_only_strategy(pool)
    started = []
    real_async = type(s.late).offload_async

    def offload_async(self, *a, **kw):
        if self is s.late:
            started.append(self.name)
        return real_async(self, *a, **kw)
    monkeypatch.setattr(type(s.late), "offload_async", offload_async)
    for start in (s.start_late, lambda: None):      # started by the caller, then by finish_late() itself
        move = s.offload(defer_late=True, hold_late=True)
        assert not started and s.pending_bytes == move.state.sizes["optim"] > 0
        assert all(m.untyped_storage().nbytes() > 0 for m in moments)   # not copying yet: still there
        start()
        s.finish_late()
        assert started == [s.late.name] and s.pending_bytes == 0
        assert all(m.untyped_storage().nbytes() == 0 for m in moments)  # copied out, freed
        s.reload()
        started.clear()
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)
    _refuse_late_copies(monkeypatch, s, real_async)
    s.offload(defer_late=True, hold_late=True)
    s.reload(late=False)
    assert s.late_outstanding                       # held: the step's hook arms for it
    with pytest.raises(ColomemError, match="no copy today"):
        s.reload_late()
    assert s.pending_bytes == 0 and not s.late_outstanding and s.late.state == "resident"
    assert s.reload_late() == 0                     # nothing of it left to bring back
    for t, b in zip(tensors, before):
        assert torch.equal(t, b) and t.untyped_storage().nbytes() > 0
    s.close()


def test_the_trainer_ends_a_held_deferred_offload_in_a_thread_and_waits_for_it_before_going_on(pool):
    """DeepSpeedTrainer's start_offload / finish_offload(background=True) over the strategy: the held copy
    starts when asked, its end runs in a thread (the trainer counts it pending meanwhile), and the next
    finish_offload() waits for it: the moments' storages are freed, their bytes in the pool."""
    tensors, before, moments, s = _moments_only_strategy(pool)
    t = bare_trainer(tiny_qwen2(), None, pool)
    t._strategies = {"colomem": s}
    t.last_offload = None
    s.offload(defer_late=True, hold_late=True)
    assert t.offload_pending
    t.start_offload()
    assert t.finish_offload(background=True) == 0.0 and t.offload_pending
    assert t.finish_offload() >= 0.0 and not t.offload_pending and s.pending_bytes == 0
    assert all(m.untyped_storage().nbytes() == 0 for m in moments)
    s.reload()
    for x, b in zip(tensors, before):
        assert torch.equal(x, b)
    s.close()


def test_colomem_strategy_close_while_offloaded_gives_the_blocks_back(pool):
    eng = fake_zero2_engine()
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.offload()
    assert pool.stats()["in_use_bytes"] > 0
    s.close()
    assert pool.stats()["in_use_bytes"] == 0


def test_to_strategy_round_trip(pool):
    eng = fake_zero2_engine()
    tensors = state_tensors(eng)
    before = snapshot(tensors)
    s = ToOffload(lambda: dsa.collect_engine_state(eng, CPU), CPU)
    for _ in range(2):
        move = s.offload()
        assert move.nbytes == sum(move.state.sizes[c] for c in dsa.CATEGORIES)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        s.reload()
        for t, b in zip(tensors, before):
            assert torch.equal(t, b)


def test_training_continues_identically_after_a_swap(pool):
    """Same updates with and without a swap in between (the optimizer keeps its state objects)."""
    def run(swap):
        eng = fake_zero2_engine(seed=1)
        s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
        master = eng.optimizer.single_partition_of_fp32_groups[0]
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            if swap:
                s.offload()
                s.reload()
            master.grad = torch.randn(master.shape, generator=g)
            eng.optimizer.optimizer.step()
            eng.optimizer.bit16_groups_flat[0].copy_(master.detach())
        s.close()
        return [p.detach().clone() for p in eng.module.parameters()]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------- LoRA named weights
def test_named_weights_full_model_are_the_hf_names():
    model = tiny_qwen2()
    t = bare_trainer(model, None)
    got = dict(t.named_weights())
    want = dict(model.named_parameters())
    assert list(got) == list(want)            # same names, same order, tied lm_head left out like HF does
    assert all(got[k].data_ptr() == want[k].data_ptr() for k in want)     # views, no copies


def test_named_weights_merged_lora_equals_peft_merge_without_touching_the_adapter():
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec())
    adapter_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    got = dict(t.named_weights(merged=True))
    reference = copy.deepcopy(model).merge_and_unload()
    want = dict(reference.named_parameters())
    assert list(got) == list(want)
    for k in want:
        # fp32 merge then one rounding to bf16; peft merges in bf16: within a bf16 ulp or two
        torch.testing.assert_close(got[k].float(), want[k].float(), atol=2e-2, rtol=1e-2)
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, adapter_before[n])
    base = dict(t.named_weights(merged=False))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(base[q], model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    assert not torch.equal(base[q], got[q])


def test_lora_state_names_match_peft_save_format():
    peft = pytest.importorskip("peft")
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec())
    got = t.lora_state()
    want = peft.get_peft_model_state_dict(model)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].device.type == "cpu"


def test_sync_staging_while_offloaded_and_phase_errors(pool):
    """prepare_sync's staging path (what offload() does for merged LoRA or without host views)."""
    model, _ = lora_model()
    t = bare_trainer(model, LoraSpec(), pool=pool)
    want = {k: v.clone() for k, v in t.named_weights(merged=True)}
    plan, staged = t._weights.plan_sync(True, False, t._staging, pool)
    assert staged >= sum(v.numel() * v.element_size() for v in want.values())
    t._offloaded = True
    with pytest.raises(PhaseOrderError, match="prepare_sync"):
        t.named_weights()
    t._sync = SyncSource(True, t._weights.resolve_sync(plan, None))
    got = dict(t.named_weights(merged=True))
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k])
    with pytest.raises(PhaseOrderError, match="merged=True"):
        t.named_weights(merged=False)
    t._staging.free()
    assert pool.stats()["in_use_bytes"] == 0


def test_cpu_trainer_merge_is_the_same_merge():
    """engines.lora.merged_named_weights (TorchTrainer's) gives what the DeepSpeed trainer's named_weights does."""
    from colomem.engines.lora import merged_named_weights

    model, _ = lora_model()
    want = dict(bare_trainer(model, LoraSpec()).named_weights(merged=True))
    got = dict(merged_named_weights(model))
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_lora_on_embeddings_is_refused():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_qwen2(), dsa.build_lora_config(LoraSpec(target_modules=["embed_tokens"])))
    with pytest.raises(InvalidArgumentError, match="linear layers only"):
        check_lora_layers(model)


def test_closed_trainer_refuses_work():
    t = bare_trainer(tiny_qwen2(), None)
    t._closed = True
    with pytest.raises(PhaseOrderError, match="closed"):
        t.named_weights()


def test_unresizable_storage_is_kept_reported_and_still_readable(pool):
    """Memory colomem cannot shrink (from_blob, DLPack, mmap'd checkpoints) stays put and is reported."""
    eng = fake_zero2_engine()
    raw = bytearray(torch.arange(8, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    foreign = torch.frombuffer(raw, dtype=torch.bfloat16)
    eng.module.register_buffer("foreign", foreign)
    st = dsa.collect_engine_state(eng, CPU)
    assert st.skipped == [("foreign", 16)]
    assert all(n != "foreign" for n, _ in st.swap_items())
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.offload()
    assert s.host_view(foreign) is None
    t = bare_trainer(eng.module, None)
    items = t._weights.resolve_sync([("foreign", ("view", foreign)), ("0.weight", ("view", eng.module[0].weight))], s)
    assert items[0][1] is foreign and items[1][1].untyped_storage().nbytes() > 0
    s.reload()
    s.close()


# ------------------------------------------- ZeRO-3: nothing process-wide keeps a closed engine's state alive
CACHES = ds_state.lru_caches(Coordinator.params_to_release)


def test_lru_cache_found_behind_a_decorator_without_wraps():
    assert len(CACHES) == 1 and CACHES[0].cache_info().maxsize is None
    assert ds_state.lru_caches(lambda: None) == [] and ds_state.lru_caches(None) == []


def test_zero3_release_frees_the_closed_engine_and_keeps_the_others():
    stack: list = []
    other = fake_zero3_engine(stack)
    eng = fake_zero3_engine(stack)
    opt = weakref.ref(eng.optimizer)
    # each holder alone keeps the whole optimizer alive
    ds_state.release_zero3_references(eng.module[1][0], stack, [])          # only part of the engine
    gc.collect()
    assert opt() is not None
    n = ds_state.release_zero3_references(eng.module, stack, CACHES)
    assert n >= 3
    assert [id(m) for m in stack] == [id(other.module), id(other.module[1]), id(other.module[1][0])]
    assert not hasattr(eng.module[0].weight, "_z3_optimizer")
    assert other.module[0].weight._z3_optimizer is other.optimizer      # another live engine keeps its links
    del eng
    gc.collect()
    assert opt() is None


def test_trim_module_stack_drops_only_what_the_step_left():
    a, b, c = object(), object(), object()
    stack = [a, b, c]
    assert ds_state.trim_module_stack(stack, 1) == 2 and stack == [a]
    assert ds_state.trim_module_stack(stack, 1) == 0 and stack == [a]
    assert ds_state.trim_module_stack(None, 0) == 0


def test_functional_linear_goes_back_when_the_last_trainer_that_saw_it_replaced_closes():
    """ZeRO-3's set-up replaces F.linear process-wide and never restores it; the guard puts torch's back after
    the last trainer closes, so a later job's numerics do not depend on what ran before it."""
    torch_linear, ds_linear = object(), object()
    ns = SimpleNamespace(linear=torch_linear)
    guard = ds_state.FunctionalLinearGuard(ns)

    def zero3_setup():
        if ns.linear is torch_linear:              # DeepSpeed replaces it only when it is torch's own
            ns.linear = ds_linear
        return "engine3"

    assert guard.setup(lambda: "engine2") == ("engine2", False)      # a ZeRO-2 set-up leaves it alone
    assert guard.setup(zero3_setup) == ("engine3", True)
    assert guard.setup(zero3_setup) == ("engine3", True)             # a second one sees it replaced too
    assert guard.setup(lambda: "engine2") == ("engine2", True)       # and so does a ZeRO-2 one meanwhile
    assert guard.holders == 3 and ns.linear is ds_linear
    guard.release()
    guard.release()
    assert ns.linear is ds_linear                    # a live trainer still runs with it
    guard.release()
    assert ns.linear is torch_linear and guard.holders == 0
    guard.release()                                  # one release too many changes nothing
    assert ns.linear is torch_linear

    # a set-up that fails after replacing it gives it back at once
    def failing_setup():
        zero3_setup()
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        guard.setup(failing_setup)
    assert ns.linear is torch_linear and guard.holders == 0

    # someone else's replacement, made while a trainer held DeepSpeed's, is theirs: it stays
    guard.setup(zero3_setup)
    mine = object()
    ns.linear = mine
    guard.release()
    assert ns.linear is mine


def test_close_unhooks_zero3_and_warns_when_the_state_is_still_held(monkeypatch):
    stack: list = []
    monkeypatch.setattr(ds_state, "zero3_global_holders", lambda: (stack, CACHES))
    eng = fake_zero3_engine(stack)
    opt, module = weakref.ref(eng.optimizer), weakref.ref(eng.module)
    t = closable_trainer(eng)
    del eng
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        t.close()
    # nothing of the trainer (its weight export included) keeps the module's parameters alive
    assert opt() is None and module() is None and stack == [] and t.engine is None
    held = fake_zero3_engine(stack).optimizer                          # the caller keeps the optimizer
    t = closable_trainer(SimpleNamespace(module=None, optimizer=held, destroy=lambda: None))
    with pytest.warns(RuntimeWarning, match="FakeZero3Optimizer is still referenced"):
        t.close()


def _stack_engine_trainer(model, stack, micro_batch):
    """A bare trainer around a StackPushingEngine over `model`, and a batch of two rows to train on."""
    from colomem.grpo.batch import GRPOBatch
    from colomem.grpo.config import GRPOConfig

    eng = StackPushingEngine(model, [] if stack is None else stack)
    t = bare_trainer(eng.module, None)
    t.__dict__.update(engine=eng, grpo=GRPOConfig(kl_coef=0.0, log_entropy=False), micro_batch=micro_batch,
                      steps=0, _ref_fn=None, _fwd_stack=stack)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    comp = torch.ones(2, 8)
    comp[:, :3] = 0
    batch = GRPOBatch(ids, torch.ones(2, 8, dtype=torch.long), comp, torch.tensor([1.0, -1.0]),
                      old_logprobs=torch.full((2, 8), -4.0) * comp)
    return t, batch


def test_train_step_leaves_deepspeeds_module_stack_as_it_found_it():
    root = object()
    stack = [root]
    t, batch = _stack_engine_trainer(tiny_qwen2(), stack, 1)
    t.train_step(batch)
    assert stack == [root]


def test_train_step_trains_in_training_mode_so_checkpointed_layers_recompute():
    """from_pretrained leaves a model in eval mode, where transformers checkpoints no layer: train_step trains
    in training mode, so each checkpointed decoder layer runs its forward again in the backward."""
    from colomem.engines.recompute import checkpointed_layers, decoder_layers, enable_recompute, recomputed_layers

    model = tiny_qwen2().eval()                               # as from_pretrained returns it
    enable_recompute(model, 1)
    layers = decoder_layers(model)
    calls = [0]
    handles = [m.self_attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in layers]
    t, batch = _stack_engine_trainer(model, None, 2)
    assert recomputed_layers(model) == 0 and checkpointed_layers(model) == len(layers)   # flags alone do nothing
    out = t.train_step(batch)
    for h in handles:
        h.remove()
    assert model.training and all(m.training for m in layers)
    assert out["recomputed_layers"] == len(layers)            # the step's metrics say what it recomputed
    assert calls[0] == 2 * len(layers)            # one micro-batch: each attention's forward, then its recompute


def test_the_peak_at_the_optimizer_steps_start_is_read_before_an_at_step_reload_and_its_figures_reported(pool):
    """The step-start hook, registered first, reads the peak before the at-step reload brings the state back
    (what could come back before the step must fit beside that peak); the reload's copies are timed."""
    from colomem.engines.deepspeed.step_reload import ReloadAtStep, StepStartPeak, reload_figures

    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    held = [100]
    peak = StepStartPeak(opt, lambda: held[0])
    hook = ReloadAtStep(opt, lambda: held.append(held.pop() + 50) or 7)    # the reload raises what is held
    hook.arm()
    w.grad = torch.ones(4)
    opt.step()
    assert peak.bytes == 100 and held == [150] and hook.nbytes == 7 and not hook.armed
    opt.step()                                             # every step, armed or not
    assert peak.bytes == 150
    peak.close()
    hook.close()
    opt.step()
    assert peak.bytes == 150
    assert reload_figures(None) == {}
    eng = fake_zero2_engine()
    s = ColomemOffload(lambda: dsa.collect_engine_state(eng, CPU), pool, CPU, 30.0)
    s.offload()
    s.reload(late=False)
    assert s.reload_late() > 0
    fig = reload_figures(s.late.last_stats)
    assert set(fig) == {"optimizer_reload_copy_s", "optimizer_reload_regrow_s"} and all(v >= 0 for v in fig.values())
    s.close()


def test_an_offload_names_what_it_left_only_beyond_what_it_meant_to_keep():
    """The (slow) scan of live tensors runs when an offload left more allocated than its kept categories and
    its deferred part, not whenever a placement keeps most of the trainer on the GPU."""
    mib = 1 << 20
    sizes = {"params": 900 * mib, "master": 1800 * mib, "optim": 3600 * mib, "grads": 0}
    kept = ("params", "master")
    assert not ds_state.worth_naming(2700 * mib, sizes, kept, 0)               # exactly what stays
    assert not ds_state.worth_naming(6300 * mib, sizes, kept, 3600 * mib)      # the moments still copying out
    assert ds_state.worth_naming(2700 * mib + 17 * mib, sizes, kept, 0)        # 17 MiB nobody meant to keep
    assert ds_state.worth_naming(2700 * mib, sizes, (), 0)                     # everything was to go
    assert not ds_state.worth_naming(8 * mib, sizes, (), 0)


def test_the_scan_of_what_an_offload_left_names_real_tensors_past_a_compiled_models_fake_ones():
    """A compiled model leaves Dynamo's fake tensors alive, their sizes symbols: the scan names the real
    tensors, largest first, and does not ask the symbolic shape engine to order the fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(torch.empty(4 + i, 8)) for i in range(3)]     # symbolic storage sizes
    assert not isinstance(fakes[0].untyped_storage().nbytes(), int)
    big, small = torch.empty(3 << 18, dtype=torch.bfloat16), torch.empty(1 << 18)   # 1.5 and 1 MiB
    names = ds_state.left_behind(CPU, top=50).split("; ")
    assert names.index(f"[{3 << 18}] bfloat16 1.5 MiB") < names.index(f"[{1 << 18}] float32 1.0 MiB")
    del fakes, big, small
