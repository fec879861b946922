"""What a SwapSet moves, read from what users hold: any iterable of tensors or (name, tensor) pairs, a dict,
a module's parameters / buffers / gradients, an optimizer's state. Sources are callables evaluated at each
offload, so tensors that appear later (gradients, optimizer state after the first step) are included."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Union

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


class PlanMemo:
    """The storages of a SwapSet's last plan, reused while its source yields tensors on the same storages of
    the same sizes. The full plan checks every tensor (its type, layout, device, storage; ~2.4 us each on a
    host core, 0.8 ms for a 1.5B model's 338 tensors) before the offload's first copy, on the wall clock of
    every offload; telling that nothing changed costs a third of that. A tensor replaced since (a new
    gradient, `t.data = ...`), a storage resized, or anything that is not a tensor sends the set back to the
    full plan. The storages compared are kept alive by the last plan's entries, so a storage that went away
    cannot be mistaken for a new one at the same address."""

    def __init__(self):
        self._key: list = []
        self._entries: list = []

    @staticmethod
    def _key_of(items: list) -> list:
        key = []
        for _, t in items:
            st = t.untyped_storage()
            key.append((st._cdata, st.nbytes()))
        return key

    def lookup(self, items: list) -> Optional[list]:
        """The last plan's entries when `items` ((name, tensor) pairs) sit on the same storages; else None."""
        if not self._entries or len(items) != len(self._key):
            return None
        try:
            if self._key_of(items) != self._key:
                return None
        except (AttributeError, TypeError, RuntimeError):   # not a tensor, or one without a storage
            return None
        return self._entries

    def remember(self, items: list, entries: list) -> None:
        try:
            self._key, self._entries = self._key_of(items), list(entries)
        except (AttributeError, TypeError, RuntimeError):
            self.forget()

    def forget(self) -> None:
        self._key, self._entries = [], []


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
