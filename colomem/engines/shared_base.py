"""One copy of a LoRA job's frozen base: the trainer's base parameters become views of vLLM's weights.

In a LoRA job the base never changes, so the trainer's model and an in-process vLLM engine can read the same
GPU memory. `alias_base(vllm_params, model)` points every frozen base parameter of a Hugging Face model
(peft-wrapped or not) at a view of the matching vLLM parameter and leaves the LoRA adapter parameters alone.

The layout is vLLM's for Qwen2 / Llama decoders at tensor-parallel size 1 (vllm/model_executor/models/qwen2.py,
llama.py): q_proj, k_proj and v_proj are row blocks of `self_attn.qkv_proj` (q rows, then k, then v, the
biases alike), gate_proj and up_proj row blocks of `mlp.gate_up_proj` (gate, then up), every other weight
(embed_tokens, o_proj, down_proj, the norms, lm_head) maps one to one. vLLM pads the vocabulary rows of
embed_tokens / lm_head (to a multiple of 64): the trainer sees the first `vocab_size` rows. With LoRA enabled
vLLM wraps its linear layers and their weights are named `<layer>.base_layer.weight`; both spellings are read.
A tied lm_head is one Parameter in the trainer and stays one (vLLM ties it the same way).

A parameter that already has storage keeps its identity (`param.data = view`: optimizers, hooks and
DeepSpeed see the same object); one on the meta device (a model built with `accelerate.init_empty_weights`,
so no second copy ever exists) is replaced by a new frozen Parameter in every module that held it.
Nothing here imports vLLM: it takes vLLM's parameters by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Union

import torch

from colomem.errors import SharedBaseError
from colomem.engines.vllm.lora_adapter import hf_base_name, is_lora_name

# HF module name -> (vLLM fused module, position of its row block inside the fused weight)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# vLLM pads these along their rows (the vocabulary): the trainer's tensor is the first rows
PADDED_ROWS = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Mapped:
    """One trainer parameter that is a view of vLLM's `vllm_name`, rows [row0, row0 + rows)."""

    name: str
    vllm_name: str
    row0: int
    rows: int
    nbytes: int


@dataclass
class SharedBaseReport:
    """What alias_base did: the parameters mapped, the bytes the trainer no longer holds a copy of, what it
    left as the trainer's own memory (and why), vLLM's parameters the trainer does not read."""

    mapped: list[Mapped] = field(default_factory=list)
    not_mapped: dict[str, str] = field(default_factory=dict)
    vllm_unused: list[str] = field(default_factory=list)
    tied: list[tuple[str, str]] = field(default_factory=list)
    adapter_params: int = 0
    replaced: int = 0                    # meta parameters replaced by new Parameters (the others kept identity)

    @property
    def bytes_shared(self) -> int:
        return sum(m.nbytes for m in self.mapped)

    def as_dict(self) -> dict:
        return {"parameters_mapped": len(self.mapped), "bytes_shared": self.bytes_shared,
                "not_mapped": dict(self.not_mapped), "vllm_unused": list(self.vllm_unused),
                "tied": [list(t) for t in self.tied], "adapter_params": self.adapter_params,
                "replaced": self.replaced}


