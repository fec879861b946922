"""A shared LoRA base merged for the rollout and given back bit for bit after it (--shared-base-rollout merged).

With one copy of the base (--shared-base) the rollout engine's weights are the trainer's frozen base. Served as
an adapter, every adapted linear layer costs vLLM two more kernels (LoRA's shrink and expand) at every decode
step; from plain weights it decodes as fast as without LoRA. So in this mode the sync adds scaling * B @ A
into each adapted base weight in place (one fp32 product and one rounding a layer, no merged copy made: the
rollout's load then finds the merged weights in its own memory), and after the rollout the adapted weights are
written back from a host copy taken once:
the base is frozen, so one copy serves the whole run. Subtracting the merge again would not give the base back:
bf16 rounds (W + D) - D.

Only the adapted layers' base weights change (a merge writes nothing else), so only they are copied: on a
Qwen2-7B-shaped model with every linear layer adapted, 13 GB of its 15 GB, one host-to-device copy a step
(0.25 s at the link). Where the GPU has that much to spare through both phases (the placement planner says,
from the measured memory), `hold_on_device` keeps a second copy in GPU memory and the restore becomes a
device-to-device copy (milliseconds); the host copy stays, the one the first merge took.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from colomem.engines.staging import Staging
from colomem.errors import ColomemError, SharedBaseError
from colomem.mapped import layout


class BaseRestore:
    """The base weights of `model`'s LoRA layers (the tensors the rollout engine reads), copied to the host
    once; `restore()` writes them back after a merged rollout."""

    def __init__(self, model: Any, pool: Any = None):
        # the LoRA layers, walked once: a walk of a 7B model's modules costs more host time than its merge's
        # kernels take on the GPU (merge_in_place walks again only for another model)
        self._model = weakref.ref(model)
        self._layers = _lora_layers(model)
        self.views: list[tuple[str, torch.Tensor]] = [(prefix + "weight", mod.base_layer.weight)
                                                      for prefix, mod in self._layers]
        if not self.views:
            raise SharedBaseError("a merged rollout on the shared base needs LoRA layers, and the trainer's model "
                                  "has none")
        self._staging = Staging()           # holds the host copy (a pool block) for the run
        self.host = self._host_copies(pool)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.host)
        self.source = self.host             # what restore() copies from: the host copy, or hold_on_device's
        self._device_buf: Any = None
        self.merged = False                 # the base holds merged weights: restore() before anyone trains on it
        self.last_restore_s = 0.0
        self.restores = 0
        self._merge_timer: Any = None

    def _host_copies(self, pool: Any) -> list[torch.Tensor]:
        """The adapted weights on the host, pinned where the base is on a GPU (the copy back then runs at the
        link's rate): laid end to end in one page-locked buffer, a block of the job's pinned pool when it has
        room, else torch's pinned memory."""
        tensors = [t.detach() for _, t in self.views]
        if not any(t.is_cuda for t in tensors):
            return [t.clone() for t in tensors]
        offsets, total = layout([t.numel() * t.element_size() for t in tensors])
        try:
            buf = self._staging.buffer(total, pool)
        except ColomemError:          # the pool's cap: torch's pinned memory instead
            buf = self._staging.buffer(total)
        return _laid_out(tensors, buf, offsets)

    def merge_in_place(self, model: Any) -> list[tuple[str, torch.Tensor]]:
        """base + scaling * B @ A written into each adapted base weight itself (the tensors the rollout engine
        reads), with the arithmetic of colomem.engines.lora.merge_adapters: the product summed in fp32 and one
        rounding to the weight's dtype (one adapter on the CPU: one GEMM into the weight, no fp32 temporary of
        its size; on a GPU an fp32 product added in place, as cuBLAS's bf16 GEMM would round twice).
        Returns the merged weights as (HF name, the base weight): what the rollout loads, its own memory where
        the base is shared. Marks the base merged first, so a merge that fails half way is
        restored too; the caller restores a merge still in the base before this."""
        from colomem.engines.lora import adapter_delta, exact_matmul, fused_merge, merge_adapters, merged_adapters

        self.merged = True
        layers = self._layers if self._model() is model else _lora_layers(model)
        timer = _GpuTimer(self.views[0][1].device)
        # one exact_matmul around the loop, not one a layer: the merge's time is the host's launches
        with torch.no_grad(), exact_matmul():
            for _, mod in layers:
                weight = mod.base_layer.weight
                adapters = merged_adapters(mod)
                factors = [(mod.lora_A[a].weight, mod.lora_B[a].weight) for a in adapters]
                if len(adapters) == 1:       # one GEMM into the weight (CPU), else an fp32 product added
                    if fused_merge(mod, weight, *factors[0], mod.scaling[adapters[0]], in_place=True) is None:
                        weight.add_(adapter_delta(mod, *factors[0]), alpha=mod.scaling[adapters[0]])
                elif adapters:
                    weight.copy_(merge_adapters(mod, weight, factors, adapters))
        timer.stop()
        self._merge_timer = timer
        return list(self.views)

    @property
    def last_merge_s(self) -> float:
        """How long the last merge_in_place ran: on a GPU its kernels' time between two events (read once the
        sync that follows waited for them, so reading it adds no wait of its own); else its wall time."""
        return self._merge_timer.seconds() if self._merge_timer is not None else 0.0

    @property
    def on_device(self) -> bool:
        """Whether restore() copies from a copy in GPU memory (hold_on_device)."""
        return self._device_buf is not None

    def device_bytes(self) -> int:
        """GPU bytes hold_on_device would take: 0 where the base is not on one GPU (nothing to gain) or the
        copy is held already."""
        devices = {t.device for _, t in self.views}
        if self.on_device or len(devices) != 1 or next(iter(devices)).type != "cuda":
            return 0
        return layout([t.numel() * t.element_size() for t in self.host])[1]

    def hold_on_device(self) -> int:
        """A copy of the adapted base weights in the base's own GPU memory, made from the host copy, which
        restore() reads from then on. Returns the GPU bytes it took (0: nothing done, device_bytes says why).
        Called once the base holds no merge (between a restore and the next merge), so either copy is exact."""
        total = self.device_bytes()
        if not total:
            return 0
        if self.merged:
            raise SharedBaseError("the base's copy can move to the GPU only while the base holds no merge")
        device = self.views[0][1].device
        offsets, _ = layout([t.numel() * t.element_size() for t in self.host])
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        out = _laid_out(self.host, buf, offsets, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        self.source, self._device_buf = out, buf
        return total

    def restore(self) -> float:
        """The adapted base weights back as they were (a no-op unless a merge wrote them); returns the seconds.
        Waits for the copies: the next reader is the trainer's forward, and the phase that restores pays it."""
        if not self.merged:
            return 0.0
        t0 = time.perf_counter()
        devices = set()
        with torch.no_grad():
            for (_, view), saved in zip(self.views, self.source):
                view.copy_(saved, non_blocking=view.is_cuda)
                if view.is_cuda:
                    devices.add(view.device)
        for d in devices:       # the copies' stream only: not the trainer's offload copies still in flight
            torch.cuda.current_stream(d).synchronize()
        self.merged = False
        self.restores += 1
        self.last_restore_s = time.perf_counter() - t0
        return self.last_restore_s


def _lora_layers(model: Any) -> list[tuple[str, Any]]:
    """(prefix, layer) of each peft LoRA layer of `model`, in HF order."""
    from colomem.engines.lora import walk_modules

    return [(prefix, mod) for prefix, mod, params in walk_modules(model) if params is None]


class _GpuTimer:
    """The time between its making and stop(): CUDA events on the device's current stream (the GPU's time for
    the work queued in between, read without a wait of its own once that work is done), else the wall clock."""

    def __init__(self, device: torch.device):
        self._device = device if device.type == "cuda" else None
        self._t0, self._wall = time.perf_counter(), 0.0
        self._events: Any = None
        if self._device is not None:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record(torch.cuda.current_stream(self._device))

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self._device))
        self._wall = time.perf_counter() - self._t0

    def seconds(self) -> float:
        if self._events is None:
            return self._wall
        start, end = self._events
        end.synchronize()                   # done already: the sync after the merge waited for the device
        return start.elapsed_time(end) / 1e3


def _laid_out(tensors: list[torch.Tensor], buf: torch.Tensor, offsets: list[int],
              non_blocking: bool = False) -> list[torch.Tensor]:
    """Copies of `tensors` in the byte buffer `buf`, each at its offset (colomem.mapped.layout), as views of it."""
    out = []
    for t, off in zip(tensors, offsets):
        v = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        v.copy_(t, non_blocking=non_blocking)
        out.append(v)
    return out


__all__ = ["BaseRestore"]
