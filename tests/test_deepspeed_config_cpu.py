"""The DeepSpeed adapter without DeepSpeed: its config building, the version and argument checks, the trainer's
refusals before any work, and the distributed env."""

from types import SimpleNamespace

import pytest
import torch

from colomem.engines import deepspeed as dsa
from colomem.engines.deepspeed.model import check_model_dir as _check_model_dir
from colomem.errors import InvalidArgumentError, NotAvailableError
from colomem.grpo.config import LoraSpec

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
