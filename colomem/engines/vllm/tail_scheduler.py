"""vLLM's scheduler with a KV tail that can be held out of its free queue (kv_tail.py).

VLLMRollout names `make_scheduler` as vLLM's `scheduler_cls` (a dotted path, so it reaches an engine in its
own process too). vLLM calls it where it would build its scheduler; it builds that same class (the async
scheduler when vLLM chose async scheduling, else the plain one) with three additions, all of them run on the
engine's own thread, between scheduling steps:

  - `colomem_tail`: the BlockHold over its block pool, which the worker (worker/kv_tail.py, in this process:
    the engine inside the trainer's process, or vLLM's engine process with its worker inside) fills when it
    lends the tail, found through `active_scheduler()`;
  - schedule(): before scheduling, a tail whose blocks are held grows back chunk by chunk while the free
    blocks run short (Grower), so a rollout that needs more than the head's blocks gets them; when a chunk
    finds no memory, a hook the trainer left (`colomem_make_room`: its copy out ended, its memory freed) runs
    once on this thread;
  - reset_prefix_cache(): vLLM's reset refuses while any block is out of the queue; the held blocks are put
    back around it.

Nothing changes while no tail is held: the additions are a check each.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import weakref
from typing import Any, Callable, Optional

from colomem.errors import NotAvailableError

from .kv_tail import BlockHold

log = logging.getLogger(__name__)
_lock = threading.Lock()
_schedulers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_classes: dict = {}
_born = itertools.count()

QUALNAME = "colomem.engines.vllm.tail_scheduler.make_scheduler"


class TailMixin:
    """The additions; mixed in front of vLLM's scheduler class (make_scheduler)."""

    colomem_tail: BlockHold
    colomem_grower: Any
    colomem_born: int
    colomem_make_room: Optional[Callable[[], Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.colomem_tail = BlockHold(self.kv_cache_manager.block_pool)   # type: ignore[attr-defined]
        self.colomem_grower = None           # set by the worker while it lends a tail
        # set by the trainer's side while its copy out still holds memory the tail could grow into (the engine
        # in the trainer's process: freeing it waits for the whole device, which between two scheduling steps
        # costs the rollout little); run once, the first time a chunk finds no memory
        self.colomem_make_room: Optional[Callable[[], Any]] = None
        with _lock:
            self.colomem_born = next(_born)
            _schedulers.add(self)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        grower = self.colomem_grower
        if grower is not None and self.colomem_tail.held:
            grower.top_up(self.colomem_tail, self.colomem_tail.pool.get_num_free_blocks(), self._colomem_room)
        return super().schedule(*args, **kwargs)    # type: ignore[misc]

    def _colomem_room(self) -> bool:
        """The hook the trainer left (colomem_make_room), run once: memory it frees on this thread."""
        room, self.colomem_make_room = self.colomem_make_room, None
        if room is None:
            return False
        try:
            room()
        except Exception as exc:  # noqa: BLE001  (the rollout goes on with the blocks it has; reload() retries)
            log.warning("freeing the trainer's memory for the KV cache's tail failed (%s: %s); the rollout goes on "
                        "with the blocks mapped now", type(exc).__name__, exc)
            return False
        return True

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        with self.colomem_tail.lent():
            return super().reset_prefix_cache(*args, **kwargs)   # type: ignore[misc]


def _with_tail(base: type) -> type:
    with _lock:
        cls = _classes.get(base)
        if cls is None:
            cls = type(f"Colomem{base.__name__}", (TailMixin, base), {"__module__": __name__})
            _classes[base] = cls
    return cls


def make_scheduler(*args: Any, **kwargs: Any) -> Any:
    """vLLM's scheduler_cls: the scheduler vLLM would build, with the tail's additions."""
    config = kwargs.get("vllm_config", args[0] if args else None)
    if getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    return _with_tail(base)(*args, **kwargs)


def active_scheduler(fits: Optional[Callable[[int], bool]] = None) -> Any:
    """This process's scheduler built by make_scheduler (whose block count `fits`, when given: a worker
    matches its KV tensors'); of several, the newest (an engine closed in this process may leave its
    scheduler alive until the garbage collector runs). NotAvailableError when there is none (vLLM built its
    own scheduler: another scheduler_cls, or the engine core runs in another process than this worker)."""
    def found() -> list:
        with _lock:
            return [s for s in list(_schedulers)
                    if fits is None or fits(len(s.colomem_tail.pool.blocks))]
    out = found()
    if len(out) > 1:
        gc.collect()
        out = found()
    if not out:
        raise NotAvailableError("the KV cache's tail cannot be lent: no scheduler of colomem's in this process "
                                "(vLLM was given another scheduler_cls, or its engine core runs in another "
                                "process than this worker); the KV cache is released by whole layers instead")
    return max(out, key=lambda s: s.colomem_born)


__all__ = ["QUALNAME", "TailMixin", "active_scheduler", "make_scheduler"]
