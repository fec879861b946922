"""The weight bridge end to end on the CPU: a host bridge (device="cpu": buffers in shared memory whose fds
cross the bridge socket) and real importers, in threads of this process and in a child process. The
rotation, ACK, ordering, verification, reassembly, close and error rules all run here; the CUDA buffers on
a GPU: tests/gpu/test_bridge_ipc.py."""

import gc
import importlib.util
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from colomem import _C
from colomem.bridge import BridgeImporter, WeightBridge, wire
from colomem.bridge.buckets import BucketMessage, Reassembler, entry_view, layout_digest, plan_buckets
from colomem.errors import (CudaOutOfMemoryError, InvalidArgumentError, PeerAbortedError, PeerClosedError, PeerError,
                            PoolClosedError, WeightCheckError, error_payload)
from random_bytes import random_tensor

PEER = Path(__file__).parent / "gpu" / "_bridge_peer.py"  # the GPU test's second process, device-agnostic


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_bridge_without_cuda_is_not_available():
    if torch.cuda.is_available() and _C.build_info()["cuda"]:
        pytest.skip("a CUDA device is visible: tests/gpu/test_bridge_ipc.py covers the bridge")
    from colomem.errors import NotAvailableError

    with pytest.raises(NotAvailableError, match="device='cpu'"):
        WeightBridge(bucket_bytes="1MiB", buffers=2, device=0)


# --- the host bridge and its importers ----------------------------------------------------------------------
class RecordingBridge(WeightBridge):
    """The real host bridge, recording which buffer each pack fills; a pack into a buffer whose message the
    test still holds (not ACKed) fails the test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: set = set()
        self.packs: list = []

    def _pack(self, i, plan, stride):
        assert i not in self.held, f"buffer {i} refilled before the ACK of the message that used it"
        super()._pack(i, plan, stride)
        self.packs.append(i)


@pytest.fixture
def make():
    """make(nbuffers, bucket_bytes, checksum) -> (a host bridge, an importer attached to it); importer=False
    -> (bridge, None). Everything made is closed at the end."""
    opened = []

    def make_(nbuffers=2, bucket_bytes=1024, checksum="full", importer=True):
        b = RecordingBridge(bucket_bytes=bucket_bytes, buffers=nbuffers, device="cpu", checksum=checksum, timeout=5.0)
        opened.append(b)
        if not importer:
            return b, None
        imp = BridgeImporter.connect(b.address, timeout=10)
        opened.append(imp)
        b.wait_for_importers(1, 10)
        return b, imp

    yield make_
    for x in reversed(opened):
        x.close()


def named(seed, n=10, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", random_tensor((60 + 97 * i,), dtype, gen)) for i in range(n)]  # several are split


def memfd_mapped(ptr):
    """Whether a bridge memfd is mapped at ptr in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return "colomem-bridge" in line
    return False


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


# --- the socket transport ------------------------------------------------------------------------------------
def in_thread(fn, *args, **kwargs):
    """Runs fn in a thread; returns (thread, box): box["result"] or box["error"] once joined."""
    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_sync_over_the_socket(make):
    bridge, imp = make(nbuffers=2)
    for version in range(2):
        items = named(20 + version)
        t, result = in_thread(bridge.sync, items, version=version)
        got = {}
        for msg in imp.messages(timeout=10):
            for name, x in imp.tensors(msg, verify="full"):
                got[name] = x.clone()
        t.join(10)
        assert result["result"].messages > 2 and imp.version == version
        for name, x in items:
            assert same_bytes(got[name], x)


def test_consumer_refusal_reaches_the_producer(make):
    bridge, imp = make()
    t, box = in_thread(bridge.sync, named(3), version=0, timeout=10)
    with pytest.raises(RuntimeError):
        for msg in imp.messages(timeout=10):
            raise RuntimeError("load_weights failed")
    t.join(10)
    errors = [box["error"]]
    assert isinstance(errors[0], PeerError)
    assert len(errors) == 1 and "refused bucket 0" in str(errors[0]) and "stopped" in str(errors[0])
    assert not bridge._publishing