def vllm_param_dict(vllm: Union[torch.nn.Module, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{name: tensor} of vLLM's model (a module or a mapping), names without vLLM's LoRA `.base_layer.`."""
    items: Iterable = (vllm.named_parameters(remove_duplicate=False) if isinstance(vllm, torch.nn.Module)
                       else vllm.items())
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        out[name.replace(".base_layer.", ".")] = t
    return out


def vllm_target(name: str) -> tuple[str, Optional[tuple[str, str, int]]]:
    """(vLLM name, fused) of a plain HF name; fused = (prefix, suffix, block index) when the HF tensor is a
    row block of a fused vLLM weight."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED:
        fused, idx = FUSED[parts[-2]]
        prefix, suffix = ".".join(parts[:-2]), parts[-1]
        return f"{prefix}.{fused}.{suffix}", (prefix, suffix, idx)
    return name, None


def _trainer_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) once per Parameter object (a tied lm_head is named once, like named_parameters)."""
    return list(model.named_parameters())


def _check_tensor(name: str, p: torch.Tensor, view: torch.Tensor, vname: str) -> None:
    if tuple(view.shape) != tuple(p.shape):
        raise SharedBaseError(
            f"the trainer's {name} has shape {tuple(p.shape)} but its part of vLLM's {vname} has "
            f"{tuple(view.shape)}: the two models are not the same checkpoint, or vLLM is tensor-parallel")
    if view.dtype != p.dtype:
        raise SharedBaseError(f"the trainer's {name} is {p.dtype} but vLLM's {vname} is {view.dtype}: build both "
                              "in the same dtype (vLLM's dtype= and the trainer's model dtype)")
    if p.device.type != "meta" and p.device != view.device:
        raise SharedBaseError(f"the trainer's {name} is on {p.device} but vLLM's {vname} is on {view.device}: "
                              "build the trainer's model on vLLM's device (or on the meta device)")


def _rows(name: str, vname: str, v: torch.Tensor, row0: int, rows: int) -> torch.Tensor:
    if not v.is_contiguous():
        raise SharedBaseError(f"vLLM's {vname} (for {name}) is not contiguous: it cannot be shared as row views")
    if row0 + rows > v.shape[0]:
        raise SharedBaseError(f"the trainer's {name} needs rows [{row0}, {row0 + rows}) of vLLM's {vname}, which "
                              f"has {v.shape[0]}: the layouts differ (tensor-parallel shard or another model)")
    return v.detach().narrow(0, row0, rows)


def plan_views(vparams: Mapping[str, torch.Tensor], params: list[tuple[str, torch.Tensor]],
               report: SharedBaseReport, *, tied: bool = False) -> list[tuple[str, torch.Tensor, torch.Tensor, Mapped]]:
    """(trainer name, parameter, view of vLLM's storage, Mapped) for every base parameter that has a vLLM
    counterpart; the others go to report.not_mapped. Checks shapes, dtypes, devices and fused row counts.
    tied: the model's config ties lm_head to embed_tokens, so a separate lm_head (a model built on the meta
    device is not tied yet) maps onto vLLM's embed_tokens."""
    hf = {hf_base_name(n): (n, p) for n, p in params if not is_lora_name(n)}

    def target(plain: str) -> tuple[str, Optional[tuple[str, str, int]]]:
        # an engine that keeps the HF layout (the CPU stand-in's transformers model) has the plain name
        vname, fused = vllm_target(plain)
        return (plain, None) if fused is not None and vname not in vparams and plain in vparams else (vname, fused)

    # the row blocks of each fused weight, from the trainer's own shapes (q, k and v differ under GQA)
    blocks: dict[str, list[int]] = {}
    for plain, (_, p) in hf.items():
        vname, fused = target(plain)
        if fused is not None:
            b = blocks.setdefault(vname, [0] * len(FUSED_PARTS[vname.split(".")[-2]]))
            b[fused[2]] = int(p.shape[0]) if p.dim() else 1
    out = []
    for plain, (name, p) in hf.items():
        if ".modules_to_save." in name or ".original_module." in name:
            raise SharedBaseError(f"{name} belongs to a peft modules_to_save copy: a trained copy of a base module "
                                  "cannot share vLLM's weights; drop modules_to_save from the LoRA config")
        vname, fused = target(plain)
        if tied and vname.endswith("lm_head.weight") and vname not in vparams:
            vname = vname[: -len("lm_head.weight")] + "model.embed_tokens.weight"
        v = vparams.get(vname)
        if v is None:
            report.not_mapped[name] = f"vLLM has no parameter {vname}"
            continue
        if fused is not None:
            b = blocks[vname]
            if 0 in b:
                missing = [FUSED_PARTS[vname.split(".")[-2]][i] for i, n in enumerate(b) if n == 0]
                raise SharedBaseError(f"vLLM's {vname} fuses {missing} too, which the trainer's model does not have")
            if sum(b) != v.shape[0]:
                raise SharedBaseError(
                    f"vLLM's {vname} has {v.shape[0]} rows but the trainer's blocks of it sum to {sum(b)} ({b}): "
                    "vLLM is tensor-parallel or another model")
            row0, rows = sum(b[:fused[2]]), b[fused[2]]
        else:
            rows = int(p.shape[0]) if p.dim() else 1
            row0 = 0
            if p.dim() and rows != v.shape[0] and not plain.endswith(PADDED_ROWS):
                raise SharedBaseError(f"the trainer's {name} has {rows} rows but vLLM's {vname} has {v.shape[0]}")
        view = _rows(name, vname, v, row0, rows) if p.dim() else v.detach()
        _check_tensor(name, p, view, vname)
        out.append((name, p, view, Mapped(name, vname, row0, rows, view.numel() * view.element_size())))
    return out


def alias_base(vllm: Union[torch.nn.Module, Mapping[str, torch.Tensor]], model: torch.nn.Module, *,
               tensor_parallel_size: int = 1) -> SharedBaseReport:
    """Points every frozen base parameter of `model` at a view of vLLM's matching parameter and freezes it.

    `vllm`: vLLM's model (or its parameters by name). `model`: the trainer's HF model, peft-wrapped or not;
    its lora_* parameters stay as they are (trainable). Every check runs before the first parameter changes,
    so a SharedBaseError leaves the model untouched. Returns what was shared and what was not, and why.
    """
    if int(tensor_parallel_size) != 1:
        raise SharedBaseError(
            f"sharing the base with vLLM needs tensor_parallel_size=1 (got {tensor_parallel_size}): at TP>1 each "
            "vLLM rank holds a shard of every weight while the trainer needs the whole tensor")
    vparams = vllm_param_dict(vllm)
    report = SharedBaseReport()
    params = _trainer_params(model)
    report.adapter_params = sum(1 for n, _ in params if is_lora_name(n))
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    plan = plan_views(vparams, params, report, tied=tied)
    holders = _holders(model) if any(p.device.type == "meta" for _, p, _, _ in plan) else {}
    made: dict[tuple, torch.nn.Parameter] = {}       # one Parameter per vLLM view: a tie stays one object
    for name, p, view, m in plan:
        if p.device.type == "meta":
            key = (m.vllm_name, m.row0, m.rows)
            new = made.setdefault(key, torch.nn.Parameter(view, requires_grad=False))
            for mod, attr in holders.get(id(p), []):
                mod._parameters[attr] = new
            report.replaced += 1
        else:
            with torch.no_grad():
                p.data = view
            p.requires_grad_(False)
        report.mapped.append(m)
    for name, p in model.named_parameters():
        if not is_lora_name(name) and p.device.type == "meta":
            raise SharedBaseError(f"{name} is still on the meta device after sharing ({report.not_mapped.get(name)})")
        if not is_lora_name(name):
            p.requires_grad_(False)           # not mapped ones are frozen too: the base is the base
    used = {m.vllm_name for m in report.mapped}
    report.vllm_unused = sorted(n for n in vparams if n not in used and not _is_duplicate(vparams, n, used))
    report.tied = _ties(model)
    return report


def _holders(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) that holds it (two for a tied lm_head)."""
    out: dict[int, list] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, attr))
    return out


def _ties(model: torch.nn.Module) -> list[tuple[str, str]]:
    seen: dict[int, str] = {}
    ties = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            ties.append((seen[id(p)], name))
        else:
            seen[id(p)] = name
    return ties


def _is_duplicate(vparams: Mapping[str, torch.Tensor], name: str, used: set) -> bool:
    """vLLM names its tied lm_head too (remove_duplicate=False): the same tensor as a used one is not unused."""
    t = vparams[name]
    return any(vparams[u] is t for u in used)


def base_storages(model: torch.nn.Module) -> dict[int, int]:
    """{storage pointer: storage bytes} of the model's non-adapter parameters, each storage once."""
    out: dict[int, int] = {}
    for name, p in model.named_parameters():
        if not is_lora_name(name):
            s = p.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def check_still_shared(vllm: Union[torch.nn.Module, Mapping[str, torch.Tensor]], model: torch.nn.Module,
                       report: SharedBaseReport) -> None:
    """Raises SharedBaseError naming the first mapped parameter that no longer is its view of vLLM's weight
    (something, e.g. a `.to()` or an engine's flattening, gave it storage of its own)."""
    vparams = vllm_param_dict(vllm)
    # by plain HF name: the report names the parameters as they were when shared, before a peft wrap
    params = {hf_base_name(n): p for n, p in model.named_parameters() if not is_lora_name(n)}
    for m in report.mapped:
        p, v = params.get(hf_base_name(m.name)), vparams[m.vllm_name]
        want = v.data_ptr() + m.row0 * (v.stride(0) if v.dim() else 0) * v.element_size()
        if p is None or p.data_ptr() != want or p.requires_grad:
            raise SharedBaseError(f"the trainer's {m.name} is no longer a frozen view of vLLM's {m.vllm_name}: "
                                  "something moved or unfroze it after alias_base")


def shared_tensors(vllm: Union[torch.nn.Module, Mapping[str, torch.Tensor]],
                   report: SharedBaseReport) -> dict[str, torch.Tensor]:
    """{vLLM name: tensor} of the vLLM weights the trainer reads: what BaseChecksum guards."""
    vparams = vllm_param_dict(vllm)
    return {n: vparams[n] for n in sorted({m.vllm_name for m in report.mapped})}


def trainer_base_is_frozen(model: torch.nn.Module) -> bool:
    return all(not p.requires_grad for n, p in model.named_parameters() if not is_lora_name(n))


__all__ = ["FUSED", "Mapped", "SharedBaseReport", "alias_base", "base_storages", "check_still_shared",
           "plan_views", "shared_tensors", "trainer_base_is_frozen", "vllm_param_dict", "vllm_target"]
