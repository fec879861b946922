"""The bridge socket's private directory on disk: removed when the bridge closes (the core does that), when
the interpreter exits with bridges still open (atexit), and, for a process that never got the chance
(SIGKILL, a crash, os._exit), by the next bridge created under the same parent directory.

Each directory is `colomem-XXXXXX/` (mkdtemp, mode 0700) holding `bridge.sock` and `owner.pid` (the
creating process's pid, written by the core). A directory is removed only when it belongs to this user,
holds nothing but those two files, its owner process no longer exists and nothing accepts on its socket.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import stat
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)

OWNER_FILE = "owner.pid"
SOCKET_FILE = "bridge.sock"
_NAME = re.compile(r"^colomem-[A-Za-z0-9]{6}$")

_open_servers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # UnixServers to close at interpreter exit
_lock = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's (pid reused): not ours to judge
        return True
    return True


def _listening(sock: str) -> bool:
    """Whether something still accepts on the socket: the owner's pid may be another pid namespace's (a
    container sharing the directory), so a pid that looks dead is confirmed by a refused connect."""
    if not os.path.exists(sock):
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(sock)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # busy, timed out, not permitted: assume someone is there
        return True
    finally:
        s.close()
    return True


def _owner(path: str) -> int:
    """The pid in a directory's owner file, or 0 when it has none readable."""
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else 0


def sweep_stale(parent: str) -> int:
    """Removes the bridge directories under `parent` whose owner process is dead; returns how many."""
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    me = os.geteuid()
    for name in names:
        if not _NAME.match(name):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
                continue
            pid = _owner(path)
            if pid <= 0 or pid == os.getpid() or _alive(pid):
                continue
            if not set(os.listdir(path)) <= {OWNER_FILE, SOCKET_FILE}:
                continue  # something else lives there: not ours to delete
            if _listening(os.path.join(path, SOCKET_FILE)):
                continue
            for f in (SOCKET_FILE, OWNER_FILE):
                try:
                    os.unlink(os.path.join(path, f))
                except FileNotFoundError:
                    pass
            os.rmdir(path)
            removed += 1
        except OSError as exc:  # raced with another sweeper, or not ours after all: leave it
            log.debug("weight bridge: not removing %s: %s", path, exc)
    if removed:
        log.info("weight bridge: removed %d socket director%s of exited processes under %s", removed,
                 "y" if removed == 1 else "ies", parent)
    return removed


def track(server: Any) -> None:
    """Closes `server` (removing its directory) at interpreter exit if nothing closed it before."""
    with _lock:
        _open_servers.add(server)


def _close_all() -> None:
    with _lock:
        servers = list(_open_servers)
    for s in servers:
        try:
            s.close()
        except Exception:  # noqa: BLE001 - at exit, one failure must not keep the others on disk
            pass


atexit.register(_close_all)
