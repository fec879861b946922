"""The weight bridge under bad input and faults, on the CPU: copy_out ranges that would wrap int64, the one
validator every wire message goes through (exactly the schema, PeerError naming the field), strict ACKs that
detach a misbehaving importer, per-call socket deadlines on a shared connection, a silent importer that
must delay nobody, an accept loop out of file descriptors, close() with a silent peer, and the socket
directories left on disk by processes that never closed their bridge.

Cases that crashed the process before their fix run in a child interpreter, so a regression fails the test
instead of killing pytest."""

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch

from colomem import _C
from colomem.bridge import BridgeImporter, WeightBridge, wire
from colomem.bridge.buckets import BucketMessage
from colomem.errors import InvalidArgumentError, PeerError, TransferTimeoutError
from random_bytes import random_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 30.0  # generous bound for waits that should succeed
SOON = 4.0      # a 0.5 s deadline must be honoured within this (generous: loaded CI machines)


def _child_path() -> str:
    # the caller's PYTHONPATH first: under the sanitizer job it names the instrumented build
    return os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), ROOT]))


def run_child(code: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=_child_path())
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def spawn(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=_child_path())
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def named(seed, n=4):
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}", random_tensor((60 + 97 * i,), torch.float32, gen)) for i in range(n)]


@pytest.fixture
def pair():
    """(a host bridge, an importer attached to it), both closed at the end."""
    bridge = WeightBridge(bucket_bytes=4096, buffers=2, device="cpu", checksum="full", timeout=10.0)
    imp = BridgeImporter.connect(bridge.address, timeout=10)
    bridge.wait_for_importers(1, 10)
    yield bridge, imp
    imp.close()
    bridge.close()


def first_message(bridge) -> dict:
    gen = bridge.publish(named(0), version=1)
    d = next(gen).to_dict()
    gen.close()
    return d


def raw_importer(address: str) -> "_C.UnixConnection":
    """A hand-driven importer: the handshake done, its descriptors closed; the test writes its answers."""
    conn = _C.UnixConnection.connect(address, TIMEOUT)
    data, fds = conn.recv(TIMEOUT)
    for fd in fds:
        os.close(fd)
    assert json.loads(data)["kind"] == "hello"
    conn.send(wire.encode("attached", ok=True, pid=os.getpid()), [], TIMEOUT)
    return conn


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


# --- sockets: deadlines, silent peers, descriptor exhaustion, close ------------------------------------------
def test_a_waiting_receiver_keeps_its_own_deadline():
    server = _C.UnixServer()
    try:
        client = _C.UnixConnection.connect(server.path, TIMEOUT)
        conn = server.accept(TIMEOUT)
        got: list = []
        holder = threading.Thread(target=lambda: got.append(conn.recv(20.0)[0]))
        holder.start()
        time.sleep(0.2)  # the other thread is now inside its 20 s receive
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="another thread"):
            conn.recv(0.5)
        assert time.monotonic() - t0 < SOON
        client.send(b"hello", [], TIMEOUT)  # the connection still works for the thread that held it
        holder.join(TIMEOUT)
        assert got == [b"hello"]
        conn.close()
        client.close()
    finally:
        server.close()


def test_a_waiting_sender_keeps_its_own_deadline():
    server = _C.UnixServer()
    try:
        client = _C.UnixConnection.connect(server.path, TIMEOUT)
        conn = server.accept(TIMEOUT)
        big = b"x" * (64 << 20)  # more than the socket buffers: the sender blocks while nobody reads
        holder = threading.Thread(target=lambda: pytest.raises(Exception, conn.send, big, [], 20.0))
        holder.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="another thread"):
            conn.send(b"small", [], 0.5)
        assert time.monotonic() - t0 < SOON
        conn.close()  # ends the blocked send
        holder.join(TIMEOUT)
        assert not holder.is_alive()
        client.close()
    finally:
        server.close()


