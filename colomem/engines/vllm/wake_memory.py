"""Waking vLLM's sleeping memory by tag within what the GPU has free, seen from VLLMRollout.

vLLM's wake_up maps its allocations one after another and stops at the first failure, leaving the tags
counted as asleep with part of them mapped. So a wake is refused before vLLM is asked when the driver reports
less free memory than the tags need (vLLM's allocations by tag, read once the engine started) plus a margin,
and a wake that still runs out of memory halfway is rolled back by the worker (worker/wake_rollback.py), so
vLLM is fully asleep again. Either way the CudaOutOfMemoryError names the knob that makes it fit.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional, Protocol

from colomem._torch import driver_memory
from colomem.errors import TO_FIT, ColomemError, CudaOutOfMemoryError, PeerError, TransferTimeoutError, is_oom
from colomem.units import format_bytes

from .engine_calls import EngineCalls

log = logging.getLogger(__name__)

WAKE_MARGIN = 256 << 20                                  # headroom kept free beyond what a wake maps


def free_bytes(device: int) -> Optional[int]:
    """Free GPU memory on the device, as the driver reports it; None without CUDA."""
    info = driver_memory(device)
    return None if info is None else info[0]


def wake_oom_message(tags: tuple, need: int, free: Optional[int], state: str, device: int) -> str:
    what = "weights" if "weights" in tags else "KV cache"
    knobs = ("offload more of the trainer first (it must be offloaded before the wake) or use a smaller "
             "model/tensor_parallel_size" if what == "weights" else
             "lower gpu_memory_utilization (--gpu-memory-utilization) or max_model_len (--max-model-len), "
             "or offload more of the trainer (smaller micro-batch)")
    free_s = "unknown" if free is None else format_bytes(free)
    return (f"waking vLLM's {what} needs {format_bytes(need)} but {free_s} is free on cuda:{device}; "
            f"{state}.{TO_FIT}{knobs}.")


class WakeOptions(Protocol):
    """What a wake reads from the rollout each time (the rollout's attributes may change)."""

    @property
    def device(self) -> int: ...

    @property
    def wake_timeout_s(self) -> float: ...


class TagWake:
    """wake_up(tags) with the free memory checked first and a partial wake rolled back (module docstring)."""

    def __init__(self, calls: EngineCalls, options: WakeOptions):
        self._calls, self._opt = calls, options
        self.tag_bytes: dict = {}           # vLLM's allocations by tag; empty when they could not be read

    def read_layout(self) -> None:
        try:
            r = self._calls.rpc("colomem_memory")
            self.tag_bytes = dict(r[0].get("cumem_bytes_by_tag", {})) if r else {}
        except ColomemError as exc:
            log.warning("could not read vLLM's memory layout: %s", exc)
            self.tag_bytes = {}

    def mapped_bytes(self, tags: Iterable[str]) -> int:
        """GPU bytes waking `tags` maps (0 for what the layout does not list)."""
        return sum(self.tag_bytes.get(t, 0) for t in tags)

    def need(self, tags: Iterable[str]) -> Optional[int]:
        """The free GPU memory waking `tags` needs: mapped_bytes(tags) plus the margin a wake asks for, 0 when
        they map nothing, None when the layout could not be read. wake() checks exactly this figure."""
        if not self.tag_bytes:
            return None
        mapped = self.mapped_bytes(tags)
        return mapped + WAKE_MARGIN if mapped else 0

    def wake(self, tags: tuple, slept_with: tuple) -> None:
        """Maps `tags` again. slept_with: (sleep level, weights_backup) of the sleep being undone."""
        device, timeout = self._opt.device, self._opt.wake_timeout_s
        need = self.mapped_bytes(tags)
        want, free = self.need(tags), free_bytes(device)
        if want and free is not None and free < want:
            raise CudaOutOfMemoryError(wake_oom_message(tags, need, free, "before waking (vLLM still asleep)",
                                                        device))
        try:
            self._calls.call(lambda llm: llm.wake_up(tags=list(tags)), timeout, f"wake_up({list(tags)})")
        except (TransferTimeoutError, PeerError):
            raise
        except Exception as exc:
            if not is_oom(exc):
                raise
            # After vLLM's level-1 sleep its host backups are the weights' only copy, and the wake drops each
            # one it copied back: the rollback backs those up again before unmapping.
            keep = tags == ("weights",) and slept_with == (1, "vllm")
            try:
                self._calls.rpc("colomem_rollback_wake", list(tags), keep, timeout, timeout=timeout)
            except ColomemError as rb:
                log.error("rolling back the partial wake failed: %s", rb)
            raise CudaOutOfMemoryError(wake_oom_message(tags, need, free_bytes(device),
                                                        "vLLM was put back to sleep", device)) from exc


__all__ = ["TagWake", "WAKE_MARGIN", "WakeOptions", "free_bytes", "wake_oom_message"]
