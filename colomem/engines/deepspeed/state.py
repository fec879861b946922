"""What a DeepSpeed ZeRO-2/3 engine holds on its GPU, found by attribute name and by a walk of DeepSpeed's
objects (`collect_engine_state`), and the DeepSpeed 0.19 workarounds that let a closed engine's state go.

What a ZeRO engine keeps on the GPU between two optimizer steps (DeepSpeed 0.19.x, bf16, no ZeRO-Offload):

    ZeRO-2  bit16_groups_flat (the bf16 params; every model param is a view into it), frozen params outside
            the optimizer (the LoRA base), single_partition_of_fp32_groups (fp32 masters), the inner
            optimizer's state (exp_avg, exp_avg_sq), module buffers; gradients only inside a step
            (averaged_gradients / grads_in_partition are dropped by step()), ipg buckets only in backward.
    ZeRO-3  lp_param_buffer (the bf16 partitions; each param's ds_tensor is a view into it), ds_tensor of
            frozen params, gathered copies of persistent (small) params, fp32_partitioned_groups_flat,
            grad_partitions_flat_buffer (kept between steps), the ipg bucket buffer (reduce_bucket_size
            elements, scratch), the optimizer state, module buffers.

Duck-typed on those attribute names: nothing here imports deepspeed at module level.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Collection, Iterator, Optional, Sequence

import torch
from torch import Tensor

from colomem import _torch
from colomem.bridge.buckets import dtype_name

from .setup_hold import SetupHold

CATEGORIES = ("params", "master", "optim", "grads", "other")
LATE_CATEGORIES = ("master", "optim")   # read by the optimizer step only, not by forward or backward


def storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata          # the StorageImpl: stable across resize_, unlike data_ptr


def storage_nbytes(t: Tensor) -> int:
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
            return sum(storage_nbytes(t) for _, t in self.scratch)
        cats = CATEGORIES if category is None else (category,)
        return sum(storage_nbytes(t) for c in cats for _, t in self.groups.get(c, ()))

    def by_category(self) -> dict[str, int]:
        """Bytes by category now (0 for storages that are offloaded); `sizes` holds them as collected."""
        out = {c: self.nbytes(c) for c in CATEGORIES}
        out["scratch"] = self.nbytes("scratch")
        return out


def collect_engine_state(engine, device: torch.device, *, walk_depth: int = 6,
                         exclude: Collection[int] = ()) -> EngineState:
    """Every storage on `device` that a ZeRO-2/3 engine keeps between steps (duck-typed on DeepSpeed 0.19's
    attribute names, plus a walk of the optimizer's and engine's own objects as a safety net). exclude:
    storage addresses that are not the engine's to move or count (a base shared with the rollout engine)."""
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
        if st.nbytes() == 0 or (exclude and st.data_ptr() in exclude):
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
                    unlisted.append((name, storage_nbytes(t)))
    state = EngineState(groups, scratch, unlisted, skipped)
    state.sizes = state.by_category()
    state.seconds = time.perf_counter() - t0
    return state



# -------------------------------------------------------------------------- ZeRO-3 process-wide references
# DeepSpeed 0.19's ZeRO-3 keeps an engine's modules reachable from two process-wide objects, and every
# parameter points at the whole optimizer (param._z3_optimizer, set by _link_all_hp_params), so after
# engine.destroy() the fp32 masters, Adam moments, grad partitions and bf16 partitions all stay allocated:
#   parameter_offload.FWD_MODULE_STACK  the root module is pushed when the hooks are set up and never popped;
#       non-reentrant activation checkpointing stops its recompute early (inside a forward), so the post-forward
#       hook that pops does not run and each micro-batch leaves more submodules on it.
#   PartitionedParameterCoordinator.__params_to_release  a functools.lru_cache on a method: one cache shared by
#       all coordinators, keyed by (coordinator, submodule, step), never cleared.
def zero3_global_holders() -> tuple[Optional[list], list]:
    """(FWD_MODULE_STACK, [lru caches holding submodules]) of the installed DeepSpeed; (None, []) without it."""
    try:
        from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator
    except ImportError:
        return None, []
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    cls = getattr(partitioned_param_coordinator, "PartitionedParameterCoordinator", None)
    fn = getattr(cls, "_PartitionedParameterCoordinator__params_to_release", None)
    return (stack if isinstance(stack, list) else None), lru_caches(fn)