def test_explicit_refusal_carries_the_consumer_error(make):
    bridge, imp = make()
    t, box = in_thread(bridge.sync, named(3), 0)
    msg = imp.receive(timeout=10)
    imp.ack(msg, ok=False, error="CUDA OOM in load_weights")
    t.join(10)
    assert isinstance(box["error"], PeerError) and "CUDA OOM in load_weights" in str(box["error"])


@pytest.mark.parametrize("error, cls", [
    (WeightCheckError("bucket bytes differ after load_weights"), WeightCheckError),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), CudaOutOfMemoryError),
    (KeyError("model.layers.0.mlp"), PeerError),
])
def test_a_refused_ack_raises_the_consumers_class_in_the_producer(make, error, cls):
    bridge, imp = make()
    t, box = in_thread(bridge.sync, named(3), version=7, tag="s")
    messages = imp.messages(timeout=10, tag="s")
    next(messages)
    with pytest.raises(type(error)):
        messages.throw(error)  # what vLLM's worker does when applying a bucket fails
    t.join(10)
    exc = box["error"]
    assert type(exc) is cls
    assert f"importer process {os.getpid()} refused bucket 0 of version 7" in str(exc)
    assert f"{type(error).__name__}: {error}" in str(exc)
    assert not bridge._publishing


def test_producer_gone_is_a_peer_error_on_receive(make):
    bridge, imp = make()
    bridge.close()  # says "closed", then hangs up
    with pytest.raises(PeerClosedError, match="closed the weight bridge"):
        imp.receive(timeout=10)
    with pytest.raises(PeerError, match="closed the connection"):
        imp.receive(timeout=10)


def test_an_importer_that_hung_up_fails_the_next_sync_at_once(make):
    """A consumer that closed its end (e.g. vLLM's bridge listener after an error) is a PeerError on the
    producer's next sync within moments, not a wait for ACKs that never come."""
    bridge, imp = make()
    imp.close()
    t0 = time.monotonic()
    with pytest.raises(PeerError):
        bridge.sync(named(3), version=0, timeout=60)
    assert time.monotonic() - t0 < 5
    assert bridge.importers == 0                 # detached: a new importer may attach for the next sync


def test_the_last_ack_carries_the_consumers_report(make):
    bridge, imp = make(nbuffers=2)
    t, result = in_thread(bridge.sync, named(6), version=0, tag="r")
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
    assert result["result"].messages > 2 and bridge.last_reports == [{"total_tensors": 10, "version": 0}]


def test_abort_and_close_say_which_they_are(make):
    bridge, imp = make()
    conn = bridge._importers[0]
    conn.send(wire.encode(wire.ABORT, tag=None, version=1, error="trainer failed"), [], 5.0)
    with pytest.raises(PeerAbortedError, match="abandoned version 1: trainer failed") as exc:
        imp.receive(timeout=10)
    assert isinstance(exc.value, PeerError) and not isinstance(exc.value, PeerClosedError)
    conn.send(wire.encode(wire.CLOSED, pid=1), [], 5.0)
    with pytest.raises(PeerClosedError, match="closed the weight bridge") as exc:
        imp.receive(timeout=10)
    assert isinstance(exc.value, PeerError) and not isinstance(exc.value, PeerAbortedError)


def test_a_failed_publish_aborts_the_waiting_importer_at_once(make):
    bridge, imp = make()

    def bad_items():
        yield from named(4, n=3)
        raise ValueError("the trainer's tensor iterator broke")

    t, box = in_thread(bridge.sync, bad_items(), 0, tag="s1")
    # not a 10 s receive timeout: the abort names the producer's error
    with pytest.raises(PeerAbortedError, match="abandoned version 0: ValueError: the trainer's tensor iterator broke"):
        for msg in imp.messages(timeout=10, tag="s1"):
            list(imp.tensors(msg, verify="full"))
    t.join(10)
    assert isinstance(box.get("error"), ValueError) and not bridge._publishing


