"""The CUDA-IPC weight bridge on a real GPU: byte-exact round trips (in one process and across two), buffers
never refilled before their ACK, a killed producer is a PeerError within the consumer's timeout, nothing
stays mapped after close, and the GPU checksum equals the host checksum for the same bytes."""

import gc
import os
import signal
from pathlib import Path

import pytest
import torch

from colomem import _C
from colomem.errors import (InvalidArgumentError, NotAvailableError, PeerError, PoolClosedError,
                            TransferTimeoutError, WeightCheckError)

pytestmark = [pytest.mark.gpu, pytest.mark.ipc]

PEER = Path(__file__).with_name("_bridge_peer.py")
MiB = 1 << 20
SLACK = 16 * MiB  # allocator/driver noise allowed when comparing free device memory


def peer_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bridge_peer", PEER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_PEER = peer_module()
spawn, stderr_of, next_event, finish = _PEER.spawn, _PEER.stderr_of, _PEER.next_event, _PEER.finish


def free_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(0)[0]


@pytest.fixture(scope="module")
def peer():
    return _PEER


# --- checksum and device selection --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, MiB + 3, 8 * MiB])
@pytest.mark.parametrize("stride", [1, 3, 64])
def test_gpu_checksum_equals_host_checksum(n, stride):
    data = torch.randint(0, 256, (n + 8,), dtype=torch.uint8)
    dev = data.cuda()
    stream = torch.cuda.current_stream()
    for off in (0, 8):  # 8-byte aligned starts
        want = _C.checksum_buffer(data[off:off + n].numpy().tobytes(), stride)
        got = _C.checksum(dev.data_ptr() + off, n, stride, stream.cuda_stream, 0)
        assert got == want
        out = torch.zeros(1, dtype=torch.int64, device="cuda")
        host = torch.full((1,), -1, dtype=torch.int64).pin_memory()
        _C.checksum_into(dev.data_ptr() + off, n, stride, out.data_ptr(), stream.cuda_stream, 0)
        assert int(out.item()) & ((1 << 64) - 1) == want
        _C.checksum_into(dev.data_ptr() + off, n, stride, out.data_ptr(), stream.cuda_stream, 0, host.data_ptr())
        stream.synchronize()
        assert int(host[0]) & ((1 << 64) - 1) == want == int(out.item()) & ((1 << 64) - 1)


