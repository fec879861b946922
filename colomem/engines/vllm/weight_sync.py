"""The base weights' way into vLLM's worker, seen from VLLMRollout.load_weights.

The transport `sync_transport` names (transports.py) is made on first use and kept (the listener's bridge
with it); the trainer's tensors stream through it while a few of them are checksummed on the way (for
check(), weight_check.py), and the SyncStats of one sync is added up from what each worker reported with its
last ACK or RPC. The guards around a sync (phase, versions, weights discarded by a sleep) and the LoRA
adapter's part stay in rollout.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from colomem.engines.reports import SyncStats
from colomem.errors import InvalidArgumentError

from .checks import checksum_parts, finish_checksums, hashed_pick, same_layout
from .engine_calls import EngineCalls
from .transports import ListenerOptions, ListenerTransport, Transport, make_transport


class SyncOptions(ListenerOptions, Protocol):
    """What a sync reads from the rollout each time (the rollout's attributes may change)."""

    @property
    def sync_transport(self) -> str: ...


@dataclass
class SentWeights:
    """One sync of base weights: its stats, the trainer's checksums of the tensors sampled on the way, and
    each worker's snapshot of its own parameters right after the copies."""

    stats: SyncStats
    sampled: dict
    snapshots: list


class BaseWeightSync:
    """The transports (one per `sync_transport` used) and one sync through the current one."""

    def __init__(self, calls: EngineCalls, options: SyncOptions, make_bridge: Callable[[], Any]):
        self._calls, self._opt, self._make_bridge = calls, options, make_bridge
        self._transports: dict[str, Transport] = {}

    def transport(self) -> Transport:
        name = self._opt.sync_transport
        if name not in self._transports:
            self._transports[name] = make_transport(name, self._calls, self._opt, self._make_bridge)
        return self._transports[name]

    @property
    def bridge(self) -> Any:
        """The listener transport's WeightBridge (None before the first listener sync)."""
        t = self._transports.get("listener")
        return t.bridge if isinstance(t, ListenerTransport) else None

    def close_bridge(self) -> None:
        """Closes the listener's bridge; the next listener sync makes a new one and the worker attaches again."""
        t = self._transports.get("listener")
        if t is not None:
            t.close()

    def forget(self) -> None:
        """Drops every transport's state without telling the worker (colomem_close detached it already)."""
        for t in self._transports.values():
            t.close(detach=False)

    def send(self, items: Iterable, version: int, direct_names: dict) -> SentWeights:
        """Streams the (name, tensor) pairs to the workers as `version`. Up to check_sample tensors whose name
        and layout vLLM holds unchanged (`direct_names`) are checksummed on the way."""
        transport = self.transport()
        stats = SyncStats(version=version)
        k = self._opt.check_sample
        pending: dict = {}

        def watched() -> Iterator:
            for name, t in items:
                if not isinstance(t, torch.Tensor):
                    raise InvalidArgumentError(f"{name!r} is a {type(t).__name__}, not a tensor")
                if len(pending) < k and hashed_pick(name) and same_layout(t, direct_names.get(name)):
                    pending[name] = checksum_parts(t)  # queued: no wait inside the pack pipeline
                stats.ntensors += 1
                stats.nbytes += t.numel() * t.element_size()
                yield name, t

        t0 = time.perf_counter()
        acks = transport.sync(watched(), version, stats)
        stats.apply_seconds = max(float(a.get("total_apply_ms", 0.0)) for a in acks) / 1e3 if acks else 0.0
        sampled = finish_checksums(pending)
        stats.seconds = time.perf_counter() - t0
        snapshots: list = []
        if acks:
            flags = [a.get("complete") for a in acks]
            stats.complete = None if None in flags else all(flags)
            stats.nmissing = max(int(a.get("nmissing", 0)) for a in acks)
            stats.missing = tuple(acks[0].get("missing", ()))
            snapshots.extend(dict(a.get("snapshot", {})) for a in acks)
            stats.replayed_tensors = min(int(a.get("replayed_tensors", 0)) for a in acks)
        return SentWeights(stats, sampled, snapshots)


__all__ = ["BaseWeightSync", "SentWeights", "SyncOptions"]
