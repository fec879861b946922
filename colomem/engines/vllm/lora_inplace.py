"""The trainer's LoRA adapter copied straight into the slot vLLM's LoRA manager activated for it.

vLLM 0.24 keeps every LoRA layer's adapters in stacked buffers, one row per slot, one pair per part of the
layer (q, k, v of a fused qkv_proj; gate, up of gate_up_proj; a single part elsewhere):

    lora_a_stacked[part]   [max_loras, 1, max_lora_rank, in]    A as peft holds it, (r, in)
    lora_b_stacked[part]   [max_loras, 1, out, max_lora_rank]   B as peft holds it, (out, r)

Activating an adapter (LoRAModelManager.activate_adapter -> layer.set_lora) zeroes the slot and copies A into
[:r, :in] and B into [:out, :r], after vLLM's loader converted both to the LoRA dtype and multiplied B by
alpha / r in that dtype (LoRALayerWeights.optimize). An adapter with the names and shapes of the active one is
therefore written over it with the same transform (cast A; cast B, then scale it), and everything else in
the slot (the rows beyond r, the parts the adapter has no weights for) stays zero from the activation. The
buffers keep their addresses, so captured CUDA graphs and the Punica kernels' pointer tables stay valid, and
the slot table and token mapping are untouched: nothing of vLLM's has to be refreshed.

Anything not mapped exactly raises AdapterLayoutError before a byte is written (the caller registers the
adapter through files instead): a module vLLM has no LoRA layer for, a shape other than the active adapter's,
a part the active adapter lacks, tensor parallelism, an embedding or lm_head adapter, a layer other than the
plain linear ones, an adapter that is not in a slot. vLLM's own copy of the adapter (the CPU tensors it
activated from) is left as it was: it is read again only if vLLM re-activates the adapter, which with one
adapter in one slot happens only after it was removed, and the caller then loads files anew.

The pieces that read vLLM (`manager_targets`) are thin; the rest works on plain tensors. This module imports
vLLM nowhere and CUDA only when the buffers are on a GPU.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from colomem.errors import AdapterLayoutError

PEFT_PREFIX = "base_model.model."

# vLLM's LoRA layers whose set_lora is the plain copy described above (exact class names: the sharded,
# variable-slice, MoE, embedding and logits-processor layers place their weights otherwise)
LINEAR_LORA_LAYERS = frozenset({
    "ColumnParallelLinearWithLoRA", "MergedColumnParallelLinearWithLoRA", "QKVParallelLinearWithLoRA",
    "MergedQKVParallelLinearWithLoRA", "RowParallelLinearWithLoRA", "ReplicatedLinearWithLoRA",
})
EMBEDDING_MODULES = ("embed_tokens", "lm_head")

_FALLBACK = "; the adapter goes through vLLM's loader instead"


@dataclass
class Target:
    """Where one part of one layer's adapter goes: the views of the slot set_lora copied into."""
    module: str                 # vLLM's LoRA layer (a fused name such as ...qkv_proj)
    part: int                   # its sub-buffer
    a: torch.Tensor             # lora_a_stacked[part][slot, 0, :r, :in]
    b: torch.Tensor             # lora_b_stacked[part][slot, 0, :out, :r]


# ----------------------------------------------------------------------------------------------- names
def peft_module(name: str, map_name: Optional[Callable[[str], Optional[str]]] = None) -> tuple[str, bool]:
    """(module, is_lora_a) of a peft adapter tensor name, parsed as vLLM's loader does (parse_fine_tuned_lora_name:
    `base_model.model.` dropped, the model's hf_to_vllm name map applied). Embedding and lm_head adapters are
    refused: vLLM places those in buffers of another layout."""
    n = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    if map_name is not None:
        mapped = map_name(n)
        if mapped is None:
            raise AdapterLayoutError(f"{name!r}: the model's name map drops it{_FALLBACK}")
        n = mapped
    parts = n.split(".")
    if parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        raise AdapterLayoutError(f"{name!r} is an embedding adapter; only linear layers are written in place"
                                 f"{_FALLBACK}")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise AdapterLayoutError(f"{name!r} is not a peft LoRA weight name (<module>.lora_A.weight or "
                                 f"<module>.lora_B.weight){_FALLBACK}")
    module = ".".join(parts[:-2])
    if parts[-3] in EMBEDDING_MODULES:
        raise AdapterLayoutError(f"{module!r} is an embedding / lm_head adapter; only linear layers are written "
                                 f"in place{_FALLBACK}")
    return module, parts[-2] == "lora_A"


