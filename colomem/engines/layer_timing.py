"""How long the trainer's decoder layers take in a forward, timed through one training step: what recomputing
a checkpointed layer costs a step, which the placement planner weighs against the rollout's sleep and wake
(colomem.runner.sleep_trade).

Forward pre and post hooks on each decoder layer mark the span of every call: CUDA events on a GPU (queued with
the layer's kernels, so nothing waits for them in the step; one synchronize at its end reads them all),
perf_counter on the CPU. Each call is one of:

    forward     a training forward (gradients on, outside the backward): one for each layer and micro-batch
    recompute   the forward non-reentrant checkpointing runs again inside the backward; the hooks see it
                where transformers checkpoints the layer's whole call, not where it checkpoints its forward
                only (the hooks then stay outside the checkpoint), and it costs what the forward costs. Its
                call may end in an exception (torch stops a recompute once it has what the backward needs):
                the post hook runs then too
    no_grad     a forward without gradients (reference or first-pass logprobs): no backward repeats it,
                counted only

A layer's forward is the median training forward: a step's first calls also pay for warm-up (kernels loaded
on first use, torch.compile compiling) that later steps do not. Recomputing one layer costs a step that
forward once for each micro-batch the step trains on.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

from colomem.errors import PhaseOrderError

from .recompute import decoder_layers

FORWARD, RECOMPUTE, NO_GRAD = "forward", "recompute", "no_grad"
# the step record's metric the planner reads: seconds a step that recomputing one decoder layer costs
LAYER_STEP_KEY = "train/recompute_layer_step_s"


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward, where non-reentrant checkpointing recomputes (the
    graph task torch's own checkpoint keys its recompute on)."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


@dataclass(frozen=True)
class LayerTimes:
    """One step's calls of the decoder layers: `layers` timed, how many calls of each kind (over all layers),
    and the median seconds of a training forward and of a recompute (0: none seen) for one micro-batch."""
    layers: int
    forwards: int
    recomputes: int
    no_grad: int
    forward_s: float
    recompute_s: float = 0.0

    @property
    def micro_batches(self) -> float:
        """Micro-batches the step trained on (every layer runs one training forward in each)."""
        return self.forwards / self.layers

    @property
    def layer_step_s(self) -> float:
        """Seconds a step that recomputing one decoder layer costs: its forward, once a micro-batch."""
        return self.forward_s * self.micro_batches

    def metrics(self) -> dict[str, float]:
        return {"train/layer_forward_s": self.forward_s, "train/layer_forwards": float(self.forwards),
                "train/layer_recomputes": float(self.recomputes), "train/layer_no_grad_forwards": float(self.no_grad),
                "train/layer_recompute_s": self.recompute_s, LAYER_STEP_KEY: self.layer_step_s}


class LayerForwardTimer:
    """Times every call of `model`'s decoder layers while entered; leaving removes the hooks (after a failure
    too), and result() then reads the figures. A model without decoder layers transformers marks is not
    timed (result() is None)."""

    def __init__(self, model: Any):
        self._layers = decoder_layers(model)
        first = next(iter(model.parameters()), None)
        self._device = first.device if first is not None and first.device.type == "cuda" else None
        self._cuda = self._device is not None
        self._open: dict[int, list[tuple[str, Any]]] = {}     # id(layer) -> its calls still running
        self._spans: list[tuple[str, Any, Any]] = []           # (kind, start, end)
        self._counts = {FORWARD: 0, RECOMPUTE: 0, NO_GRAD: 0}
        self._handles: list[Any] = []

    def __enter__(self) -> "LayerForwardTimer":
        for layer in self._layers:
            self._handles.append(layer.register_forward_pre_hook(self._before))
            self._handles.append(layer.register_forward_hook(self._after, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._open.clear()

    def _stamp(self) -> Any:
        if self._cuda:
            import torch

            mark = torch.cuda.Event(enable_timing=True)
            mark.record()                # on the current stream: the backward's, in a recompute
            return mark
        return time.perf_counter()

    def _before(self, module: Any, args: Any) -> None:
        import torch

        kind = RECOMPUTE if in_backward() else FORWARD if torch.is_grad_enabled() else NO_GRAD
        self._counts[kind] += 1
        self._open.setdefault(id(module), []).append((kind, None if kind == NO_GRAD else self._stamp()))

    def _after(self, module: Any, args: Any, output: Any) -> None:
        running = self._open.get(id(module))
        if not running:
            return
        kind, start = running.pop()
        if start is not None:
            self._spans.append((kind, start, self._stamp()))

    def result(self) -> Optional[LayerTimes]:
        """The figures of the calls timed (None when no training forward was); waits for the GPU once."""
        if self._handles:
            raise PhaseOrderError("LayerForwardTimer.result() while it is still timing; leave it first")
        if not self._layers or not any(kind == FORWARD for kind, _, _ in self._spans):
            return None
        if self._cuda:
            import torch

            torch.cuda.synchronize(self._device)
        seconds: dict[str, list[float]] = {FORWARD: [], RECOMPUTE: []}
        for kind, start, end in self._spans:
            seconds[kind].append(start.elapsed_time(end) / 1e3 if self._cuda else end - start)
        self._spans.clear()
        recomputes = seconds[RECOMPUTE]
        return LayerTimes(len(self._layers), self._counts[FORWARD], self._counts[RECOMPUTE], self._counts[NO_GRAD],
                          statistics.median(seconds[FORWARD]), statistics.median(recomputes) if recomputes else 0.0)


__all__ = ["FORWARD", "LAYER_STEP_KEY", "LayerForwardTimer", "LayerTimes", "NO_GRAD", "RECOMPUTE", "in_backward"]
