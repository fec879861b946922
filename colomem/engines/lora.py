"""peft LoRA for every Trainer: the adapter config from a LoraSpec, the layers the merge supports, and the
merge itself (base + scaling * B @ A under the base's HF names), which is what the rollout engine loads.

The merge never touches the model (no merge_and_unload: no rounding drift across steps) and sums in fp32
with one rounding to the weight's dtype: one adapter in one pass over the weight where it can (fused_merge:
on the CPU one GEMM; on a GPU the core's kernel once switched on, as cuBLAS's bf16 GEMM rounds twice),
anything else in fp32. A trainer whose parameters are partitioned (ZeRO-3) passes `full`, a context manager
that hands out the complete tensors of a module's parameters while they are read.

Nothing here imports torch or peft at module level (DeepSpeedConfig imports build_lora_config).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from torch import Tensor
    from torch.nn import Module

# The linear layers of a Llama/Qwen-style decoder (attention and MLP): what LoraSpec's "all-linear" picks there.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FullParams = Callable[[list], ContextManager[list]]
"""full(params) -> context manager yielding the complete tensors of params, in order."""


def build_lora_config(lora: Any) -> Any:
    """peft.LoraConfig from a colomem LoraSpec (r, alpha, dropout, target_modules)."""
    from peft import LoraConfig

    alpha: Any = float(lora.alpha)      # peft annotates an int but scales by alpha / r: a float stays exact
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoraConfig(r=int(lora.r), lora_alpha=alpha, lora_dropout=float(lora.dropout),
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")


def lora_layer_class() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:                      # peft missing: cannot be a peft model
        return False
    return isinstance(model, PeftModel)


def check_lora_layers(model: "Module") -> None:
    """Only Linear LoRA layers without DoRA: the merge handles exactly those."""
    import torch

    from colomem.errors import InvalidArgumentError

    lora_cls = lora_layer_class()
    for name, mod in model.named_modules():
        if not isinstance(mod, lora_cls):
            continue
        base = getattr(mod, "base_layer", None)
        if not isinstance(base, torch.nn.Linear) or getattr(mod, "lora_embedding_A", None):
            raise InvalidArgumentError(f"LoRA on {name} ({type(base).__name__}) is not supported; "
                                       "target linear layers only (e.g. q_proj, k_proj, v_proj, o_proj)")
        if any(getattr(mod, "use_dora", {}).values()):
            raise InvalidArgumentError(f"DoRA on {name} is not supported by the weight merge")


@contextlib.contextmanager
def detached(params: list) -> Iterator[list]:
    """The `full` of a model whose parameters are complete tensors: their detached views."""
    yield [p.detach() for p in params]


def adapter_delta(layer: Any, A: "Tensor", B: "Tensor") -> "Tensor":
    """B @ A in fp32, oriented as the layer's base weight (unscaled)."""
    delta = B.float() @ A.float()
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


_EXACT_DEPTH = [0]     # exact_matmul's nesting: an inner one (a merge a layer inside a loop's) sets nothing


@contextlib.contextmanager
def exact_matmul() -> Iterator[None]:
    """cuBLAS without its reduced-precision shortcuts (TF32 inputs, split-K sums kept in bf16 / fp16) while a
    merge runs, so its product is the fp32 one. The flags are the process's: set back after. Nested inside
    another it does nothing (a merge of many layers sets the flags once around them all)."""
    import torch

    if _EXACT_DEPTH[0]:
        yield
        return
    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_tf32 = m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False
    _EXACT_DEPTH[0] += 1
    try:
        yield
    finally:
        _EXACT_DEPTH[0] -= 1
        m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


def fused_merge(layer: Any, weight: "Tensor", A: "Tensor", B: "Tensor", scaling: float,
                in_place: bool) -> Optional["Tensor"]:
    """weight + scaling * B @ A as one GEMM (addmm: the product summed in fp32, added to the weight and
    rounded once to its dtype), into `weight` itself (in_place) or a new tensor. It reads the weight once and
    writes it once, where the fp32 path writes and reads an fp32 product of the weight's size too. None,
    nothing written, where that one rounding is not what the GEMM does: factors of another dtype than the
    weight's (addmm takes one dtype: peft's fp32 adapters on a bf16 base), or a weight on a GPU, where
    cuBLAS's reduced-precision GEMM rounds the product to the weight's dtype before it adds the weight, whatever
    the precision flags say (two roundings: up to 256 bf16 steps from the exact sum where the terms nearly
    cancel; benchmarks/diag_merge_rounding.py shows it). On a GPU the core's one-rounding kernel
    (colomem.engines.lora_merge_kernel) does the merge instead while its GPU_KERNEL is on, also for fp32
    factors on a bf16 weight; where it is off or does not apply (another dtype, a core built without CUDA)
    the caller takes the fp32 path."""
    import torch

    if weight.device.type != "cpu":     # the core's one-rounding kernel
        from colomem.engines.lora_merge_kernel import GPU_KERNEL, kernel_merge

        return kernel_merge(layer, weight, A, B, scaling, in_place) if GPU_KERNEL else None
    if A.dtype != weight.dtype or B.dtype != weight.dtype or not weight.is_floating_point():
        return None
    m1, m2 = (A.T, B.T) if getattr(layer, "fan_in_fan_out", False) else (B, A)
    with torch.no_grad(), exact_matmul():
        if in_place:
            return weight.addmm_(m1, m2, alpha=scaling)
        return torch.addmm(weight, m1, m2, alpha=scaling)


