"""DeepSpeedTrainer: a DeepSpeed ZeRO-2/3 (bf16) engine from a transformers causal LM, optionally with a peft
LoRA adapter, whose whole GPU state moves to the pinned pool and back between training phases.

What a ZeRO engine keeps on the GPU between two optimizer steps (DeepSpeed 0.19.x, bf16, no ZeRO-Offload):

    ZeRO-2  bit16_groups_flat (the bf16 params; every model param is a view into it), frozen params outside
            the optimizer (the LoRA base), single_partition_of_fp32_groups (fp32 masters), the inner
            optimizer's state (exp_avg, exp_avg_sq), module buffers; gradients only inside a step
            (averaged_gradients / grads_in_partition are dropped by step()), ipg buckets only in backward.
    ZeRO-3  lp_param_buffer (the bf16 partitions; each param's ds_tensor is a view into it), ds_tensor of
            frozen params, gathered copies of persistent (small) params, fp32_partitioned_groups_flat,
            grad_partitions_flat_buffer (kept between steps), the ipg bucket buffer (reduce_bucket_size
            elements, scratch), the optimizer state, module buffers.

`offload="colomem"` moves every one of those storages into the pool with a SwapSet (the tensor objects,
views and DeepSpeed's references stay the same, so nothing is re-linked), drops the scratch buckets
without copying them, and returns the memory to the driver. The two baselines: `offload="deepspeed"`
(engine.offload_states() / reload_states()) and `offload="to"` (the same storages copied with .to("cpu")
into fresh pageable memory, synchronously, one at a time).

Nothing here imports deepspeed, transformers or peft at module level: the config builders, the version check
and the state collection work (and are tested) without them.
"""
from __future__ import annotations

import contextlib
import gc
import os
import re
import socket
import threading
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from colomem._bucket import dtype_name
from colomem._checkpoint import checkpoint_problem
from colomem.errors import (ColomemError, CudaOutOfMemoryError, InvalidArgumentError, NotAvailableError,
                            PhaseOrderError)
from colomem.swap import PendingReloads

SUPPORTED_DEEPSPEED = ((0, 19),)          # major.minor series whose ZeRO internals this adapter knows
TESTED_DEEPSPEED = "0.19.8"
ALLOW_UNTESTED_ENV = "COLOMEM_ALLOW_UNTESTED_DEEPSPEED"
OFFLOAD_METHODS = ("colomem", "deepspeed", "to")
ZERO_STAGES = (2, 3)
CATEGORIES = ("params", "master", "optim", "grads", "other")
LATE_CATEGORIES = ("master", "optim")   # read by the optimizer step only, not by forward or backward
DIST_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


# ------------------------------------------------------------------------------------------------ version
def check_deepspeed_version(version: str, *, environ=None) -> None:
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


def import_deepspeed():
    """`import deepspeed` with the version check and an error that says where DeepSpeed comes from."""
    try:
        import deepspeed
    except ImportError as e:
        raise NotAvailableError(
            f"DeepSpeed is not installed ({e}); install deepspeed=={TESTED_DEEPSPEED} (on the GPU host it comes "
            "from ../shared/gpu-kit) or use the CPU trainer (colomem.engines.torch_cpu.TorchTrainer)") from None
    check_deepspeed_version(deepspeed.__version__)
    return deepspeed


# ------------------------------------------------------------------------------------- distributed setup
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env(environ=None) -> dict[str, str]:
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
    defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": None, "RANK": "0", "WORLD_SIZE": "1",
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    out = {k: v for k, v in defaults.items() if k not in environ}
    if "MASTER_PORT" in out:
        out["MASTER_PORT"] = str(_free_port())
    return out


def _init_distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank); reuses a process group someone else started (e.g. vLLM)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.update(distributed_env())
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