def test_a_batch_of_gpu_windows_gives_each_windows_own_checksum():
    """Windows of several tensors, of every size class (empty, a tail only, sampled, more than 65,535 windows
    across launches), in one batch: each value is the host checksum of its bytes."""
    a = torch.randint(0, 256, (3 * MiB + 5,), dtype=torch.uint8)
    b = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    da, db = a.cuda(), b.cuda()
    spans = [(da, a, 0, 0, 1), (da, a, 8, 7, 1), (da, a, 0, 3 * MiB + 5, 1), (da, a, 64, 2 * MiB, 5),
             (da, a, 1024, MiB, 4096), (db, b, 0, 4096, 1), (db, b, 8, 4000, 3)]
    spans += [(db, b, 8 * (i % 500), 8, 1) for i in range(70_000)]     # a second launch of the sum kernel
    n = len(spans)
    descs = torch.tensor([v for d, _, off, size, stride in spans for v in (d.data_ptr() + off, size, stride)],
                         dtype=torch.int64).pin_memory()
    host = torch.full((n,), -1, dtype=torch.int64).pin_memory()
    out = torch.zeros(n, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream()
    _C.checksum_many_into(descs.data_ptr(), n, out.data_ptr(), stream.cuda_stream, 0, host.data_ptr())
    stream.synchronize()
    want_of = {}
    for _, h, off, size, stride in spans:
        key = (h.data_ptr(), off, size, stride)
        if key not in want_of:
            want_of[key] = _C.checksum_buffer(h[off:off + size].numpy().tobytes(), stride)
    want = [want_of[(h.data_ptr(), off, size, stride)] for _, h, off, size, stride in spans]
    mask = (1 << 64) - 1
    assert [int(v) & mask for v in host.tolist()] == want
    assert [int(v) & mask for v in out.cpu().tolist()] == want


def test_a_gpu_batch_is_refused_before_anything_runs_when_a_window_or_its_descriptors_are_wrong():
    dev = torch.zeros(64, dtype=torch.uint8, device="cuda")
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    plain = torch.tensor([dev.data_ptr(), 64, 1], dtype=torch.int64)        # pageable: the kernels cannot read it
    with pytest.raises(InvalidArgumentError, match="descs"):
        _C.checksum_many_into(plain.data_ptr(), 1, out.data_ptr(), 0, 0)
    on_gpu = plain.cuda()                                                   # nor one on the GPU, read here
    with pytest.raises(InvalidArgumentError, match="descs"):
        _C.checksum_many_into(on_gpu.data_ptr(), 1, out.data_ptr(), 0, 0)
    host = torch.zeros(64, dtype=torch.uint8)
    bad = torch.tensor([dev.data_ptr(), 64, 1, host.data_ptr(), 64, 1], dtype=torch.int64).pin_memory()
    with pytest.raises(InvalidArgumentError, match="not CUDA memory"):
        _C.checksum_many_into(bad.data_ptr(), 2, out.data_ptr(), 0, 0)
    odd = torch.tensor([dev.data_ptr() + 4, 16, 1], dtype=torch.int64).pin_memory()
    with pytest.raises(InvalidArgumentError, match="aligned"):
        _C.checksum_many_into(odd.data_ptr(), 1, out.data_ptr(), 0, 0)
    torch.cuda.synchronize()                   # nothing was queued that could fault


def test_gpu_checksum_on_a_vmm_buffer_and_bad_pointers():
    buf = _C.ExportableBuffer(0, 3 * MiB)
    assert buf.nbytes % _C.ipc_granularity(0) == 0 and buf.nbytes >= 3 * MiB
    from colomem._torch import device_bytes

    view = device_bytes(buf.ptr, buf.nbytes, torch.device("cuda", 0), owner=buf)
    view.copy_(torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8).cuda())
    torch.cuda.synchronize()
    assert _C.checksum(buf.ptr, buf.nbytes, 1, 0, 0) == _C.checksum_buffer(view.cpu().numpy().tobytes())
    with pytest.raises(InvalidArgumentError):
        _C.checksum(buf.ptr + 4, 64, 1, 0, 0)  # misaligned for the GPU path
    host = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="not CUDA memory"):
        _C.checksum(host.data_ptr(), 64, 1, 0, 0)  # refused before a kernel could fault
    del view
    buf.close()
    with pytest.raises(PoolClosedError):
        buf.ptr


def test_device_uuid_round_trip():
    for i in range(torch.cuda.device_count()):
        u = _C.device_uuid(i)
        assert u.startswith("GPU-") and len(u) == 40
        assert _C.device_by_uuid(u) == i and _C.device_by_uuid(u.upper()[4:]) == i
    with pytest.raises(NotAvailableError, match="not visible"):
        _C.device_by_uuid("GPU-00000000-0000-0000-0000-000000000000")


# --- one process: producer and consumer side by side ---------------------------------------------------------
def test_round_trip_in_process_with_the_callable_transport(peer):
    from colomem.bridge import BridgeImporter, WeightBridge

    with WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=2, device=0) as bridge:
        imp = BridgeImporter.connect(bridge.address, timeout=60)
        bridge.wait_for_importers(1, 60)
        for version in range(3):
            want = peer.named_tensors(version, "cuda:0")
            got = {}

            def apply(msg_dict):  # what the vLLM worker does inside collective_rpc
                for name, t in imp.tensors(msg_dict, verify="sampled"):
                    got[name] = t.clone()
                return {"version": msg_dict["version"], "seq": msg_dict["seq"], "ok": True}

            stats = bridge.sync(want, version=version, send=apply)
            assert stats.messages > 3 and stats.version == version
            assert imp.version == version
            assert set(got) == {n for n, _ in want}
            for name, t in want:
                assert peer.same_bytes(got[name], t.contiguous()), name
        imp.close()


