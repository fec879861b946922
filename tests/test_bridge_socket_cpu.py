"""The weight bridge on the CPU over its socket and across processes: a sync through the socket, refusals and
the consumer's errors reaching the producer, a peer gone or aborted, an importer in another process, and the raw
ranges a consumer copies out of a bucket it knows (copy_out)."""

import importlib.util
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from colomem.bridge import BridgeImporter, WeightBridge, wire
from colomem.bridge.buckets import BucketMessage, layout_digest, plan_buckets
from colomem.errors import (CudaOutOfMemoryError, InvalidArgumentError, PeerAbortedError, PeerClosedError, PeerError,
                            WeightCheckError)
from bridge_host import make  # noqa: F401  (a fixture: a host bridge with an importer attached)
from bridge_host import named, same_bytes

PEER = Path(__file__).parent / "gpu" / "_bridge_peer.py"  # the GPU test's second process, device-agnostic


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
