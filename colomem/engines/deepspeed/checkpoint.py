"""DeepSpeedTrainer checkpoints: the engine's state byte for byte, read from the pool while offloaded.

DeepSpeed's own `save_checkpoint` reads the engine's GPU tensors, which the colomem offload has emptied; it
would need a reload (and the GPU memory vLLM is using) for every save. This writes the equivalent from the
pool's host copies instead, one file per rank:

    trainer-rank<R>.pt   every storage the engine keeps between steps (the bf16 parameters, the fp32 master
                         partitions, module buffers) as raw bytes under the names collect_engine_state gives
                         them; the Adam state (moments, step) by its master partition's name; the engine's counters;
                         the lr scheduler; the CPU and CUDA RNG states; the layout (ZeRO stage, world size,
                         DeepSpeed version) a resume must match.

Resident, the same bytes are copied from the GPU. Loading writes them into a freshly built engine of the same
model and layout, in place (the tensors DeepSpeed's hooks and views point at stay the same objects), so the
state after load_state equals the state saved, bit for bit. Gradients and scratch buffers are not saved: a
step overwrites them before reading them.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from colomem.engines.hf_export import save_torch
from colomem.engines.pending_write import host_copy
from colomem.errors import ColomemError, ConfigError

from .state import CATEGORIES, collect_engine_state, storage_key
from .strategies import ColomemOffload

# 2: no learning-rate scheduler state (a resume builds the schedule from its flags); format 1 files still load
FORMAT = 2
SAVED_CATEGORIES = tuple(c for c in CATEGORIES if c not in ("grads", "optim"))   # optim: by master name
REQUIRED_CATEGORIES = ("params", "master")          # must match exactly; "other" is restored where it does
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def rank_file(path: Path, rank: int) -> Path:
    return path / f"trainer-rank{rank}.pt"


def _gpu_bytes(t: Tensor) -> Tensor:
    """t's whole storage as uint8 on its own device."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def _state(trainer: Any):
    """The engine's state as the trainer counts it (a base shared with the rollout engine left out)."""
    return collect_engine_state(trainer.engine, trainer.device, exclude=getattr(trainer, "_shared_storages", ()))


def layout(trainer: Any) -> dict:
    out = {"zero_stage": trainer.zero_stage, "world_size": trainer.world_size, "lora": trainer.lora is not None}
    if getattr(trainer, "shared", None) is not None:     # the base is the model's, not in the file
        out["shared_base"] = True
    return out


def prepare_state(trainer: Any, path: Path, offloaded: Optional[ColomemOffload] = None) -> Callable[[], None]:
    """This rank's file, ready to write: returns the write (file I/O only, fit for a background thread).
    offloaded: the colomem offload holding the state now (its pool copies are read where they are, so they
    must stay until the write ended: the trainer's WriteGuard); None: the trainer is resident (copied from the
    GPU now)."""
    engine = trainer.engine
    items = offloaded.offloaded_items() if offloaded is not None else None
    if items is None:
        st = _state(trainer)
        items = [(c, n, t) for c in CATEGORIES for n, t in st.groups.get(c, ())]

    def read(t: Tensor) -> Tensor:              # the whole storage, raw
        raw = offloaded.host_storage(t) if offloaded is not None else None
        return raw if raw is not None else host_copy(_gpu_bytes(t))

    def host(t: Tensor) -> Tensor:              # the tensor itself (torch's step counts live on the host)
        view = offloaded.host_view(t) if offloaded is not None else None
        return view if view is not None else host_copy(t)

    storages = {n: read(t) for c, n, t in items if c in SAVED_CATEGORIES}
    categories = {n: c for c, n, _ in items if c in SAVED_CATEGORIES}
    # The Adam state by the name of the master partition it belongs to, not torch's state_dict: ZeRO-3 puts a
    # sub-group's partition into the inner optimizer's param_groups only while it steps it.
    masters = {storage_key(t): n for c, n, t in items if c == "master"}
    inner = engine.optimizer.optimizer
    opt_state = {}
    for key, s in inner.state.items():
        name = masters.get(storage_key(key)) if isinstance(key, Tensor) else None
        if name is None:
            raise ColomemError("the DeepSpeed optimizer holds state for a tensor that is not one of its fp32 "
                               "master partitions; this DeepSpeed version is not supported by the checkpoint "
                               "(please report it)")
        opt_state[name] = {k: host(v) if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in s.items()}
    opt_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
    # no scheduler state: a resume builds the schedule from its own flags and stands it at "steps"
    blob = {"format": FORMAT, "layout": layout(trainer), "deepspeed": trainer.deepspeed_version,
            "steps": trainer.steps, "storages": storages, "categories": categories,
            "optimizer": {"state": opt_state, "param_groups": opt_groups},
            "counters": {k: getattr(engine, k) for k in _COUNTERS if isinstance(getattr(engine, k, None), int)},
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None}
    out = rank_file(path, trainer.rank)

    def write() -> None:
        path.mkdir(parents=True, exist_ok=True)
        save_torch(blob, out)
    return write