def test_buffer_is_not_refilled_before_its_ack(peer):
    from colomem.bridge import BridgeImporter, WeightBridge

    for nbuf in (1, 2, 3):
        with WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=nbuf, device=0, checksum="full") as bridge:
            imp = BridgeImporter.connect(bridge.address, timeout=60)
            seen = 0
            for msg in bridge.publish(peer.named_tensors(0, "cuda:0"), version=0):
                torch.cuda.synchronize()  # every pack the bridge launched so far has landed
                imp.verify(msg.to_dict(), "full")  # ... and none of them wrote into this message's buffer
                list(imp.tensors(msg.to_dict(), verify="full"))
                seen += 1
            assert seen > 3 and imp.version == 0
            imp.close()


def test_corrupted_buffer_is_a_weight_check_error(peer):
    from colomem.bridge import BridgeImporter, WeightBridge

    with WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=2, device=0, checksum="sampled") as bridge:
        imp = BridgeImporter.connect(bridge.address, timeout=60)
        gen = bridge.publish(peer.named_tensors(0, "cuda:0"), version=0)
        msg = next(gen)
        bridge._views[msg.buffer][:8].add_(1)  # what a premature refill would do
        torch.cuda.synchronize()
        with pytest.raises(WeightCheckError, match="overwritten"):
            list(imp.tensors(msg.to_dict(), verify="sampled"))
        with pytest.raises(InvalidArgumentError, match="checksum='full'"):
            imp.verify(msg.to_dict(), "full")  # a sampled producer cannot be fully verified
        gen.close()
        imp.close()


def test_protocol_errors(peer):
    from colomem.bridge import BridgeImporter, WeightBridge

    bridge = WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=2, device=0)
    imp = BridgeImporter.connect(bridge.address, timeout=60)
    v5 = []
    for m in bridge.publish(peer.named_tensors(0, "cuda:0")[:1], version=5):  # one split tensor: 2 buckets
        v5.append(m.to_dict())
        list(imp.tensors(v5[-1]))
    assert len(v5) == 2 and imp.version == 5
    with pytest.raises(PeerError, match="back in time"):
        imp.tensors({**v5[0], "version": 4})
    with pytest.raises(PeerError):
        imp.tensors({**v5[0], "buffer": 9})
    gen = bridge.publish(peer.named_tensors(0, "cuda:0"), version=6)
    first = next(gen)
    with pytest.raises(InvalidArgumentError, match="still running"):
        bridge.publish([], version=7)
    with pytest.raises(PeerError, match="out of order"):
        imp.tensors({**first.to_dict(), "seq": 3}, verify="none")
    gen.close()
    bridge.close()
    with pytest.raises(PoolClosedError):
        bridge.publish([], version=8)
    with pytest.raises(PoolClosedError):
        bridge.address
    with pytest.raises(PeerError, match="closed"):
        imp.receive(timeout=10)  # the bridge said goodbye
    imp.close()
    with pytest.raises(PoolClosedError):
        imp.tensors(v5[0])
    with pytest.raises(PeerError):
        BridgeImporter.connect("/nonexistent-colomem-dir/bridge.sock", timeout=2)


def test_receive_timeout_is_typed(peer):
    from colomem.bridge import BridgeImporter, WeightBridge

    with WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=1, device=0) as bridge:
        with BridgeImporter.connect(bridge.address, timeout=60) as imp:
            with pytest.raises(TransferTimeoutError):
                imp.receive(timeout=0.2)


