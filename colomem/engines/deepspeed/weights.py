"""The weights DeepSpeedTrainer hands to the rollout: (HF name, tensor) with LoRA merged (colomem.engines.lora),
the full tensors of ZeRO-3 partitions, and what an offload prepares so they stay readable while offloaded.

Resident, a weight is a view of the engine's own storage where this rank holds it whole (ZeRO-2; ZeRO-3 on
one rank: the partition is the whole tensor), a gathered copy otherwise. Before an offload, `plan_sync`
keeps those views (the colomem offload then gives host views of their pool copies) and stages everything
else (merged LoRA weights, gathered ZeRO-3 weights) into one page-locked host buffer kept across offloads.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from colomem.engines import lora
from colomem.engines.hf_export import adapter_key
from colomem.engines.staging import Staging
from colomem.errors import ColomemError

from .gather import BucketedGather
from .state import storage_nbytes
from .strategies import OffloadStrategy

ALIGN = 256             # staged weights start on this byte boundary
GATHER_BUCKET_BYTES = 512 << 20   # ZeRO-3 on several ranks: parameter bytes gathered per collective


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class SyncSource:
    """Named weights prepared for the sync while the trainer is offloaded (host tensors)."""
    merged: bool
    items: list[tuple[str, Tensor]]


class WeightExport:
    """The rollout's view of an engine's module (a transformers model, or a peft model over one)."""

    def __init__(self, model: torch.nn.Module, *, zero_stage: int, world_size: int, device: torch.device,
                 gather_bucket_bytes: int = GATHER_BUCKET_BYTES):
        self.model = model
        self.zero_stage = zero_stage
        self.world_size = world_size
        self.device = device
        self.gather_bucket_bytes = int(gather_bucket_bytes)
        self.last_gathers = 0          # collectives the last walk over partitioned weights made

    @property
    def complete_locally(self) -> bool:
        return self.zero_stage != 3 or self.world_size == 1

    @contextlib.contextmanager
    def full_params(self, params: list) -> Iterator[list[Tensor]]:
        """Full (unpartitioned) tensors of params: views where the data is complete on this rank, gathered
        copies otherwise (collectively: every rank must enter)."""
        if self.zero_stage != 3 or not params or not all(hasattr(p, "ds_tensor") for p in params):
            yield [p.detach() for p in params]
            return
        if self.world_size == 1:
            yield [p.ds_tensor.narrow(0, 0, p.ds_numel).view(p.ds_shape) for p in params]
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield [p.data for p in params]

    def iter_weights(self, merged: bool) -> Iterator[tuple[str, Tensor, bool]]:
        """(HF name, full tensor, direct); direct: a view of the engine's own storage (not a temporary).
        ZeRO-3 partitions on several ranks are gathered a bucket of modules at a time (gather.py)."""
        if self.complete_locally or not all(hasattr(p, "ds_tensor") for p in self.model.parameters()):
            return lora.named_weights(self.model, merged=merged, full=self.full_params,
                                      direct=self.complete_locally)
        return self._gathered_weights(merged)

    def _gathered_weights(self, merged: bool) -> Iterator[tuple[str, Tensor, bool]]:
        import deepspeed

        full = BucketedGather(list(lora.param_groups(self.model, merged=merged)), self.gather_bucket_bytes,
                              lambda p: int(p.ds_numel) * p.element_size(),
                              lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=None))
        try:
            yield from lora.named_weights(self.model, merged=merged, full=full, direct=False)
        finally:
            full.close()
            self.last_gathers = full.gathers

    def weight_meta(self, merged: bool) -> Iterator[tuple[str, int, bool]]:
        """(name, aligned bytes, direct) of every weight, from shapes only (nothing gathered or computed)."""
        def nbytes_of(p) -> int:
            numel = int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()
            return _aligned(numel * p.element_size())
        return lora.weight_sizes(self.model, merged=merged, direct=self.complete_locally, nbytes_of=nbytes_of)

    def lora_tensors(self, copy: bool) -> dict[str, Tensor]:
        """The adapter's tensors named as peft saves them (…lora_A.weight, …lora_B.weight)."""
        named = [(n, p) for n, p in self.model.named_parameters() if ".lora_" in n]
        out = {}
        with self.full_params([p for _, p in named]) as full:
            for (n, _), t in zip(named, full):
                out[adapter_key(n)] = t.detach().to("cpu", copy=True) if copy else t
        return out

    def plan_sync(self, merged: bool, views_ok: bool, staging: Staging, pool: Any = None) -> tuple[list, int]:
        """Before the swap: (name, ('view', gpu tensor) | ('host', staged host tensor)) for every weight, and
        the bytes staged."""
        items = list(self.weight_meta(merged))
        need = sum(n for _, n, d in items if not (d and views_ok))
        host = staging.buffer(need, pool) if need else None
        plan, off = [], 0
        for name, t, is_direct in self.iter_weights(merged):
            if is_direct and views_ok:
                plan.append((name, ("view", t)))
                continue
            if host is None:
                raise ColomemError(f"named weight {name} needs staging but its size was not counted; this is a "
                                   "bug in the DeepSpeed adapter's weight export (please report it)")
            nbytes = t.numel() * t.element_size()
            dst = host[off:off + nbytes].view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=True)
            plan.append((name, ("host", dst)))
            off += _aligned(nbytes)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return plan, off

    @staticmethod
    def resolve_sync(plan: list, strategy: Optional[OffloadStrategy]) -> list[tuple[str, Tensor]]:
        """After the swap: the plan's GPU views replaced by host views of their offloaded copies."""
        out = []
        for name, (kind, t) in plan:
            if kind == "view":
                h = strategy.host_view(t) if strategy is not None else None
                if h is not None:
                    t = h
                elif storage_nbytes(t) == 0:
                    raise ColomemError(f"named weight {name} was offloaded but is not in the swap set; this is a "
                                       "bug in the DeepSpeed adapter's state collection (please report it)")
                # else: a storage that could not be resized stayed where it is (kept_bytes): read it there
            out.append((name, t))
        return out


__all__ = ["Staging", "SyncSource", "WeightExport"]
