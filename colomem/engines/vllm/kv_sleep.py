"""The KV-cache-only sleep, seen from VLLMRollout: sleep(keep_weights=True) and the wake_kv() after it.

For a LoRA job whose trainer's frozen base parameters are views of vLLM's weights: vLLM must never unmap or
move those weights, so between rollouts it releases only its KV cache. vLLM has no such sleep level, so the
worker does it (worker/kv_release.py), and this module keeps vLLM's own bookkeeping honest around it:

  release:   vLLM's scheduling is paused first (its level-0 sleep: no memory changes, requests aborted, new
             ones queued), so vLLM reports itself sleeping and nothing runs a forward pass on the cache while
             it is unmapped; then the worker unmaps the "kv_cache" allocations.
  map_back:  the worker maps new memory at the same addresses, the prefix cache is reset (the blocks hold
             undefined bytes now; a prompt seen before must not reuse them), and scheduling resumes
             (wake_up(["scheduling"])).
  a full sleep while the KV cache is released: vLLM's sleep unmaps every allocation it knows, so the
             released entries are lent out of its table for that call (the worker's lend / take_back) and
             from then on vLLM counts the cache as asleep, like after its own sleep.

Every call runs through EngineCalls, so each wait is bounded; the worker's errors come back as their classes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

from colomem.errors import ColomemError, CudaOutOfMemoryError, NotAvailableError, PhaseOrderError
from colomem.units import format_bytes

from . import wake_memory
from .wake_memory import WakeOptions
from .engine_calls import EngineCalls
from .prefix_cache import reset_prefix_cache

log = logging.getLogger(__name__)


class KvSleep:
    """Releases vLLM's KV cache and maps it back, the weights left mapped. `released` while it is out."""

    def __init__(self, calls: EngineCalls, llm_kwargs: dict, options: WakeOptions, margin: int):
        self._calls = calls
        self._sleep_mode = bool(llm_kwargs.get("enable_sleep_mode", False))
        self._opt = options                  # the rollout: its device and wake timeout, read at each use
        self.margin = int(margin)
        self.released = False
        self.nbytes = 0              # what the workers released (the largest worker's figure)

    def check_available(self) -> None:
        if not self._sleep_mode:
            raise NotAvailableError("sleep(keep_weights=True) needs vLLM's sleep mode, but this engine was built "
                                    "with enable_sleep_mode=False (llm_kwargs): drop that override")

    @property
    def timeout_s(self) -> float:
        return float(self._opt.wake_timeout_s)

    @property
    def device(self) -> int:
        return int(self._opt.device)

    def _rpc(self, method: str, *args) -> list:
        return self._calls.rpc(method, *args, timeout=self.timeout_s)

    def _call(self, fn, what: str):
        return self._calls.call(fn, self.timeout_s, what)

    def release(self, already_out: bool = False, nbytes: Optional[int] = None) -> dict:
        """Pauses vLLM's scheduling and releases the KV cache: at least nbytes of it on every worker, in
        whole allocations (None: all of it). Returns the timings' figures (zero bytes when the cache is out
        already)."""
        self.check_available()
        if already_out:
            return {"kv_released_bytes": 0, "kv_freed_bytes": 0, "kv_release_s": 0.0}
        self._call(lambda llm: llm.sleep(level=0), "sleep(level=0)")
        try:
            r = self._rpc("colomem_kv_release", None if nbytes is None else int(nbytes))
        except ColomemError:
            if not self._calls.broken:   # stuck or dead (timed out, engine gone): nothing more to ask it
                self._undo_release()
            raise
        self.released = True
        self.nbytes = max(int(x["released_bytes"]) for x in r)
        return {"kv_released_bytes": self.nbytes, "kv_freed_bytes": max(int(x["freed_bytes"]) for x in r),
                "kv_release_s": max(float(x["seconds"]) for x in r)}

    def _undo_release(self) -> None:
        """A worker failed partway: what it released is mapped again, scheduling resumes (best effort)."""
        try:
            self._rpc("colomem_kv_map")
        except PhaseOrderError:
            pass                     # the worker released nothing before it failed
        except ColomemError as exc:
            log.error("mapping back what a failed KV release unmapped failed: %s", exc)
        try:
            self._call(lambda llm: llm.wake_up(tags=["scheduling"]), "wake_up(['scheduling'])")
        except ColomemError as exc:
            log.error("resuming vLLM's scheduling after a failed KV release failed: %s", exc)

    def map_back(self) -> dict:
        """Maps the KV cache again, resets the prefix cache, resumes scheduling. Refuses before asking vLLM
        when the GPU lacks the memory (CudaOutOfMemoryError; the cache stays released, retry later)."""
        free = wake_memory.free_bytes(self.device)
        if self.nbytes and free is not None and free < self.nbytes + self.margin:
            raise CudaOutOfMemoryError(wake_memory.wake_oom_message(
                ("kv_cache",), self.nbytes, free, "before mapping the KV cache back (it stays released)",
                self.device))
        r = self._rpc("colomem_kv_map")
        self.released, nbytes = False, self.nbytes
        self.nbytes = 0
        reset_prefix_cache(self._calls, self.timeout_s, "after its KV cache was mapped back",
                           "its cached blocks hold undefined bytes now")
        self._call(lambda llm: llm.wake_up(tags=["scheduling"]), "wake_up(['scheduling'])")
        return {"kv_mapped_bytes": nbytes, "kv_taken_bytes": max(int(x["taken_bytes"]) for x in r),
                "kv_map_s": max(float(x["seconds"]) for x in r)}

    @contextlib.contextmanager
    def lent_to_vllm_sleep(self) -> Iterator[None]:
        """Around vLLM's own sleep while the cache is released (see the module docstring)."""
        if not self.released:
            yield
            return
        self._rpc("colomem_kv_lend")
        slept = False
        try:
            yield
            slept = True
        finally:
            self._rpc("colomem_kv_take_back", slept)
            if slept:
                self.released, self.nbytes = False, 0

    def map_before_close(self) -> None:
        """An in-process engine's tensors are freed in this process after close; vLLM's free callback would
        unmap the released cache a second time and leave its allocator's error state set for the next engine
        of this process. So the cache is mapped back first, when the memory is there."""
        if not self.released:
            return
        try:
            self._rpc("colomem_kv_map")
            self.released, self.nbytes = False, 0
        except ColomemError as exc:
            log.warning("could not map vLLM's released KV cache (%s) back before closing (%s); another vLLM "
                        "engine in this process may fail to allocate", format_bytes(self.nbytes), exc)

    def report(self) -> dict:
        return {"kv_released": self.released, "kv_released_bytes": self.nbytes}


__all__ = ["KvSleep"]
