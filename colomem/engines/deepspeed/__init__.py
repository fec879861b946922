"""The DeepSpeed trainer (ZeRO-2/3, bf16, optional peft LoRA) whose GPU state moves to the pinned pool and back.

    config.py      DeepSpeedConfig (every option, validated), the DeepSpeed version check, build_ds_config,
                   the distributed environment; imports neither torch nor deepspeed
    model.py       the model it trains (a checkpoint, a module, or a LoRA base shared with the rollout engine)
    state.py       what a ZeRO engine holds on its GPU (collect_engine_state), DeepSpeed 0.19 workarounds
    strategies.py  the three offload methods: colomem (pool swaps), deepspeed (offload_states), to (.to loop)
    weights.py     the weights for the rollout sync (LoRA merged, ZeRO-3 gathered, staged while offloaded)
    step_reload.py the optimizer state brought back inside the optimizer step (optimizer_reload "step")
    trainer.py     DeepSpeedTrainer

Build a trainer with keywords, or validate the options first and hand them over:

    config = DeepSpeedConfig(zero_stage=3, micro_batch=4, offload="colomem")   # InvalidArgumentError if bad
    trainer = DeepSpeedTrainer(model_path, config=config, pool=pool, lora=spec, grpo=grpo)
    trainer = DeepSpeedTrainer(model_path, zero_stage=3, micro_batch=4, pool=pool)          # the same

Nothing here imports deepspeed, transformers or peft at module level (the trainer does on construction), and
config.py not even torch, so the run config can import DeepSpeedConfig to validate before anything starts.
"""
from __future__ import annotations

from colomem.engines.reports import SwitchReport

from .config import (ALLOW_UNTESTED_ENV, OFFLOAD_METHODS, SUPPORTED_DEEPSPEED, TESTED_DEEPSPEED, ZERO_STAGES,
                     DeepSpeedConfig, build_ds_config, build_lora_config, check_deepspeed_version,
                     distributed_env, import_deepspeed, init_distributed, validate_trainer_args)
from .state import CATEGORIES, EngineState, collect_engine_state
from .trainer import DeepSpeedTrainer

__all__ = ["ALLOW_UNTESTED_ENV", "CATEGORIES", "DeepSpeedConfig", "DeepSpeedTrainer", "EngineState",
           "OFFLOAD_METHODS", "SUPPORTED_DEEPSPEED", "SwitchReport", "TESTED_DEEPSPEED", "ZERO_STAGES",
           "build_ds_config", "build_lora_config", "check_deepspeed_version", "collect_engine_state",
           "distributed_env", "import_deepspeed", "init_distributed", "validate_trainer_args"]
