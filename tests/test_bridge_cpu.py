"""WeightBridge / BridgeImporter logic on the CPU: the device pieces (VMM buffers, GPU pack, CUDA streams)
are replaced by CPU tensors so the rotation, ACK, ordering, verification, reassembly and close rules run
here. The real thing on a GPU: tests/gpu/test_bridge_ipc.py."""

import gc
import threading
import time

import numpy as np
import pytest
import torch

import colomem.bridge as br
from colomem import _C
from colomem._bucket import BucketMessage, Reassembler, entry_view, pack_bucket, plan_buckets
from colomem.errors import InvalidArgumentError, PeerError, PoolClosedError, WeightCheckError
from random_bytes import random_tensor


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_bridge_without_cuda_is_not_available():
    if torch.cuda.is_available() and _C.build_info()["cuda"]:
        pytest.skip("a CUDA device is visible: tests/gpu/test_bridge_ipc.py covers the bridge")
    from colomem.errors import NotAvailableError

    with pytest.raises(NotAvailableError):
        br.WeightBridge(bucket_bytes="1MiB", buffers=2, device=0)


# --- fakes ----------------------------------------------------------------------------------------------------
class _Done:
    def query(self):
        return True


class FakeBuffer:
    """Stands for an IPC buffer: host bytes at .ptr; records close() and its release (the C++ destructor)."""

    def __init__(self, nbytes, released):
        self.t = torch.zeros(nbytes, dtype=torch.uint8)
        self.ptr, self.nbytes, self.closed, self._released = self.t.data_ptr(), nbytes, False, released

    def close(self):
        self.closed = True

    def __del__(self):
        self._released.append(self.ptr)


class _HostArray:
    """Like colomem._torch._CudaArray for host memory: a numpy view that keeps `owner` alive."""

    def __init__(self, ptr, nbytes, owner):
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        self.owner = owner


class FakeConn:
    def close(self):
        pass


def cpu_bridge(monkeypatch, nbuffers, bucket_bytes, checksum="full", views=None):
    """A WeightBridge whose buffers are CPU tensors; records packs and fails on a refill before the ACK."""
    b = br.WeightBridge.__new__(br.WeightBridge)
    b.bucket_bytes, b.checksum, b.timeout, b.device = bucket_bytes, checksum, 5.0, torch.device("cpu")
    b._closed, b._publishing, b._lock, b._importers = False, False, threading.Lock(), []
    b._views = views or [torch.zeros(bucket_bytes, dtype=torch.uint8) for _ in range(nbuffers)]
    b._buffers, b._pending = list(b._views), [None] * nbuffers
    b._sums_host = torch.zeros(nbuffers, dtype=torch.int64)
    b._server = b._thread = b.last_stats = b._stream = None
    held, packs = set(), []

    def fake_pack(self, i, plan, stride):
        assert i not in held, f"buffer {i} refilled before the ACK of the message that used it"
        pack_bucket(plan, self._views[i])
        if stride:
            v = _C.checksum(self._views[i].data_ptr(), plan.nbytes, stride, 0, -1)
            self._sums_host[i] = v - (1 << 64) if v >= 1 << 63 else v
        self._pending[i] = (_Done(), plan.sources)
        packs.append(i)

    monkeypatch.setattr(br.WeightBridge, "_pack", fake_pack)
    monkeypatch.setattr(br, "_wait_stream", lambda *a, **k: 0.0)
    return b, held, packs


def cpu_pair(monkeypatch, nbuffers=2, bucket_bytes=1024, checksum="full"):
    """A CPU producer and an importer sharing the same buffers, plus the list of released buffers."""
    released = []
    bufs = [FakeBuffer(bucket_bytes, released) for _ in range(nbuffers)]
    bridge, held, packs = cpu_bridge(monkeypatch, nbuffers, bucket_bytes, checksum, views=[b.t for b in bufs])
    monkeypatch.setattr(br, "_view", lambda buf, n, device, owner: torch.from_numpy(
        np.asarray(_HostArray(buf.ptr, n, owner))))
    monkeypatch.setattr(br, "_wait_current_stream", lambda *a, **k: 0.0)
    monkeypatch.setattr(br, "_buffer_checksum", lambda ptr, n, stride, device: _C.checksum(ptr, n, stride, 0, -1))
    hello = {"uuid": "GPU-fake", "bucket_bytes": bucket_bytes, "pid": 1, "checksum": checksum}
    imp = br.BridgeImporter(FakeConn(), bufs, hello, torch.device("cpu"), 5.0)
    return bridge, imp, released