def part_map(modules: Iterable[str], packed: dict) -> dict:
    """{adapter module name: (vLLM LoRA layer, part)}: a fused layer's sub-layers by their place in it
    (vLLM's packed_modules: {"...qkv_proj": ["...q_proj", "...k_proj", "...v_proj"]}), every other layer as
    its own part 0."""
    out: dict = {}
    for m in modules:
        subs = packed.get(m) or ()
        if len(subs) > 1:
            for i, s in enumerate(subs):
                out[s] = (m, i)
        else:
            out[m] = (m, 0)
    return out


# ---------------------------------------------------------------------------------------------- slots
def slot_target(module: str, part: int, a_stacked: torch.Tensor, b_stacked: torch.Tensor, slot: int,
                a_shape: tuple, b_shape: tuple) -> Target:
    """The views set_lora copies an A of `a_shape` (r, in) and a B of `b_shape` (out, r) into, in `slot` of
    one part's stacked buffers; AdapterLayoutError when they do not fit there."""
    if a_stacked.dim() != 4 or b_stacked.dim() != 4 or a_stacked.shape[1] != 1 or b_stacked.shape[1] != 1:
        raise AdapterLayoutError(f"{module!r} part {part}: vLLM's LoRA buffers are {tuple(a_stacked.shape)} / "
                                 f"{tuple(b_stacked.shape)}, not [slots, 1, rank, in] / [slots, 1, out, rank]"
                                 f"{_FALLBACK}")
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        raise AdapterLayoutError(f"{module!r} part {part}: lora_A {tuple(a_shape)} and lora_B {tuple(b_shape)} "
                                 f"are not (r, in) and (out, r){_FALLBACK}")
    r, n_in = a_shape
    n_out = b_shape[0]
    if not (0 <= slot < a_stacked.shape[0] and r <= a_stacked.shape[2] and n_in <= a_stacked.shape[3]
            and n_out <= b_stacked.shape[2] and r <= b_stacked.shape[3]):
        raise AdapterLayoutError(f"{module!r} part {part}: an adapter of A {tuple(a_shape)}, B {tuple(b_shape)} "
                                 f"does not fit slot {slot} of buffers {tuple(a_stacked.shape)} / "
                                 f"{tuple(b_stacked.shape)}{_FALLBACK}")
    return Target(module, part, a_stacked[slot, 0, :r, :n_in], b_stacked[slot, 0, :n_out, :r])


def plan_copies(adapter: Iterable, parts: dict, targets: dict,
                map_name: Optional[Callable[[str], Optional[str]]] = None, resolved: Optional[dict] = None) -> list:
    """[(Target, A, B)] for the adapter's (peft name, tensor) pairs, checked against the active adapter's
    targets ({(layer, part): Target}); AdapterLayoutError naming the module for anything that does not map
    exactly (nothing is written before every pair passed). `resolved` keeps {name: (module, key, is_a)} of
    names already mapped, for the next version against the same targets."""
    halves: dict = {}
    names: dict = {}
    resolved = {} if resolved is None else resolved
    for name, t in adapter:
        if not isinstance(t, torch.Tensor):
            raise AdapterLayoutError(f"{name!r} is a {type(t).__name__}, not a tensor{_FALLBACK}")
        hit = resolved.get(name)
        if hit is None:
            module, is_a = peft_module(name, map_name)
            key = parts.get(module)
            if key is None:
                raise AdapterLayoutError(f"vLLM has no LoRA layer for {module!r}{_FALLBACK}")
            if key not in targets:
                raise AdapterLayoutError(f"{module!r}: the adapter vLLM holds now has no weights there, so its "
                                         f"slot part was left empty{_FALLBACK}")
            hit = resolved[name] = (module, key, is_a)
        module, key, is_a = hit
        pair = halves.setdefault(key, [None, None])
        i = 0 if is_a else 1
        if pair[i] is not None:
            raise AdapterLayoutError(f"{module!r}: lora_{'AB'[i]} given twice{_FALLBACK}")
        pair[i] = t
        names[key] = module
    rev = {v: k for k, v in parts.items()}
    missing = [rev.get(k, f"{k[0]} part {k[1]}") for k in targets if k not in halves]
    if missing:
        raise AdapterLayoutError(f"the adapter lacks {len(missing)} module(s) the active one has, e.g. "
                                 f"{missing[:3]}{_FALLBACK}")
    out = []
    for key, (a, b) in halves.items():
        module, tgt = names[key], targets[key]
        if a is None or b is None:
            raise AdapterLayoutError(f"{module!r}: lora_{'B' if b is None else 'A'} is missing{_FALLBACK}")
        for what, src, dst in (("lora_A", a, tgt.a), ("lora_B", b, tgt.b)):
            if tuple(src.shape) != tuple(dst.shape):
                raise AdapterLayoutError(f"{module!r}: {what} is {tuple(src.shape)}, the active adapter's is "
                                         f"{tuple(dst.shape)}{_FALLBACK}")
            if not src.is_floating_point():
                raise AdapterLayoutError(f"{module!r}: {what} is {src.dtype}, not a floating-point tensor"
                                         f"{_FALLBACK}")
            if src.device != dst.device:
                raise AdapterLayoutError(f"{module!r}: {what} is on {src.device}, vLLM's slot on {dst.device}"
                                         f"{_FALLBACK}")
        out.append((tgt, a, b))
    return out