def lru_caches(fn, depth: int = 3) -> list:
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


def trim_module_stack(stack: Optional[list], depth: int) -> int:
    """Drops what a finished step left above `depth` on FWD_MODULE_STACK (every forward has returned, so
    nothing there is live); returns how many entries went."""
    if stack is None or len(stack) <= depth:
        return 0
    n = len(stack) - depth
    del stack[depth:]
    return n


def release_zero3_references(module, stack: Optional[list] = None, caches: Optional[list] = None) -> int:
    """After engine.destroy(): unhooks `module` (a ZeRO-3 engine's module) from DeepSpeed's process-wide objects
    so the engine can be collected; other engines' entries stay. Returns how many references went."""
    if stack is None and caches is None:
        stack, caches = zero3_global_holders()
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


class FunctionalLinearGuard(SetupHold):
    """Puts torch.nn.functional.linear back once no live trainer needs DeepSpeed's replacement.

    Setting up a ZeRO-3 engine replaces torch.nn.functional.linear, process-wide, with DeepSpeed's
    memory-efficient autograd function, and nothing puts it back: every later F.linear in the process (a ZeRO-2
    trainer's, a reference model's, the user's own code) then runs DeepSpeed's backward, whose rounding
    differs from torch's, so the same job gives different bits depending on what ran before it. The last
    release puts back what was there before the first replacement, unless someone else has replaced the
    function since."""

    def __init__(self, namespace=torch.nn.functional) -> None:
        super().__init__()
        self._ns = namespace
        self._original = None
        self._patched = None

    def _snapshot(self):
        return self._ns.linear

    def _took(self, before) -> bool:
        """When the function a trainer's set-up left differs from torch's own, whether this set-up or a live
        trainer's replaced it."""
        now = self._ns.linear
        if self._holders == 0:
            if now is before:
                return False
            self._original = before
        elif now is self._original:
            return False
        self._patched = now
        return True

    def _give_back(self) -> None:
        if self._ns.linear is self._patched and self._original is not None:
            self._ns.linear = self._original
        self._original = self._patched = None


FUNCTIONAL_LINEAR = FunctionalLinearGuard()


def release_cached_memory() -> None:
    """Returns torch's cached blocks to the driver, cuBLAS workspaces included unless an in-process engine's
    CUDA graphs replay over them (colomem._torch.clear_cublas_workspaces)."""
    _torch.clear_cublas_workspaces()
    torch.cuda.empty_cache()


LEFT_BEHIND_REPORT_BYTES = 16 << 20   # an offload leaving more than this allocated says what it is


def worth_naming(left: int, sizes: dict, keep, pending: int) -> bool:
    """Whether an offload left more allocated than it meant to (the categories kept and a deferred part still
    copying out stay by design) by more than LEFT_BEHIND_REPORT_BYTES."""
    meant = sum(n for c, n in sizes.items() if c in keep) + pending
    return left - meant > LEFT_BEHIND_REPORT_BYTES


def left_behind(device: torch.device, top: int = 6) -> str:
    """'shape dtype MiB' of the largest live tensors on `device` (a diagnosis of what an offload missed)."""
    found, seen = [], set()
    for obj in gc.get_objects():
        try:
            # type(), not isinstance: isinstance reads __class__, which warns on deprecated module objects
            if not (issubclass(type(obj), Tensor) and obj.device == device):
                continue
            st = obj.untyped_storage()
            nbytes = st.nbytes()
            # a compiled model leaves fake tensors alive whose sizes are symbols: comparing those asks the
            # symbolic shape engine, which fails outside its trace; they hold no memory anyway
            if type(nbytes) is not int or nbytes == 0 or st._cdata in seen:
                continue
            seen.add(st._cdata)
            found.append((nbytes, f"{list(obj.shape)} {dtype_name(obj.dtype)}"))
        except Exception:  # noqa: BLE001 - a diagnosis must not fail the offload
            continue
    found.sort(reverse=True)
    return "; ".join(f"{d} {n / 2**20:.1f} MiB" for n, d in found[:top])


