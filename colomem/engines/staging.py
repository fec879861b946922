"""A page-locked host buffer kept across uses: a block of the job's pinned pool when there is one, torch's
pinned memory otherwise. The DeepSpeed trainer stages its sync weights in one while offloaded
(colomem.engines.deepspeed.weights); a merged shared base keeps its host copy in one
(colomem.engines.base_restore)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


class Staging:
    """A host uint8 buffer, page-locked, kept across offloads (a pool block when there is a pool)."""

    def __init__(self) -> None:
        self._block: Any = None
        self._host: Optional[Tensor] = None

    def buffer(self, nbytes: int, pool: Any = None) -> Tensor:
        """At least nbytes; the same buffer while it is large enough."""
        if self._host is not None and self._host.numel() >= nbytes:
            return self._host
        self.free()
        if pool is not None and not pool.closed:
            self._block = pool.alloc(nbytes)
            self._host = self._block.as_tensor(nbytes)
        else:
            self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._host

    def free(self) -> None:
        self._host = None
        if self._block is not None:
            if not self._block.pool.closed:
                self._block.release()
            self._block = None


__all__ = ["Staging"]
