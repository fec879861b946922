"""The GRPO algorithm's options (`GRPOConfig`) and a LoRA adapter's shape (`LoraSpec`): what the loss, the
rollout sampling and both trainers read. The whole run's configuration is `colomem.runner.config.RunConfig`.
"""
from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from colomem.errors import ConfigError  # noqa: F401  (re-exported: where it was before)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSpec(_Strict):
    """A peft LoRA adapter on the policy; trained weights are merged into the base for the rollout sync."""
    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class GRPOConfig(_Strict):
    """The GRPO algorithm (what the loss and the rollout sampling need); shared by every Trainer."""
    group_size: int = Field(8, ge=2, description="completions sampled per prompt (n)")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="ratio clip: [1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: Optional[float] = Field(None, gt=0, description="upper clip; None = clip_eps")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference; 0 = no reference")
    loss_norm: Literal["sequence", "token"] = Field(
        "sequence", description="sequence: mean over each completion's tokens, then over completions (GRPO); "
                                "token: sum over all completion tokens / their count (DAPO)")
    scale_rewards: bool = Field(True, description="divide advantages by the group's std (False, with "
                                                  "loss_norm token: Dr. GRPO)")
    std: Literal["population", "sample"] = Field(
        "population", description="the group std of the advantages: population (divide by n) or sample (by n - 1, "
                                  "as TRL and verl)")
    adv_eps: float = Field(1e-4, gt=0)
    temperature: float = Field(1.0, gt=0, description="sampling temperature; logprobs use logits/temperature")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: Optional[int] = Field(None, gt=0, description="unset = the task's (longest answer + EOS)")
    old_logprobs: Literal["policy", "rollout"] = Field(
        "policy", description="ratio denominator: policy = the trainer's own logprobs before the update (on-policy, "
                              "robust to rollout/trainer numerics); rollout = the rollout engine's logprobs")
    mask_truncated: bool = Field(False, description="completions cut at max_new_tokens get no loss")
    log_entropy: bool = Field(True, description="mean token entropy in the metrics (one extra pass on logits)")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


# One release of the old home of the run configuration: `colomem.grpo.config.RunConfig` and its loaders now
# live in `colomem.runner.config` (imported lazily: that module imports this one).
_MOVED = ("RunConfig", "load_run_config", "config_from_dict", "build_arg_parser", "load_yaml")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"colomem.grpo.config.{name} moved to colomem.runner.config.{name}", DeprecationWarning,
                      stacklevel=2)
        from colomem.runner import config as _run_config

        return getattr(_run_config, name)
    raise AttributeError(f"module 'colomem.grpo.config' has no attribute {name!r}")


__all__ = ["ConfigError", "GRPOConfig", "LoraSpec"]
