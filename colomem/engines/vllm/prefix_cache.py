"""vLLM's prefix cache, dropped when its KV blocks go stale: after new weights reach an engine that stayed
awake, and after its KV cache was mapped back (kv_sleep.py).

vLLM's reset walks every KV block in Python, in the engine's process: tens of milliseconds on a large cache,
which a sync into an awake engine would wait for. When the caller knows that new weights come next (the
colocated loop, once a rollout that does not sleep is done), `retire` starts the reset at once on the engine's
call thread, so it runs while the trainer trains and the sync then only collects it. Any generate in between
fills the cache again, so the sync then resets it as before.
"""
from __future__ import annotations

import concurrent.futures
from typing import Optional

from colomem.errors import ColomemError

from .engine_calls import EngineCalls

WHAT = "reset_prefix_cache()"


def _refused(ok: object, after: str, stale: str) -> None:
    if ok is False:
        raise ColomemError(f"vLLM refused to reset its prefix cache {after} (requests still running?); {stale}")


def reset_prefix_cache(calls: EngineCalls, timeout_s: float, after: str, stale: str) -> None:
    """Drops vLLM's cached KV blocks (of the prefix cache), whose bytes no longer match their prompts. `stale`
    says what generating would do with them if vLLM refuses."""
    _refused(calls.call(lambda llm: llm.reset_prefix_cache(), timeout_s, WHAT), after, stale)


class PrefixCache:
    """The reset after a sync into an awake engine, started early where the caller allows it."""

    def __init__(self, calls: EngineCalls):
        self._calls = calls
        self._pending: Optional[concurrent.futures.Future] = None

    def retire(self) -> None:
        """Starts the reset now, without waiting for it (the engine is idle: nothing is generating)."""
        if self._pending is None:
            self._pending = self._calls.start(lambda llm: llm.reset_prefix_cache(), WHAT)

    def settle(self, timeout_s: float, after: Optional[str] = None, stale: str = "") -> None:
        """Waits for a reset `retire` started (none: returns at once) and raises its error. A refusal by vLLM
        raises only when `after` says what the reset was for; before a generate or a sleep it is harmless (the
        generate fills the cache again, the sleep drops it)."""
        fut, self._pending = self._pending, None
        if fut is not None:
            ok = self._calls.wait(fut, timeout_s, WHAT)
            if after is not None:
                _refused(ok, after, stale)

    def drop(self, timeout_s: float, after: str, stale: str) -> bool:
        """The cache emptied of stale blocks: the reset `retire` started when nothing generated since, else a
        reset now. Returns whether the reset had been started before (so its time was hidden)."""
        early = self._pending is not None
        if early:
            self.settle(timeout_s, after, stale)
        else:
            reset_prefix_cache(self._calls, timeout_s, after, stale)
        return early

    def forget(self) -> None:
        """Drops a pending reset without waiting (the engine is closing)."""
        self._pending = None


__all__ = ["PrefixCache", "reset_prefix_cache"]