def test_a_tagged_sync_skips_what_a_failed_one_left_in_the_socket(make):
    bridge, imp = make()
    conn = bridge._importers[0]
    # leftovers of sync "old": a bucket nobody read and its abort
    conn.send(wire.encode(wire.BUCKET, tag="old", buffer=0, version=1, seq=3, last=False, nbytes=0, checksum=None,
                          checksum_stride=0, entries=[]), [], 5.0)
    conn.send(wire.encode(wire.ABORT, tag="old", version=1, error="gone"), [], 5.0)
    items = named(5)
    t, result = in_thread(bridge.sync, items, version=2, timeout=10, tag="new")
    got = {}
    for msg in imp.messages(timeout=10, tag="new"):
        for name, x in imp.tensors(msg, verify="full"):
            got[name] = x.clone()
    t.join(10)
    assert result["result"].messages > 2 and imp.version == 2
    assert all(same_bytes(got[n], x) for n, x in items)


# --- another process ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("_bridge_peer", PEER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_importer_in_another_process_gets_every_byte(peer):
    """The GPU two-process test's consumer, on a host bridge: it maps the memfds it received, checks every
    tensor over versions, holds every other buffer before its ACK (re-verified: no early refill), and its
    last ACK carries a report."""
    versions = 2
    bridge = WeightBridge(bucket_bytes=peer.BUCKET_BYTES, buffers=2, device="cpu", checksum="full", timeout=120)
    child = peer.spawn("consumer", bridge.address, versions, 0.05)
    try:
        ev = peer.next_event(child)
        assert ev["event"] == "attached" and ev["uuid"] == "host" and ev["device"] == "cpu" and ev["buffers"] == 2
        bridge.wait_for_importers(1, 60)
        for v in range(versions):
            stats = bridge.sync(peer.named_tensors(v, "cpu"), version=v)
            ev = peer.next_event(child)
            assert ev["event"] == "version" and ev["version"] == v
            assert ev["ok"], ev["bad"]
            assert ev["messages"] == stats.messages and ev["applied"] == v and ev["held"] >= 2
            assert bridge.last_reports == [{"version": v, "messages": stats.messages}]
        assert peer.next_event(child) == {"event": "closed", "live_views": 0}
        peer.finish(child)
    finally:
        peer.reap(child)
        bridge.close()


def test_a_producer_killed_mid_sync_is_a_peer_error_and_the_mapping_outlives_it(peer):
    child = peer.spawn("producer", 1, "cpu")
    try:
        ev = peer.next_event(child)
        assert ev["event"] == "address"
        imp = BridgeImporter.connect(ev["address"], timeout=60)
        assert imp.device == torch.device("cpu")
        msg = peer.receive_until_whole(imp, dict(peer.named_tensors(0, "cpu")))
        os.kill(child.pid, signal.SIGKILL)  # the producer waits for this ACK (mid-sync); kill it there
        child.wait(60)
        msg = peer.ack_until_peer_error(imp, msg, child.pid)
        imp.verify(msg, "full")  # the memfd lives as long as this process maps it
        imp.close()
    finally:
        peer.reap(child)


# --- copy_out: raw ranges out of a bucket whose layout the consumer knows ----------------------------------------
def test_copy_out_writes_the_ranges_verifies_and_keeps_order(make):
    from colomem._torch import ranges_tensor

    bridge, imp = make(nbuffers=2, bucket_bytes=4096)
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


def test_copy_out_raises_on_a_changed_buffer(make):
    from colomem._torch import ranges_tensor

    bridge, imp = make(nbuffers=1, bucket_bytes=4096)
    items = named(4, n=3)
    gen = bridge.publish(items, version=0)
    d = next(gen).to_dict()
    bridge._views[d["buffer"]][0] ^= 0xFF  # overwritten before the ACK
    with pytest.raises(WeightCheckError):
        imp.copy_out(d, ranges_tensor([]), verify="full")
    gen.close()


def test_layout_digest_tells_layouts_apart():
    a = list(plan_buckets([("x", torch.zeros(8)), ("y", torch.zeros(4))], 1024))[0].entries
    b = list(plan_buckets([("x", torch.ones(8)), ("y", torch.ones(4))], 1024))[0].entries
    c = list(plan_buckets([("x", torch.zeros(8)), ("z", torch.zeros(4))], 1024))[0].entries
    d = list(plan_buckets([("x", torch.zeros(8)), ("y", torch.zeros(2, 2))], 1024))[0].entries
    assert layout_digest(a) == layout_digest(b)  # values do not matter, places do
    assert len({layout_digest(a), layout_digest(c), layout_digest(d)}) == 3