# -------------------------------------------------------------------------------------- config building
def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_ds_config(*, zero_stage: int, micro_batch: int, grad_accum: int = 1, world_size: int = 1,
                    lr: float = 1e-5, weight_decay: float = 0.0, betas: Sequence[float] = (0.9, 0.999),
                    eps: float = 1e-8, torch_adam: bool = False, max_grad_norm: Optional[float] = 1.0,
                    grad_accum_dtype: Optional[str] = None, reduce_bucket_size: Optional[int] = None,
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


def build_lora_config(lora):
    """peft.LoraConfig from a colomem LoraSpec (r, alpha, dropout, target_modules)."""
    from peft import LoraConfig

    return LoraConfig(r=int(lora.r), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                      target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")


def validate_trainer_args(*, zero_stage, micro_batch, grad_accum, lr, offload, torch_adam=False, lora=None,
                          betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0,
                          grad_accum_dtype=None, timeout_s=300.0) -> None:
    """InvalidArgumentError naming the argument, before anything heavy is built."""
    def bad(msg):
        raise InvalidArgumentError(msg)

    if zero_stage not in ZERO_STAGES:
        bad(f"zero_stage={zero_stage!r}: the DeepSpeed trainer supports ZeRO stage 2 or 3 (bf16); stage 0/1 use "
            "DeepSpeed's BF16_Optimizer, whose buffers this adapter does not move")
    for name, v in (("micro_batch", micro_batch), ("grad_accum", 1 if grad_accum is None else grad_accum)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            bad(f"{name}={v!r}: must be an integer >= 1")
    if not (isinstance(lr, (int, float)) and lr > 0):
        bad(f"lr={lr!r}: must be > 0")
    if offload not in OFFLOAD_METHODS:
        bad(f"offload={offload!r}: choose one of {', '.join(OFFLOAD_METHODS)}")
    if offload == "deepspeed" and zero_stage == 3 and torch_adam:
        bad("offload='deepspeed' with ZeRO-3 needs DeepSpeed's FusedAdam (its offload_states() asserts it); "
            "set torch_adam=False or use offload='colomem'")
    if len(tuple(betas)) != 2 or not all(0 <= b < 1 for b in betas):
        bad(f"betas={betas!r}: two numbers in [0, 1)")
    if not eps > 0:
        bad(f"eps={eps!r}: must be > 0")
    if weight_decay < 0:
        bad(f"weight_decay={weight_decay!r}: must be >= 0")
    if max_grad_norm is not None and not max_grad_norm > 0:
        bad(f"max_grad_norm={max_grad_norm!r}: must be > 0 or None (no clipping)")
    if grad_accum_dtype not in (None, "fp32", "bf16"):
        bad(f"grad_accum_dtype={grad_accum_dtype!r}: None (DeepSpeed's default, the model dtype), 'fp32' or 'bf16'")
    if not timeout_s > 0:
        bad(f"timeout_s={timeout_s!r}: must be > 0")
    if lora is not None:
        for attr in ("r", "alpha", "dropout", "target_modules"):
            if not hasattr(lora, attr):
                bad(f"lora must be a colomem.grpo.config.LoraSpec (r, alpha, dropout, target_modules); "
                    f"{type(lora).__name__} has no {attr!r}")
        if not lora.target_modules:
            bad("lora.target_modules is empty; name the linear layers to adapt, e.g. ['q_proj', 'v_proj']")


# ------------------------------------------------------------------------------------- state collection
def _storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata          # the StorageImpl: stable across resize_, unlike data_ptr


def _storage_nbytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def _iter_tensors(obj, path: str, depth: int, seen: set[int], deep: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Tensors reachable from obj through lists, tuples, sets, dicts (keys too) and, with deep=True,
    through the attributes of DeepSpeed's own objects (buckets, fragments, coordinators). Modules and
    torch optimizers are not entered: their tensors are collected by name."""
    if isinstance(obj, Tensor):
        yield path, obj
        if obj.is_leaf and obj.grad is not None:
            yield path + ".grad", obj.grad
        return
    if depth <= 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(list(obj.items())):
            key = k if isinstance(k, (str, int, torch.dtype)) else i
            yield from _iter_tensors(k, f"{path}.key[{key}]", depth - 1, seen, deep)
            yield from _iter_tensors(v, f"{path}[{key}]", depth - 1, seen, deep)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(obj)):
            yield from _iter_tensors(v, f"{path}[{i}]", depth - 1, seen, deep)
        # a list subclass may carry tensors as attributes (DeepSpeed's GradPartitionBufferGroup.flat_partition)
        if type(obj) not in (list, tuple, set, frozenset) and hasattr(obj, "__dict__"):
            yield from _iter_attrs(obj, path, depth, seen, deep)
        return
    if hasattr(obj, "__dict__") and (deep or type(obj).__module__.startswith("deepspeed")) \
            and not isinstance(obj, type):
        yield from _iter_attrs(obj, path, depth, seen, deep)


def _iter_attrs(obj, path: str, depth: int, seen: set[int], deep: bool) -> Iterator[tuple[str, Tensor]]:
    for k, v in list(vars(obj).items()):
        yield from _iter_tensors(v, f"{path}.{k}", depth - 1, seen, deep)


# Attributes of DeepSpeed's ZeRO optimizers that hold state between steps, by category (see module docstring).
_ZERO_ROOTS = {
    2: {"params": ("bit16_groups_flat",), "master": ("single_partition_of_fp32_groups",),
        "grads": ("averaged_gradients", "grads_in_partition", "all_grad_tensors"),
        "other": ("_global_grad_norm", "norm_for_param_grads")},
    3: {"params": ("lp_param_buffer", "fp16_partitioned_groups_flat"), "master": ("fp32_partitioned_groups_flat",),
        "grads": ("grad_partitions_flat_buffer", "averaged_gradients"),
        "other": ("_global_grad_norm", "norm_for_param_grads", "inf_or_nan_tracker")},
}
_SCRATCH_ROOTS = ("ipg_buckets",)       # overwritten before they are read: dropped, not copied


@dataclass
class EngineState:
    """The storages an engine holds on one device: one (name, tensor) per storage, by category."""
    groups: dict[str, list[tuple[str, Tensor]]]
    scratch: list[tuple[str, Tensor]]
    unlisted: list[tuple[str, int]]          # (name, bytes) found only by the walk of DeepSpeed's objects
    skipped: list[tuple[str, int]] = field(default_factory=list)   # not resizable: stays on the GPU
    sizes: dict[str, int] = field(default_factory=dict)            # bytes by category when collected
    seconds: float = 0.0                                            # time the collection took

    def swap_items(self, categories: Sequence[str] = CATEGORIES) -> list[tuple[str, Tensor]]:
        return [item for c in categories for item in self.groups.get(c, ())]

    def nbytes(self, category: Optional[str] = None) -> int:
        if category == "scratch":
            return sum(_storage_nbytes(t) for _, t in self.scratch)
        cats = CATEGORIES if category is None else (category,)
        return sum(_storage_nbytes(t) for c in cats for _, t in self.groups.get(c, ()))

    def by_category(self) -> dict[str, int]:
        """Bytes by category now (0 for storages that are offloaded); `sizes` holds them as collected."""
        out = {c: self.nbytes(c) for c in CATEGORIES}
        out["scratch"] = self.nbytes("scratch")
        return out


def collect_engine_state(engine, device: torch.device, *, walk_depth: int = 6) -> EngineState:
    """Every storage on `device` that a ZeRO-2/3 engine keeps between steps (duck-typed on DeepSpeed 0.19's
    attribute names, plus a walk of the optimizer's and engine's own objects as a safety net)."""
    t0 = time.perf_counter()
    device = torch.device(device)
    stage = int(engine.zero_optimization_stage())
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    module = engine.module
    groups: dict[str, list[tuple[str, Tensor]]] = {c: [] for c in CATEGORIES}
    scratch: list[tuple[str, Tensor]] = []
    unlisted: list[tuple[str, int]] = []
    skipped: list[tuple[str, int]] = []
    seen: set[int] = set()

    def add(cat: str, name: str, t) -> bool:
        if not isinstance(t, Tensor) or t.device != device or t.layout != torch.strided:
            return False
        st = t.untyped_storage()
        if st.nbytes() == 0:
            return False
        key = st._cdata
        if key in seen:
            return False
        seen.add(key)
        if not st.resizable():
            skipped.append((name, st.nbytes()))
            return False
        (scratch if cat == "scratch" else groups[cat]).append((name, t))
        return True

    roots = _ZERO_ROOTS.get(stage, _ZERO_ROOTS[2])
    for attr in roots["params"]:
        for name, t in _iter_tensors(getattr(opt, attr, None), f"optimizer.{attr}", 4, set()):
            add("params", name, t)
    for name, p in module.named_parameters():
        add("params", name, p)
        add("params", name + ".ds_tensor", getattr(p, "ds_tensor", None))
        add("params", name + ".ds_secondary_tensor", getattr(p, "ds_secondary_tensor", None))
    for name, b in module.named_buffers():
        add("params", name, b)
    for attr in roots["master"]:
        for name, t in _iter_tensors(getattr(opt, attr, None), f"optimizer.{attr}", 4, set()):
            add("grads" if name.endswith(".grad") else "master", name, t)
    if inner is not None:
        for i, (p, st) in enumerate(list(getattr(inner, "state", {}).items())):
            for k, v in st.items():
                add("optim", f"optimizer.optimizer.state[{i}].{k}", v)
    for name, p in module.named_parameters():
        if p.grad is not None:
            add("grads", name + ".grad", p.grad)
    for attr in roots["grads"]:
        for name, t in _iter_tensors(getattr(opt, attr, None), f"optimizer.{attr}", 4, set()):
            add("grads", name, t)
    for attr in roots["other"]:                  # small scalars: grad norms, overflow flags
        for name, t in _iter_tensors(getattr(opt, attr, None), f"optimizer.{attr}", 3, set()):
            add("other", name, t)
    for attr in _SCRATCH_ROOTS:
        for name, t in _iter_tensors(getattr(opt, attr, None), f"optimizer.{attr}", 5, set(), deep=True):
            add("scratch", name, t)
    # safety net: anything else DeepSpeed's objects hold on this device (what a new release might add)
    walk_seen: set[int] = {id(module)}
    for root, obj in (("optimizer", opt), ("engine", engine)):
        attrs = vars(obj) if hasattr(obj, "__dict__") else {}
        for k, v in attrs.items():
            if k in ("module", "_modules", "optimizer") or v is opt:
                continue
            for name, t in _iter_tensors(v, f"{root}.{k}", walk_depth, walk_seen):
                if add("other", name, t):
                    unlisted.append((name, _storage_nbytes(t)))
    state = EngineState(groups, scratch, unlisted, skipped)
    state.sizes = state.by_category()
    state.seconds = time.perf_counter() - t0
    return state


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    """A uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


# -------------------------------------------------------------------------- ZeRO-3 process-wide references
# DeepSpeed 0.19's ZeRO-3 keeps an engine's modules reachable from two process-wide objects, and every
# parameter points at the whole optimizer (param._z3_optimizer, set by _link_all_hp_params), so after
# engine.destroy() the fp32 masters, Adam moments, grad partitions and bf16 partitions all stay allocated:
#   parameter_offload.FWD_MODULE_STACK  the root module is pushed when the hooks are set up and never popped;
#       non-reentrant activation checkpointing stops its recompute early (inside a forward), so the post-forward
#       hook that pops does not run and each micro-batch leaves more submodules on it.
#   PartitionedParameterCoordinator.__params_to_release  a functools.lru_cache on a method: one cache shared by
#       all coordinators, keyed by (coordinator, submodule, step), never cleared.
def _zero3_global_holders() -> tuple[Optional[list], list]:
    """(FWD_MODULE_STACK, [lru caches holding submodules]) of the installed DeepSpeed; (None, []) without it."""
    try:
        from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator
    except ImportError:
        return None, []
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    cls = getattr(partitioned_param_coordinator, "PartitionedParameterCoordinator", None)
    fn = getattr(cls, "_PartitionedParameterCoordinator__params_to_release", None)
    return (stack if isinstance(stack, list) else None), _lru_caches(fn)


def _lru_caches(fn, depth: int = 3) -> list:
    """The functools.lru_cache wrappers inside fn (itself, __wrapped__, or closure cells of decorators that
    do not use functools.wraps, like DeepSpeed's instrument_w_nvtx)."""
    out: list = []
    todo, seen = [(fn, 0)], set()
    while todo:
        f, d = todo.pop()
        if f is None or id(f) in seen or d > depth:
            continue
        seen.add(id(f))
        if callable(getattr(f, "cache_clear", None)) and callable(getattr(f, "cache_info", None)):
            out.append(f)
        todo.append((getattr(f, "__wrapped__", None), d + 1))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                todo.append((cell.cell_contents, d + 1))
            except ValueError:           # an empty cell
                pass
    return out


def _trim_module_stack(stack: Optional[list], depth: int) -> int:
    """Drops what a finished step left above `depth` on FWD_MODULE_STACK (every forward has returned, so
    nothing there is live); returns how many entries went."""
    if stack is None or len(stack) <= depth:
        return 0
    n = len(stack) - depth
    del stack[depth:]
    return n


def _release_zero3_references(module, stack: Optional[list] = None, caches: Optional[list] = None) -> int:
    """After engine.destroy(): unhooks `module` (a ZeRO-3 engine's module) from DeepSpeed's process-wide objects
    so the engine can be collected; other engines' entries stay. Returns how many references went."""
    if stack is None and caches is None:
        stack, caches = _zero3_global_holders()
    n = 0
    if module is not None:
        ours = {id(m) for m in module.modules()}
        if stack is not None:
            keep = [m for m in stack if id(m) not in ours]
            n += len(stack) - len(keep)
            stack[:] = keep              # in place: DeepSpeed reads the list object it imported
        for p in module.parameters():
            if "_z3_optimizer" in getattr(p, "__dict__", {}):
                del p._z3_optimizer      # a module the caller still holds must not keep the optimizer alive
                n += 1
    for cache in caches or ():
        n += cache.cache_info().currsize
        cache.cache_clear()              # only a cache: live engines recompute their entries
    return n


# ------------------------------------------------------------------------------------ offload strategies
@dataclass
class _Move:
    nbytes: int                  # bytes copied by the strategy
    seconds: float               # the move alone (collection included for colomem and to, not for deepspeed)
    state: Optional[EngineState] = None


class _ScratchBuffers:
    """Storages whose contents do not matter between steps: shrunk without a copy, re-grown empty."""

    def __init__(self):
        self._held: list[tuple[torch.UntypedStorage, int]] = []

    def release(self, items: Iterable[tuple[str, Tensor]]) -> int:
        n = 0
        for _, t in items:
            st = t.untyped_storage()
            size = st.nbytes()
            st.resize_(0)
            self._held.append((st, size))
            n += size
        return n

    def regrow(self) -> int:
        n, grown = 0, []
        try:
            for st, size in self._held:
                st.resize_(size)
                grown.append(st)
                n += size
        except torch.OutOfMemoryError as e:
            for st in grown:
                st.resize_(0)
            raise CudaOutOfMemoryError(f"re-growing DeepSpeed's gradient buckets ({n} bytes) ran out of GPU "
                                       f"memory: {e}") from e
        return n

    def forget(self) -> None:
        self._held = []

    def shrink_again(self) -> None:
        for st, _ in self._held:
            st.resize_(0)


class _ColomemOffload:
    """Two SwapSets over what the engine holds (re-collected at each offload) + dropped scratch: what the
    forward and backward read, and what only the optimizer step reads (LATE: fp32 masters, Adam moments),
    which reload(pending) copies back while the forward and backward run."""
    method = "colomem"

    def __init__(self, collect: Callable[[], EngineState], pool, device: torch.device, timeout_s: float):
        from colomem.swap import SwapSet

        self._collect = collect
        self._state: Optional[EngineState] = None
        self._scratch = _ScratchBuffers()
        self._timeout = timeout_s
        early = tuple(c for c in CATEGORIES if c not in LATE_CATEGORIES)

        def items(cats):
            return lambda: self._state.swap_items(cats) if self._state else []
        # release=True: the memory goes back to the driver inside the timed move, as with the baselines
        self.swapset = SwapSet.from_tensors(items(early), pool, name="deepspeed-trainer", device=device,
                                            release=device.type == "cuda")
        self.late = SwapSet.from_tensors(items(LATE_CATEGORIES), pool, name="deepspeed-trainer.optimizer",
                                         device=device, release=False)   # offloaded first; the early set's
        #                                                                     offload returns the memory

    def offload(self) -> _Move:
        t0 = time.perf_counter()
        state = self._state = self._collect()
        self._scratch.release(state.scratch)
        nbytes = 0
        try:
            nbytes += self.late.offload(self._timeout).nbytes
            nbytes += self.swapset.offload(self._timeout).nbytes
        except BaseException:
            if self.late.state == "offloaded":    # all or nothing: the engine stays trainable
                self.late.reload(self._timeout)
            self._scratch.regrow()
            self._scratch.forget()
            raise
        return _Move(nbytes, time.perf_counter() - t0, state)

    def reload(self, pending=None) -> _Move:
        """pending: a colomem.swap.PendingReloads to start the LATE part in (its wait() must come before
        the optimizer step); None: everything is back when this returns."""
        t0 = time.perf_counter()
        self._scratch.regrow()
        try:
            nbytes = self.swapset.reload(self._timeout).nbytes
        except BaseException:
            self._scratch.shrink_again()      # all or nothing: the set rolled its storages back too
            raise
        try:
            if pending is None:
                nbytes += self.late.reload(self._timeout).nbytes
            else:
                pending.add(self.late.reload_async(ordered=False))
        except BaseException:
            self.swapset.offload(self._timeout)   # e.g. no GPU memory for the late part: offloaded again
            self._scratch.shrink_again()
            raise
        self._scratch.forget()
        self._state = None
        return _Move(nbytes, time.perf_counter() - t0)

    def host_view(self, t: Tensor) -> Optional[Tensor]:
        """A CPU tensor over the pool copy of t (same dtype, shape, strides), valid while offloaded."""
        fn = getattr(self.swapset, "host_view", None)
        if fn is not None:
            return fn(t)
        key = _storage_key(t)
        for e in getattr(self.swapset, "_entries", ()):        # until SwapSet has a public host_view()
            if e.storage._cdata == key and e.block is not None:
                raw = e.block.as_tensor(e.nbytes)
                return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        return None

    def close(self) -> None:
        for s in (self.swapset, self.late):
            if s.state == "offloaded":
                s.discard()
            s.close()


class _ToOffload:
    """The naive baseline: each storage copied with .to('cpu') into new pageable memory and back."""
    method = "to"

    def __init__(self, collect: Callable[[], EngineState], device: torch.device):
        self._collect = collect
        self._device = device
        self._held: list[tuple[torch.UntypedStorage, int, Tensor]] = []
        self._scratch = _ScratchBuffers()

    def offload(self) -> _Move:
        t0 = time.perf_counter()
        state = self._collect()
        self._scratch.release(state.scratch)
        try:
            for _, t in state.swap_items():
                st = t.untyped_storage()
                host = _bytes_of(st, self._device).to("cpu", copy=True)
                self._held.append((st, st.nbytes(), host))
                st.resize_(0)
        except BaseException:
            self._restore()
            self._scratch.regrow()
            self._scratch.forget()
            raise
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        return _Move(sum(h.numel() for _, _, h in self._held), time.perf_counter() - t0, state)

    def _restore(self) -> int:
        n, done = 0, []
        try:
            for st, size, host in self._held:
                st.resize_(size)
                _bytes_of(st, self._device).copy_(host)
                done.append(st)
                n += size
        except torch.OutOfMemoryError as e:
            for st in done:
                st.resize_(0)
            raise CudaOutOfMemoryError(f"reload (.to loop) ran out of GPU memory after {n} bytes: {e}") from e
        self._held = []
        return n

    def reload(self) -> _Move:
        t0 = time.perf_counter()
        self._scratch.regrow()
        try:
            n = self._restore()
        except BaseException:
            self._scratch.shrink_again()
            raise
        self._scratch.forget()
        return _Move(n, time.perf_counter() - t0)

    def host_view(self, t: Tensor) -> Optional[Tensor]:
        return None

    def close(self) -> None:
        self._held = []


class _DeepSpeedOffload:
    """The baseline: DeepSpeed's own engine.offload_states() / reload_states() (pinned buffers it caches).
    nbytes: how much torch's allocated memory fell (offload) or rose (reload), i.e. what DeepSpeed moved."""
    method = "deepspeed"

    def __init__(self, engine, collect: Callable[[], EngineState]):
        self._engine = engine
        self._collect = collect

    def offload(self) -> _Move:
        state = self._collect()       # what there was to move, for the report (not timed)
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        self._engine.offload_states()
        torch.cuda.synchronize()
        return _Move(max(0, before - torch.cuda.memory_allocated()), time.perf_counter() - t0, state)

    def reload(self) -> _Move:
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        self._engine.reload_states()
        torch.cuda.synchronize()
        return _Move(max(0, torch.cuda.memory_allocated() - before), time.perf_counter() - t0)

    def host_view(self, t: Tensor) -> Optional[Tensor]:
        return None

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------- reports
@dataclass
class SwitchReport:
    """One offload or reload: what moved, how long it took, what the driver saw."""
    method: str
    direction: str               # "offload" | "reload"
    seconds: float
    moved_bytes: int             # bytes copied (deepspeed: the drop/rise of torch's allocated bytes)
    freed_bytes: int             # offload: driver free memory gained; reload: driver memory taken
    free_bytes: int              # driver free memory after
    allocated_bytes: int         # torch allocated after
    reserved_bytes: int          # torch reserved after
    by_category: dict[str, int] = field(default_factory=dict)
    unlisted: list[tuple[str, int]] = field(default_factory=list)   # (name, bytes) only the walk found
    kept_bytes: int = 0          # storages that could not be resized (stay on the GPU)
    move_seconds: float = 0.0    # the move alone (without preparing the sync and empty_cache)
    collect_seconds: float = 0.0  # finding the storages (part of move_seconds for colomem and to)
    sync_seconds: float = 0.0    # offload: preparing the weights for the sync (views or staging)
    staged_bytes: int = 0        # offload: weights copied to host for the sync (merged LoRA, ZeRO-3 ranks)
    deferred_bytes: int = 0      # reload: bytes still in flight on return (overlap_reload; train_step waits)
    left_behind: str = ""        # offload: the largest CUDA tensors still alive when much stayed allocated
    #                              (the first such offload of a trainer)

    @property
    def gbps(self) -> float:
        """Bytes moved per second of the move itself."""
        t = self.move_seconds or self.seconds
        return self.moved_bytes / t / 1e9 if t > 0 else float("inf")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 3)
        return d


def _release_cached_memory() -> None:
    """Returns torch's cached blocks to the driver, cuBLAS workspaces included: one per (handle, stream),
    32 MiB each on Hopper, out of any Python object's reach (the next matmul makes them again)."""
    clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_cublas is not None:
        clear_cublas()
    torch.cuda.empty_cache()


LEFT_BEHIND_REPORT_BYTES = 16 << 20   # an offload leaving more than this allocated says what it is


def _left_behind(device: torch.device, top: int = 6) -> str:
    """'shape dtype MiB' of the largest live tensors on `device` (a diagnosis of what an offload missed)."""
    found, seen = [], set()
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, Tensor) and obj.device == device):
                continue
            st = obj.untyped_storage()
            if st._cdata in seen or st.nbytes() == 0:
                continue
            seen.add(st._cdata)
            found.append((st.nbytes(), f"{list(obj.shape)} {dtype_name(obj.dtype)}"))
        except Exception:  # noqa: BLE001 - a diagnosis must not fail the offload
            continue
    found.sort(reverse=True)
    return "; ".join(f"{d} {n / 2**20:.1f} MiB" for n, d in found[:top])


@dataclass
class _SyncSource:
    """Named weights prepared for the sync while the trainer is offloaded (host tensors)."""
    merged: bool
    items: list[tuple[str, Tensor]]


def _run_with_timeout(fn: Callable[[], None], timeout_s: float, what: str) -> bool:
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
class DeepSpeedTrainer:
    """The Trainer of docs/design.md on DeepSpeed ZeRO-2/3 (bf16).

    model_path: a local transformers checkpoint directory (nothing is downloaded), or an already built
        transformers causal LM (e.g. from a config, for benchmarks).
    zero_stage: 2 or 3. lora: a LoraSpec (peft adapter on the policy; the base with adapters off is the free
        KL reference) or None (full fine-tune). micro_batch: rows per forward/backward; grad_accum: the
        nominal micro-batches per step (train_step takes any batch size: the accumulation boundary is set
        by hand at its last micro-batch; None = 1). pool: the colomem.PinnedPool for offload="colomem" (default: one
        owned by the trainer). offload: "colomem" | "deepspeed" (engine.offload_states) | "to" (.to loop).
    torch_adam: torch's AdamW instead of DeepSpeed's FusedAdam (skips its ~30 s JIT build).
    overlap_reload: with offload="colomem", reload() brings back what forward and backward read and starts
        the fp32 masters and Adam moments (most of a full fine-tune's state) behind them; train_step waits
        for those just before the optimizer step, so their copy hides behind the forward and backward.
    grad_accum_dtype: None (DeepSpeed's default: the model dtype), "fp32" or "bf16".
    ds_config: extra DeepSpeed config merged over the one built here. timeout_s: bound on each swap and on
        close(). seed: torch seed before the model and the LoRA adapter are built.

    Multi-GPU: start with torchrun (data parallel over all ranks); every rank calls every method. On ZeRO-3
    with several ranks, offload(prepare_sync=True) and named_weights() gather parameters collectively.
    """

    def __init__(self, model_path, *, zero_stage: int = 2, lora=None, lr: float = 1e-5, micro_batch: int = 1,
                 grad_accum: Optional[int] = 1, pool=None, gradient_checkpointing: bool = True,
                 trust_remote_code: bool = False, grpo=None, offload: str = "colomem", torch_adam: bool = False,
                 weight_decay: float = 0.0, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: Optional[float] = 1.0, grad_accum_dtype: Optional[str] = None,
                 reduce_bucket_size: Optional[int] = None, seed: int = 0,
                 attn_implementation: Optional[str] = None, ds_config: Optional[dict] = None,
                 timeout_s: float = 300.0, overlap_reload: bool = True):
        validate_trainer_args(zero_stage=zero_stage, micro_batch=micro_batch, grad_accum=grad_accum, lr=lr,
                              offload=offload, torch_adam=torch_adam, lora=lora, betas=betas, eps=eps,
                              weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                              grad_accum_dtype=grad_accum_dtype, timeout_s=timeout_s)
        grad_accum = 1 if grad_accum is None else grad_accum
        if not isinstance(model_path, torch.nn.Module):
            _check_model_dir(model_path)
        if not torch.cuda.is_available():
            raise NotAvailableError("DeepSpeedTrainer needs a CUDA GPU; on a machine without one use "
                                    "colomem.engines.torch_cpu.TorchTrainer")
        deepspeed = import_deepspeed()
        if grpo is None:
            from colomem.grpo.config import GRPOConfig
            grpo = GRPOConfig()
        self.grpo = grpo
        self.zero_stage = zero_stage
        self.lora = lora
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.offload_method = offload
        self.timeout_s = float(timeout_s)
        self.overlap_reload = bool(overlap_reload)
        self._pending = PendingReloads()
        self.deepspeed_version = deepspeed.__version__
        self.last_offload: Optional[SwitchReport] = None
        self.last_reload: Optional[SwitchReport] = None
        self.steps = 0
        self._closed = False
        self._offloaded = False
        self._offloaded_by: Optional[str] = None
        self._left_behind_named = False       # the (slow) scan of live tensors runs once per trainer
        self._sync: Optional[_SyncSource] = None
        self._lora_cache: Optional[dict[str, Tensor]] = None
        self._stage_block = None
        self._stage_host: Optional[Tensor] = None
        self._pool = pool
        self._owns_pool = False
        self._strategies: dict[str, Any] = {}

        self.rank, self.world_size, self.local_rank = _init_distributed()
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)

        torch.manual_seed(seed)
        model = self._build_model(model_path, trust_remote_code, attn_implementation, gradient_checkpointing)
        config = build_ds_config(zero_stage=zero_stage, micro_batch=micro_batch, grad_accum=grad_accum,
                                 world_size=self.world_size, lr=lr, weight_decay=weight_decay, betas=betas,
                                 eps=eps, torch_adam=torch_adam, max_grad_norm=max_grad_norm,
                                 grad_accum_dtype=grad_accum_dtype, reduce_bucket_size=reduce_bucket_size,
                                 overrides=ds_config)
        self.ds_config = config
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
        self.model = self.engine.module
        self._fwd_stack = _zero3_global_holders()[0] if zero_stage == 3 else None
        self._ref_fn = None
        try:
            stage = int(self.engine.zero_optimization_stage())
            if stage != zero_stage or not hasattr(self.engine.optimizer, "optimizer"):
                raise ColomemError(f"DeepSpeed built a stage-{stage} {type(self.engine.optimizer).__name__}, not "
                                   f"the ZeRO-{zero_stage} optimizer asked for; check the ds_config overrides")
            if lora is not None:
                from colomem.grpo.step import peft_reference_fn
                self._ref_fn = peft_reference_fn(self.engine, getattr(grpo, "temperature", 1.0))
        except BaseException:
            self.close()
            raise

    # -- building -----------------------------------------------------------------------------------------
    def _build_model(self, model_path, trust_remote_code, attn_implementation, gradient_checkpointing):
        if isinstance(model_path, torch.nn.Module):
            model = model_path
        else:
            from transformers import AutoModelForCausalLM

            kw = {"dtype": torch.bfloat16, "trust_remote_code": bool(trust_remote_code)}
            if attn_implementation:
                kw["attn_implementation"] = attn_implementation
            model = AutoModelForCausalLM.from_pretrained(str(model_path), **kw)
        if hasattr(model, "config"):
            model.config.use_cache = False
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, build_lora_config(self.lora))
            if gradient_checkpointing:
                model.enable_input_require_grads()
            _check_lora_layers(model)
        return model

    # -- state --------------------------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._offloaded

    @property
    def optimizer(self):
        """DeepSpeed's ZeRO optimizer (its .optimizer is the inner AdamW), its state fully reloaded."""
        self.wait_reload()
        return self.engine.optimizer

    def state(self) -> EngineState:
        """The storages the engine holds on this GPU now, by category (what offload() moves)."""
        return collect_engine_state(self.engine, self.device)

    def memory(self) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        out = {"allocated": torch.cuda.memory_allocated(self.device),
               "reserved": torch.cuda.memory_reserved(self.device), "driver_used": total - free,
               "driver_free": free, "pinned_pool": 0}
        if self._pool is not None and not self._pool.closed:
            out["pinned_pool"] = int(self._pool.stats()["reserved_bytes"])
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise PhaseOrderError("this DeepSpeedTrainer was closed; build a new one")

    def _check_resident(self, what: str) -> None:
        self._check_open()
        if self._offloaded:
            raise PhaseOrderError(f"{what} on an offloaded trainer; call reload() first")

    # -- training -----------------------------------------------------------------------------------------
    def train_step(self, batch) -> dict[str, float]:
        """One optimizer step on `batch` (a GRPOBatch): micro-batches of micro_batch rows, weighted by their
        share of the batch, gradients accumulated, one update. Returns rank-local metrics."""
        from colomem.grpo.step import MetricAccumulator, compute_loss, split_micro_batches

        self._check_resident("train_step()")
        if len(batch) == 0:
            raise InvalidArgumentError("train_step() got an empty batch; every rank needs at least one row")
        t0 = time.perf_counter()
        micro = split_micro_batches(batch, self.micro_batch, getattr(self.grpo, "loss_norm", "sequence"))
        ref_fn = self._ref_fn if getattr(self.grpo, "kl_coef", 0.0) > 0 else None
        acc = MetricAccumulator()
        engine = self.engine
        total_loss = 0.0
        stack = getattr(self, "_fwd_stack", None)
        depth = len(stack) if stack is not None else 0
        try:
            for i, mb in enumerate(micro):
                mb = mb.to(self.device, non_blocking=True)
                engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
                loss, metrics = compute_loss(engine, mb, self.grpo, ref_fn)
                engine.backward(loss, scale_wrt_gas=False)    # the loss already carries mb.loss_weight
                total_loss += metrics.pop("loss")             # weighted: the sum is the batch loss
                acc.add(metrics, mb.loss_weight / batch.loss_weight)
            waited = self.wait_reload()                       # the step reads the masters and moments
            engine.step()
        finally:
            _trim_module_stack(stack, depth)      # ZeRO-3's checkpoint recompute leaves submodules pushed
        self.steps += 1
        out = acc.result()
        out["loss"] = total_loss
        out["reload_wait_s"] = waited
        norm = engine.get_global_grad_norm()
        if norm is not None:
            out["grad_norm"] = float(norm)
        out["lr"] = float(engine.get_lr()[0])
        out["micro_batches"] = float(len(micro))
        out["train_step_s"] = time.perf_counter() - t0
        return out

    # -- offload / reload ---------------------------------------------------------------------------------
    def _strategy(self, method: str):
        s = self._strategies.get(method)
        if s is not None:
            return s

        def collect():
            return collect_engine_state(self.engine, self.device)
        if method == "colomem":
            if self._pool is None:
                from colomem.pool import PinnedPool
                need = collect().nbytes() + (64 << 20)
                self._pool = PinnedPool(need)
                self._owns_pool = True
            s = _ColomemOffload(collect, self._pool, self.device, self.timeout_s)
        elif method == "to":
            s = _ToOffload(collect, self.device)
        else:
            s = _DeepSpeedOffload(self.engine, collect)
        self._strategies[method] = s
        return s

    def offload(self, *, prepare_sync: bool = True, merged: bool = True, method: Optional[str] = None) -> None:
        """Moves the engine's GPU state out (see `offload` in the constructor) and returns the memory to the
        driver. prepare_sync: keep the named weights readable for the weight sync while offloaded (host views
        of the pool copy where possible, staged host copies otherwise); merged: as in named_weights().
        method: another offload method for this cycle (benchmarks). The report is in `last_offload`."""
        self._check_resident("offload()")
        self.wait_reload()                     # reloaded, never trained on: let the late copies finish first
        method = method or self.offload_method
        if method not in OFFLOAD_METHODS:
            raise InvalidArgumentError(f"method={method!r}: choose one of {', '.join(OFFLOAD_METHODS)}")
        strategy = self._strategy(method)
        dev = self.device
        torch.cuda.synchronize(dev)        # DeepSpeed's side streams (reduction, all-gather) included
        free0 = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        if self.zero_stage == 3 and hasattr(self.engine.optimizer, "empty_partition_cache"):
            self.engine.optimizer.empty_partition_cache()     # gathered params are copies of the partitions
        plan, staged = [], 0
        if prepare_sync:
            plan, staged = self._plan_sync(merged, views_ok=(method == "colomem"))
            if self.lora is not None:
                self._lora_cache = self._lora_tensors(copy=True)
        t_sync = time.perf_counter() - t0
        move = strategy.offload()
        self._offloaded, self._offloaded_by = True, method
        if prepare_sync:
            self._sync = _SyncSource(merged, self._resolve_sync(plan, strategy))
        _release_cached_memory()
        torch.cuda.synchronize(dev)
        free1 = torch.cuda.mem_get_info(dev)[0]
        state = move.state
        left = torch.cuda.memory_allocated(dev)
        # A gc scan of live tensors costs a noticeable share of a second in a big process: name what stayed
        # once, not on every step's offload (the timed switch of a baseline would carry it every step).
        diagnose = left > LEFT_BEHIND_REPORT_BYTES and not self._left_behind_named
        self._left_behind_named |= diagnose
        self.last_offload = SwitchReport(
            method, "offload", time.perf_counter() - t0, move.nbytes, free1 - free0, free1,
            left, torch.cuda.memory_reserved(dev), dict(state.sizes),
            list(state.unlisted), sum(n for _, n in state.skipped), move.seconds, state.seconds, t_sync, staged,
            _left_behind(dev) if diagnose else "")

    def reload(self) -> None:
        """Brings the state back (the same tensor objects with colomem); training can continue."""
        self._check_open()
        if not self._offloaded:
            raise PhaseOrderError("reload() on a trainer that is not offloaded; call offload() first")
        dev = self.device
        free0 = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        strategy = self._strategies[self._offloaded_by]
        if self.overlap_reload and isinstance(strategy, _ColomemOffload):
            move = strategy.reload(self._pending)
        else:
            move = strategy.reload()
        self._sync = None                 # host views die with the offload
        # This stream only: a device-wide synchronize would also wait for the deferred copies on colomem's
        # H2D stream (on the GPU host it did: the reload phase took 0.40 s for a 0.065 s move).
        torch.cuda.current_stream(dev).synchronize()
        free1 = torch.cuda.mem_get_info(dev)[0]
        self.last_reload = SwitchReport(self._offloaded_by, "reload", time.perf_counter() - t0, move.nbytes,
                                        free0 - free1, free1, torch.cuda.memory_allocated(dev),
                                        torch.cuda.memory_reserved(dev), move_seconds=move.seconds,
                                        deferred_bytes=self._pending.nbytes)
        self._offloaded, self._offloaded_by = False, None

    def wait_reload(self, timeout: Optional[float] = None) -> float:
        """Waits for the part of the last reload that overlap_reload left in flight (train_step calls this
        before the optimizer step; call it before reading the optimizer's state yourself). Returns the
        seconds it blocked: 0.0 when nothing was pending."""
        return self._pending.wait(self.timeout_s if timeout is None else timeout)

    # -- weights for the sync -----------------------------------------------------------------------------
    def named_weights(self, merged: bool = True) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) for every weight the rollout engine loads. With LoRA and merged=True: base +
        scaling * B @ A, computed in fp32 without touching the adapter; merged=False: the base alone.

        Resident: GPU tensors, valid until the iterator moves on (ZeRO-3 with several ranks gathers module
        by module, collectively: every rank must iterate to the end). Offloaded: host tensors prepared by
        offload(prepare_sync=True), valid until reload()."""
        self._check_open()
        if self._offloaded:
            if self._sync is None:
                raise PhaseOrderError("named_weights() on an offloaded trainer needs offload(prepare_sync=True)")
            if self._sync.merged != merged:
                raise PhaseOrderError(f"the weights were prepared with merged={self._sync.merged}; call "
                                      f"offload(merged={merged}) to get the other kind")
            return iter(list(self._sync.items))
        return ((name, t) for name, t, _ in self._iter_weights(merged))

    def lora_state(self) -> dict[str, Tensor]:
        """The adapter's tensors on the host, named as peft saves them (…lora_A.weight, …lora_B.weight)."""
        self._check_open()
        if self.lora is None:
            raise InvalidArgumentError("lora_state(): this trainer has no LoRA adapter (lora=None)")
        if self._offloaded:
            if self._lora_cache is None:
                raise PhaseOrderError("lora_state() on an offloaded trainer needs offload(prepare_sync=True)")
            return dict(self._lora_cache)
        return self._lora_tensors(copy=True)

    def _lora_tensors(self, copy: bool) -> dict[str, Tensor]:
        named = [(n, p) for n, p in self.model.named_parameters() if ".lora_" in n]
        out = {}
        with self._full_params([p for _, p in named]) as full:
            for (n, _), t in zip(named, full):
                key = re.sub(r"\.(lora_[A-Za-z_]+)\.[^.]+\.", r".\1.", n)     # drop the adapter name
                out[key] = t.detach().to("cpu", copy=True) if copy else t
        return out

    @contextlib.contextmanager
    def _full_params(self, params: list) -> Iterator[list[Tensor]]:
        """Full (unpartitioned) tensors of params: views where the data is complete on this rank (ZeRO-2;
        ZeRO-3 on one rank: the partition is the whole tensor), gathered copies otherwise."""
        if self.zero_stage != 3 or not params or not all(hasattr(p, "ds_tensor") for p in params):
            yield [p.detach() for p in params]
            return
        if self.world_size == 1:
            yield [p.ds_tensor.narrow(0, 0, p.ds_numel).view(p.ds_shape) for p in params]
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield [p.data for p in params]

    @property
    def _complete_locally(self) -> bool:
        return self.zero_stage != 3 or self.world_size == 1

    def _walk_weights(self) -> Iterator[tuple[str, object, list]]:
        """(prefix, module, params) per module in HF order: a peft LoRA layer comes with params None (its
        base weight and adapters are handled together), other modules with their own not-yet-seen params."""
        base = self.model.get_base_model() if self.lora is not None else self.model
        lora_cls = _lora_layer_class() if self.lora is not None else None
        skip_prefixes: list[str] = []
        seen: set[int] = set()
        for mname, mod in base.named_modules():
            if any(mname.startswith(p) for p in skip_prefixes):
                continue
            prefix = mname + "." if mname else ""
            if lora_cls is not None and isinstance(mod, lora_cls):
                skip_prefixes.append(prefix)
                yield prefix, mod, None
                continue
            params = [(pn, p) for pn, p in mod.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in params)
            if params:
                yield prefix, mod, params

    def _iter_weights(self, merged: bool) -> Iterator[tuple[str, Tensor, bool]]:
        """(HF name, full tensor, direct); direct: a view of the engine's own storage (not a temporary)."""
        direct = self._complete_locally
        for prefix, mod, params in self._walk_weights():
            if params is None:
                yield from self._lora_weights(prefix, mod, merged, direct)
                continue
            with self._full_params([p for _, p in params]) as full:
                for (pn, _), t in zip(params, full):
                    yield prefix + pn, t, direct

    def _lora_weights(self, prefix: str, mod, merged: bool, direct: bool) -> Iterator[tuple[str, Tensor, bool]]:
        layer = mod.base_layer
        adapters = [a for a in mod.active_adapters if a in mod.lora_A] if merged else []
        params = [layer.weight] + ([layer.bias] if getattr(layer, "bias", None) is not None else [])
        lora_params = [w for a in adapters for w in (mod.lora_A[a].weight, mod.lora_B[a].weight)]
        with self._full_params(params + lora_params) as full:
            weight = full[0]
            if adapters:
                acc = weight.to(torch.float32, copy=True)       # never a view of the base weight
                for i, a in enumerate(adapters):
                    A, B = full[len(params) + 2 * i], full[len(params) + 2 * i + 1]
                    delta = B.float() @ A.float()
                    acc.add_(delta.T if getattr(mod, "fan_in_fan_out", False) else delta, alpha=mod.scaling[a])
                yield prefix + "weight", acc.to(weight.dtype), False
            else:
                yield prefix + "weight", weight, direct
            if len(params) > 1:
                yield prefix + "bias", full[1], direct

    def _plan_sync(self, merged: bool, views_ok: bool) -> tuple[list, int]:
        """Before the swap: (name, ('view', gpu tensor) | ('host', staged host tensor)) for every weight."""
        items = list(self._weight_meta(merged))
        need = sum(n for _, n, d in items if not (d and views_ok))
        host = self._staging(need) if need else None
        plan, off = [], 0
        for name, t, is_direct in self._iter_weights(merged):
            if is_direct and views_ok:
                plan.append((name, ("view", t)))
                continue
            nbytes = t.numel() * t.element_size()
            dst = host[off:off + nbytes].view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=True)
            plan.append((name, ("host", dst)))
            off += (nbytes + 255) // 256 * 256
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return plan, off

    def _weight_meta(self, merged: bool) -> Iterator[tuple[str, int, bool]]:
        """(name, aligned bytes, direct) of every weight, from shapes only (nothing gathered or computed)."""
        direct = self._complete_locally

        def nbytes_of(p) -> int:
            numel = int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()
            return (numel * p.element_size() + 255) // 256 * 256
        for prefix, mod, params in self._walk_weights():
            if params is None:
                is_merged = merged and any(a in mod.lora_A for a in mod.active_adapters)
                yield prefix + "weight", nbytes_of(mod.base_layer.weight), direct and not is_merged
                if getattr(mod.base_layer, "bias", None) is not None:
                    yield prefix + "bias", nbytes_of(mod.base_layer.bias), direct
                continue
            for pn, p in params:
                yield prefix + pn, nbytes_of(p), direct

    def _staging(self, nbytes: int) -> Tensor:
        """A host uint8 buffer of at least nbytes, page-locked, kept across offloads (pool block if any)."""
        if self._stage_host is not None and self._stage_host.numel() >= nbytes:
            return self._stage_host
        self._free_staging()
        if self._pool is not None and not self._pool.closed:
            self._stage_block = self._pool.alloc(nbytes)
            self._stage_host = self._stage_block.as_tensor(nbytes)
        else:
            self._stage_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._stage_host

    def _free_staging(self) -> None:
        self._stage_host = None
        if self._stage_block is not None:
            if not self._stage_block.pool.closed:
                self._stage_block.release()
            self._stage_block = None

    def _resolve_sync(self, plan, strategy) -> list[tuple[str, Tensor]]:
        out = []
        for name, (kind, t) in plan:
            if kind == "view":
                h = strategy.host_view(t)
                if h is not None:
                    t = h
                elif _storage_nbytes(t) == 0:
                    raise ColomemError(f"named weight {name} was offloaded but is not in the swap set; this is a "
                                       "bug in the DeepSpeed adapter's state collection (please report it)")
                # else: a storage that could not be resized stayed where it is (kept_bytes): read it there
            out.append((name, t))
        return out

    # -- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Releases the engine, its GPU memory and the pool blocks; bounded by timeout_s; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._sync = None
        self._lora_cache = None
        pending = getattr(self, "_pending", None)       # (absent when __init__ failed before it)
        try:
            if pending:
                pending.wait(self.timeout_s)
        except Exception as e:           # noqa: BLE001 - closing goes on
            warnings.warn(f"a deferred reload did not finish: {e!r}", RuntimeWarning, stacklevel=2)
        for s in self._strategies.values():
            try:
                s.close()
            except Exception as e:       # noqa: BLE001 - closing goes on
                warnings.warn(f"closing the {s.method} offload failed: {e!r}", RuntimeWarning, stacklevel=2)
        self._strategies = {}
        self._free_staging()
        engine = getattr(self, "engine", None)
        opt_ref = None
        if engine is not None:
            _run_with_timeout(engine.destroy, self.timeout_s, "DeepSpeed engine.destroy()")
            if getattr(self, "zero_stage", None) == 3:
                try:
                    _release_zero3_references(getattr(engine, "module", None))
                except Exception as e:     # noqa: BLE001 - closing goes on; the check below reports a leak
                    warnings.warn(f"unhooking the ZeRO-3 module from DeepSpeed failed: {e!r}", RuntimeWarning,
                                  stacklevel=2)
            opt_ref = _weakref_or_none(getattr(engine, "optimizer", None))
        del engine                         # a local reference would keep it alive through the collection below
        self.engine = self.model = self._ref_fn = None
        self._fwd_stack = None
        if self._owns_pool and self._pool is not None and not self._pool.closed:
            self._pool.close(force=True)
        self._pool = None
        gc.collect()
        if torch.cuda.is_available():
            _release_cached_memory()
        if opt_ref is not None and opt_ref() is not None:
            version = getattr(self, "deepspeed_version", "?")
            warnings.warn(f"the closed trainer's {type(opt_ref()).__name__} is still referenced, so its GPU state "
                          "stays allocated; drop your references to trainer.engine / .optimizer / .model (with "
                          f"DeepSpeed {version}: report it if you hold none)", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> "DeepSpeedTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------- helpers
def _weakref_or_none(obj):
    try:
        return weakref.ref(obj) if obj is not None else None
    except TypeError:                    # not weak-referenceable: nothing to check
        return None


def _check_model_dir(model_path) -> None:
    problem = checkpoint_problem(model_path)
    if problem:
        raise InvalidArgumentError(problem)


def _lora_layer_class():
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def _check_lora_layers(model) -> None:
    """Only Linear LoRA layers without DoRA: the merge in named_weights handles exactly those."""
    lora_cls = _lora_layer_class()
    for name, mod in model.named_modules():
        if not isinstance(mod, lora_cls):
            continue
        if not isinstance(mod.base_layer, torch.nn.Linear) or getattr(mod, "lora_embedding_A", None):
            raise InvalidArgumentError(f"LoRA on {name} ({type(mod.base_layer).__name__}) is not supported; "
                                       "target linear layers only (e.g. q_proj, k_proj, v_proj, o_proj)")
        if any(getattr(mod, "use_dora", {}).values()):
            raise InvalidArgumentError(f"DoRA on {name} is not supported by the weight merge")