def prepare_model(trainer: Any, path: Path, merged: bool, stable: bool) -> list[Callable[[], None]]:
    """The model beside a rank's state, on rank 0, in Hugging Face format, ready to write: `model/` (the peft
    adapter with LoRA, the full model without), and with LoRA and merged, `model-merged/` (the adapter
    merged). Every rank calls it: ZeRO-3 gathers the weights collectively. stable: the weights the trainer
    gives are host tensors that stay until its next offload (offloaded); otherwise each is copied as it comes
    (ZeRO-3 reuses its gather buffers)."""
    from colomem.engines.hf_export import save_adapter, save_full_model

    writes: list[Callable[[], None]] = []
    lora = trainer.lora is not None
    main = trainer.rank == 0
    if lora:
        adapter = trainer.lora_state()                         # host copies
        if main:
            writes.append(lambda: save_adapter(trainer.model, adapter, path / "model"))
    if not lora or merged:
        weights: list[tuple[str, Tensor]] = []
        for n, t in trainer.named_weights(merged=True):       # collective on ZeRO-3 with several ranks
            if main:
                weights.append((n, t if stable else host_copy(t)))
        if main:
            out = path / ("model-merged" if lora else "model")
            writes.append(lambda: save_full_model(trainer.model, weights, out))
    return writes


def load_state(trainer: Any, path: Path) -> None:
    """This rank's file into the (resident, freshly built) trainer; ConfigError when it does not fit."""
    f = rank_file(path, trainer.rank)
    if not f.is_file():
        raise ConfigError(f"checkpoint {str(path)!r} has no {f.name}: it was written by another trainer or "
                          "another number of ranks; resume with the same backend and world size")
    blob = torch.load(f, map_location="cpu", weights_only=True)
    if int(blob.get("format", 0)) > FORMAT:
        raise ConfigError(f"{f} has format {blob.get('format')}; this colomem reads format {FORMAT} and older: "
                          "upgrade colomem")
    here = layout(trainer)
    if blob["layout"] != here:
        diff = "; ".join(f"{k} {blob['layout'].get(k)!r} there, {v!r} here" for k, v in here.items()
                         if blob["layout"].get(k) != v)
        raise ConfigError(f"checkpoint {str(path)!r} was written by another trainer layout ({diff}); resume with "
                          "the same ZeRO stage, world size and LoRA setting")
    engine = trainer.engine
    state = _state(trainer)
    live = {n: (c, t) for c in SAVED_CATEGORIES for n, t in state.groups.get(c, ())}
    saved, cats = blob["storages"], blob["categories"]
    for cat in REQUIRED_CATEGORIES:
        want = {n for n, c in cats.items() if c == cat}
        have = {n for n, (c, _) in live.items() if c == cat}
        if want != have:
            raise ConfigError(f"checkpoint {str(path)!r} is of another model or DeepSpeed version: its {cat} "
                              f"storages differ (missing here: {sorted(want - have)[:3]}, not there: "
                              f"{sorted(have - want)[:3]})")
    for name, raw in saved.items():
        if name not in live:
            continue                                  # an "other" storage this engine does not keep
        dst = _gpu_bytes(live[name][1])
        if dst.numel() != raw.numel():
            if live[name][0] in REQUIRED_CATEGORIES:
                raise ConfigError(f"checkpoint {str(path)!r}: {name} holds {raw.numel()} bytes there and "
                                  f"{dst.numel()} here; it is of another model")
            continue
        dst.copy_(raw)
    _load_optimizer(engine.optimizer.optimizer, blob["optimizer"], dict(state.groups.get("master", ())), path)
    for k, v in blob["counters"].items():
        setattr(engine, k, v)
    trainer.steps = int(blob["steps"])
    torch.set_rng_state(blob["torch_rng"])
    if blob["cuda_rng"] is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(blob["cuda_rng"], trainer.device)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


def _load_optimizer(inner: Any, saved: dict, masters: dict[str, Tensor], path: Path) -> None:
    """The Adam state into the fresh engine: in place where ZeRO built it at initialisation (its views of it
    stay valid), as new tensors on the master's device otherwise."""
    if len(saved["param_groups"]) != len(inner.param_groups):
        raise ConfigError(f"checkpoint {str(path)!r}: its optimizer has {len(saved['param_groups'])} parameter "
                          f"groups, this one {len(inner.param_groups)}; it is of another model or configuration")
    for name, s in saved["state"].items():
        p = masters.get(name)
        if p is None:
            raise ConfigError(f"checkpoint {str(path)!r}: optimizer state of {name}, which this engine does not "
                              "have; it is of another model or configuration")
        cur = inner.state[p]
        for k, v in s.items():
            old = cur.get(k)
            if isinstance(v, Tensor) and isinstance(old, Tensor) and old.shape == v.shape:
                old.copy_(v)
            elif isinstance(v, Tensor):
                cur[k] = v.clone() if k == "step" else v.to(p.device, copy=True)   # torch keeps steps on the host
            else:
                cur[k] = v
    for group, g in zip(inner.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in g.items() if k != "params"})


__all__ = ["FORMAT", "layout", "load_state", "prepare_model", "prepare_state", "rank_file"]