# --------------------------------------------------------------------------------------------- copies
def write_copies(copies: list, scaling: float, timeout: float, ready: Any = None) -> float:
    """Copies every (Target, A, B): A cast to the slot's dtype, B cast then multiplied by `scaling` in that
    dtype (vLLM's loader rounds the same way). On a GPU all on the current stream, after `ready` (an event
    the producer recorded), then waited for with a bound. Returns the seconds it took."""
    t0 = time.perf_counter()
    if not copies:
        return 0.0
    device = copies[0][0].a.device
    stream = None
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        if ready is not None:
            stream.wait_event(ready)
    scale = float(scaling)
    dst = [t.a for t, _, _ in copies] + [t.b for t, _, _ in copies]
    src = [a for _, a, _ in copies] + [b for _, _, b in copies]
    with torch.inference_mode():        # vLLM may have made its buffers as inference tensors: writable here
        if hasattr(torch, "_foreach_copy_"):   # one call for all (its per-tensor path is copy_ itself)
            torch._foreach_copy_(dst, src, non_blocking=True)
        else:
            for d, t in zip(dst, src):
                d.copy_(t, non_blocking=True)
        if scale != 1.0:
            bs = dst[len(copies):]
            if hasattr(torch, "_foreach_mul_"):
                torch._foreach_mul_(bs, scale)
            else:
                for d in bs:
                    d.mul_(scale)
    if stream is not None:
        from colomem.bridge.buffers import wait_stream

        wait_stream(stream, timeout, "writing the LoRA adapter into vLLM's slot")
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- vLLM's side
def active_slot(manager: Any, lora_id: int) -> Optional[int]:
    """The slot vLLM's LoRA manager has adapter `lora_id` active in, None when it is in none."""
    if manager is None or lora_id not in manager._active_adapters:
        return None
    try:
        return int(manager.lora_index_to_id.index(lora_id))
    except ValueError:
        return None