def test_nothing_stays_mapped_after_close():
    from colomem.bridge import BridgeImporter, WeightBridge

    big = 64 * MiB
    torch.zeros(1, device="cuda")
    free0 = free_bytes()
    for cycle in range(3):
        bridge = WeightBridge(bucket_bytes=big, buffers=2, device=0)
        imp = BridgeImporter.connect(bridge.address, timeout=60)
        tensors = [("x", torch.ones(big // 4 - 64, device="cuda")), ("y", torch.arange(10, device="cuda"))]
        for msg in bridge.publish(tensors, version=cycle):
            kept = [t for _, t in imp.tensors(msg.to_dict())]  # views into the mapped buffer
        del tensors
        assert free_bytes() <= free0 - 2 * big + SLACK  # the two buffers are really there
        imp.close()
        bridge.close()
        # a view still alive keeps its buffer mapped (the driver counts the importer's handle) ...
        assert free_bytes() <= free0 - big + SLACK
        assert imp.live_views >= 1
        del kept, msg
        # ... and dropping it unmaps: everything is back
        assert free_bytes() >= free0 - SLACK, f"cycle {cycle}: device memory not returned"


# --- two processes ------------------------------------------------------------------------------------------
def test_two_processes_byte_exact_over_versions(peer):
    from colomem.bridge import WeightBridge

    torch.zeros(1, device="cuda")
    free0 = free_bytes()
    versions = 3
    bridge = WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=2, device=0, checksum="full", timeout=120)
    child = spawn("consumer", bridge.address, versions, 0.2)
    try:
        ev = next_event(child)
        assert ev["event"] == "attached" and ev["uuid"] == _C.device_uuid(0) and ev["buffers"] == 2
        bridge.wait_for_importers(1, 60)
        for v in range(versions):
            stats = bridge.sync(peer.named_tensors(v, "cuda:0"), version=v)
            ev = next_event(child)
            assert ev["event"] == "version" and ev["version"] == v
            assert ev["ok"], ev["bad"]
            assert ev["messages"] == stats.messages and ev["applied"] == v and ev["held"] >= 2
            assert bridge.last_reports == [{"version": v, "messages": stats.messages}]
        assert next_event(child) == {"event": "closed", "live_views": 0}
        finish(child)
    finally:
        if child.poll() is None:
            child.kill()
        bridge.close()
    assert free_bytes() >= free0 - SLACK


def test_producer_killed_mid_sync_is_a_peer_error_not_a_hang(peer):
    from colomem.bridge import BridgeImporter

    torch.zeros(1, device="cuda")
    free0 = free_bytes()
    child = spawn("producer", 1)
    try:
        ev = next_event(child)
        assert ev["event"] == "address"
        imp = BridgeImporter.connect(ev["address"], timeout=60)
        want = dict(peer.named_tensors(0, imp.device))
        msg = peer.receive_until_whole(imp, want)
        # the producer waits for this ACK (mid-sync); kill it there
        os.kill(child.pid, signal.SIGKILL)
        child.wait(60)
        msg = peer.ack_until_peer_error(imp, msg, child.pid)
        # the mapping outlives the exporter: the bytes of the last bucket are still there
        imp.verify(msg, "full")
        imp.close()
    finally:
        if child.poll() is None:
            child.kill()
    del want  # this test's own tensors sit in torch's cache, not in the bridge's mappings
    gc.collect()
    torch.cuda.empty_cache()
    assert free_bytes() >= free0 - SLACK


@pytest.mark.multi_gpu
def test_importer_finds_the_gpu_by_uuid_under_another_numbering(peer):
    from colomem.bridge import WeightBridge

    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(1))  # the child sees our cuda:1 as its cuda:0
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[1]
    bridge = WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=2, device=1, checksum="full", timeout=120)
    child = spawn("consumer", bridge.address, 1, 0.0, env=env)
    try:
        ev = next_event(child)
        assert ev["event"] == "attached" and ev["device"] == "cuda:0" and ev["uuid"] == _C.device_uuid(1)
        bridge.wait_for_importers(1, 60)
        bridge.sync(peer.named_tensors(0, "cuda:1"), version=0)
        ev = next_event(child)
        assert ev["ok"], ev["bad"]
        finish(child)
    finally:
        if child.poll() is None:
            child.kill()
        bridge.close()
