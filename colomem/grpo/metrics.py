"""A step's training metrics, kept on the device until the step's micro-batches are done.

Reading a GPU number (float(t), .item()) waits for every kernel queued before it, and while it waits the host
queues nothing: read after each micro-batch's loss, a dozen metrics stall the host before every backward.
The loss functions can return their metrics as 0-d tensors instead (lazy=True); MetricAccumulator sums them
on the device and result() reads them all at once, in float64 as the float path computes them, so both give
the same numbers.

A metric value is a float, a 0-d tensor, or (value, present): a 0-d tensor and a 0-d 0/1 flag, for a metric
a micro-batch may not have (it then counts for nothing in the weighted mean, and a metric no micro-batch had
is left out).
"""
from __future__ import annotations

from typing import Mapping, Union

import torch
from torch import Tensor

Value = Union[float, Tensor, tuple[Tensor, Tensor]]


def optional(value: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """A metric that exists only where `present` (a 0-d bool tensor) holds, without reading it."""
    return value.detach(), present.detach().to(torch.float64)


def _read_all(values: list) -> list:
    """Floats of the tensors among values (one device read per device), the floats as they are."""
    out = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, Tensor):
            by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        got = torch.stack([values[i].detach().to(torch.float64).reshape(()) for i in idx]).tolist()
        for i, g in zip(idx, got):
            out[i] = g
    return out


def read(metrics: Mapping[str, Value]) -> dict[str, float]:
    """Every metric as a float, read from the device at once; an optional metric that is absent is left out."""
    keys = list(metrics)
    flat: list = []
    for k in keys:
        v = metrics[k]
        flat.extend(v if isinstance(v, tuple) else (v, 1.0))
    got = _read_all(flat)
    return {k: got[2 * i] for i, k in enumerate(keys) if got[2 * i + 1]}


def _f64(v) -> Union[float, Tensor]:
    return v.detach().to(torch.float64) if isinstance(v, Tensor) else float(v)


class MetricAccumulator:
    """Weighted means of micro-batch metrics (max for *_max, min for *_min; sums for counts and the weighted
    "loss"). Values may be floats or tensors (see the module docstring): tensors stay on the device until
    result()."""
    _SUM = ("completion_tokens", "loss")

    def __init__(self) -> None:
        self._acc: dict[str, Union[float, Tensor]] = {}
        self._w: dict[str, Union[float, Tensor]] = {}
        self._optional: set[str] = set()

    def add(self, metrics: Mapping[str, Value], weight: float) -> None:
        for k, raw in metrics.items():
            w: Union[float, Tensor] = weight
            v = _f64(raw[0] if isinstance(raw, tuple) else raw)
            if isinstance(raw, tuple):       # absent: weight 0, and its value (maybe NaN) not added at all
                flag = raw[1].to(torch.float64)
                w = flag * weight
                v = torch.where(flag > 0, v, torch.zeros_like(flag))
                self._optional.add(k)
            if k.endswith("_max") or k.endswith("_min"):
                pick = max if k.endswith("_max") else min
                prev = self._acc.get(k)
                if prev is None:
                    self._acc[k] = v
                elif isinstance(prev, Tensor) or isinstance(v, Tensor):
                    dev = next(x.device for x in (prev, v) if isinstance(x, Tensor))
                    a, b = (torch.as_tensor(x, dtype=torch.float64, device=dev) for x in (prev, v))
                    self._acc[k] = torch.maximum(a, b) if pick is max else torch.minimum(a, b)
                else:
                    self._acc[k] = pick(prev, v)
                self._w[k] = 1.0
            elif k in self._SUM:
                self._acc[k] = self._acc.get(k, 0.0) + v
                self._w[k] = 1.0
            else:
                self._acc[k] = self._acc.get(k, 0.0) + v * w
                self._w[k] = self._w.get(k, 0.0) + w

    def result(self) -> dict[str, float]:
        keys = list(self._acc)
        got = _read_all([self._acc[k] for k in keys] + [self._w[k] for k in keys])
        acc, wts = got[:len(keys)], got[len(keys):]
        out = {}
        for k, v, w in zip(keys, acc, wts):
            if w:
                out[k] = v / w
            elif k not in self._optional:      # no weight at all: the sum as it is (0 for an empty batch)
                out[k] = v
        return out


__all__ = ["MetricAccumulator", "Value", "optional", "read"]