def named(seed, n=10, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", random_tensor((60 + 97 * i,), dtype, gen)) for i in range(n)]  # several are split


# --- producer ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbuffers", [1, 2, 3])
def test_publish_rotates_buffers_only_after_acks(monkeypatch, nbuffers):
    bridge, held, packs = cpu_bridge(monkeypatch, nbuffers, 1024)
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


def test_publish_of_nothing_still_closes_the_version(monkeypatch):
    bridge, _, packs = cpu_bridge(monkeypatch, 2, 1024)
    (msg,) = list(bridge.publish([], version=4))
    assert msg.last and msg.nbytes == 0 and msg.entries == () and msg.version == 4 and packs == []
    assert msg.checksum == _C.checksum_buffer(b"", 1)


def test_publish_one_at_a_time_and_early_close(monkeypatch):
    bridge, held, _ = cpu_bridge(monkeypatch, 2, 1024, checksum="none")
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


def test_callable_acks(monkeypatch):
    bridge, imp, _ = cpu_pair(monkeypatch)
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


# --- consumer ---------------------------------------------------------------------------------------------
def test_importer_round_trip_over_versions(monkeypatch):
    bridge, imp, _ = cpu_pair(monkeypatch, nbuffers=2)
    for version in range(3):
        items = named(10 + version, dtype=torch.bfloat16)
        got = {}
        for msg in bridge.publish(items, version=version):
            for name, t in imp.tensors(msg.to_dict(), verify="full"):
                got[name] = t.clone()
        assert imp.version == version
        assert [n for n, _ in items] == sorted(got, key=lambda n: int(n[1:]))
        for name, t in items:
            assert same_bytes(got[name], t)
    imp.close()


def test_importer_verification(monkeypatch):
    bridge, imp, _ = cpu_pair(monkeypatch, checksum="sampled")
    gen = bridge.publish(named(2), version=0)
    msg = next(gen).to_dict()
    with pytest.raises(InvalidArgumentError, match="checksum='full'"):
        imp.verify(msg, "full")
    imp.verify(msg, "sampled")
    bridge._views[msg["buffer"]][0] ^= 0xFF  # word 0 is always sampled
    with pytest.raises(WeightCheckError, match="overwritten"):
        list(imp.tensors(msg, verify="sampled"))
    list(imp.tensors({**msg, "seq": 0}, verify="none"))  # verify="none" takes the bytes as they are
    with pytest.raises(InvalidArgumentError):
        imp.tensors(msg, verify="paranoid")
    gen.close()
    bridge2, imp2, _ = cpu_pair(monkeypatch, checksum="none")
    msg2 = next(bridge2.publish(named(2), version=0)).to_dict()
    with pytest.raises(InvalidArgumentError, match="no checksum"):
        list(imp2.tensors(msg2, verify="sampled"))


def test_importer_ordering(monkeypatch):
    bridge, imp, _ = cpu_pair(monkeypatch)
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


def test_a_lost_part_of_a_split_tensor_is_a_peer_error(monkeypatch):
    bridge, imp, _ = cpu_pair(monkeypatch)
    gen = bridge.publish([("big", torch.arange(1000, dtype=torch.float32))], version=0)  # 4 parts of 1 KiB
    m0 = next(gen).to_dict()
    assert list(imp.tensors(m0)) == []  # a part only: nothing complete yet
    next(gen)  # bucket 1 is lost on the way
    m2 = next(gen).to_dict()
    with pytest.raises(PeerError, match="split tensor 'big'"):
        list(imp.tensors({**m2, "seq": 1}))
    gen.close()


def test_close_unmaps_now_or_when_the_last_view_goes(monkeypatch):
    bridge, imp, released = cpu_pair(monkeypatch, nbuffers=2)
    items = [("a", torch.ones(200)), ("b", torch.ones(200) * 2)]  # 800 B each: one per bucket
    views = []
    for msg in bridge.publish(items, version=0):
        views += [t for _, t in imp.tensors(msg.to_dict())]
    keep = views[1]  # a view into buffer 1
    del views, msg
    gc.collect()
    bufs = list(imp._buffers)
    assert imp.live_views == 1
    imp.close()
    assert bufs[0].closed and not bufs[1].closed  # buffer 1 is still viewed
    assert keep.sum().item() == 400.0  # ... and still readable
    with pytest.raises(PoolClosedError):
        imp.tensors({"buffer": 0})
    with pytest.raises(PoolClosedError):
        imp.receive()
    ptr1 = bufs[1].ptr
    del bufs
    bridge._views = bridge._buffers = []  # the producer side lets go too (its close())
    assert ptr1 not in released
    del keep
    gc.collect()
    assert ptr1 in released and imp.live_views == 0  # the last view took the mapping with it
    imp.close()  # idempotent


def test_importer_keeps_no_view_once_the_caller_copied_and_let_go(monkeypatch):
    # What the GPU two-process test checks at close (live_views == 0), by plain refcounting (no gc), with
    # split and whole tensors over versions. Its peer once kept a for-loop variable (the last view) alive.
    bridge, imp, _ = cpu_pair(monkeypatch, nbuffers=2)
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


# --- the socket transport (real bridge socket, CPU buffers) -------------------------------------------------
def socket_pair(monkeypatch, **kw):
    bridge, imp, released = cpu_pair(monkeypatch, **kw)
    server = _C.UnixServer()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", _C.UnixConnection.connect(server.path, 10.0)))
    t.start()
    producer_side = server.accept(10.0)
    t.join(10)
    bridge._importers.append(producer_side)
    imp._conn = box["c"]
    return bridge, imp, server


def test_sync_over_the_socket(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch, nbuffers=2)
    for version in range(2):
        items = named(20 + version)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("stats", bridge.sync(items, version=version)))
        t.start()
        got = {}
        for msg in imp.messages(timeout=10):
            for name, x in imp.tensors(msg, verify="full"):
                got[name] = x.clone()
        t.join(10)
        assert result["stats"].messages > 2 and imp.version == version
        for name, x in items:
            assert same_bytes(got[name], x)
    server.close()