def manager_targets(manager: Any, held_model: Any, lora_id: int, slot: int) -> dict:
    """{(layer, part): Target} of every part the active adapter `lora_id` has weights for, from vLLM's
    LoRAModelManager (its layers) and the LoRAModel it activated (what set_lora copied, at which shape)."""
    targets: dict = {}
    for mname, layer in manager.modules.items():
        held = held_model.get_lora(mname)
        if held is None:
            continue                   # reset to zero at activation; an adapter with weights here is refused
        kind = type(layer).__name__
        if kind not in LINEAR_LORA_LAYERS:
            raise AdapterLayoutError(f"{mname!r} is a {kind}; only plain linear LoRA layers are written in place"
                                     f"{_FALLBACK}")
        if int(getattr(layer, "tp_size", 1)) != 1:
            raise AdapterLayoutError(f"{mname!r} is split over {layer.tp_size} tensor-parallel ranks; in-place "
                                     f"writes take unsplit layers only{_FALLBACK}")
        a_list = held.lora_a if isinstance(held.lora_a, list) else [held.lora_a]
        b_list = held.lora_b if isinstance(held.lora_b, list) else [held.lora_b]
        n = len(layer.lora_a_stacked)
        if not (len(a_list) == len(b_list) == n == len(layer.lora_b_stacked)):
            raise AdapterLayoutError(f"{mname!r}: vLLM holds {len(a_list)} part(s) of the adapter for a layer of "
                                     f"{n}{_FALLBACK}")
        for part, (a, b) in enumerate(zip(a_list, b_list)):
            if a is None and b is None:
                continue
            if a is None or b is None:
                raise AdapterLayoutError(f"{mname!r} part {part}: vLLM holds only one of lora_A, lora_B"
                                         f"{_FALLBACK}")
            targets[(mname, part)] = slot_target(mname, part, layer.lora_a_stacked[part],
                                                 layer.lora_b_stacked[part], slot, tuple(a.shape), tuple(b.shape))
    if not targets:
        raise AdapterLayoutError(f"adapter {lora_id} has no weights in any linear LoRA layer of vLLM{_FALLBACK}")
    return targets


@dataclass
class Layout:
    """What one active adapter's writes reuse: its targets and the names already mapped to them."""
    lora_id: int
    slot: int
    held: Any                   # weakref to the LoRAModel vLLM activated: a re-added adapter is another one
    parts: dict
    targets: dict
    map_name: Optional[Callable[[str], Optional[str]]]
    resolved: dict


def layout_for(manager: Any, lora_id: int, cache: Optional[dict] = None) -> Layout:
    """The Layout of adapter `lora_id` in vLLM's manager, from `cache` while it is still the same adapter in
    the same slot; AdapterLayoutError when it is in no slot or not held."""
    if manager is None:
        raise AdapterLayoutError(f"vLLM runs without LoRA (no LoRA manager in its model runner){_FALLBACK}")
    slot = active_slot(manager, lora_id)
    if slot is None:
        raise AdapterLayoutError(f"adapter {lora_id} is in none of vLLM's LoRA slots now{_FALLBACK}")
    held = manager.get_adapter(lora_id)
    if held is None:
        raise AdapterLayoutError(f"vLLM's LoRA manager does not hold adapter {lora_id}{_FALLBACK}")
    old = cache.get("layout") if cache is not None else None
    if old is not None and old.lora_id == lora_id and old.slot == slot and old.held() is held:
        return old
    mapper = getattr(getattr(manager, "model", None), "hf_to_vllm_mapper", None)   # as vLLM's loader maps names
    parts = part_map(manager.modules, getattr(manager, "packed_modules", {}) or {})
    layout = Layout(lora_id, slot, weakref.ref(held), parts, manager_targets(manager, held, lora_id, slot),
                    getattr(mapper, "_map_name", None), {})
    if cache is not None:
        cache["layout"] = layout
    return layout


def write_adapter(manager: Any, lora_id: int, adapter: list, scaling: float, timeout: float,
                  ready: Any = None, cache: Optional[dict] = None) -> dict:
    """The adapter's (peft name, tensor) pairs written over the slot adapter `lora_id` is active in (`cache`:
    a dict kept between calls, for the Layout).

    Returns {"slot", "tensors", "nbytes", "seconds"}; AdapterLayoutError (nothing written) when it does not
    map exactly."""
    t0 = time.perf_counter()
    lay = layout_for(manager, int(lora_id), cache)
    copies = plan_copies(adapter, lay.parts, lay.targets, lay.map_name, lay.resolved)
    write_copies(copies, scaling, timeout, ready)
    nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, a, b in copies)
    return {"slot": lay.slot, "tensors": 2 * len(copies), "nbytes": int(nbytes),
            "seconds": time.perf_counter() - t0}


__all__ = ["EMBEDDING_MODULES", "LINEAR_LORA_LAYERS", "Layout", "Target", "active_slot", "layout_for",
           "manager_targets", "part_map", "peft_module", "plan_copies", "slot_target", "write_adapter",
           "write_copies"]
