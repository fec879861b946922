"""The weight bridge's sockets under faults, on the CPU: per-call deadlines on a shared connection, a silent
importer that must delay nobody, an accept loop out of file descriptors, close() with a silent peer, and the
socket directories left on disk by processes that never closed their bridge.

Cases that crashed the process before their fix run in a child interpreter, so a regression fails the test
instead of killing pytest."""

import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time

import pytest

from colomem import _C
from colomem.bridge import BridgeImporter, WeightBridge
from colomem.errors import PeerError, TransferTimeoutError
from bridge_faults import SOON, TIMEOUT, named, run_child, spawn


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
