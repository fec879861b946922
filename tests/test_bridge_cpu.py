"""The weight bridge end to end on the CPU: a host bridge (device="cpu": buffers in shared memory whose fds
cross the bridge socket) and real importers in threads of this process. The
rotation, ACK, ordering, verification, reassembly and close rules run here, the socket, its errors and another
process in test_bridge_socket_cpu.py; the CUDA buffers on a GPU: tests/gpu/test_bridge_ipc.py."""

import gc

import pytest
import torch

from colomem import _C
from colomem.bridge import BridgeImporter, WeightBridge
from colomem.bridge.buckets import BucketMessage, Reassembler, entry_view, plan_buckets
from colomem.errors import (CudaOutOfMemoryError, InvalidArgumentError, PeerError, PoolClosedError, WeightCheckError,
                            error_payload)
from bridge_host import make  # noqa: F401  (a fixture: a host bridge with an importer attached)
from bridge_host import memfd_mapped, named, same_bytes


def test_bridge_without_cuda_is_not_available():
    if torch.cuda.is_available() and _C.build_info()["cuda"]:
        pytest.skip("a CUDA device is visible: tests/gpu/test_bridge_ipc.py covers the bridge")
    from colomem.errors import NotAvailableError

    with pytest.raises(NotAvailableError, match="device='cpu'"):
        WeightBridge(bucket_bytes="1MiB", buffers=2, device=0)