def test_a_silent_importer_does_not_delay_another_attach():
    bridge = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", timeout=60.0)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        silent.connect(bridge.address)  # connects and never answers the hello
        time.sleep(0.3)                 # its handshake has started
        imp = BridgeImporter.connect(bridge.address, timeout=10)  # 60 s if handshakes ran one at a time
        assert bridge.wait_for_importers(1, 10) == 1
        bridge.sync(named(4, n=2), version=0, send=lambda d: [list(imp.tensors(d)) and
                                                               {"version": d["version"], "seq": d["seq"]}])
        imp.close()
    finally:
        silent.close()
        bridge.close()


def test_close_with_a_silent_peer_is_prompt_and_leaves_no_thread():
    bridge = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", timeout=60.0)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        silent.connect(bridge.address)
        deadline = time.monotonic() + TIMEOUT
        while not bridge._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        threads = [bridge._thread] + list(bridge._pending.values())
        assert len(threads) == 2
        t0 = time.monotonic()
        bridge.close()
        assert time.monotonic() - t0 < SOON  # was 5 s (the join's bound), the accept thread still alive
        assert not any(t.is_alive() for t in threads)
    finally:
        silent.close()


EMFILE_CHILD = """
import json, logging, os, resource, sys, time
from colomem.bridge import WeightBridge
warnings = []
class Count(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("colomem.bridge").addHandler(Count())
b = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", timeout=10.0)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print(b.address, flush=True)
sys.stdin.readline()                       # the parent's connection waits in the backlog: accept has no fd
c0, t0 = time.process_time(), time.monotonic()
time.sleep(2.0)
cpu = time.process_time() - c0
for fd in held:
    os.close(fd)
sys.stdout.write(json.dumps({"cpu": cpu, "wall": time.monotonic() - t0, "warnings": len(warnings),
                             "text": warnings[:1]}) + "\\n")
sys.stdout.flush()
b.close()
"""


def test_accept_out_of_descriptors_does_not_spin():
    if _C.build_info().get("sanitizers"):
        # UBSan's vptr check probes memory through a pipe: with no descriptor left the probe fails and it
        # aborts on every exception object (a report about the sanitizer, not about the bridge)
        pytest.skip("the sanitizer runtime itself needs free file descriptors")
    child = spawn(EMFILE_CHILD)
    try:
        address = child.stdout.readline().strip()
        assert address, child.stderr.read()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        r = json.loads(out.strip().splitlines()[-1])
        # a spinning accept thread burns a whole core (about 2 s of CPU in 2 s) and logs every time
        assert r["cpu"] < 0.5 * r["wall"], r
        assert r["warnings"] <= 2, r
        assert r["warnings"] == 0 or "ulimit" in r["text"][0], r
        s.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# --- socket directories on disk -------------------------------------------------------------------------------
@pytest.fixture
def root():
    """A short private parent for socket directories (Unix socket paths are limited to 107 bytes)."""
    d = tempfile.mkdtemp(prefix="cmb", dir="/tmp")
    yield d
    for name in os.listdir(d):
        path = os.path.join(d, name)
        for f in os.listdir(path) if os.path.isdir(path) else []:
            os.unlink(os.path.join(path, f))
        (os.rmdir if os.path.isdir(path) else os.unlink)(path)
    os.rmdir(d)


HOLD_BRIDGE = """
import sys, time
from colomem.bridge import WeightBridge
b = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", socket_dir=sys.argv[1])
print(b.address, flush=True)
time.sleep(120)
"""