def merge_adapters(layer: Any, weight: "Tensor", factors: Sequence[tuple["Tensor", "Tensor"]],
                   adapters: Sequence[str]) -> "Tensor":
    """weight + sum of scaling[a] * B @ A over `adapters` ((A, B) in `factors`), summed in fp32, as weight's
    dtype (one rounding). A new tensor: never a view of the base weight. One adapter of the weight's dtype
    on the CPU is one GEMM (fused_merge); anything else is summed in an fp32 copy of the weight."""
    if len(adapters) == 1:
        out = fused_merge(layer, weight, *factors[0], layer.scaling[adapters[0]], in_place=False)
        if out is not None:
            return out
    acc = weight.float().clone()
    with exact_matmul():           # the fp32 product in fp32, even where the job turned TF32 on
        for a, (A, B) in zip(adapters, factors):
            acc.add_(adapter_delta(layer, A, B), alpha=layer.scaling[a])
    return acc.to(weight.dtype)


def merged_adapters(layer: Any) -> list[str]:
    """The adapters of a LoRA layer that the merge adds (none when peft merged them into the base already)."""
    if getattr(layer, "merged", False):
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


def walk_modules(model: Any) -> Iterator[tuple[str, Any, Optional[list]]]:
    """(prefix, module, params) per module in HF order (the order of named_parameters): a peft LoRA layer comes
    with params None (its base weight and adapters are read together), every other module with its own
    not-yet-seen (name, parameter) pairs (tied weights once, like HF's state dict)."""
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    lora_cls = lora_layer_class() if peft else None
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


def _lora_params(mod: Any, merged: bool) -> tuple[list, list, list]:
    """(base params, adapter factors, adapter names) of a peft LoRA layer, in the order `full` gets them."""
    layer = mod.base_layer
    adapters = merged_adapters(mod) if merged else []
    base = [layer.weight] + ([layer.bias] if getattr(layer, "bias", None) is not None else [])
    factors = [w for a in adapters for w in (mod.lora_A[a].weight, mod.lora_B[a].weight)]
    return base, factors, adapters


def param_groups(model: "Module", *, merged: bool = True) -> Iterator[list]:
    """The parameter lists named_weights hands to `full`, one per call, in its order (what a `full` that
    gathers several modules at once must know ahead)."""
    for _, mod, params in walk_modules(model):
        if params is not None:
            yield [p for _, p in params]
        else:
            base, factors, _ = _lora_params(mod, merged)
            yield base + factors


def named_weights(model: "Module", *, merged: bool = True, full: FullParams = detached,
                  direct: bool = True) -> Iterator[tuple[str, "Tensor", bool]]:
    """(HF name, tensor, is_direct) of every weight the rollout loads: LoRA merged into the base (merged=True)
    or the base alone; lora_* tensors left out. is_direct: the tensor is what `full` handed out (with
    direct=True, a view of the trainer's own storage), not a temporary made by the merge."""
    for prefix, mod, params in walk_modules(model):
        if params is not None:
            with full([p for _, p in params]) as tensors:
                for (pn, _), t in zip(params, tensors):
                    yield prefix + pn, t, direct
            continue
        base, factors, adapters = _lora_params(mod, merged)
        with full(base + factors) as tensors:
            weight = tensors[0]
            if adapters:
                pairs = [(tensors[len(base) + 2 * i], tensors[len(base) + 2 * i + 1]) for i in range(len(adapters))]
                yield prefix + "weight", merge_adapters(mod, weight, pairs, adapters), False
            else:
                yield prefix + "weight", weight, direct
            if len(base) > 1:
                yield prefix + "bias", tensors[1], direct


def weight_sizes(model: "Module", *, merged: bool, direct: bool,
                 nbytes_of: Callable[[Any], int]) -> Iterator[tuple[str, int, bool]]:
    """(name, nbytes_of(param), is_direct) of what named_weights yields, from the parameters' metadata only
    (nothing gathered or computed)."""
    for prefix, mod, params in walk_modules(model):
        if params is None:
            yield prefix + "weight", nbytes_of(mod.base_layer.weight), direct and not (merged and merged_adapters(mod))
            if getattr(mod.base_layer, "bias", None) is not None:
                yield prefix + "bias", nbytes_of(mod.base_layer.bias), direct
            continue
        for pn, p in params:
            yield prefix + pn, nbytes_of(p), direct


def merged_named_weights(model: "Module") -> Iterator[tuple[str, "Tensor"]]:
    """(HF name, tensor) of a model; for a peft LoRA model, base + scaling * B @ A under the base's names."""
    for name, t, _ in named_weights(model):
        yield name, t


__all__ = ["DEFAULT_TARGET_MODULES", "adapter_delta", "build_lora_config", "check_lora_layers", "detached",
           "exact_matmul", "fused_merge", "is_peft_model", "lora_layer_class", "merge_adapters", "merged_adapters",
           "merged_named_weights", "named_weights", "param_groups", "walk_modules", "weight_sizes"]
