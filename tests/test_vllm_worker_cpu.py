"""ColomemWorkerExtension without vLLM, on CPU tensors: errors returned as payloads, bucket order, the bridge
picked by GPU UUID, checksums, the end-of-peer test of the listener, the wake rollback, and the benchmark's
subclass (the fake worker of tests/fakes/vllm.py; vLLM's pieces the worker imports are stubbed)."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from colomem.engines.vllm.checks import tensor_checksum
from colomem.engines.vllm.worker import ColomemWorkerExtension
from colomem.engines.vllm.worker.listener import peer_ended
from colomem.errors import (CudaOutOfMemoryError, PeerAbortedError, PeerClosedError, PeerError,
                            TransferTimeoutError, raise_payload)
from fakes.vllm import REPO, FakeBridge, FakeWorker, fake_worker_class, make, trainer_weights
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)

def test_worker_errors_come_back_as_their_colomem_class():
    w = FakeWorker()
    err = w.colomem_listen()
    assert err["error"] == "PeerError" and "colomem_attach" in err["message"]
    with pytest.raises(PeerError, match="colomem_attach"):
        raise_payload(err, "colomem_listen")
    assert w.colomem_param_checksums(["nope"])["error"] == "InvalidArgumentError"
    with pytest.raises(CudaOutOfMemoryError):
        raise_payload({"error": "CudaOutOfMemoryError", "message": "CUDA out of memory"}, "x")
    with pytest.raises(PeerError):                # unknown classes become PeerError, never a bare Exception
        raise_payload({"error": "KeyError", "message": "boom"}, "x")
    bad = w.colomem_load_direct([("o_proj", torch.zeros(4, 4))], "not a version")
    assert bad["error"] == "PeerError"            # a ValueError in the worker: a PeerError naming it
    assert "ValueError" in bad["message"]


def test_buckets_out_of_order_are_refused():
    r = make(sync_transport="listener")
    r.load_weights(trainer_weights(1).items(), version=1)
    w = r._worker
    msg = {"buffer": 0, "version": 2, "seq": 3, "last": False, "nbytes": 0, "entries": []}
    with pytest.raises(PeerError, match="out of order"):
        w._colomem_apply(msg)
    r.close()


def test_checksum_is_order_free_and_sensitive():
    t = torch.randn(1000, 33)
    assert tensor_checksum(t) == tensor_checksum(t.clone()) == tensor_checksum(t.t().contiguous().t())
    u = t.clone()
    u.view(-1)[0] += 1
    assert tensor_checksum(u) != tensor_checksum(t)
    assert tensor_checksum(t[:, 1:]) == tensor_checksum(t[:, 1:].contiguous())   # odd offsets copy once


def test_worker_maps_the_bridge_on_its_own_gpu_by_uuid():
    w = FakeWorker()
    w._colomem_device_uuid = lambda: "GPU-bbbb"
    bridge = FakeBridge(256, 2)
    try:
        other = "/tmp/not-this-one"
        got = w.colomem_attach({"GPU-aaaa": other, "GPU-BBBB": bridge.address})   # UUIDs compare case-blind
        assert "error" not in got and w._colomem().importer.address == bridge.address
        err = w.colomem_attach({"GPU-aaaa": other})
        assert err["error"] == "PeerError" and "GPU-bbbb" in err["message"] and "GPU-aaaa" in err["message"]
        assert w.colomem_attach({})["error"] == "InvalidArgumentError"
    finally:
        bridge.close()


def test_ping_is_a_round_trip_that_does_nothing(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))   # as bench_sync.py does for vLLM's worker
    from sync_worker import WORKER_EXTENSION as BENCH_EXTENSION
    from sync_worker import BenchWorkerExtension

    r = make(worker_cls=fake_worker_class(BenchWorkerExtension), worker_extension=BENCH_EXTENSION)
    assert r.built_with["worker_extension_cls"] == "sync_worker.BenchWorkerExtension"
    assert r.rpc("colomem_ping") == [{"pid": os.getpid()}]
    r.close()
    assert not hasattr(ColomemWorkerExtension, "colomem_ping")     # benchmark-only: not in the product


def test_peer_end_is_told_by_class():
    assert peer_ended(PeerClosedError("closed")) == "closed" and peer_ended(PeerAbortedError("x")) == "abort"
    assert peer_ended(PeerError("exporter closed the weight bridge")) is None


def test_rollback_backs_up_then_unmaps_only_what_the_failed_wake_mapped(monkeypatch):
    from colomem.engines.vllm.worker import wake_rollback

    def alloc(tag, size, backup=None):
        return types.SimpleNamespace(tag=tag, handle=(0, size), cpu_backup_tensor=backup)

    kept = torch.zeros(8, dtype=torch.uint8)
    table = {0x1000: alloc("weights", 16), 0x2000: alloc("weights", 32, kept), 0x3000: alloc("weights", 64),
             0x4000: alloc("kv_cache", 128)}
    mapped = {0x1000, 0x2000, 0x4000}            # 0x3000: the wake stopped before it
    events: list = []
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    allocator = types.SimpleNamespace(pointer_to_data=table)
    setattr(cumem, "CuMemAllocator", types.SimpleNamespace(get_instance=lambda: allocator))
    setattr(cumem, "unmap_and_release", lambda handle: events.append(("unmap", handle[1])))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", types.ModuleType("vllm.device_allocator"))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    monkeypatch.setattr(wake_rollback, "_C", types.SimpleNamespace(pointer_is_mapped=lambda p: p in mapped))
    monkeypatch.setattr(wake_rollback, "_pinned", lambda n: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(wake_rollback, "device_copy",
                        lambda device, direction, copies, timeout: events.append((direction, copies)))

    out = wake_rollback.rollback_wake(torch.device("cpu"), ["weights"], True, 5.0)
    assert out == {"released_bytes": 16 + 32}
    assert events[0][0] == "d2h" and [(src, n) for _, src, n in events[0][1]] == [(0x1000, 16)]
    assert events[1:] == [("unmap", 16), ("unmap", 32)]            # every backup copied before any unmap
    assert table[0x1000].cpu_backup_tensor.numel() == 16 and table[0x2000].cpu_backup_tensor is kept
    assert table[0x3000].cpu_backup_tensor is None

    table[0x1000].cpu_backup_tensor = None
    events.clear()

    def failing(*a):
        raise TransferTimeoutError("copy timed out")

    monkeypatch.setattr(wake_rollback, "device_copy", failing)
    with pytest.raises(TransferTimeoutError):
        wake_rollback.rollback_wake(torch.device("cpu"), ["weights"], True, 5.0)
    assert events == [] and table[0x1000].cpu_backup_tensor is None   # no half-made backup, nothing unmapped