def test_a_killed_owners_directory_is_removed_by_the_next_bridge(root):
    child = spawn(HOLD_BRIDGE, root)
    try:
        address = child.stdout.readline().strip()
        assert address, child.stderr.read()
        stale = os.path.dirname(address)
        assert open(os.path.join(stale, "owner.pid")).read().strip() == str(child.pid)
        alive = spawn(HOLD_BRIDGE, root)  # a live owner's directory must stay
        live_dir = os.path.dirname(alive.stdout.readline().strip())
        child.send_signal(signal.SIGKILL)
        child.wait(TIMEOUT)
        assert os.path.isdir(stale)  # SIGKILL: nothing ran, the directory is left
        bridge = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", socket_dir=root)
        try:
            assert not os.path.exists(stale) and os.path.isdir(live_dir)
            assert sorted(os.listdir(root)) == sorted([os.path.basename(live_dir),
                                                       os.path.basename(os.path.dirname(bridge.address))])
        finally:
            bridge.close()
            alive.kill()
            alive.wait(TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_directory_with_foreign_files_or_no_owner_is_kept(root):
    keep = os.path.join(root, "colomem-abcdef")
    os.mkdir(keep, 0o700)
    with open(os.path.join(keep, "owner.pid"), "w") as f:
        f.write("999999999\n")  # no such process
    with open(os.path.join(keep, "notes.txt"), "w") as f:
        f.write("not the bridge's")
    no_owner = os.path.join(root, "colomem-ghijkl")
    os.mkdir(no_owner, 0o700)
    WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", socket_dir=root).close()
    assert os.path.isdir(keep) and os.path.isdir(no_owner) and len(os.listdir(root)) == 2


def test_close_and_interpreter_exit_remove_the_directory(root):
    bridge = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", socket_dir=root)
    d = os.path.dirname(bridge.address)
    assert sorted(os.listdir(d)) == ["bridge.sock", "owner.pid"]
    bridge.close()
    assert os.listdir(root) == []
    for how in ("pass", "raise SystemExit(3)", "raise RuntimeError('uncaught')"):
        out = run_child(f"""
            import sys
            from colomem.bridge import WeightBridge
            b = WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", socket_dir=sys.argv[1])
            print(b.address, flush=True)
            {how}
        """, root)
        assert out.stdout.strip(), out.stderr
        assert os.listdir(root) == [], (how, out.stderr)


def test_sigterm_leaves_a_directory_the_next_bridge_removes(root):
    child = spawn(HOLD_BRIDGE, root)
    address = child.stdout.readline().strip()
    assert address, child.stderr.read()
    child.send_signal(signal.SIGTERM)
    child.wait(TIMEOUT)
    WeightBridge(bucket_bytes=4096, buffers=1, device="cpu", socket_dir=root).close()
    assert os.listdir(root) == []


def test_accept_warnings_are_rate_limited(caplog):
    """A steady accept failure logs once per interval, with the count of what it suppressed."""
    from colomem.bridge import producer

    calls = {"n": 0}

    class FailingServer:
        def accept(self, timeout):
            calls["n"] += 1
            if calls["n"] > 200:
                raise producer.PoolClosedError("closed")
            raise PeerError("accept failed: Too many open files")

    class Alive:
        closed = False

    keep = Alive()
    import weakref

    with caplog.at_level(logging.WARNING, logger="colomem.bridge"):
        producer._accept_loop(weakref.ref(keep), FailingServer(), threading.Event())
    assert calls["n"] == 201
    assert len([r for r in caplog.records if "Too many open files" in r.getMessage()]) == 1


def test_a_directory_whose_socket_still_listens_is_kept(root):
    """An owner pid that looks dead may be another pid namespace's (a container sharing the directory): a
    socket that still accepts keeps the directory; once nothing listens, it goes."""
    from colomem.bridge import socket_dir

    d = os.path.join(root, "colomem-mnopqr")
    os.mkdir(d, 0o700)
    with open(os.path.join(d, "owner.pid"), "w") as f:
        f.write("999999999\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(d, "bridge.sock"))
    listener.listen(4)
    try:
        assert socket_dir.sweep_stale(root) == 0 and os.path.isdir(d)
    finally:
        listener.close()
    assert socket_dir.sweep_stale(root) == 1 and not os.path.exists(d)
