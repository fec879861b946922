"""The weight bridge under bad input, on the CPU: copy_out ranges that would wrap int64, the one validator
every wire message goes through (exactly the schema, PeerError naming the field), strict ACKs that detach a
misbehaving importer (sockets, deadlines and directories: test_reliability_sockets.py).

Cases that crashed the process before their fix run in a child interpreter, so a regression fails the test
instead of killing pytest."""

import json
import os
import random
import threading

import pytest
import torch

from colomem import _C
from colomem.bridge import BridgeImporter, WeightBridge, wire
from colomem.bridge.buckets import BucketMessage
from colomem.errors import InvalidArgumentError, PeerError
from bridge_faults import TIMEOUT, first_message, named, raw_importer, run_child
from bridge_faults import pair  # noqa: F401  (fixture)


# --- copy_out: bounds without int64 wrap-around -------------------------------------------------------------
def test_copy_out_with_offsets_near_2_62_is_refused_not_read():
    # offset + nbytes = 2**63 wraps negative in int64: the old check passed and the core read 4 EiB
    out = run_child("""
        import torch
        from colomem.bridge import BridgeImporter, WeightBridge
        from colomem.errors import InvalidArgumentError
        b = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", timeout=10.0)
        imp = BridgeImporter.connect(b.address, timeout=10)
        gen = b.publish([("w", torch.ones(16))], version=0)
        msg = next(gen).to_dict()
        dst = torch.zeros(64, dtype=torch.uint8)
        for off, n in ((2**62, 2**62), (2**63 - 1, 1), (1, 2**63 - 1), (0, 2**63 - 1)):
            ranges = torch.tensor([[dst.data_ptr(), off, n]], dtype=torch.int64)
            try:
                imp.copy_out(msg, ranges, verify="none")
                print("ACCEPTED", off, n)
            except InvalidArgumentError as exc:
                print("refused:", exc)
        gen.close(); imp.close(); b.close()
    """)
    assert out.returncode == 0, out.stderr
    assert "ACCEPTED" not in out.stdout and out.stdout.count("refused:") == 4, out.stdout
    assert "reads past bucket 0" in out.stdout


def test_copy_out_refuses_negative_and_malformed_ranges(pair):
    bridge, imp = pair
    gen = bridge.publish(named(1), version=0)
    msg = next(gen).to_dict()
    dst = torch.zeros(64, dtype=torch.uint8)
    for bad in ([[dst.data_ptr(), -256, 8]], [[dst.data_ptr(), 0, -8]], [[-1, 0, 8]]):
        with pytest.raises(InvalidArgumentError, match="negative"):
            imp.copy_out(msg, torch.tensor(bad, dtype=torch.int64), verify="none")
    with pytest.raises(InvalidArgumentError, match=r"\(n, 3\) int64"):
        imp.copy_out(msg, torch.zeros(2, 3, dtype=torch.int32), verify="none")
    # a range that ends exactly at the bucket's end is fine, and its bytes arrive
    n = msg["entries"][0]["nbytes"]
    imp.copy_out(msg, torch.tensor([[dst.data_ptr(), 0, min(n, 64)]], dtype=torch.int64), verify="none")
    assert torch.equal(dst[:min(n, 64)], named(1)[0][1].view(torch.uint8)[:min(n, 64)])
    gen.close()