# --- the host bridge and its importers: bridge_host.py ------------------------------------------------------
def test_the_host_bridge_hands_over_shared_memory(make):
    bridge, imp = make()
    assert imp.device == torch.device("cpu") and imp.uuid == bridge.uuid == "host" and len(imp._buffers) == 2
    assert bridge.device == torch.device("cpu") and bridge.importers == 1
    for pb, ib in zip(bridge._buffers, imp._buffers):
        assert pb.ptr != ib.ptr and memfd_mapped(pb.ptr) and memfd_mapped(ib.ptr)  # two mappings, one memory
    bridge._views[1][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert _C.checksum(imp._buffers[1].ptr, 8, 1, 0, -1) == _C.checksum(bridge._buffers[1].ptr, 8, 1, 0, -1)
    with pytest.raises(InvalidArgumentError, match="host memory"):
        BridgeImporter.connect(bridge.address, timeout=10, device="cuda:0")
    kept, ptr = bridge._views[1], bridge._buffers[1].ptr
    bridge.close()  # a view that outlives the bridge keeps the memory mapped (no dangling pointer) ...
    assert kept[:4].tolist() == [1, 2, 3, 4] and memfd_mapped(ptr)
    del kept
    gc.collect()
    assert not memfd_mapped(ptr)  # ... until it goes


# --- producer ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbuffers", [1, 2, 3])
def test_publish_rotates_buffers_only_after_acks(make, nbuffers):
    bridge, _ = make(nbuffers, 1024, importer=False)
    held, packs = bridge.held, bridge.packs
    for version in (0, 1):
        items = named(version)
        total = len(list(plan_buckets(items, 1024)))
        packs.clear()
        reasm, got, msgs = Reassembler(), {}, []
        for k, msg in enumerate(bridge.publish(items, version=version)):
            held.add(msg.buffer)
            assert len(packs) == min(total, k + nbuffers)  # the next buckets are packed while this one is out
            buf = bridge._views[msg.buffer]
            assert _C.checksum(buf.data_ptr(), msg.nbytes, 1, 0, -1) == msg.checksum
            for e in BucketMessage.from_dict(msg.to_dict()).entries:
                out = reasm.add(e, entry_view(buf, e))
                if out:
                    got[out[0]] = out[1].clone()
            msgs.append(msg)
            held.discard(msg.buffer)  # resuming the generator is the ACK
        assert [m.seq for m in msgs] == list(range(total)) and len(packs) == total
        assert [m.last for m in msgs] == [False] * (total - 1) + [True]
        assert all(m.version == version for m in msgs)
        for name, t in items:
            assert same_bytes(got[name], t)
        st = bridge.last_stats
        assert st.messages == total and st.nbytes == sum(t.numel() * 4 for _, t in items)


def test_publish_of_nothing_still_closes_the_version(make):
    bridge, _ = make(2, 1024, importer=False)
    (msg,) = list(bridge.publish([], version=4))
    assert msg.last and msg.nbytes == 0 and msg.entries == () and msg.version == 4 and bridge.packs == []
    assert msg.checksum == _C.checksum_buffer(b"", 1)


def test_publish_one_at_a_time_and_early_close(make):
    bridge, _ = make(2, 1024, checksum="none", importer=False)
    items = [(f"t{i}", torch.zeros(200)) for i in range(6)]
    gen = bridge.publish(items, version=0)
    first = next(gen)
    assert first.checksum is None and first.checksum_stride == 0
    with pytest.raises(InvalidArgumentError, match="still running"):
        bridge.publish(items, version=1)
    gen.close()  # a consumer that failed: the bridge is usable again
    assert len(list(bridge.publish(items, version=1))) == len(list(plan_buckets(items, 1024)))
    never_started = bridge.publish(items, version=2)
    del never_started  # a generator never started must not leave the bridge "busy"
    assert len(list(bridge.publish(items, version=3))) > 1
    with pytest.raises(InvalidArgumentError):
        bridge.publish(items, version=-1)


def test_callable_acks(make):
    bridge, imp = make()
    items = named(1)
    seen = []

    def send(d):
        seen.append(d["seq"])
        for _ in imp.tensors(d, verify="full"):
            pass
        return [{"version": d["version"], "seq": d["seq"]}]  # collective_rpc: one ACK per worker

    stats = bridge.sync(items, version=1, send=send)
    assert seen == list(range(stats.messages)) and imp.version == 1
    with pytest.raises(PeerError, match="refused bucket 0 of version 2: full disk"):
        bridge.sync(items, version=2, send=lambda d: {"ok": False, "error": "full disk"})
    with pytest.raises(PeerError, match="acknowledged"):
        bridge.sync(items, version=3, send=lambda d: {"version": 3, "seq": d["seq"] + 1})
    with pytest.raises(PeerError):
        bridge.sync(items, version=4, send=lambda d: False)
    assert not bridge._publishing  # every failed sync released the bridge


def test_callable_refusals_keep_the_consumers_error_class(make):
    bridge, _ = make(importer=False)
    items = named(1, n=3)
    bad = error_payload(WeightCheckError("parameter 'w' differs"))
    with pytest.raises(WeightCheckError, match="the consumer refused bucket 0 of version 0: .*parameter 'w' differs"):
        bridge.sync(items, version=0, send=lambda d: {"ok": False, "error": bad})
    with pytest.raises(CudaOutOfMemoryError, match="refused bucket 0 of version 1"):  # an RPC's error return
        bridge.sync(items, version=1, send=lambda d: [error_payload(RuntimeError("CUDA out of memory"))])
    with pytest.raises(PeerError, match="refused bucket 0 of version 2: no reason given"):
        bridge.sync(items, version=2, send=lambda d: {"ok": False})
    assert not bridge._publishing


# --- consumer ---------------------------------------------------------------------------------------------
def test_importer_round_trip_over_versions(make):
    bridge, imp = make(nbuffers=2)
    for version in range(3):
        items = named(10 + version, dtype=torch.bfloat16)
        got = {}
        for msg in bridge.publish(items, version=version):
            for name, t in imp.tensors(msg.to_dict(), verify="full"):
                assert t.device == torch.device("cpu")
                got[name] = t.clone()
        assert imp.version == version
        assert [n for n, _ in items] == sorted(got, key=lambda n: int(n[1:]))
        for name, t in items:
            assert same_bytes(got[name], t)
    imp.close()


def test_importer_verification(make):
    bridge, imp = make(checksum="sampled")
    gen = bridge.publish(named(2), version=0)
    msg = next(gen).to_dict()
    with pytest.raises(InvalidArgumentError, match="checksum='full'"):
        imp.verify(msg, "full")
    imp.verify(msg, "sampled")
    bridge._views[msg["buffer"]][0] ^= 0xFF  # word 0 is always sampled; the importer maps the same memory
    with pytest.raises(WeightCheckError, match="overwritten"):
        list(imp.tensors(msg, verify="sampled"))
    list(imp.tensors({**msg, "seq": 0}, verify="none"))  # verify="none" takes the bytes as they are
    with pytest.raises(InvalidArgumentError):
        imp.tensors(msg, verify="paranoid")
    gen.close()
    bridge2, imp2 = make(checksum="none")
    msg2 = next(bridge2.publish(named(2), version=0)).to_dict()
    with pytest.raises(InvalidArgumentError, match="no checksum"):
        list(imp2.tensors(msg2, verify="sampled"))


def test_importer_ordering(make):
    bridge, imp = make()
    msgs = []
    for m in bridge.publish(named(3), version=5):
        msgs.append(m.to_dict())
        list(imp.tensors(msgs[-1]))
    assert len(msgs) > 2 and imp.version == 5
    with pytest.raises(PeerError, match="back in time"):
        imp.tensors({**msgs[0], "version": 4})
    with pytest.raises(PeerError, match="buffer 7"):
        imp.tensors({**msgs[0], "buffer": 7})
    with pytest.raises(PeerError, match="holds"):
        imp.tensors({**msgs[0], "nbytes": 10**6, "entries": []})
    list(imp.tensors({**msgs[0], "version": 6}, verify="none"))  # a new version starts at seq 0 (its buffer
    # was refilled since: these bytes are not version 0's any more, hence verify="none")
    with pytest.raises(PeerError, match="out of order"):
        imp.tensors({**msgs[2], "version": 6})  # seq 1 skipped
    with pytest.raises(PeerError, match="malformed"):
        imp.tensors({"buffer": 0})


def test_a_lost_part_of_a_split_tensor_is_a_peer_error(make):
    bridge, imp = make()
    gen = bridge.publish([("big", torch.arange(1000, dtype=torch.float32))], version=0)  # 4 parts of 1 KiB
    m0 = next(gen).to_dict()
    assert list(imp.tensors(m0)) == []  # a part only: nothing complete yet
    next(gen)  # bucket 1 is lost on the way
    m2 = next(gen).to_dict()
    with pytest.raises(PeerError, match="split tensor 'big'"):
        list(imp.tensors({**m2, "seq": 1}))
    gen.close()


def test_close_unmaps_now_or_when_the_last_view_goes(make):
    bridge, imp = make(nbuffers=2)
    items = [("a", torch.ones(200)), ("b", torch.ones(200) * 2)]  # 800 B each: one per bucket
    views = []
    for msg in bridge.publish(items, version=0):
        views += [t for _, t in imp.tensors(msg.to_dict())]
    keep = views[1]  # a view into buffer 1
    del views, msg
    gc.collect()
    bufs = list(imp._buffers)
    ptr0, ptr1 = bufs[0].ptr, bufs[1].ptr
    assert imp.live_views == 1
    imp.close()
    assert bufs[0].closed and not bufs[1].closed  # buffer 1 is still viewed
    assert not memfd_mapped(ptr0) and memfd_mapped(ptr1)
    assert keep.sum().item() == 400.0  # ... and still readable
    with pytest.raises(PoolClosedError):
        imp.tensors({"buffer": 0})
    with pytest.raises(PoolClosedError):
        imp.receive()
    del bufs
    bridge.close()  # the producer side lets go too
    assert memfd_mapped(ptr1) and keep.sum().item() == 400.0
    del keep
    gc.collect()
    assert not memfd_mapped(ptr1) and imp.live_views == 0  # the last view took the mapping with it
    imp.close()  # idempotent


def test_importer_keeps_no_view_once_the_caller_copied_and_let_go(make):
    # What the GPU two-process test checks at close (live_views == 0), by plain refcounting (no gc), with
    # split and whole tensors over versions. Its peer once kept a for-loop variable (the last view) alive.
    bridge, imp = make(nbuffers=2)
    for version in range(3):
        got = {}
        for msg in bridge.publish(named(30 + version), version=version):
            got.update({name: t.clone() for name, t in imp.tensors(msg.to_dict(), verify="full")})
            assert imp.live_views == 0  # neither the importer nor its exhausted iterator holds a view
        assert imp.version == version and len(got) == 10
    gen = bridge.publish(named(40), version=3)
    for name, t in imp.tensors(next(gen).to_dict()):
        pass
    gen.close()
    assert imp.live_views == 1  # ... whereas a loop variable keeps the last whole-tensor view alive
    bufs = list(imp._buffers)
    del t
    assert imp.live_views == 0
    imp.close()
    assert all(b.closed for b in bufs)  # nothing viewed: every buffer unmapped at close