def test_consumer_refusal_reaches_the_producer(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch)
    errors = []

    def produce():
        try:
            bridge.sync(named(3), version=0, timeout=10)
        except PeerError as exc:
            errors.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    with pytest.raises(RuntimeError):
        for msg in imp.messages(timeout=10):
            raise RuntimeError("load_weights failed")
    t.join(10)
    assert len(errors) == 1 and "refused bucket 0" in str(errors[0]) and "stopped" in str(errors[0])
    assert not bridge._publishing
    server.close()


def test_explicit_refusal_carries_the_consumer_error(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(PeerError, bridge.sync, named(3), 0)))
    t.start()
    msg = imp.receive(timeout=10)
    imp.ack(msg, ok=False, error="CUDA OOM in load_weights")
    t.join(10)
    assert "CUDA OOM in load_weights" in str(errors[0].value)
    server.close()


def test_producer_gone_is_a_peer_error_on_receive(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch)
    bridge._importers[0].send(br._encode("closed", pid=1), [], 5.0)  # what WeightBridge.close() sends
    with pytest.raises(PeerError, match="closed the weight bridge"):
        imp.receive(timeout=10)
    bridge._importers[0].close()  # and then hangs up
    with pytest.raises(PeerError, match="closed the connection"):
        imp.receive(timeout=10)
    server.close()


def test_an_importer_that_hung_up_fails_the_next_sync_at_once(monkeypatch):
    """A consumer that closed its end (e.g. vLLM's bridge listener after an error) is a PeerError on the
    producer's next sync within moments, not a wait for ACKs that never come."""
    bridge, imp, server = socket_pair(monkeypatch)
    imp.close()
    t0 = time.monotonic()
    with pytest.raises(PeerError):
        bridge.sync(named(3), version=0, timeout=60)
    assert time.monotonic() - t0 < 5
    assert bridge.importers == 0                 # detached: a new importer may attach for the next sync
    server.close()


def test_the_last_ack_carries_the_consumers_report(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch, nbuffers=2)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("s", bridge.sync(named(6), version=0, tag="r")))
    t.start()
    first = imp.receive(timeout=10, tag="r")            # e.g. a listener's idle wait, then the version
    gen = imp.messages(timeout=10, tag="r", first=first)
    msg = next(gen)
    assert msg is first
    while True:
        list(imp.tensors(msg, verify="full"))
        try:
            msg = gen.send({"total_tensors": 10, "version": 0} if msg["last"] else None)
        except StopIteration:
            break
    t.join(10)
    assert result["s"].messages > 2 and bridge.last_reports == [{"total_tensors": 10, "version": 0}]
    server.close()


def test_abort_and_close_say_which_they_are(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch)
    conn = bridge._importers[0]
    conn.send(br._encode("abort", tag=None, version=1, error="trainer failed"), [], 5.0)
    with pytest.raises(PeerError, match="abandoned version 1: trainer failed") as exc:
        imp.receive(timeout=10)
    assert exc.value.kind == "abort"             # this version only: the connection stays usable
    conn.send(br._encode("closed", pid=1), [], 5.0)
    with pytest.raises(PeerError, match="closed the weight bridge") as exc:
        imp.receive(timeout=10)
    assert exc.value.kind == "closed"
    server.close()


