"""The end of a DeepSpeedTrainer's deferred offload (offload(defer=True)): the held copy started, the copy
waited for and its GPU memory given back to the driver, now or in a thread while the rollout runs in vLLM's
own process. A mixin of DeepSpeedTrainer, which holds the state it reads."""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from colomem._torch import mem_get_info
from colomem.engines.background import BackgroundSlot

from .state import release_cached_memory
from .strategies import ColomemOffload


class DeferredOffload:
    _strategies: dict
    _finishing: BackgroundSlot
    timeout_s: float
    device: torch.device
    last_offload: Any

    @property
    def offload_pending(self) -> bool:
        s = self._strategies.get("colomem")
        return self._finishing.busy or (isinstance(s, ColomemOffload) and s.pending_bytes > 0)

    def start_offload(self) -> None:
        """Starts the copy an offload(defer=True, hold=True) held back; nothing to do otherwise."""
        s = self._strategies.get("colomem")
        if isinstance(s, ColomemOffload):
            s.start_late()

    def finish_offload(self, timeout: Optional[float] = None, *, background: bool = False) -> float:
        """Waits for what offload(defer=True) left copying and gives its memory to the driver; returns the
        seconds waited (0.0: nothing was deferred). background: that happens in a thread while the caller
        goes on (0.0 returned), only where nothing else runs on this GPU in this process meanwhile (the
        release's cudaFree waits for the whole device): the rollout in vLLM's own process. Any later call
        of the trainer's that needs the state (this one included) waits for the thread first."""
        if self._finishing.busy:
            return self._finishing.collect(self.timeout_s if timeout is None else timeout)
        if background:
            if self.offload_pending:
                self._finishing.start(self._finish_in_thread, "the end of the deferred offload")
            return 0.0
        return self._finish_offload_now(timeout)

    def _finish_in_thread(self) -> float:
        if self.device.type != "cuda":
            return self._finish_offload_now()
        with torch.cuda.device(self.device):   # a new thread starts on device 0
            return self._finish_offload_now()

    def _finish_offload_now(self, timeout: Optional[float] = None) -> float:
        s = self._strategies.get("colomem")
        if not isinstance(s, ColomemOffload) or not s.pending_bytes:
            return 0.0
        t0 = time.perf_counter()
        nbytes = s.finish_late(timeout)
        release_cached_memory()
        waited = time.perf_counter() - t0
        rep = self.last_offload
        if rep is not None:
            rep.moved_bytes += nbytes
            rep.wait_seconds = waited
            rep.free_bytes = mem_get_info(self.device)[0]
        return waited


__all__ = ["DeferredOffload"]
