"""VLLMConfig: every option of VLLMRollout, validated before vLLM starts.

Starting vLLM takes long, so a bad option should fail at once: the runner's config validates these fields
when it reads its own (this module imports neither torch nor vLLM). Errors are InvalidArgumentError naming
the field and what it allows.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from colomem.errors import InvalidArgumentError
from colomem.units import parse_bytes

from .lora_adapter import LORA_RANKS, lora_attr, vllm_lora_rank
from .tail_scheduler import QUALNAME as TAIL_SCHEDULER

WORKER_EXTENSION = "colomem.engines.vllm.worker.ColomemWorkerExtension"

SYNC_TRANSPORTS = {
    "listener": "a thread in vLLM's worker serves the bridge socket: no RPC per sync (the default)",
    "direct": "engine_in_process=True: the trainer's tensors straight into the model",
}
VERIFY_MODES = ("none", "sampled", "full")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


# field -> (allowed values, how an error message says them)
CHOICES: dict[str, tuple[tuple, str]] = {
    "sleep_level": ((1, 2), "1 or 2"),
    "weights_backup": (("vllm", "pool"), "'vllm' or 'pool'"),
    "verify": (VERIFY_MODES, "'none', 'sampled' or 'full'"),
    "logprobs_mode": (LOGPROBS_MODES, "'processed_logprobs' (log-softmax of logits / temperature, as the GRPO "
                                      "loss computes them) or 'raw_logprobs'"),
    "lora_mode": (("merged", "adapter"), "'merged' or 'adapter'"),
    "seeded_noise": (("vllm", "batched"), "'vllm' (vLLM's sampler draws each seeded request's noise itself) or "
                                          "'batched' (colomem's draw of every seeded request in one launch)"),
}


def check_choice(field: str, value: Any) -> Any:
    """`value` when it is one of the values `field` allows (CHOICES), else InvalidArgumentError."""
    allowed, words = CHOICES[field]
    if value not in allowed:
        raise InvalidArgumentError(f"{field} must be {words}, got {value!r}")
    return value


def check_sync_transport(transport: Any, engine_in_process: bool) -> str:
    if transport not in SYNC_TRANSPORTS:
        allowed = ", ".join(f"'{k}' ({v})" for k, v in SYNC_TRANSPORTS.items())
        raise InvalidArgumentError(f"sync_transport must be one of {allowed}; got {transport!r}")
    if transport == "direct" and not engine_in_process:
        raise InvalidArgumentError("sync_transport='direct' hands the trainer's tensors to vLLM's worker as "
                                   "Python objects, which needs the worker in this process: pass "
                                   "engine_in_process=True (or use 'listener')")
    return str(transport)


def check_adapter_mode(lora_mode: str, sleep_level: int, weights_backup: str) -> None:
    if lora_mode == "adapter" and sleep_level == 2 and weights_backup == "vllm":
        raise InvalidArgumentError(
            "lora_mode='adapter' keeps the base weights in vLLM across sleep, but sleep_level=2 without a "
            "backup discards them: use sleep_level=1, weights_backup='pool', or lora_mode='merged'")


class VLLMConfig(BaseModel):
    """The options of VLLMRollout(model_path, ...). See colomem.engines.vllm for what each mode does."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    gpu_memory_utilization: float = 0.5
    kv_cache_bytes: Optional[int] = None  # the KV cache on each GPU, instead of the utilization's share
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    seed: int = 0
    enforce_eager: bool = True
    lora: Any = None                     # LoraSpec (or a dict with r, alpha, target_modules)
    lora_mode: str = "merged"
    sleep_level: int = 1
    weights_backup: str = "vllm"
    trust_remote_code: bool = False
    bucket_bytes: Union[int, str] = 512 << 20
    bucket_buffers: int = 2
    dtype: str = "bfloat16"
    device: int = 0
    max_num_seqs: Optional[int] = None
    logprobs_mode: str = "processed_logprobs"
    seeded_noise: str = "batched"        # worker/seeded_noise.py: one launch per decode step, not one per request
    verify: str = "sampled"
    check_sample: int = 8
    sync_transport: str = "listener"
    engine_in_process: bool = False
    external_launcher: bool = False      # in-process engine of a torchrun rank (launcher.py): TP over the ranks
    fast_load: bool = True
    rpc_timeout_s: float = 120.0
    generate_timeout_s: float = 1800.0
    wake_timeout_s: float = 300.0
    shutdown_timeout_s: float = 30.0
    llm_kwargs: Optional[dict] = None
    worker_extension: str = WORKER_EXTENSION   # dotted path of vLLM's worker_extension_cls
    # a partial KV release lends each layer's tail by chunks, mapped back as the rollout needs them
    # (kv_tail.py); vLLM's scheduler is then built with the tail's hooks (tail_scheduler.py). Off by default
    # until the lent tail's GPU tests pass on vLLM (tests/gpu/test_vllm_kv_sleep_gpu.py)
    kv_tail: bool = False

    def __init__(self, **options: Any):
        try:
            super().__init__(**options)
        except ValidationError as e:
            raise InvalidArgumentError(_describe(e)) from None

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _utilization(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {v}")
        return v

    @field_validator("kv_cache_bytes")
    @classmethod
    def _kv_cache_bytes(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {v}")
        return v

    @field_validator("max_model_len")
    @classmethod
    def _max_model_len(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"max_model_len must be positive, got {v}")
        return v

    @field_validator("tensor_parallel_size", "bucket_buffers")
    @classmethod
    def _at_least_one(cls, v: int, info) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("rpc_timeout_s", "generate_timeout_s", "wake_timeout_s", "shutdown_timeout_s")
    @classmethod
    def _positive(cls, v: float, info) -> float:
        if not v > 0:
            raise ValueError(f"{info.field_name} must be positive, got {v}")
        return v

    @field_validator(*CHOICES, mode="before")
    @classmethod
    def _one_of(cls, v: Any, info) -> Any:
        return check_choice(info.field_name, v)

    @field_validator("bucket_bytes")
    @classmethod
    def _bucket_bytes(cls, v: Union[int, str]) -> int:
        return parse_bytes(v)

    @model_validator(mode="after")
    def _together(self) -> "VLLMConfig":
        check_sync_transport(self.sync_transport, self.engine_in_process)
        if self.external_launcher and not self.engine_in_process:
            raise ValueError("external_launcher=True builds vLLM's worker inside this torchrun rank: it needs "
                             "engine_in_process=True (and sync_transport='direct')")
        if self.lora_mode == "adapter":
            if self.lora is None:
                raise ValueError("lora_mode='adapter' needs lora=LoraSpec(r, alpha, target_modules)")
            if int(lora_attr(self.lora, "r", default=0)) not in range(1, LORA_RANKS[-1] + 1):
                raise ValueError(f"LoRA rank must be in 1..{LORA_RANKS[-1]} for vLLM 0.24")
        check_adapter_mode(self.effective_lora_mode, self.sleep_level, self.weights_backup)
        return self

    @property
    def effective_lora_mode(self) -> str:
        """"merged" without a LoRA spec, whatever lora_mode says."""
        return self.lora_mode if self.lora is not None else "merged"


    def llm_arguments(self, model_path: str) -> dict:
        """vllm.LLM's arguments for these options (llm_kwargs last: they override)."""
        kw: dict = dict(
            model=model_path, enable_sleep_mode=True, worker_extension_cls=self.worker_extension,
            trust_remote_code=self.trust_remote_code, seed=self.seed,
            gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager, tensor_parallel_size=self.tensor_parallel_size, dtype=self.dtype,
            logprobs_mode=self.logprobs_mode,
        )
        if self.external_launcher:
            kw["distributed_executor_backend"] = "external_launcher"
        if self.max_num_seqs is not None:
            kw["max_num_seqs"] = self.max_num_seqs
        if self.kv_cache_bytes is not None:      # vLLM then sizes its cache so, not by the utilization
            kw["kv_cache_memory_bytes"] = int(self.kv_cache_bytes)
        if self.effective_lora_mode == "adapter":
            kw.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(self.lora))
        if self.kv_tail:
            kw["scheduler_cls"] = TAIL_SCHEDULER   # another scheduler_cls in llm_kwargs wins: no tail then
        kw.update(self.llm_kwargs or {})
        return kw


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        name = ".".join(str(x) for x in e["loc"]) or "VLLMConfig"
        if e["type"] == "extra_forbidden":
            lines.append(f"{name}: not a VLLMRollout option (allowed: {', '.join(VLLMConfig.model_fields)})")
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(msg if msg.startswith(name) or name == "VLLMConfig" else f"{name}: {msg}")
    return "invalid VLLMRollout options: " + "; ".join(lines)


__all__ = ["CHOICES", "SYNC_TRANSPORTS", "VLLMConfig", "WORKER_EXTENSION", "check_adapter_mode", "check_choice",
           "check_sync_transport"]
