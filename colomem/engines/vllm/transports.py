"""How a weight version gets into vLLM's worker (`sync_transport`), one class per way, and their registry.

  "listener"  (default) vLLM's engine in its own process. The trainer's WeightBridge packs the tensors into
              exportable GPU buckets; a thread in the worker (started at attach) serves the bridge socket
              and applies each version as it comes. No RPC per sync: the worker's report comes with the
              last ACK. If that thread stops, it closes its end and the next sync fails at once with its
              reason (and attaches again).
  "direct"    engine_in_process=True (vLLM's EngineCore and worker in this process): RPCs hand the
              trainer's (name, tensor) pairs to the worker, a chunk of about DIRECT_CHUNK_BYTES at a time,
              and its recorded copies read them directly. The last RPC's reply is the report.

Each transport's `sync(items, version, stats)` returns one report per worker (the dict the worker's last
ACK or RPC carries: coverage, snapshot checksums, totals).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterator, Protocol

from colomem.engines.reports import SyncStats
from colomem.errors import ColomemError, InvalidArgumentError, PeerError, TransferTimeoutError

from .engine_calls import EngineCalls

log = logging.getLogger(__name__)

# Bytes of the trainer's tensors one direct RPC hands over. The items may be made as they are yielded (merged
# LoRA weights, one module at a time), and each chunk is let go once loaded: a sync holds about one chunk of
# them instead of a whole model's worth.
DIRECT_CHUNK_BYTES = 1 << 30


class Transport(Protocol):
    def sync(self, items: Iterator, version: int, stats: SyncStats) -> list:
        ...

    def close(self, detach: bool = True) -> None:
        """Forgets the transport's state (detach=False: the worker is told otherwise, e.g. colomem_close)."""
        ...


class ListenerOptions(Protocol):
    """What the listener reads from the rollout at each sync (the rollout's attributes may change)."""

    @property
    def verify(self) -> str: ...

    @property
    def check_sample(self) -> int: ...

    @property
    def fast_load(self) -> bool: ...

    @property
    def rpc_timeout_s(self) -> float: ...

    @property
    def tensor_parallel_size(self) -> int: ...


class ListenerTransport:
    """Over the bridge socket, to the listener thread in vLLM's worker."""

    def __init__(self, calls: EngineCalls, options: ListenerOptions, make_bridge: Callable[[], Any]):
        self._calls, self._opt, self._make_bridge = calls, options, make_bridge
        self.bridge: Any = None
        self._syncs = 0

    def sync(self, items: Iterator, version: int, stats: SyncStats) -> list:
        bridge = self._ensure_bridge()
        tag = self._next_tag(version)
        t0 = time.perf_counter()
        try:
            bridge.sync(items, version=version, send=None, timeout=self._opt.rpc_timeout_s, tag=tag)
        except (PeerError, TransferTimeoutError) as exc:
            self._raise_if_listener_stopped(exc)
            raise
        stats.bridge_seconds = time.perf_counter() - t0
        bs = bridge.last_stats
        stats.nbuckets = bs.messages if bs else 0
        for k in ("pack_issue_seconds", "pack_copy_seconds", "pack_checksum_seconds", "pack_wait_seconds",
                  "ack_seconds"):
            setattr(stats, k, float(getattr(bs, k, 0.0) or 0.0))
        reports = bridge.last_reports
        if not reports or not all(isinstance(r, dict) and "total_tensors" in r for r in reports):
            raise PeerError("the worker's bridge listener acknowledged the last bucket without its report; "
                            "producer and worker colomem versions differ?")
        return reports

    def close(self, detach: bool = True) -> None:
        bridge, self.bridge = self.bridge, None
        if bridge is None:
            return
        try:
            if detach:
                self._calls.rpc("colomem_detach", timeout=10.0)
        except ColomemError as exc:
            log.warning("detaching vLLM's worker from the bridge failed: %s", exc)
        finally:
            try:
                bridge.close()
            except Exception as exc:  # noqa: BLE001  (closing must go on)
                log.warning("closing the weight bridge failed: %s", exc)

    def _ensure_bridge(self) -> Any:
        if self.bridge is None:
            if int(self._opt.tensor_parallel_size) > 1:
                raise InvalidArgumentError(
                    "the weight bridge maps the trainer's buffers on one GPU, but with tensor_parallel_size > 1 "
                    "vLLM's workers sit on several; sync with tensor_parallel_size=1 (one engine per GPU)")
            bridge = self._make_bridge()
            o = self._opt
            try:
                self._calls.rpc("colomem_attach", bridge.address, 30.0, o.verify, o.check_sample, o.fast_load,
                                timeout=max(60.0, o.rpc_timeout_s))
                self._calls.rpc("colomem_listen", o.rpc_timeout_s)
            except BaseException:
                bridge.close()
                raise
            self.bridge = bridge
        return self.bridge

    def _next_tag(self, version: int) -> str:
        """A name for this sync that no earlier one had (each side skips leftovers of failed syncs by it)."""
        self._syncs += 1
        return f"{os.getpid()}.{version}.{self._syncs}"

    def _raise_if_listener_stopped(self, exc: BaseException) -> None:
        """After a failed sync: when a worker's listener has stopped, raise its reason (the next sync
        attaches again and starts a new listener); otherwise return (the sync's own error stands)."""
        try:
            states = self._calls.rpc("colomem_listener_state", timeout=min(30.0, self._opt.rpc_timeout_s))
        except Exception as ask:  # noqa: BLE001 - the sync's own error is the one to report
            if self._calls.broken:        # the engine itself is gone: that is why the sync failed
                raise PeerError(f"the weight sync to vLLM failed: {ask}") from exc
            log.debug("asking vLLM's worker about its bridge listener failed: %s", ask)
            return
        stopped = [s for s in states if isinstance(s, dict) and not s.get("listening")]
        if stopped:
            self.close()
            why = "; ".join(str(s.get("error") or "no error recorded") for s in stopped)
            raise PeerError(f"the bridge listener in vLLM's worker stopped ({why}); this sync failed, the next "
                            f"one attaches again and starts a new listener") from exc


class DirectTransport:
    """In process: the trainer's tensors handed to the worker as Python objects, no bridge, in chunks of
    about DIRECT_CHUNK_BYTES (one RPC each; the worker keeps the version open from the first to the last)."""

    def __init__(self, calls: EngineCalls):
        self._calls = calls

    def sync(self, items: Iterator, version: int, stats: SyncStats) -> list:
        chunk: list = []
        nbytes, first = 0, True
        for name, t in items:
            chunk.append((name, t))
            nbytes += t.nbytes
            if nbytes >= DIRECT_CHUNK_BYTES:
                self._calls.rpc("colomem_load_direct", chunk, version, first, False)
                # a new list rather than chunk.clear(): the call may still hold the one it was given
                chunk, nbytes, first = [], 0, False
        # what is left ends the version (nothing, when the items ended on a chunk's edge): its reply is the report
        return self._calls.rpc("colomem_load_direct", chunk, version, first, True)

    def close(self, detach: bool = True) -> None:
        pass


TRANSPORTS = ("listener", "direct")


def make_transport(name: str, calls: EngineCalls, options: ListenerOptions,
                   make_bridge: Callable[[], Any]) -> Transport:
    if name == "listener":
        return ListenerTransport(calls, options, make_bridge)
    if name == "direct":
        return DirectTransport(calls)
    raise InvalidArgumentError(f"no sync transport {name!r}; choose from {TRANSPORTS}")


__all__ = ["DIRECT_CHUNK_BYTES", "DirectTransport", "ListenerTransport", "TRANSPORTS", "Transport", "make_transport"]
