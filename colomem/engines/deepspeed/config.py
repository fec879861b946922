"""DeepSpeedTrainer's options (`DeepSpeedConfig`), the DeepSpeed version check, the DeepSpeed config it builds
and the distributed environment it starts in.

Nothing here imports torch or deepspeed at module level: the run config validates a DeepSpeedConfig before
vLLM or DeepSpeed start, and these checks are tested on machines without either.
"""
from __future__ import annotations

import os
import re
import socket
import warnings
from typing import Any, Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from colomem.engines.lora import build_lora_config
from colomem.engines.lr_schedule import LrSchedule
from colomem.errors import InvalidArgumentError, NotAvailableError

SUPPORTED_DEEPSPEED = ((0, 19),)          # major.minor series whose ZeRO internals this adapter knows
TESTED_DEEPSPEED = "0.19.8"
ALLOW_UNTESTED_ENV = "COLOMEM_ALLOW_UNTESTED_DEEPSPEED"
OFFLOAD_METHODS = ("colomem", "deepspeed", "to")
ZERO_STAGES = (2, 3)
DIST_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


# ------------------------------------------------------------------------------------------------ version
def check_deepspeed_version(version: str, *, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuses DeepSpeed versions whose ZeRO internals the offload was not written against."""
    environ = os.environ if environ is None else environ
    m = re.match(r"^\s*(\d+)\.(\d+)", str(version))
    series = (int(m.group(1)), int(m.group(2))) if m else None
    if series in SUPPORTED_DEEPSPEED:
        return
    supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_DEEPSPEED)
    msg = (f"DeepSpeed {version} is not supported by colomem's DeepSpeed adapter: it supports {supported} "
           f"(tested with {TESTED_DEEPSPEED}), because its offload walks the ZeRO-2/3 optimizer's flat bf16 "
           f"buffers, fp32 partitions and gradient buffers, which change between DeepSpeed releases. Install "
           f"deepspeed=={TESTED_DEEPSPEED}, or set {ALLOW_UNTESTED_ENV}=1 to try this version anyway (the "
           f"adapter then still reports what it could not move in its offload report).")
    if environ.get(ALLOW_UNTESTED_ENV, "") in ("1", "true", "yes"):
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return
    raise NotAvailableError(msg)


def import_deepspeed() -> Any:
    """`import deepspeed` with the version check and an error that says how to get DeepSpeed."""
    try:
        import deepspeed
    except ImportError as e:
        raise NotAvailableError(
            f"DeepSpeed is not installed ({e}); pip install deepspeed=={TESTED_DEEPSPEED} (or colomem[gpu], which "
            "pins it), or run without it: `--backend cpu` trains with the CPU stand-in "
            "(colomem.engines.stand_ins.TorchTrainer)") from None
    check_deepspeed_version(deepspeed.__version__)
    return deepspeed


def check_offload_args(method: str, keep: tuple, defer: bool, categories: Sequence[str]) -> tuple:
    """An offload's method, kept categories and deferral, checked (InvalidArgumentError); returns keep."""
    if method not in OFFLOAD_METHODS:
        raise InvalidArgumentError(f"method={method!r}: choose one of {', '.join(OFFLOAD_METHODS)}")
    unknown = [c for c in keep if c not in categories]
    if unknown:
        raise InvalidArgumentError(f"keep={list(keep)}: unknown categories {unknown}; they are "
                                   f"{', '.join(categories)}")
    if (keep or defer) and method != "colomem":
        raise InvalidArgumentError(f"keep={list(keep)} / defer={defer} need the colomem offload method (not "
                                   f"{method!r})")
    return keep


def check_keep_part(part: tuple, keep: tuple, method: str, categories: Sequence[str]) -> tuple[str, int]:
    """An offload's keep_part (category, bytes) checked (InvalidArgumentError): the colomem method, a known
    category not kept whole and a byte count >= 0; ("", 0) for none."""
    if not part or not part[1]:
        return ("", 0)
    cat, nbytes = part
    if method != "colomem":
        raise InvalidArgumentError(f"keep_part={tuple(part)} needs the colomem offload method (not {method!r})")
    if cat not in categories or cat in keep:
        raise InvalidArgumentError(f"keep_part={tuple(part)}: name a category that is not kept whole: "
                                   f"{', '.join(c for c in categories if c not in keep)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"keep_part={tuple(part)}: the bytes must be a whole number >= 0")
    return (str(cat), int(nbytes))


# ------------------------------------------------------------------------------------- distributed setup
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables to add before torch.distributed starts: none under torchrun (it sets all of them),
    single-process defaults (rank 0 of 1, a free local port) when none is set. A partial launcher env is
    refused, because guessing the rest would hang the other ranks."""
    environ = os.environ if environ is None else environ
    present = [k for k in DIST_KEYS if k in environ]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if k in environ and not str(environ[k]).strip().isdigit():
            raise InvalidArgumentError(f"{k}={environ[k]!r} is not a non-negative integer")
    if len(present) == len(DIST_KEYS):
        if int(environ["RANK"]) >= int(environ["WORLD_SIZE"]):
            raise InvalidArgumentError(f"RANK={environ['RANK']} but WORLD_SIZE={environ['WORLD_SIZE']}")
        return {}
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        missing = [k for k in DIST_KEYS if k not in environ]
        raise InvalidArgumentError(
            f"WORLD_SIZE={environ['WORLD_SIZE']} but {', '.join(missing)} not set; start the job with torchrun "
            "(it sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) or set all five")
    defaults = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1"}
    out = {k: v for k, v in defaults.items() if k not in environ}
    if "MASTER_PORT" not in environ:
        out["MASTER_PORT"] = str(_free_port())
    return out


_ADDED_ENV: set[str] = set()      # the variables init_distributed put in os.environ


def init_distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank); reuses a process group someone else started (e.g. vLLM)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    added = distributed_env()
    os.environ.update(added)
    _ADDED_ENV.update(added)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def forget_distributed_env() -> None:
    """Takes back what init_distributed put in the environment, once the group it served is destroyed: the
    next group then starts on a fresh free port, where the old one's store may still hold its port for as
    long as anything references that group."""
    for k in _ADDED_ENV:
        os.environ.pop(k, None)
    _ADDED_ENV.clear()


# -------------------------------------------------------------------------------------- config building
def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_ds_config(*, zero_stage: int, micro_batch: int, grad_accum: int = 1, world_size: int = 1,
                    lr: float = 1e-5, weight_decay: float = 0.0, betas: Sequence[float] = (0.9, 0.999),
                    eps: float = 1e-8, torch_adam: bool = False, max_grad_norm: Optional[float] = 1.0,
                    grad_accum_dtype: Optional[str] = None, reduce_bucket_size: Optional[float] = None,
                    overrides: Optional[dict] = None) -> dict:
    """The DeepSpeed config of a bf16 ZeRO-2/3 engine with AdamW (FusedAdam, or torch's with torch_adam)."""
    zero: dict[str, Any] = {"stage": int(zero_stage), "contiguous_gradients": True}
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = int(reduce_bucket_size)
    if zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(micro_batch),
        "gradient_accumulation_steps": int(grad_accum),
        "train_batch_size": int(micro_batch) * int(grad_accum) * int(world_size),
        "steps_per_print": 1 << 30,          # the trainer reports its own metrics
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "optimizer": {"type": "AdamW", "params": {"lr": float(lr), "betas": [float(b) for b in betas],
                                                  "eps": float(eps), "weight_decay": float(weight_decay),
                                                  "torch_adam": bool(torch_adam)}},
    }
    if grad_accum_dtype is not None:
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return _merge(cfg, overrides) if overrides else cfg


# ------------------------------------------------------------------------------------------- the options
class DeepSpeedConfig(BaseModel):
    """Every option of DeepSpeedTrainer (the model, pool, LoRA spec and GRPO config are its own arguments).

    DeepSpeedConfig(...) raises colomem's InvalidArgumentError naming the option (not pydantic's
    ValidationError), so a bad value is reported before vLLM or DeepSpeed start.

    zero_stage: 2 or 3. micro_batch: rows per forward/backward; grad_accum: the nominal micro-batches per step
        (train_step takes any batch size: the accumulation boundary is set by hand at its last micro-batch;
        None = 1). micro_batch_tokens: micro-batches by a token budget instead (rows, longest first, while rows
        x the longest stays within it; colomem.grpo.micro_batches). offload: "colomem" (pool swaps) | "deepspeed" (engine.offload_states) | "to" (.to loop).
    gradient_checkpointing / checkpoint_every: recompute in the backward every checkpoint_every-th decoder
        layer's forward (1: all of them; colomem.engines.recompute).
    torch_adam: torch's AdamW instead of DeepSpeed's FusedAdam (no JIT build of the fused kernel).
    overlap_reload: with offload="colomem", reload() brings back what forward and backward read and starts
        the fp32 masters and Adam moments behind them; train_step waits for those just before the optimizer
        step. optimizer_reload: "overlap" (that) or "step": the masters and moments stay in the pool until
        the optimizer step has cast the gradients to fp32 and freed them, and come back from inside it (not
        hidden; for a step whose peak does not fit with them resident: step_reload.py).
    optimizer_state_memory: "torch" (Adam's moments in torch's allocator, moved whole) or "mapped" (with
        offload="colomem": from their first offload on, in memory colomem maps chunk by chunk, so with
        optimizer_reload "step" the part that fits beside the step's peak comes back behind the forward and
        backward and only the rest inside the step: mapped_moments.py).
        grad_accum_dtype: None (DeepSpeed's default: the model dtype), "fp32" or "bf16".
    grad_reduction: when ZeRO-2 reduces the gradients of a step's micro-batches. "per_micro_batch" (DeepSpeed's
        default): its per-parameter hooks copy every gradient into a bucket, reduce it and copy it into the
        rank's partition after each micro-batch's backward, host work that on one rank makes the training phase
        wait for the host. "per_step": the micro-batches' gradients add up on the parameters (in the model
        dtype, as DeepSpeed's own accumulation does) and are reduced once, before the optimizer step
        (DeepSpeed's coalesce_grad_reduction); between micro-batches a rank then holds its full gradients, and
        for a moment at the reduction the partition beside them. "auto": per_step on one rank (the same
        additions in the same order: the step is the same bit for bit), per_micro_batch on several ranks
        (where per_step changes the order of the reductions and keeps the full gradients on every rank).
        per_step needs ZeRO-2 and gradients accumulated in the model dtype (grad_accum_dtype None or "bf16").
    torch_compile: torch.compile each decoder layer's parts (colomem.engines.compile): fused kernels and far
        less host work per micro-batch; the first steps pay the compile. ZeRO-2 only (ZeRO-3 gathers each
        module's parameters in hooks a compiled module would trace).
    ds_config: extra DeepSpeed config merged over the built one. timeout_s: bound on each swap and on close().
    seed: torch seed before the model and the LoRA adapter are built.
    lr_schedule: the learning rate over the run (colomem.engines.lr_schedule; None: constant at lr), stepped by
        the engine at each optimizer step; on resume it stands where the checkpoint's optimizer steps leave it.
    """
    model_config = ConfigDict(extra="forbid", frozen=True)

    zero_stage: Literal[2, 3] = 2
    lr: float = 1e-5
    micro_batch: int = 1
    micro_batch_tokens: Optional[int] = None
    grad_accum: Optional[int] = 1
    gradient_checkpointing: bool = True
    checkpoint_every: int = Field(1, ge=1)
    trust_remote_code: bool = False
    offload: Literal["colomem", "deepspeed", "to"] = "colomem"
    torch_adam: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: Optional[float] = 1.0
    grad_accum_dtype: Optional[Literal["fp32", "bf16"]] = None
    grad_reduction: Literal["auto", "per_step", "per_micro_batch"] = "auto"
    reduce_bucket_size: Optional[int] = None
    seed: int = 0
    attn_implementation: Optional[str] = None
    ds_config: Optional[dict[str, Any]] = None
    timeout_s: float = 300.0
    overlap_reload: bool = True
    optimizer_reload: Literal["overlap", "step"] = "overlap"
    optimizer_state_memory: Literal["torch", "mapped"] = "torch"
    torch_compile: bool = False
    lr_schedule: Optional[LrSchedule] = None

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ValidationError as e:
            raise InvalidArgumentError(_describe(e)) from None

    # "before" checks see the value as given (pydantic would turn True into 1 or "2" into 2)
    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage(cls, v: Any) -> Any:
        if v not in ZERO_STAGES:
            raise ValueError(f"zero_stage={v!r}: the DeepSpeed trainer supports ZeRO stage 2 or 3 (bf16); stage "
                             "0/1 use DeepSpeed's BF16_Optimizer, whose buffers this adapter does not move")
        return v

    @field_validator("micro_batch", "grad_accum", "micro_batch_tokens", mode="before")
    @classmethod
    def _count(cls, v: Any, info) -> Any:
        if v is None and info.field_name in ("grad_accum", "micro_batch_tokens"):
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{info.field_name}={v!r}: must be an integer >= 1")
        return v

    @field_validator("lr", mode="before")
    @classmethod
    def _lr(cls, v: Any) -> Any:
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"lr={v!r}: must be > 0")
        return v

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, v: Any) -> Any:
        if v not in OFFLOAD_METHODS:
            raise ValueError(f"offload={v!r}: choose one of {', '.join(OFFLOAD_METHODS)}")
        return v

    @field_validator("grad_accum_dtype", mode="before")
    @classmethod
    def _accum_dtype(cls, v: Any) -> Any:
        if v not in (None, "fp32", "bf16"):
            raise ValueError(f"grad_accum_dtype={v!r}: None (DeepSpeed's default, the model dtype), 'fp32' or "
                             "'bf16'")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas={v!r}: two numbers in [0, 1)")
        return v

    @field_validator("eps", "timeout_s")
    @classmethod
    def _positive(cls, v: float, info) -> float:
        if not v > 0:
            raise ValueError(f"{info.field_name}={v!r}: must be > 0")
        return v

    @field_validator("weight_decay")
    @classmethod
    def _decay(cls, v: float) -> float:
        if v < 0:
            raise ValueError(f"weight_decay={v!r}: must be >= 0")
        return v

    @field_validator("max_grad_norm")
    @classmethod
    def _clip(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not v > 0:
            raise ValueError(f"max_grad_norm={v!r}: must be > 0 or None (no clipping)")
        return v

    @model_validator(mode="after")
    def _fused_adam_for_ds_offload(self) -> "DeepSpeedConfig":
        if self.offload == "deepspeed" and self.zero_stage == 3 and self.torch_adam:
            raise ValueError("offload='deepspeed' with ZeRO-3 needs DeepSpeed's FusedAdam (its offload_states() "
                             "asserts it); set torch_adam=False or use offload='colomem'")
        if self.grad_reduction == "per_step" and (self.zero_stage != 2 or self.grad_accum_dtype == "fp32"):
            why = (f"ZeRO-2, not ZeRO-{self.zero_stage}" if self.zero_stage != 2 else
                   "gradients accumulated in the model dtype (grad_accum_dtype None or 'bf16', not 'fp32')")
            raise ValueError(f"grad_reduction='per_step' adds the micro-batches' gradients up on the parameters "
                             f"and reduces them once: it needs {why}; use grad_reduction='per_micro_batch'")
        if self.torch_compile and self.zero_stage != 2:
            raise ValueError(f"torch_compile compiles the decoder layers' parts, which ZeRO-{self.zero_stage}'s "
                             "parameter-gathering hooks run inside; use ZeRO-2 or turn torch_compile off")
        if self.optimizer_state_memory == "mapped" and self.offload != "colomem":
            raise ValueError(f"optimizer_state_memory='mapped' needs offload='colomem' (not {self.offload!r}): "
                             "only colomem's offload moves the moments chunk by chunk")
        return self

    def reduces_per_step(self, world_size: int) -> bool:
        """Whether the trainer reduces a step's gradients once (grad_reduction resolved for world_size ranks)."""
        if self.grad_reduction != "auto":
            return self.grad_reduction == "per_step"
        return world_size == 1 and self.zero_stage == 2 and self.grad_accum_dtype != "fp32"

    @property
    def accum_steps(self) -> int:
        """grad_accum with None read as 1."""
        return 1 if self.grad_accum is None else self.grad_accum

    def build_ds_config(self, world_size: int = 1) -> dict:
        """The DeepSpeed config of these options on `world_size` ranks (ds_config merged over it)."""
        return build_ds_config(zero_stage=self.zero_stage, micro_batch=self.micro_batch, grad_accum=self.accum_steps,
                               world_size=world_size, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas,
                               eps=self.eps, torch_adam=self.torch_adam, max_grad_norm=self.max_grad_norm,
                               grad_accum_dtype=self.grad_accum_dtype, reduce_bucket_size=self.reduce_bucket_size,
                               overrides=self.ds_config)


def _describe(err: ValidationError) -> str:
    """One line per problem, each naming the option: `micro_batch=0: must be an integer >= 1`."""
    lines = []
    for e in err.errors():
        name = ".".join(str(x) for x in e["loc"]) or "DeepSpeedConfig"
        if e["type"] == "value_error":
            lines.append(str(e["ctx"]["error"]) if "ctx" in e else e["msg"].removeprefix("Value error, "))
        elif e["type"] == "extra_forbidden":
            lines.append(f"{name}: not an option of DeepSpeedTrainer (options: "
                         f"{', '.join(DeepSpeedConfig.model_fields)})")
        else:
            lines.append(f"{name}={e.get('input')!r}: {e['msg']}")
    return "; ".join(lines)


def check_lora_spec(lora: Any) -> None:
    """InvalidArgumentError unless lora is None or LoraSpec-shaped with at least one target module."""
    if lora is None:
        return
    for attr in ("r", "alpha", "dropout", "target_modules"):
        if not hasattr(lora, attr):
            raise InvalidArgumentError(f"lora must be a colomem.grpo.config.LoraSpec (r, alpha, dropout, "
                                       f"target_modules); {type(lora).__name__} has no {attr!r}")
    if not lora.target_modules:
        raise InvalidArgumentError("lora.target_modules is empty; name the linear layers to adapt, e.g. "
                                   "['q_proj', 'v_proj']")


def validate_trainer_args(*, lora: Any = None, **options: Any) -> DeepSpeedConfig:
    """DeepSpeedTrainer's keywords checked before anything heavy is built: the options as a DeepSpeedConfig,
    or InvalidArgumentError naming the argument."""
    config = DeepSpeedConfig(**options)
    check_lora_spec(lora)
    return config


__all__ = ["ALLOW_UNTESTED_ENV", "DeepSpeedConfig", "OFFLOAD_METHODS", "SUPPORTED_DEEPSPEED", "TESTED_DEEPSPEED",
           "ZERO_STAGES", "build_ds_config", "build_lora_config", "check_deepspeed_version", "check_lora_spec", "check_offload_args",
           "distributed_env", "forget_distributed_env", "import_deepspeed", "init_distributed",
           "validate_trainer_args"]