def test_a_failed_publish_aborts_the_waiting_importer_at_once(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch)

    def bad_items():
        yield from named(4, n=3)
        raise ValueError("the trainer's tensor iterator broke")

    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(ValueError, bridge.sync, bad_items(), 0,
                                                                    tag="s1")))
    t.start()
    # not a 10 s receive timeout: the abort names the producer's error
    with pytest.raises(PeerError, match="abandoned version 0: ValueError: the trainer's tensor iterator broke"):
        for msg in imp.messages(timeout=10, tag="s1"):
            list(imp.tensors(msg, verify="full"))
    t.join(10)
    assert errors and not bridge._publishing
    server.close()


def test_a_tagged_sync_skips_what_a_failed_one_left_in_the_socket(monkeypatch):
    bridge, imp, server = socket_pair(monkeypatch)
    conn = bridge._importers[0]
    # leftovers of sync "old": a bucket nobody read and its abort
    conn.send(br._encode("bucket", tag="old", buffer=0, version=1, seq=3, last=False, nbytes=0, checksum=None,
                         checksum_stride=0, entries=[]), [], 5.0)
    conn.send(br._encode("abort", tag="old", version=1, error="gone"), [], 5.0)
    items = named(5)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("s", bridge.sync(items, version=2, timeout=10,
                                                                            tag="new")))
    t.start()
    got = {}
    for msg in imp.messages(timeout=10, tag="new"):
        for name, x in imp.tensors(msg, verify="full"):
            got[name] = x.clone()
    t.join(10)
    assert result["s"].messages > 2 and imp.version == 2
    assert all(same_bytes(got[n], x) for n, x in items)
    server.close()


# --- copy_out: raw ranges out of a bucket whose layout the consumer knows ----------------------------------------
def test_copy_out_writes_the_ranges_verifies_and_keeps_order(monkeypatch):
    from colomem._torch import ranges_tensor

    bridge, imp, _ = cpu_pair(monkeypatch, nbuffers=2, bucket_bytes=4096)
    items = named(3, n=4)  # whole tensors only (3.4 KB)
    dst = {n: torch.zeros_like(t) for n, t in items}
    msgs = []
    for msg in bridge.publish(items, version=0):
        d = msg.to_dict()
        m = BucketMessage.from_dict(d)
        assert d["layout"] == msg.layout and msg.layout is not None
        ranges = ranges_tensor([(dst[e.name].data_ptr(), e.offset, e.nbytes) for e in m.entries])
        imp.copy_out(d, ranges, verify="full")
        msgs.append(d)
    assert all(same_bytes(dst[n], t) for n, t in items) and imp.version == 0

    gen = bridge.publish(items, version=1)
    first = next(gen).to_dict()
    bad = ranges_tensor([(dst["t0"].data_ptr(), 0, first["nbytes"] + 8)])
    with pytest.raises(InvalidArgumentError, match="past bucket"):
        imp.copy_out(first, bad, verify="none")
    with pytest.raises(PeerError, match="out of order"):
        imp.copy_out({**first, "seq": 5}, ranges_tensor([]), verify="none")
    gen.close()


def test_copy_out_raises_on_a_changed_buffer(monkeypatch):
    from colomem._torch import ranges_tensor

    bridge, imp, _ = cpu_pair(monkeypatch, nbuffers=1, bucket_bytes=4096)
    items = named(4, n=3)
    gen = bridge.publish(items, version=0)
    d = next(gen).to_dict()
    bridge._views[d["buffer"]][0] ^= 0xFF  # overwritten before the ACK
    with pytest.raises(WeightCheckError):
        imp.copy_out(d, ranges_tensor([]), verify="full")
    gen.close()


def test_layout_digest_tells_layouts_apart():
    from colomem._bucket import layout_digest

    a = list(plan_buckets([("x", torch.zeros(8)), ("y", torch.zeros(4))], 1024))[0].entries
    b = list(plan_buckets([("x", torch.ones(8)), ("y", torch.ones(4))], 1024))[0].entries
    c = list(plan_buckets([("x", torch.zeros(8)), ("z", torch.zeros(4))], 1024))[0].entries
    d = list(plan_buckets([("x", torch.zeros(8)), ("y", torch.zeros(2, 2))], 1024))[0].entries
    assert layout_digest(a) == layout_digest(b)  # values do not matter, places do
    assert len({layout_digest(a), layout_digest(c), layout_digest(d)}) == 3
