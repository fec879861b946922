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

A release of part of the cache (nbytes) lends each layer's tail instead where vLLM's layout and scheduler
allow (worker/kv_tail.py): nothing maps back at the wake, the scheduler maps the tail's chunks as its free
blocks run short, so the rollout starts on the head's blocks at once. The prefix cache (stale after the new
weights, and the first lend's head holds new bytes) is reset on the engine's call thread right after the
lend, while the trainer trains; the wake only collects that reset. Where the tail cannot be lent (another
layout, another scheduler), the whole-layer release takes over and the reason is logged once.

Every call runs through EngineCalls, so each wait is bounded; the worker's errors come back as their classes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional

from colomem.errors import (ColomemError, CudaOutOfMemoryError, InvalidArgumentError, NotAvailableError,
                            PhaseOrderError)
from colomem.units import format_bytes

from . import wake_memory
from .wake_memory import WakeOptions
from .engine_calls import EngineCalls
from .prefix_cache import PrefixCache, reset_prefix_cache
from .tail_scheduler import QUALNAME as TAIL_SCHEDULER, active_scheduler

log = logging.getLogger(__name__)


class KvSleep:
    """Releases vLLM's KV cache and maps it back, the weights left mapped. `released` while it is out."""

    def __init__(self, calls: EngineCalls, llm_kwargs: dict, options: WakeOptions, margin: int,
                 prefix: Optional[PrefixCache] = None):
        self._calls = calls
        self._sleep_mode = bool(llm_kwargs.get("enable_sleep_mode", False))
        self._opt = options                  # the rollout: its device and wake timeout, read at each use
        self.margin = int(margin)
        self.released = False
        self.nbytes = 0              # what the workers released (the largest worker's figure)
        # the tail is lent only with colomem's scheduler in the engine (VLLMConfig.kv_tail, no other given)
        self._tail_scheduler = llm_kwargs.get("scheduler_cls") == TAIL_SCHEDULER and prefix is not None
        self.tail_possible = self._tail_scheduler
        self.tail = False            # a tail is lent now (released is True too)
        self.tail_held = False       # the workers hold vLLM's KV allocations as chunks (from the first lend)
        self._prefix = prefix

    def _resume_scheduling(self) -> None:
        """vLLM schedules again (after the level-0 sleep that paused it for a release)."""
        self._call(lambda llm: llm.wake_up(tags=["scheduling"]), "wake_up(['scheduling'])")

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
        if nbytes is not None and self.tail_possible:
            out = self._lend_tail(int(nbytes))
            if out is not None:
                return out
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

    def set_tail(self, on: bool) -> None:
        """Lend tails from now on (on), or release whole layers. InvalidArgumentError when the engine was not
        built with colomem's scheduler; PhaseOrderError while the workers hold the cache as chunks."""
        if not isinstance(on, bool):
            raise InvalidArgumentError(f"kv_tail must be True or False, got {on!r}")
        if on and not self._tail_scheduler:
            raise InvalidArgumentError("this engine was built without colomem's scheduler (VLLMConfig.kv_tail "
                                       f"False, or another scheduler_cls than {TAIL_SCHEDULER}): it cannot lend a tail")
        if self.tail_held and not on:
            raise PhaseOrderError("the KV cache is held as chunks now; switch kv_tail off before the first "
                                  "partial release, or after vLLM's own sleep gave it back")
        self.tail_possible = on

    def set_room(self, fn: Optional[Callable[[], Any]], in_process: bool) -> bool:
        """With the engine in this process and the cache held as chunks: fn runs once, on the engine's thread
        between two scheduling steps, the first time the tail finds no memory to grow into (the trainer ends
        its copy out and frees that memory there); None takes it back. Returns whether it is in place (False:
        the engine runs in its own process, or nothing is held)."""
        if not (in_process and self.tail_held):
            return False
        active_scheduler().colomem_make_room = fn
        return True

    def _lend_tail(self, nbytes: int) -> Optional[dict]:
        """The tail's lend (scheduling paused); None when the layout or the scheduler cannot (said once)."""
        try:
            r = self._rpc("colomem_kv_tail_lend", nbytes)
        except NotAvailableError as exc:
            self.tail_possible = False
            log.warning("vLLM's KV cache cannot lend its tail (%s); its released part is whole layers, mapped "
                        "back before each rollout", exc)
            return None
        except ColomemError:
            if not self._calls.broken:
                self._undo_tail()
            raise
        self.released = self.tail = self.tail_held = True
        self.nbytes = max(int(x["lent_bytes"]) for x in r)
        assert self._prefix is not None
        self._prefix.retire()        # the stale cache drops while the trainer trains (the wake collects it)
        return {"kv_released_bytes": self.nbytes, "kv_freed_bytes": self.nbytes,
                "kv_release_s": max(float(x["seconds"]) for x in r),
                "kv_tail_held_blocks": max(int(x["held_blocks"]) for x in r)}

    def _undo_tail(self) -> None:
        """A lend failed partway: the workers' allocations back to vLLM, mapped, scheduling resumed."""
        try:
            self._rpc("colomem_kv_tail_restore", True)
        except ColomemError as exc:
            log.error("giving vLLM back its KV cache after a failed lend failed: %s", exc)
        self.tail = self.tail_held = False
        try:
            self._resume_scheduling()
        except ColomemError as exc:
            log.error("resuming vLLM's scheduling after a failed KV lend failed: %s", exc)

    def _undo_release(self) -> None:
        """A worker failed partway: what it released is mapped again, scheduling resumes (best effort)."""
        try:
            self._rpc("colomem_kv_map")
        except PhaseOrderError:
            pass                     # the worker released nothing before it failed
        except ColomemError as exc:
            log.error("mapping back what a failed KV release unmapped failed: %s", exc)
        try:
            self._resume_scheduling()
        except ColomemError as exc:
            log.error("resuming vLLM's scheduling after a failed KV release failed: %s", exc)

    def map_back(self) -> dict:
        """Maps the KV cache again, resets the prefix cache, resumes scheduling. Refuses before asking vLLM
        when the GPU lacks the memory (CudaOutOfMemoryError; the cache stays released, retry later). A lent
        tail maps nothing here: the reset started at the lend is collected and scheduling resumes."""
        if self.tail:
            assert self._prefix is not None
            self._prefix.settle(self.timeout_s, "after its KV cache's tail was lent",
                                "its cached blocks were computed with the old weights")
            self._resume_scheduling()
            self.released = self.tail = False
            nbytes, self.nbytes = self.nbytes, 0
            return {"kv_mapped_bytes": 0, "kv_taken_bytes": 0, "kv_map_s": 0.0, "kv_tail_lent_bytes": nbytes}
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
        self._resume_scheduling()
        return {"kv_mapped_bytes": nbytes, "kv_taken_bytes": max(int(x["taken_bytes"]) for x in r),
                "kv_map_s": max(float(x["seconds"]) for x in r)}

    @contextlib.contextmanager
    def lent_to_vllm_sleep(self) -> Iterator[None]:
        """Around vLLM's own sleep while the cache is released (see the module docstring). Workers that hold
        the allocations as chunks give them back first, unmapped and lent out of vLLM's table as a whole-layer
        release lends them: vLLM's sleep must free all of its memory, and its wake maps them whole."""
        if self.tail_held:
            if self.tail and self._prefix is not None:
                self._prefix.settle(self.timeout_s)      # the lend's reset, queued before this call anyway
            r = self._rpc("colomem_kv_tail_restore", False)
            self.tail_held, self.tail, self.released = False, False, True
            self.nbytes = max(int(x.get("released_bytes", 0)) for x in r)
        elif not self.released:
            yield
            return
        else:
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
        of this process. So the cache is mapped back first, when the memory is there (and workers that hold
        it as chunks give it back to vLLM, mapped whole)."""
        if self.tail_held:
            try:
                self._rpc("colomem_kv_tail_restore", True)
                self.tail_held, self.tail, self.released, self.nbytes = False, False, False, 0
                return
            except ColomemError as exc:
                self.tail_held = self.tail = False   # what it could not map is released in vLLM's table:
                self.released = True                 # mapped below, if the memory came free meanwhile
                log.warning("could not give vLLM its KV cache back whole before closing (%s)", exc)
        if not self.released:
            return
        try:
            self._rpc("colomem_kv_map")
            self.released, self.nbytes = False, 0
        except ColomemError as exc:
            log.warning("could not map vLLM's released KV cache (%s) back before closing (%s); another vLLM "
                        "engine in this process may fail to allocate", format_bytes(self.nbytes), exc)

    def report(self) -> dict:
        return {"kv_released": self.released, "kv_released_bytes": self.nbytes, "kv_tail_lent": self.tail}


__all__ = ["KvSleep"]
