"""The bridge socket between two processes: bytes + file descriptors, same-uid peers only, bounded waits,
a dead peer is a PeerError (not a hang). Host-only: runs in both builds."""

import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import threading

import pytest

from child_env import child_env
from colomem import _C
from colomem.errors import InvalidArgumentError, PeerError, PoolClosedError, TransferTimeoutError

TIMEOUT = 30.0  # generous bound for waits that should succeed; failures are typed errors, never a hang


def spawn(code: str, *args: str) -> subprocess.Popen:
    """Runs `code` in a fresh interpreter (argv[1:] = args); stdout is captured."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 0, f"child failed ({p.returncode}):\n{out}\n{err}"
    return out


@pytest.fixture
def server():
    s = _C.UnixServer()
    yield s
    s.close()


def test_socket_is_private(server):
    path = server.path
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.stat(os.path.dirname(path)).st_uid == os.geteuid()
    server.close()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


CHILD_ECHO_FD = """
import os, sys
from colomem import _C
c = _C.UnixConnection.connect(sys.argv[1], 30.0)
data, fds = c.recv(30.0)
assert len(fds) == 1, fds
os.lseek(fds[0], 0, os.SEEK_SET)
content = os.read(fds[0], 1 << 20)
os.close(fds[0])
r, w = os.pipe()
os.write(w, b"from the child " + content[:16])
os.close(w)
c.send(data[::-1] + b"|" + content, [r], 30.0)
os.close(r)
print(c.peer_pid, c.peer_uid)
c.recv(30.0)  # wait for the parent's goodbye before exiting
"""


def test_bytes_and_fds_both_ways(server):
    child = spawn(CHILD_ECHO_FD, server.path)
    conn = server.accept(TIMEOUT)
    assert conn.peer_pid == child.pid and conn.peer_uid == os.geteuid() and conn.peer_role == "importer"
    mfd = os.memfd_create("colomem-test")
    payload = os.urandom(100_000)
    os.write(mfd, payload)
    conn.send(b"abc\x00def", [mfd], TIMEOUT)
    os.close(mfd)  # the child got its own duplicate
    data, fds = conn.recv(TIMEOUT)
    assert data == b"fed\x00cba|" + payload
    assert len(fds) == 1
    assert os.read(fds[0], 1000) == b"from the child " + payload[:16]
    assert os.get_inheritable(fds[0]) is False  # received with close-on-exec
    os.close(fds[0])
    conn.send(b"bye", [], TIMEOUT)
    pid, uid = finish(child).split()
    assert int(pid) == os.getpid() and int(uid) == os.geteuid()  # the client sees the server's credentials
    conn.close()


def test_large_message_and_many_messages_in_order(server):
    code = """
    import sys
    from colomem import _C
    c = _C.UnixConnection.connect(sys.argv[1], 30.0)
    for _ in range(50):
        data, _ = c.recv(30.0)
        c.send(data, [], 30.0)
    """
    child = spawn(code, server.path)
    conn = server.accept(TIMEOUT)
    msgs = [os.urandom(n) for n in ([0, 1, 15, 16, 17, 4096, 3 << 20] * 8)[:50]]
    sender = threading.Thread(target=lambda: [conn.send(m, [], TIMEOUT) for m in msgs])
    sender.start()
    got = [conn.recv(TIMEOUT)[0] for _ in msgs]
    sender.join(TIMEOUT)
    assert got == msgs
    finish(child)


def test_recv_timeout_is_typed_and_keeps_the_connection(server):
    code = """
    import sys, time
    from colomem import _C
    c = _C.UnixConnection.connect(sys.argv[1], 30.0)
    c.recv(30.0)           # "go"
    c.send(b"late", [], 30.0)
    c.recv(30.0)
    """
    child = spawn(code, server.path)
    conn = server.accept(TIMEOUT)
    with pytest.raises(TransferTimeoutError) as ei:
        conn.recv(0.2)
    assert isinstance(ei.value, TimeoutError) and "wait again" in str(ei.value)
    conn.send(b"go", [], TIMEOUT)
    assert conn.recv(TIMEOUT)[0] == b"late"  # still usable after the timeout
    conn.send(b"bye", [], TIMEOUT)
    finish(child)


def test_accept_timeout(server):
    with pytest.raises(TransferTimeoutError):
        server.accept(0.1)


def test_killed_peer_is_a_peer_error_not_a_timeout(server):
    code = """
    import sys, time
    from colomem import _C
    c = _C.UnixConnection.connect(sys.argv[1], 30.0)
    print("connected", flush=True)
    time.sleep(600)
    """
    child = spawn(code, server.path)
    conn = server.accept(TIMEOUT)
    assert child.stdout.readline().strip() == "connected"
    threading.Timer(0.2, lambda: os.kill(child.pid, signal.SIGKILL)).start()
    with pytest.raises(PeerError) as ei:
        conn.recv(TIMEOUT)  # the kill, not this bound, ends the wait: PeerError, never TransferTimeoutError
    assert str(child.pid) in str(ei.value) and "importer process" in str(ei.value)
    child.wait(TIMEOUT)
    with pytest.raises(PeerError):  # and sending to it fails the same way
        conn.send(b"x", [], TIMEOUT)


def test_peer_that_exits_mid_message_is_a_peer_error(server):
    code = """
    import socket, struct, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.sendall(struct.pack("<IIQ", 0x314D4C43, 0, 1000) + b"only part of the body")
    """
    child = spawn(code, server.path)
    conn = server.accept(TIMEOUT)
    finish(child)
    with pytest.raises(PeerError, match="closed the connection"):
        conn.recv(TIMEOUT)


def test_malformed_header_is_a_peer_error(server):
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(server.path)
    conn = server.accept(TIMEOUT)
    raw.sendall(struct.pack("<IIQ", 0xDEADBEEF, 0, 4) + b"abcd")
    with pytest.raises(PeerError, match="malformed"):
        conn.recv(TIMEOUT)
    raw.close()


def test_close_from_another_thread_wakes_a_blocked_recv(server):
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(server.path)
    conn = server.accept(TIMEOUT)
    threading.Timer(0.2, conn.close).start()
    with pytest.raises(PoolClosedError):
        conn.recv(TIMEOUT)
    with pytest.raises(PoolClosedError):
        conn.send(b"x", [], TIMEOUT)
    assert conn.closed
    raw.close()


def test_server_close_wakes_accept_and_refuses_new_clients(server):
    path = server.path
    threading.Timer(0.2, server.close).start()
    with pytest.raises(PoolClosedError):
        server.accept(TIMEOUT)
    with pytest.raises(PeerError, match="no colomem bridge"):
        _C.UnixConnection.connect(path, 1.0)


def test_connect_to_a_dead_listener(tmp_path):
    path = str(tmp_path / "dead.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # the file exists, nobody listens: an exporter that died without cleaning up
    with pytest.raises(PeerError, match="nobody listens"):
        _C.UnixConnection.connect(path, 1.0)
    s.close()


def test_bad_arguments(server):
    with pytest.raises(InvalidArgumentError):
        server.accept(-1.0)
    with pytest.raises(InvalidArgumentError):
        server.accept(float("inf"))
    with pytest.raises(InvalidArgumentError):
        _C.UnixConnection.connect("x" * 200, 1.0)
    with pytest.raises(InvalidArgumentError):
        _C.UnixServer(name="a/b")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
def test_other_user_is_refused(server):
    nobody = 65534
    # 1) the 0700 directory alone keeps another user out
    code = """
    import os, socket, sys
    os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
    except PermissionError:
        print("refused")
    """
    assert finish(spawn(code, server.path)).strip() == "refused"
    # 2) with the directory opened up, the credential check still refuses the peer
    os.chmod(os.path.dirname(server.path), 0o777)
    os.chmod(server.path, 0o777)
    code = """
    import socket, sys, os
    os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.recv(1)
    """
    child = spawn(code, server.path)
    with pytest.raises(PeerError, match=f"uid {nobody}"):
        server.accept(TIMEOUT)
    finish(child)
    # and the server keeps serving its own user
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(server.path)
    assert server.accept(TIMEOUT).peer_uid == os.geteuid()
    raw.close()
