"""WeightBridge, the producer side of the weight bridge (in the trainer process): named tensors -> flat
buckets in exportable buffers, a socket importers attach to, and `publish` / `sync`. See colomem.bridge."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from colomem import _C
from colomem.bridge import buffers as _buffers
from colomem.bridge import socket_dir as _socket_dir
from colomem.bridge.buckets import ALIGN, BucketMessage, PlannedBucket, layout_digest, plan_buckets
from colomem.bridge.wire import (ABORT, ACK, ATTACHED, BUCKET, CHECKSUM_STRIDES, CLOSED, HELLO, HOST_BACKEND, PROTOCOL,
                                 _BadAck, check_ack, check_socket_ack, decode, encode)
from colomem.errors import ColomemError, InvalidArgumentError, PeerError, PoolClosedError, TransferTimeoutError
from colomem.units import parse_bytes

log = logging.getLogger(__name__)


@dataclass
class BridgeStats:
    """What one publish/sync did (producer side). Where the time went: the packs' device time
    (pack_copy_seconds at pinned/local bytes over it is the pack's rate), the host time launching them, the
    host time blocked on them, and the consumer's share (ack_seconds); `buckets` has the same per bucket."""

    version: int = -1
    messages: int = 0
    tensors: int = 0                # entries (a split tensor counts once per part)
    nbytes: int = 0                 # payload bytes packed
    seconds: float = 0.0            # first pack to last ACK
    pack_wait_seconds: float = 0.0  # host time blocked waiting for a pack (+ checksum) to finish
    ack_seconds: float = 0.0        # time between handing out a message and its ACK
    pack_issue_seconds: float = 0.0     # host time launching the packs' copies
    pack_copy_seconds: float = 0.0      # the packs' copies, device time on the pack stream
    pack_checksum_seconds: float = 0.0  # the checksums after them, device time
    local_bytes: int = 0            # packed from the bucket's own memory (same GPU / host for a host bridge)
    pinned_bytes: int = 0           # packed from page-locked host memory (e.g. a pool's host views)
    torch_bytes: int = 0            # packed by torch's copy: pageable host memory into a GPU bucket (slow: staged)
    buckets: list = field(default_factory=list)  # per bucket: {seq, nbytes, issue/copy/checksum/wait/ack ms}

    def add_pack(self, rec: "_buffers.PackRecord") -> dict:
        """Adds one bucket's pack; returns its row of `buckets` (the producer adds ack_ms once it is known)."""
        self.pack_issue_seconds += rec.issue_seconds
        self.pack_copy_seconds += rec.copy_seconds
        self.pack_checksum_seconds += rec.checksum_seconds
        self.pack_wait_seconds += rec.wait_seconds
        self.local_bytes += rec.packed.local_bytes
        self.pinned_bytes += rec.packed.pinned_bytes
        self.torch_bytes += rec.packed.torch_bytes
        row = {"seq": len(self.buckets), "nbytes": rec.nbytes, "issue_ms": rec.issue_seconds * 1e3,
               "copy_ms": rec.copy_seconds * 1e3, "checksum_ms": rec.checksum_seconds * 1e3,
               "wait_ms": rec.wait_seconds * 1e3, "ack_ms": None}
        self.buckets.append(row)
        return row


ACCEPT_POLL_S = 0.2        # how often the accept thread looks at the stop flag
ACCEPT_WARN_EVERY_S = 30.0  # a failing accept (e.g. out of file descriptors) is logged once per interval
MAX_PENDING_HANDSHAKES = 64
JOIN_S = 2.0               # close() waits this long for the bridge's threads (they are woken, so they end)


def _accept_loop(bridge_ref: "weakref.ref", server: "_C.UnixServer", stop: threading.Event) -> None:
    """Accepts importers until the bridge closes (or is garbage-collected); each handshake runs in a thread
    of its own with its own deadline, so a silent importer delays nobody else's attach."""
    last_warn, suppressed = -ACCEPT_WARN_EVERY_S, 0
    while not stop.is_set():
        try:
            conn = server.accept(ACCEPT_POLL_S)
        except TransferTimeoutError:
            if bridge_ref() is None:
                return
            continue
        except PoolClosedError:
            return
        except PeerError as exc:  # e.g. a process of another user, or no descriptors left: keep serving
            now = time.monotonic()
            if now - last_warn >= ACCEPT_WARN_EVERY_S:
                more = f" ({suppressed} more since the last warning)" if suppressed else ""
                log.warning("weight bridge: %s%s", exc, more)
                last_warn, suppressed = now, 0
            else:
                suppressed += 1
            continue
        bridge = bridge_ref()
        if bridge is None:
            conn.close()
            return
        bridge._start_handshake(conn)
        del bridge


def _handshake_thread(bridge_ref: "weakref.ref", conn: "_C.UnixConnection") -> None:
    bridge = bridge_ref()
    try:
        if bridge is not None:
            bridge._handshake(conn)
    except Exception as exc:  # noqa: BLE001 - one bad importer must not affect the others
        if bridge is not None and not bridge.closed:
            log.warning("weight bridge: attaching importer process %s failed: %s", conn.peer_pid, exc)
        conn.close()
    finally:
        if bridge is not None:
            bridge._end_handshake(conn)
        else:
            conn.close()


class WeightBridge:
    """Producer side: exportable buckets, a socket importers attach to, and `publish`/`sync`.

    bucket_bytes: size of each buffer (int or "512MiB"); tensors larger than that are split.
    buffers: buffers in rotation (2 = double buffering; each costs bucket_bytes of the device's memory).
    device: the CUDA device (int, "cuda:0", torch.device; default: current device), or "cpu": buffers in
        shared host memory that importers on this machine map, packed by host copies (no GPU needed).
    checksum: "sampled" (default), "full" or "none": what every message carries for the consumer to verify.
    timeout: bound (s) on every wait (packs, handshakes, ACKs over the socket).
    socket_dir: where the private socket directory is created (default $XDG_RUNTIME_DIR, $TMPDIR or /tmp).
    """

    def __init__(self, bucket_bytes: Union[int, str] = 512 << 20, buffers: int = 2,
                 device: Union[int, str, torch.device, None] = None, checksum: str = "sampled",
                 timeout: float = 60.0, socket_dir: Optional[str] = None):
        bucket_bytes = parse_bytes(bucket_bytes)
        if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
            raise InvalidArgumentError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
        if int(buffers) < 1:
            raise InvalidArgumentError(f"buffers must be >= 1, got {buffers}")
        if checksum not in CHECKSUM_STRIDES:
            raise InvalidArgumentError(f"checksum must be one of {sorted(CHECKSUM_STRIDES)}, got {checksum!r}")
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout}")
        self.device = _buffers.bridge_device(device)
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self.timeout = float(timeout)
        self._closed = False
        self._publishing = False
        self._lock = threading.Lock()
        self._importers: list = []
        self._buffers: list = []
        self._server = None
        self._thread = None
        self._packer: Optional[Union[_buffers.CudaPacker, _buffers.HostPacker]] = None
        try:
            for _ in range(int(buffers)):
                self._buffers.append(_buffers.allocate(self.device, bucket_bytes))
            self.uuid = self._buffers[0].uuid
            self._views = [_buffers.view(b, bucket_bytes, self.device, b) for b in self._buffers]
            self._packer = _buffers.packer(self.device, self._buffers, self._views)
            server = self._server = _C.UnixServer(socket_dir or "")
        except BaseException:
            self._release()
            raise
        self._path: str = server.path
        _socket_dir.track(server)
        _socket_dir.sweep_stale(os.path.dirname(os.path.dirname(self._path)))
        self._pending: dict = {}  # connection -> its handshake thread
        self._stop = threading.Event()
        # The thread holds the bridge weakly: a bridge dropped without close() still goes away.
        self._thread = threading.Thread(target=_accept_loop, args=(weakref.ref(self), server, self._stop),
                                        name="colomem-bridge-accept", daemon=True)
        self._thread.start()
        self.last_stats: Optional[BridgeStats] = None
        self.last_reports: list = []  # sync(send=None): each importer's report with its last ACK

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Path of the Unix socket importers connect to."""
        self._check_open()
        return self._path

    @property
    def buffers(self) -> int:
        return len(self._buffers)

    @property
    def importers(self) -> int:
        """Importers attached now (handshake done, not detached)."""
        with self._lock:
            return len(self._importers)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the weight bridge was closed; create a new WeightBridge")

    # -- attaching importers ---------------------------------------------------------------------------------
    def _start_handshake(self, conn: "_C.UnixConnection") -> None:
        with self._lock:
            if self._closed or len(self._pending) >= MAX_PENDING_HANDSHAKES:
                busy = not self._closed
                conn.close()
                if busy:
                    log.warning("weight bridge: refused importer process %s: %d handshakes already pending",
                                conn.peer_pid, MAX_PENDING_HANDSHAKES)
                return
            t = threading.Thread(target=_handshake_thread, args=(weakref.ref(self), conn),
                                 name="colomem-bridge-handshake", daemon=True)
            self._pending[conn] = t
        t.start()

    def _end_handshake(self, conn: "_C.UnixConnection") -> None:
        with self._lock:
            self._pending.pop(conn, None)

    def _handshake(self, conn: "_C.UnixConnection") -> None:
        fds: list = []
        try:
            for b in self._buffers:
                fds.append(b.export_fd())
            host = {"backend": HOST_BACKEND} if self.device.type == "cpu" else {}  # a CUDA hello names none
            conn.send(encode(HELLO, protocol=PROTOCOL, uuid=self.uuid, pid=os.getpid(),
                             buffers=[b.nbytes for b in self._buffers], bucket_bytes=self.bucket_bytes,
                             checksum=self.checksum, **host), fds, self.timeout)
        finally:
            for fd in fds:
                os.close(fd)
        data, rfds = conn.recv(self.timeout)
        reply = decode(data, conn, rfds)
        if reply["kind"] != ATTACHED or reply["ok"] is not True:
            raise PeerError(f"importer process {conn.peer_pid} could not map the buffers: "
                            f"{reply.get('error', reply)}")
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._importers.append(conn)

    def wait_for_importers(self, n: int = 1, timeout: Optional[float] = None) -> int:
        """Waits until at least n importers are attached; returns how many are."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            k = self.importers
            if k >= n:
                return k
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"{k} of {n} importers attached to {self._path} within "
                                           f"{timeout:g} s; start the consumer with BridgeImporter.connect(address)")
            time.sleep(0.005)

    # -- producing -------------------------------------------------------------------------------------------
    def publish(self, named_tensors: Iterable, version: int) -> Iterator[BucketMessage]:
        """Packs (name, tensor) pairs into the buffers and yields one BucketMessage per bucket, in order.

        Resuming the generator after a message is its ACK: that buffer may be refilled right away, so resume
        only once the consumer is done with the message (e.g. its collective_rpc returned). The last message
        has last=True; no tensors at all still yields one empty last message. Stats: `last_stats`.
        """
        self._check_open()
        version = int(version)
        if version < 0:
            raise InvalidArgumentError(f"version must be >= 0, got {version}")
        self._check_idle()
        return self._publish(named_tensors, version)

    def _check_idle(self) -> None:
        if self._publishing:
            raise InvalidArgumentError("another publish() of this bridge is still running; finish or close() it "
                                       "first")

    def _publish(self, named_tensors: Iterable, version: int) -> Iterator[BucketMessage]:
        with self._lock:  # set here, not in publish(): a generator never started never runs its finally
            self._check_idle()
            self._publishing = True
        stats = BridgeStats(version=version)
        t0 = time.perf_counter()
        plans = plan_buckets(named_tensors, self.bucket_bytes)
        lookahead: deque = deque()  # planned, not yet packed
        free = deque(range(len(self._buffers)))
        packed: deque = deque()  # (buffer, plan) packing or packed, not yet handed out
        stride = CHECKSUM_STRIDES[self.checksum]
        exhausted = False

        def plan_next() -> bool:
            nonlocal exhausted
            if not lookahead and not exhausted:
                nxt = next(plans, None)
                if nxt is None:
                    exhausted = True
                else:
                    lookahead.append(nxt)
            return bool(lookahead)

        def fill() -> None:
            while free and plan_next():
                i, plan = free.popleft(), lookahead.popleft()
                self._pack(i, plan, stride)
                packed.append((i, plan))

        try:
            fill()
            if not packed:  # nothing to send: one empty message still closes the version
                empty = BucketMessage(buffer=0, version=version, seq=0, last=True, nbytes=0,
                                      checksum=_C.checksum(0, 0, stride, 0, -1) if stride else None,
                                      checksum_stride=stride, entries=())
                stats.messages = 1
                t1 = time.perf_counter()
                yield empty
                stats.ack_seconds += time.perf_counter() - t1
                self._check_open()
            seq = 0
            while packed:
                i, plan = packed.popleft()
                packer = self._live_packer()
                # the sources may go once their pack finished
                row = stats.add_pack(packer.ready(i, self.timeout, f"packing bucket {seq} on {self.device}"))
                checksum = packer.checksum(i) if stride else None
                fill()  # other free buffers start packing while the consumer applies this one
                last = not packed and not plan_next()
                msg = BucketMessage(buffer=i, version=version, seq=seq, last=last, nbytes=plan.nbytes,
                                    checksum=checksum, checksum_stride=stride, entries=tuple(plan.entries),
                                    layout=layout_digest(plan.entries))
                stats.messages += 1
                stats.tensors += len(plan.entries)
                stats.nbytes += sum(e.nbytes for e in plan.entries)
                t1 = time.perf_counter()
                yield msg
                acked = time.perf_counter() - t1
                stats.ack_seconds += acked
                row["ack_ms"] = acked * 1e3
                self._check_open()
                free.append(i)  # ACKed: the buffer may be refilled
                seq += 1
                fill()
        finally:
            # Packs still in flight read their sources and write the buffers: let them finish before the
            # sources may be freed or another publish reuses the buffers.
            try:
                if not self._closed and self._packer is not None:
                    self._packer.drain(self.timeout, "the bridge's pack stream")
            except ColomemError as exc:
                log.warning("weight bridge: %s", exc)
            if self._packer is not None:
                self._packer.reset()
            stats.seconds = time.perf_counter() - t0
            self.last_stats = stats
            with self._lock:
                self._publishing = False

    def _pack(self, i: int, plan: PlannedBucket, stride: int) -> None:
        """Fills buffer i with the bucket (and its checksum when stride > 0); see buffers.CudaPacker/HostPacker."""
        self._live_packer().pack(i, plan, stride)

    def _live_packer(self) -> Union[_buffers.CudaPacker, _buffers.HostPacker]:
        if self._packer is None:
            raise PoolClosedError("the weight bridge was closed; create a new WeightBridge")
        return self._packer

    def sync(self, named_tensors: Iterable, version: int, send: Optional[Callable[[dict], Any]] = None,
             timeout: Optional[float] = None, tag: Optional[str] = None) -> BridgeStats:
        """Publishes a version and waits for each bucket's ACK.

        send=None: over the bridge socket to every attached importer (waits up to `timeout` for the first to
        attach); each must answer through BridgeImporter.messages()/ack(). If the publish fails midway, the
        importers get an "abort" and their receive raises PeerError at once. tag: a string naming this sync;
        an importer that receives with the same tag ignores what an earlier, failed sync left in the socket.
        send=callable: called with each message's dict; its return value is the ACK (False or
        {"ok": False, "error": ...} refuses).
        """
        timeout = self.timeout if timeout is None else float(timeout)
        conns: list = []
        self.last_reports = []
        if send is None:
            self.wait_for_importers(1, timeout)
            with self._lock:
                conns = list(self._importers)
        try:
            for msg in self.publish(named_tensors, version):
                d = msg.to_dict()
                if send is not None:
                    check_ack(send(d), msg, "the consumer")
                    continue
                payload = encode(BUCKET, tag=tag, **d)
                for c in conns:
                    self._guard(c, lambda: c.send(payload, [], timeout))
                replies = []
                for c in conns:
                    reply = self._reply(c, tag, timeout)
                    if reply["kind"] != ACK:
                        self._detach(c)
                        raise PeerError(f"importer process {c.peer_pid} answered {reply['kind']!r} to bucket "
                                        f"{msg.seq}, expected an ack; detached it")
                    # a refusal keeps the importer; an ACK for another bucket breaks the protocol: detached
                    self._guard(c, lambda: check_socket_ack(reply, msg, f"importer process {c.peer_pid}"),
                                only=_BadAck)
                    replies.append(reply.get("report"))
                if msg.last:
                    self.last_reports = replies
        except BaseException as exc:
            # Importers waiting for the next bucket learn at once that this version will not come.
            self._abort(conns, version, tag, f"{type(exc).__name__}: {exc}")
            raise
        assert self.last_stats is not None  # publish() records its stats when it ends
        return self.last_stats

    def _reply(self, c, tag: Optional[str], timeout: float) -> dict:
        """The importer's next answer to this sync (answers to an earlier, failed sync are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            data, fds = self._guard(c, lambda: c.recv(max(1e-3, deadline - time.monotonic())))
            reply = self._guard(c, lambda: decode(data, c, fds))  # a malformed answer detaches its importer
            if reply.get("tag") == tag or reply["kind"] != ACK:
                return reply
            log.debug("weight bridge: skipping an ack of an earlier sync from process %s", c.peer_pid)

    def _abort(self, conns: list, version: int, tag: Optional[str], why: str) -> None:
        payload = encode(ABORT, version=int(version), tag=tag, error=why[:2000])
        for c in conns:
            try:
                c.send(payload, [], 1.0)
            except ColomemError:
                pass  # gone already: it gets PeerError on its own

    def _guard(self, conn: "_C.UnixConnection", fn: Callable, only: "type[Exception]" = PeerError):
        """Runs a socket call; an importer that died or broke the protocol (`only`) is detached."""
        try:
            return fn()
        except only:
            self._detach(conn)
            raise

    def _detach(self, conn) -> None:
        with self._lock:
            if conn in self._importers:
                self._importers.remove(conn)
        conn.close()

    # -- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Detaches importers (they get PeerError on their next receive), stops listening, frees the buffers.

        Importers that still map the buffers keep the memory alive until they close (the driver counts
        them); this process's share is gone when close returns. Idempotent.
        """
        if self._closed:
            return
        with self._lock:
            self._closed = True
            conns, self._importers = self._importers, []
            pending = list(self._pending.items())
        if self._thread is not None:
            self._stop.set()
        if self._server is not None:
            self._server.close()  # shuts the listener down: wakes the accept thread's poll
        for c, _ in pending:
            c.close()  # wakes a handshake waiting on a silent importer
        deadline = time.monotonic() + JOIN_S
        for t in [self._thread] + [t for _, t in pending]:
            if t is not None and t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        for c in conns:
            try:
                c.send(encode(CLOSED, pid=os.getpid()), [], 0.5)
            except ColomemError:
                pass
            c.close()
        try:
            if self._packer is not None:
                self._packer.drain(self.timeout, "the bridge's pack stream")
        except ColomemError:
            pass
        self._release()

    def _release(self) -> None:
        self._views = []
        self._packer = None
        buffers, self._buffers = self._buffers, []
        try:
            _buffers.close_all(buffers)
        finally:
            if self._server is not None:
                self._server.close()

    def __enter__(self) -> "WeightBridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.importers} importer(s) at {self._path}"
        return (f"WeightBridge({self.bucket_bytes} B x {len(self._buffers)} on {self.device}, "
                f"checksum={self.checksum}, {state})")
