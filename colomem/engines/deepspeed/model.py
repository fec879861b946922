"""What DeepSpeedTrainer builds on and waits with: the model it trains (from a checkpoint, a module, or the
rollout engine's weights for a shared LoRA base) and small helpers of its set-up and teardown."""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from colomem._checkpoint import checkpoint_problem
from colomem.engines.lora import check_lora_layers
from colomem.errors import InvalidArgumentError

from .config import DeepSpeedConfig, build_lora_config
from .state import release_zero3_references


def build_model(model_path: Any, config: DeepSpeedConfig, lora: Any, device: torch.device,
                shared_base: Optional[Mapping[str, Tensor]] = None) -> tuple[Any, Any]:
    """(the model to train, the SharedBaseReport of its base shared with the rollout engine or None): loaded
    in bf16 (or taken as given, or built on the rollout engine's weights), gradient checkpointing, the LoRA
    adapter and torch.compile of its decoder layers as the config and spec ask."""
    model: Any
    report: Any = None
    if shared_base is not None:
        from colomem.engines.hf_model import model_on_base

        kw_base: dict[str, Any] = ({"attn_implementation": config.attn_implementation}
                                   if config.attn_implementation else {})
        model, report = model_on_base(model_path, shared_base, torch.bfloat16, config.trust_remote_code,
                                      device, **kw_base)
    elif isinstance(model_path, torch.nn.Module):
        model = model_path
    else:
        from transformers import AutoModelForCausalLM

        kw: dict[str, Any] = {"dtype": torch.bfloat16, "trust_remote_code": bool(config.trust_remote_code)}
        if config.attn_implementation:
            kw["attn_implementation"] = config.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(model_path), **kw)
    if hasattr(model, "config"):
        model.config.use_cache = False
    if config.gradient_checkpointing:
        from colomem.engines.recompute import enable_recompute

        enable_recompute(model, config.checkpoint_every)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, build_lora_config(lora))
        if config.gradient_checkpointing:
            model.enable_input_require_grads()
        check_lora_layers(model)
    if config.torch_compile:           # last: the parts it compiles hold the LoRA layers
        from colomem.engines.compile import compile_decoder_layers

        compile_decoder_layers(model, device.type)
    return model, report


def run_with_timeout(fn: Callable[[], None], timeout_s: float, what: str) -> bool:
    """Runs fn in a daemon thread; warns and returns False when it does not finish in time."""
    err: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:       # noqa: BLE001 - reported below
            err.append(e)

    th = threading.Thread(target=target, name=f"colomem-{what}", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        warnings.warn(f"{what} did not finish within {timeout_s:.0f} s; continuing without it", RuntimeWarning,
                      stacklevel=3)
        return False
    if err:
        warnings.warn(f"{what} failed: {err[0]!r}", RuntimeWarning, stacklevel=3)
        return False
    return True


# ----------------------------------------------------------------------------------------------- trainer


def weakref_or_none(obj: Any) -> Optional[weakref.ref]:
    try:
        return weakref.ref(obj) if obj is not None else None
    except TypeError:                    # not weak-referenceable: nothing to check
        return None


def destroy_engine(engine: Any, zero_stage: Optional[int], timeout_s: float) -> Optional[weakref.ref]:
    """engine.destroy() bounded by timeout_s, and a ZeRO-3 module unhooked from DeepSpeed's process-wide
    objects; returns a weak reference to the engine's optimizer (to check that nothing still holds it)."""
    run_with_timeout(engine.destroy, timeout_s, "DeepSpeed engine.destroy()")
    if zero_stage == 3:
        try:
            release_zero3_references(getattr(engine, "module", None))
        except Exception as e:     # noqa: BLE001 - closing goes on; the caller's check reports a leak
            warnings.warn(f"unhooking the ZeRO-3 module from DeepSpeed failed: {e!r}", RuntimeWarning,
                          stacklevel=3)
    return weakref_or_none(getattr(engine, "optimizer", None))


def check_model_dir(model_path: Any) -> None:
    problem = checkpoint_problem(model_path, tokenizer=False)     # the trainer reads no tokenizer
    if problem:
        raise InvalidArgumentError(problem)


__all__ = ["build_model", "check_model_dir", "destroy_engine", "run_with_timeout", "weakref_or_none"]