def test_the_core_refuses_address_sums_that_wrap():
    out = run_child("""
        import torch
        from colomem import _C
        from colomem.errors import InvalidArgumentError
        src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
        for d, s, n in ((0, 2**63 - 1, 2**63 - 1), (2**63 - 1, 0, 2**63 - 1)):
            ops = torch.tensor([[d, s, n]], dtype=torch.int64)
            try:
                _C.copy_ranges(ops.data_ptr(), 1, dst.data_ptr(), src.data_ptr(), 0, -1)
                print("ACCEPTED")
            except InvalidArgumentError as exc:
                print("refused:", exc)
        ops = torch.tensor([[0, 0, 64]], dtype=torch.int64)  # the same call, in bounds, copies
        _C.copy_ranges(ops.data_ptr(), 1, dst.data_ptr(), src.data_ptr(), 0, -1)
        print("copied", int(dst.sum()))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused:") == 2 and "address space" in out.stdout and "copied 64" in out.stdout, \
        out.stdout


# --- the validator --------------------------------------------------------------------------------------------
def _dup_name(d):
    d["entries"][1]["name"] = d["entries"][0]["name"]


def _same_offset(d):
    d["entries"][1]["offset"] = d["entries"][0]["offset"]


def _entry(key, value):
    def f(d):
        d["entries"][0][key] = value
    return f


def _field(key, value):
    def f(d):
        d[key] = value
    return f


def _drop(key):
    def f(d):
        d.pop(key)
    return f


BAD_BUCKETS = {
    "duplicate entry names": (_dup_name, "appears twice"),
    "two entries at one offset": (_same_offset, "overlaps"),
    "last is the string 'false'": (_field("last", "false"), "'last'"),
    "last is 0": (_field("last", 0), "'last'"),
    "negative version": (_field("version", -1), "'version'"),
    "buffer index 1.9": (_field("buffer", 1.9), "'buffer'"),
    "buffer index True": (_field("buffer", True), "'buffer'"),
    "seq as a string": (_field("seq", "0"), "'seq'"),
    "version past int64": (_field("version", 2**64), "'version'"),
    "checksum past uint64": (_field("checksum", 2**64), "'checksum'"),
    "nbytes missing": (_drop("nbytes"), "'nbytes'"),
    "entries not a list": (_field("entries", {"a": 1}), "'entries'"),
    "unknown field": (_field("surprise", 1), "unknown field"),
    "offset as a string": (_entry("offset", "0"), "'offset'"),
    "offset not aligned": (_entry("offset", 3), "'offset'"),
    "a 1,000-dimension shape": (_entry("shape", [1] * 1000), "'shape'"),
    "a dimension past int64": (_entry("shape", [2**70]), "shape"),
    "a negative dimension": (_entry("shape", [-4]), "shape"),
    "a dimension of 2.5": (_entry("shape", [2.5]), "shape"),
    "nbytes not the shape's": (_entry("nbytes", 4), "'nbytes'"),
    "an unknown dtype": (_entry("dtype", "float99"), "dtype"),
    "a dtype that is a torch function": (_entry("dtype", "zeros"), "dtype"),
    "name not a string": (_entry("name", 7), "'name'"),
    "entry not an object": (lambda d: d["entries"].__setitem__(0, [1, 2]), "must be an object"),
    "part of the wrong length": (_entry("part", [0, 1]), "'part'"),
    "entry past the bucket": (_field("nbytes", 8), "past the bucket"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUCKETS))
def test_malformed_bucket_messages_are_peer_errors_naming_the_field(pair, case):
    bridge, imp = pair
    d = first_message(bridge)
    assert len(d["entries"]) >= 2
    mutate, field = BAD_BUCKETS[case]
    mutate(d)
    with pytest.raises(PeerError, match=field):
        BucketMessage.from_dict(d)
    with pytest.raises(PeerError, match=field):
        list(imp.tensors(d, verify="none"))
    assert imp.version is None  # nothing was applied


def test_a_valid_message_still_passes_and_zero_size_entries_may_share_an_offset(pair):
    bridge, imp = pair
    items = [("a", torch.ones(3)), ("empty", torch.empty(0)), ("b", torch.arange(5.0))]
    gen = bridge.publish(items, version=0)
    d = next(gen).to_dict()
    assert d["entries"][1]["offset"] == d["entries"][2]["offset"]  # the empty tensor takes no bytes
    got = dict((n, t.clone()) for n, t in imp.tensors(d, verify="full"))
    assert torch.equal(got["b"], torch.arange(5.0)) and got["empty"].numel() == 0
    gen.close()


def test_random_corruptions_raise_peer_error_or_nothing(pair):
    """No AttributeError, OverflowError, TypeError or torch RuntimeError from any corrupt field."""
    bridge, imp = pair
    good = first_message(bridge)
    values = [None, True, False, 1.9, -1, 0, 2**62, 2**64, "x", "0", "false", [], {}, [1] * 1000, [[[]]],
              {"kind": "bucket"}, float("nan")]
    rng = random.Random(1234)
    for _ in range(400):
        d = json.loads(json.dumps(good))
        target = d if rng.random() < 0.5 else rng.choice(d["entries"])
        key = rng.choice(sorted(target))
        target[key] = rng.choice(values)
        try:
            for _ in imp.entries(d, verify="none"):
                pass
        except PeerError:
            pass
        imp._next = None  # the ordering state is not under test here


def test_deep_json_and_non_objects_are_peer_errors(pair):
    bridge, imp = pair
    deep = b"[" * 100_000 + b"]" * 100_000
    for data in (deep, b"\xff\xfe", b"[1, 2]", b'{"kind": 5}', b'{"no": "kind"}'):
        with pytest.raises(PeerError, match="malformed"):
            wire.parse(data, "test")
    # over the socket: the importer's receive turns it into a PeerError, and the connection is still usable
    conn = bridge._importers[0]
    conn.send(deep, [], TIMEOUT)
    with pytest.raises(PeerError, match="malformed"):
        imp.receive(timeout=TIMEOUT)
    conn.send(wire.encode("bucket", **{**first_message(bridge), "last": "false"}), [], TIMEOUT)
    with pytest.raises(PeerError, match="'last'"):
        imp.receive(timeout=TIMEOUT)
    conn.send(wire.encode("mystery"), [], TIMEOUT)
    with pytest.raises(PeerError, match="unknown bridge message kind"):
        imp.receive(timeout=TIMEOUT)


BAD_HELLOS = {
    "buffer size past int64": {"buffers": [2**70]},
    "buffer size as a float": {"buffers": [4096.0]},
    "pid as a string": {"pid": "1"},
    "bucket_bytes missing": {"bucket_bytes": None},
    "buffers not a list": {"buffers": 4096},
    "an unknown checksum": {"checksum": "md5"},
}


@pytest.mark.parametrize("case", sorted(BAD_HELLOS))
def test_malformed_handshakes_are_peer_errors(case):
    server = _C.UnixServer()
    hello = {"protocol": wire.PROTOCOL, "uuid": "host", "pid": os.getpid(), "buffers": [4096],
             "bucket_bytes": 4096, "checksum": "full", "backend": "host"}
    hello.update(BAD_HELLOS[case])
    hello = {k: v for k, v in hello.items() if v is not None}
    answer: list = []

    def producer():
        c = server.accept(TIMEOUT)
        c.send(wire.encode("hello", **hello), [], TIMEOUT)
        answer.append(json.loads(c.recv(TIMEOUT)[0]))
        c.close()

    t = threading.Thread(target=producer)
    t.start()
    try:
        with pytest.raises(PeerError):
            BridgeImporter.connect(server.path, timeout=10)
    finally:
        t.join(TIMEOUT)
        server.close()
    assert answer and answer[0]["ok"] is False  # the producer learns why


# --- strict ACKs ----------------------------------------------------------------------------------------------
def _ack_case(bridge, conn, make_ack):
    """Runs a sync against the raw importer `conn`, answering its first bucket with make_ack(bucket)."""
    errors: list = []

    def produce():
        try:
            bridge.sync(named(2, n=1), version=3, timeout=10)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    d = json.loads(conn.recv(TIMEOUT)[0])
    assert d["kind"] == "bucket"
    conn.send(json.dumps(make_ack(d)).encode(), [], TIMEOUT)
    t.join(TIMEOUT)
    assert not t.is_alive()
    return errors


BAD_ACKS = {
    "ok is the string 'false'": lambda d: {"kind": "ack", "ok": "false", "seq": d["seq"], "version": d["version"]},
    "ok is 0": lambda d: {"kind": "ack", "ok": 0, "seq": d["seq"], "version": d["version"]},
    "ok is 1": lambda d: {"kind": "ack", "ok": 1, "seq": d["seq"], "version": d["version"]},
    "no seq": lambda d: {"kind": "ack", "ok": True, "version": d["version"]},
    "no version": lambda d: {"kind": "ack", "ok": True, "seq": d["seq"]},
    "seq as a string": lambda d: {"kind": "ack", "ok": True, "seq": str(d["seq"]), "version": d["version"]},
    "another seq": lambda d: {"kind": "ack", "ok": True, "seq": d["seq"] + 1, "version": d["version"]},
    "an attached instead of an ack": lambda d: {"kind": "attached", "ok": True, "pid": 1},
}


@pytest.mark.parametrize("case", sorted(BAD_ACKS))
def test_bad_importer_acks_fail_the_sync_and_detach_the_importer(case):
    bridge = WeightBridge(bucket_bytes=4096, buffers=2, device="cpu", timeout=10.0)
    try:
        conn = raw_importer(bridge.address)
        bridge.wait_for_importers(1, 10)
        errors = _ack_case(bridge, conn, BAD_ACKS[case])
        assert len(errors) == 1 and isinstance(errors[0], PeerError), errors
        assert bridge.importers == 0  # the importer that broke the protocol is gone
        conn.close()
    finally:
        bridge.close()


def test_a_refusal_keeps_the_importer_and_a_strict_ack_succeeds():
    bridge = WeightBridge(bucket_bytes=4096, buffers=2, device="cpu", timeout=10.0)
    try:
        conn = raw_importer(bridge.address)
        bridge.wait_for_importers(1, 10)
        errors = _ack_case(bridge, conn, lambda d: {"kind": "ack", "ok": False, "seq": d["seq"],
                                                    "version": d["version"], "error": "disk full"})
        assert len(errors) == 1 and "disk full" in str(errors[0]) and bridge.importers == 1
        conn.recv(TIMEOUT)  # the abort of that version
        ok = {"kind": "ack", "ok": True}
        errors = _ack_case(bridge, conn, lambda d: {**ok, "seq": d["seq"], "version": d["version"]})
        assert errors == [] and bridge.importers == 1
        conn.close()
    finally:
        bridge.close()


@pytest.mark.parametrize("ack", [{"ok": "false"}, {"ok": 0}, {"ok": None}, {"seq": "0", "version": 0},
                                 {"seq": 0.0, "version": 0}])
def test_callable_acks_of_the_wrong_type_are_refusals(ack):
    bridge = WeightBridge(bucket_bytes=4096, buffers=2, device="cpu", timeout=10.0)
    try:
        with pytest.raises(PeerError):
            bridge.sync(named(3, n=1), version=0, send=lambda d: ack)
    finally:
        bridge.close()


def test_the_workers_receiver_validates_a_bucket_before_reading_it():
    from colomem.engines.vllm.worker.receive import apply_bucket

    for bad in ({"version": "1", "seq": 0}, {"version": 1, "seq": 1.5}, {"version": -1, "seq": 0}, []):
        with pytest.raises(PeerError):
            apply_bucket(object(), bad)      # refused before the worker's state is looked at

