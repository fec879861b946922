"""What a SwapSet moves, read from what users hold: any iterable of tensors or (name, tensor) pairs, a dict,
a module's parameters / buffers / gradients, an optimizer's state. Sources are callables evaluated at each
offload, so tensors that appear later (gradients, optimizer state after the first step) are included."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Union

import torch

TensorSource = Union[Iterable, Callable[[], Iterable]]


def iter_named(source: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a source; unnamed tensors are called tensor[i]."""
    items = source() if callable(source) else source
    if isinstance(items, dict):
        items = items.items()
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:
            yield f"tensor[{i}]", item


def module_tensors(module: torch.nn.Module, params: bool, buffers: bool, grads: bool) -> TensorSource:
    def collect():
        if params:
            for n, p in module.named_parameters():
                yield n, p
                if grads and p.grad is not None:
                    yield n + ".grad", p.grad
        elif grads:
            for n, p in module.named_parameters():
                if p.grad is not None:
                    yield n + ".grad", p.grad
        if buffers:
            for n, b in module.named_buffers():
                yield n, b

    return collect


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> TensorSource:
    def collect():
        index = {id(p): f"{gi}.{pi}" for gi, g in enumerate(optimizer.param_groups)
                 for pi, p in enumerate(g["params"])}
        for p, st in optimizer.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    yield f"state[{index.get(id(p), '?')}].{k}", v

    return collect
