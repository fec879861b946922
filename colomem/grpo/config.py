"""The GRPO algorithm's options (`GRPOConfig`) and a LoRA adapter's shape (`LoraSpec`): what the loss, the
rollout sampling and both trainers read. The whole run's configuration is `colomem.runner.config.RunConfig`.
"""
from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from colomem.errors import ConfigError  # noqa: F401  (re-exported: where it was before)


ALL_LINEAR = "all-linear"          # peft's name for every linear layer except the output head


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSpec(_Strict):
    """A peft LoRA adapter on the policy; trained weights are merged into the base for the rollout sync."""
    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: Union[str, list[str]] = Field(
        "all-linear", description="the layers to adapt: all-linear (every linear layer but the output head, "
                                  "peft's choice for any architecture) or a comma list of module names")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, v: Any) -> Any:
        if isinstance(v, str) and v != ALL_LINEAR:       # "q_proj,v_proj" from a flag
            return [m.strip() for m in v.split(",") if m.strip()]
        return v


class GRPOConfig(_Strict):
    """The GRPO algorithm (what the loss and the rollout sampling need); shared by every Trainer."""
    group_size: int = Field(8, ge=2, description="completions sampled per prompt (n)")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="ratio clip: [1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: Optional[float] = Field(None, gt=0, description="upper clip; None = clip_eps")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference; 0 = no reference")
    loss_norm: Literal["sequence", "token"] = Field(
        "sequence", description="sequence: mean over each completion's tokens, then over completions (GRPO); "
                                "token: sum over all completion tokens / their count, over every rank (DAPO)")
    scale_rewards: bool = Field(True, description="divide advantages by the group's std (False, with "
                                                  "loss_norm token: Dr. GRPO)")
    std: Literal["population", "sample"] = Field(
        "population", description="the group std of the advantages: population (divide by n) or sample (by n - 1, "
                                  "as TRL and verl)")
    adv_eps: float = Field(1e-4, gt=0)
    temperature: float = Field(1.0, gt=0, description="sampling temperature; logprobs use logits/temperature")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1, description="sample among the k most likely tokens only; unset = all")
    min_p: float = Field(0.0, ge=0, lt=1, description="drop tokens less likely than min_p x the most likely one's "
                                                     "probability; 0 = off")
    repetition_penalty: float = Field(
        1.0, gt=0, description="divides a positive logit (multiplies a negative one) of every token already in the "
                               "prompt or the completion; 1 = off (vLLM's and TRL's repetition_penalty)")
    max_new_tokens: Optional[int] = Field(None, gt=0, description="unset = the task's (longest answer + EOS)")
    old_logprobs: Literal["policy", "rollout"] = Field(
        "policy", description="ratio denominator: policy = the trainer's own logprobs before the batch's first update "
                              "(robust to rollout/trainer numerics); rollout = the rollout engine's logprobs")
    mask_truncated: bool = Field(False, description="completions cut at max_new_tokens get no loss")
    log_entropy: bool = Field(True, description="mean token entropy in the metrics (from the logprobs' pass over the "
                                                "logits; with entropy_coef > 0 from the bonus' own)")
    # reusing a batch
    num_iterations: int = Field(1, ge=1, description="passes over each batch (TRL num_iterations, verl ppo_epochs); "
                                                     "above 1 the ratio's old policy is the batch's first pass")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass: each rank's rows split into this many "
                                                   "mini-batches (verl ppo_mini_batch_size, as a count)")
    # loss variants (docs/grpo.md: what TRL and verl call them)
    importance_level: Literal["token", "sequence"] = Field(
        "token", description="policy ratio per token, or one per completion: the geometric mean of its tokens' "
                             "ratios (sequence: GSPO)")
    dual_clip: Optional[float] = Field(
        None, gt=1, description="dual-clip PPO (verl clip_ratio_c): where the advantage is negative, the loss stops "
                                "growing once the ratio passes this; unset = off")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: loss - entropy_coef * mean token entropy")
    log_ratio_clamp: Optional[float] = Field(
        20.0, gt=0, description="log-ratios (policy/old, reference/policy, trainer/rollout) clamped to +-this "
                                "before exp, as verl does; unset = off")
    kl_clamp: Optional[float] = Field(None, gt=0, description="cap on the per-token k3 KL (verl: 10); unset = off")
    kl_ratio_correction: bool = Field(
        False, description="weight the KL term by the policy ratio (TRL use_bias_correction_kl)")
    # rollout engine / trainer mismatch
    is_correction: Literal["none", "token", "sequence"] = Field(
        "none", description="importance weights trainer / rollout engine on the policy term, per token or per "
                            "completion (TRL vllm_importance_sampling_correction, verl rollout_is)")
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="weights above is_cap: truncate (set to is_cap) or mask (set to 0)")
    is_cap: float = Field(3.0, ge=1, description="upper bound of the importance weights")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @model_validator(mode="after")
    def _combinations(self):
        if self.is_correction != "none" and self.old_logprobs == "rollout":
            raise ValueError("is_correction weights the ratio to the trainer's own logprobs by trainer / rollout; "
                             "with old_logprobs rollout the ratio already divides by the rollout's: use "
                             "old_logprobs policy with is_correction, or is_correction none")
        return self


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
