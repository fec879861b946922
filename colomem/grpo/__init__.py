"""GRPO for the colocated runner: batches, advantages, the clipped loss, rewards, tasks, the tiny model.

Importing this package needs torch; `tasks` and `tiny_model` (tokenizers, transformers) load on use.
"""
from .advantages import group_advantages, group_stats
from .batch import Completion, GRPOBatch, build_batch
from .config import ConfigError, GRPOConfig, LoraSpec
from .loss import grpo_loss, kl_k3, token_entropy, token_logprobs, token_logprobs_and_entropy
from .micro_batches import micro_batch_rows
from .step import (MetricAccumulator, accumulate_gradients, compute_loss, frozen_reference_fn,
                   peft_reference_fn, policy_logprobs, split_micro_batches)

__all__ = [
    "Completion", "ConfigError", "GRPOBatch", "GRPOConfig", "LoraSpec", "MetricAccumulator",
    "accumulate_gradients", "build_batch", "compute_loss", "frozen_reference_fn", "grpo_loss",
    "group_advantages", "group_stats", "kl_k3", "micro_batch_rows", "peft_reference_fn", "policy_logprobs",
    "split_micro_batches", "token_entropy", "token_logprobs", "token_logprobs_and_entropy",
]
