"""An optimizer's state moved into memory colomem maps chunk by chunk (colomem.swap_mapped.MappedSet).

Adam's two moments are the largest thing a trainer holds that only the optimizer step reads. Held by torch's
caching allocator, each is one allocation: it leaves whole and comes back whole, and the memory left beside
the forward and backward (less than one moment on a 7B full fine-tune) cannot take part of one early. Moved
into a MappedSet, they leave and come back a chunk at a time, so part of them can come back behind the
backward and the rest at the step.

The optimizer keeps working on the same state dict: the moments' tensors are replaced, once, by tensors of
the same dtype and shape in the mapped memory. Three hooks on the torch optimizer keep it from reading
memory that is not mapped: before each step and before state_dict() the state is brought back in full (in
the current stream's order), and after load_state_dict() (which puts new tensors in the state) the mapped
copy is let go, so the loaded state is what the optimizer uses; map it again with a new MappedOptimizerState.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from colomem.errors import ColomemError
from colomem.mapped import CHUNK_BYTES_DEFAULT
from colomem.pool import PinnedPool
from colomem.swap_handles import DEFAULT_TIMEOUT_S
from colomem.swap_mapped import MappedHandle, MappedSet

MOMENTS = ("exp_avg", "exp_avg_sq")


def state_tensors(optimizer: torch.optim.Optimizer, keys: Sequence[str]) -> list[tuple[Any, str, torch.Tensor]]:
    """(param, key, tensor) for each non-empty state tensor named in `keys`, in the param groups' order."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for k in keys:
                t = st.get(k)
                if isinstance(t, torch.Tensor) and t.numel():
                    out.append((p, k, t))
    return out


class MappedOptimizerState:
    """The optimizer's state tensors named `keys` (default: Adam's moments) moved into one MappedSet.

    Raises ColomemError when the optimizer has none of them yet (Adam makes its state at its first step:
    map after it) or when they are not on one device."""

    def __init__(self, optimizer: torch.optim.Optimizer, keys: Sequence[str] = MOMENTS,
                 pool: Optional[PinnedPool] = None, *, chunk_bytes: int = CHUNK_BYTES_DEFAULT,
                 name: str = "optimizer state"):
        found = state_tensors(optimizer, keys)
        if not found:
            raise ColomemError(f"{type(optimizer).__name__} has no state named {', '.join(keys)} yet; it is made "
                               "by the first optimizer step, so map the state after that step")
        devices = {t.device for _, _, t in found}
        if len(devices) > 1:
            raise ColomemError(f"the optimizer's state is on several devices ({sorted(map(str, devices))}); a "
                               "mapped state lives on one")
        self.optimizer = optimizer
        self.keys = tuple(keys)
        self.set = MappedSet([(f"{i}.{k}", t) for i, (_, k, t) in enumerate(found)], pool, name=name,
                             chunk_bytes=chunk_bytes)
        self._refs = [(p, k) for p, k, _ in found]
        for (p, k), new in zip(self._refs, self.set.tensors):
            optimizer.state[p][k] = new
        del found  # the old tensors go with the last reference: their memory back to the allocator
        self.active = True
        self._hooks = [optimizer.register_step_pre_hook(self._before_read),
                       optimizer.register_state_dict_pre_hook(self._before_read),
                       optimizer.register_load_state_dict_post_hook(self._after_load)]

    @property
    def device(self) -> torch.device:
        return self.set.device

    @property
    def nbytes(self) -> int:
        return self.set.nbytes

    @property
    def resident_bytes(self) -> int:
        return self.set.resident_bytes

    def offload(self, *, timing: bool = False) -> MappedHandle:
        """Queues the state's copy out (after the current stream's work); wait() on the handle frees each
        chunk as its copy ends."""
        self._check_active()
        return self.set.offload(timing=timing)

    def reload(self, budget_bytes: Optional[int] = None, *, ordered: bool = True,
               timing: bool = False) -> MappedHandle:
        """Brings back the chunks in the pool, at most `budget_bytes` of them (None: all); see
        MappedSet.reload."""
        self._check_active()
        return self.set.reload(budget_bytes, ordered=ordered, timing=timing)

    def ensure_resident(self, timeout: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
        """The whole state back before anything reads it: on a GPU in the current stream's order (work queued
        after this call sees every byte), on the host waited for here."""
        if not self.active or self.set.resident:
            return
        h = self.set.reload(ordered=True)
        if self.set.device.type != "cuda":
            self.set.wait(timeout)
        del h

    def close(self) -> None:
        """Brings the state back into torch tensors the optimizer then owns, and frees the mapped memory."""
        if not self.active:
            return
        self.ensure_resident()
        self.set.wait(DEFAULT_TIMEOUT_S)
        for (p, k), t in zip(self._refs, self.set.tensors):
            self.optimizer.state[p][k] = t.clone()
        self._let_go()

    # -- hooks -----------------------------------------------------------------------------------------------
    def _before_read(self, *_args: Any) -> None:
        self.ensure_resident()

    def _after_load(self, *_args: Any) -> None:
        """load_state_dict() put new tensors in the state: the mapped ones are no longer the optimizer's."""
        self._let_go()

    def _let_go(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.active = False
        self.set.close()

    def _check_active(self) -> None:
        if not self.active:
            raise ColomemError("this mapped optimizer state was let go (closed, or the optimizer loaded a state "
                               "dict); map the optimizer's state again")


__all__ = ["MOMENTS", "MappedOptimizerState", "state_tensors"]
