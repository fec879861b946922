"""WeightBridge: the trainer's named tensors -> flat GPU buckets that another process on the same GPU maps.

Producer (trainer process)::

    bridge = WeightBridge(bucket_bytes=512 << 20, buffers=2, device=0)
    addr = bridge.address                              # a 0600 Unix socket in a fresh 0700 directory
    for msg in bridge.publish(named_tensors, version=v):
        ack = consumer_call(msg.to_dict())             # e.g. llm.collective_rpc("colomem_apply", ...)
    # or: bridge.sync(named_tensors, version=v)                 (messages and ACKs over the socket)
    #     bridge.sync(named_tensors, version=v, send=callable)  (callable's return is the ACK)
    bridge.close()

Consumer (e.g. vLLM's worker)::

    imp = BridgeImporter.connect(addr, timeout=30)     # same-uid check; maps the buffers on the GPU by UUID
    for name, t in imp.tensors(msg_dict, verify="sampled"):   # views into the mapped buffer, no copy
        ...
    # socket transport: for msg in imp.messages(timeout=30): load(imp.tensors(msg))   (ACK on resume)
    imp.close()

Double buffering: with `buffers=n`, up to n-1 buckets are packed (on a side stream) while the consumer
applies the current one. A buffer is refilled only after the consumer ACKed the message that used it: in
`publish`, resuming the generator after a message is that ACK, so call it only once the consumer is done.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from colomem import _C
from colomem._bucket import (ALIGN, BucketMessage, Reassembler, entry_view, layout_digest, pack_bucket,
                             plan_buckets)
from colomem._torch import copy_ranges, device_bytes
from colomem.errors import (ColomemError, DeviceMismatchError, InvalidArgumentError, NotAvailableError, PeerError,
                            PoolClosedError, TransferTimeoutError, WeightCheckError)
from colomem.units import parse_bytes

log = logging.getLogger(__name__)

PROTOCOL = 1
CHECKSUM_STRIDES = {"none": 0, "sampled": 64, "full": 1}  # 8-byte words between samples (0: no checksum)
_U64 = (1 << 64) - 1

__all__ = ["BridgeImporter", "BridgeStats", "BucketMessage", "CHECKSUM_STRIDES", "WeightBridge"]


@dataclass
class BridgeStats:
    """What one publish/sync did (producer side)."""

    version: int = -1
    messages: int = 0
    tensors: int = 0                # entries (a split tensor counts once per part)
    nbytes: int = 0                 # payload bytes packed
    seconds: float = 0.0            # first pack to last ACK
    pack_wait_seconds: float = 0.0  # host time blocked waiting for a pack (+ checksum) to finish
    ack_seconds: float = 0.0        # time between handing out a message and its ACK


def _cuda_index(device: Union[int, str, torch.device, None]) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise InvalidArgumentError(f"the weight bridge needs a CUDA device, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def _wait_event(event: torch.cuda.Event, timeout: float, what: str) -> float:
    """Waits for a CUDA event with a bound; returns the seconds waited."""
    if event.query():
        return 0.0
    t0 = time.perf_counter()
    deadline = t0 + timeout
    pause = 10e-6
    while not event.query():
        if time.perf_counter() > deadline:
            raise TransferTimeoutError(f"{what} did not finish within {timeout:g} s; the GPU may be hung or "
                                       f"heavily shared. Raise the timeout or check the device")
        time.sleep(pause)
        pause = min(pause * 2, 5e-5)  # waits here are a bucket's copy (~1 ms): poll finely
    return time.perf_counter() - t0


def _wait_stream(stream: torch.cuda.Stream, timeout: float, what: str) -> float:
    ev = torch.cuda.Event()
    ev.record(stream)
    return _wait_event(ev, timeout, what)


def _wait_current_stream(device: torch.device, timeout: float, what: str) -> float:
    return _wait_stream(torch.cuda.current_stream(device), timeout, what)


def _buffer_checksum(ptr: int, nbytes: int, stride: int, device: torch.device) -> int:
    """The checksum of device memory, computed on (and synchronising) the current stream."""
    return _C.checksum(ptr, nbytes, stride, int(torch.cuda.current_stream(device).cuda_stream), device.index)


def _view(buf: "_C.IpcBuffer", nbytes: int, device: torch.device, owner: Any) -> torch.Tensor:
    t = device_bytes(buf.ptr, nbytes, device, owner=owner)
    if t.data_ptr() != buf.ptr or t.device != device:  # torch must view, never copy
        raise ColomemError(f"torch copied the IPC buffer instead of viewing it (got {t.device} "
                           f"0x{t.data_ptr():x}, want {device} 0x{buf.ptr:x}); this torch version is unsupported")
    return t


def _encode(kind: str, **fields) -> bytes:
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def _decode(data: bytes, conn: "_C.UnixConnection", fds: list) -> dict:
    for fd in fds:  # only the handshake carries descriptors
        os.close(fd)
    try:
        d = json.loads(data)
    except ValueError:
        d = None
    if not isinstance(d, dict) or "kind" not in d:
        raise PeerError(f"{conn.peer_role} process {conn.peer_pid} sent a malformed bridge message")
    return d


def _check_ack(ack: Any, msg: BucketMessage, who: str) -> None:
    """An ACK is anything but a refusal: False, or a dict (or a list of dicts, one per worker) with ok=False
    or another seq/version than the message's."""
    acks = ack if isinstance(ack, (list, tuple)) else [ack]
    for a in acks:
        if a is False:
            raise PeerError(f"{who} refused bucket {msg.seq} of version {msg.version}")
        if isinstance(a, dict):
            if a.get("ok", True) is False:
                raise PeerError(f"{who} refused bucket {msg.seq} of version {msg.version}: "
                                f"{a.get('error', 'no reason given')}")
            if ("seq" in a and int(a["seq"]) != msg.seq) or ("version" in a and int(a["version"]) != msg.version):
                raise PeerError(f"{who} acknowledged version {a.get('version')} seq {a.get('seq')} for bucket "
                                f"{msg.seq} of version {msg.version}")


def _accept_loop(bridge_ref: "weakref.ref", server: "_C.UnixServer", stop: threading.Event) -> None:
    """Attaches importers until the bridge closes (or is garbage-collected)."""
    while not stop.is_set():
        try:
            conn = server.accept(0.2)
        except TransferTimeoutError:
            if bridge_ref() is None:
                return
            continue
        except PoolClosedError:
            return
        except PeerError as exc:  # e.g. a process of another user: refused, keep serving
            log.warning("weight bridge: %s", exc)
            continue
        bridge = bridge_ref()
        if bridge is None:
            conn.close()
            return
        try:
            bridge._handshake(conn)
        except Exception as exc:  # noqa: BLE001 - one bad importer must not stop the accept thread
            log.warning("weight bridge: attaching importer process %s failed: %s", conn.peer_pid, exc)
            conn.close()
        del bridge


class WeightBridge:
    """Producer side: exportable GPU buckets, a socket importers attach to, and `publish`/`sync`.

    bucket_bytes: size of each buffer (int or "512MiB"); tensors larger than that are split.
    buffers: buffers in rotation (2 = double buffering; each costs bucket_bytes of GPU memory).
    device: the CUDA device (int, "cuda:0", torch.device; default: current device).
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
        if not torch.cuda.is_available():
            raise NotAvailableError("the weight bridge needs a CUDA device and torch sees none; on a CPU machine use "
                                    "the host stand-ins (colomem.engines.torch_cpu)")
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self.timeout = float(timeout)
        idx = _cuda_index(device)
        self.device = torch.device("cuda", idx)
        self._closed = False
        self._publishing = False
        self._lock = threading.Lock()
        self._importers: list = []
        self._buffers: list = []
        self._server = None
        self._thread = None
        try:
            for _ in range(int(buffers)):
                self._buffers.append(_C.ExportableBuffer(idx, bucket_bytes))
            self.uuid = self._buffers[0].uuid
            self._views = [_view(b, bucket_bytes, self.device, b) for b in self._buffers]
            self._stream = torch.cuda.Stream(self.device)
            self._pending: list = [None] * len(self._buffers)  # (event, sources) of the last pack per buffer
            self._sums_dev = torch.zeros(len(self._buffers), dtype=torch.int64, device=self.device)
            self._sums_host = torch.zeros(len(self._buffers), dtype=torch.int64).pin_memory()
            self._server = _C.UnixServer(socket_dir or "")
        except BaseException:
            self._release()
            raise
        self._stop = threading.Event()
        # The thread holds the bridge weakly: a bridge dropped without close() still goes away.
        self._thread = threading.Thread(target=_accept_loop, args=(weakref.ref(self), self._server, self._stop),
                                        name="colomem-bridge-accept", daemon=True)
        self._thread.start()
        self.last_stats: Optional[BridgeStats] = None
        self.last_reports: list = []  # sync(send=None): each importer's report with its last ACK

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Path of the Unix socket importers connect to."""
        self._check_open()
        return self._server.path

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
    def _handshake(self, conn: "_C.UnixConnection") -> None:
        fds: list = []
        try:
            for b in self._buffers:
                fds.append(b.export_fd())
            conn.send(_encode("hello", protocol=PROTOCOL, uuid=self.uuid, pid=os.getpid(),
                              buffers=[b.nbytes for b in self._buffers], bucket_bytes=self.bucket_bytes,
                              checksum=self.checksum), fds, self.timeout)
        finally:
            for fd in fds:
                os.close(fd)
        data, rfds = conn.recv(self.timeout)
        reply = _decode(data, conn, rfds)
        if reply.get("kind") != "attached" or not reply.get("ok"):
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
                raise TransferTimeoutError(f"{k} of {n} importers attached to {self._server.path} within "
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
                stats.pack_wait_seconds += _wait_event(self._pending[i][0], self.timeout,
                                                       f"packing bucket {seq} on {self.device}")
                self._pending[i] = None  # the sources may go now
                checksum = (int(self._sums_host[i]) & _U64) if stride else None
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
                stats.ack_seconds += time.perf_counter() - t1
                self._check_open()
                free.append(i)  # ACKed: the buffer may be refilled
                seq += 1
                fill()
        finally:
            # Packs still in flight read their sources and write the buffers: let them finish before the
            # sources may be freed or another publish reuses the buffers.
            try:
                if not self._closed:
                    _wait_stream(self._stream, self.timeout, "the bridge's pack stream")
            except ColomemError as exc:
                log.warning("weight bridge: %s", exc)
            self._pending = [None] * len(self._buffers)
            stats.seconds = time.perf_counter() - t0
            self.last_stats = stats
            with self._lock:
                self._publishing = False

    def _pack(self, i: int, plan, stride: int) -> None:
        for src in plan.sources:
            if src.device.type == "cuda" and src.device != self.device:
                raise DeviceMismatchError(f"a tensor on {src.device} was given to a bridge on {self.device}")
        s = self._stream
        s.wait_stream(torch.cuda.current_stream(self.device))  # the producer's writes to the tensors first
        with torch.cuda.stream(s):
            pack_bucket(plan, self._views[i])
            if stride:
                _C.checksum_into(self._buffers[i].ptr, plan.nbytes, stride, self._sums_dev[i:i + 1].data_ptr(),
                                 s.cuda_stream, self.device.index)
                self._sums_host[i:i + 1].copy_(self._sums_dev[i:i + 1], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        self._pending[i] = (ev, plan.sources)  # sources stay alive until the pack finished

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
                    _check_ack(send(d), msg, "the consumer")
                    continue
                payload = _encode("bucket", tag=tag, **d)
                for c in conns:
                    self._guard(c, lambda: c.send(payload, [], timeout))
                replies = []
                for c in conns:
                    reply = self._reply(c, tag, timeout)
                    if reply.get("kind") != "ack":
                        raise PeerError(f"importer process {c.peer_pid} answered {reply.get('kind')!r} to bucket "
                                        f"{msg.seq}, expected an ack")
                    _check_ack(reply, msg, f"importer process {c.peer_pid}")
                    replies.append(reply.get("report"))
                if msg.last:
                    self.last_reports = replies
        except BaseException as exc:
            # Importers waiting for the next bucket learn at once that this version will not come.
            self._abort(conns, version, tag, f"{type(exc).__name__}: {exc}")
            raise
        return self.last_stats

    def _reply(self, c, tag: Optional[str], timeout: float) -> dict:
        """The importer's next answer to this sync (answers to an earlier, failed sync are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            data, fds = self._guard(c, lambda: c.recv(max(1e-3, deadline - time.monotonic())))
            reply = _decode(data, c, fds)
            if reply.get("tag") == tag or reply.get("kind") != "ack":
                return reply
            log.debug("weight bridge: skipping an ack of an earlier sync from process %s", c.peer_pid)

    def _abort(self, conns: list, version: int, tag: Optional[str], why: str) -> None:
        payload = _encode("abort", version=int(version), tag=tag, error=why[:2000])
        for c in conns:
            try:
                c.send(payload, [], 1.0)
            except ColomemError:
                pass  # gone already: it gets PeerError on its own

    def _guard(self, conn: "_C.UnixConnection", fn: Callable):
        """Runs a socket call; an importer that died or broke the protocol is detached."""
        try:
            return fn()
        except PeerError:
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
        if self._thread is not None:
            self._stop.set()
        if self._server is not None:
            self._server.close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for c in conns:
            try:
                c.send(_encode("closed", pid=os.getpid()), [], 1.0)
            except ColomemError:
                pass
            c.close()
        try:
            _wait_stream(self._stream, self.timeout, "the bridge's pack stream")
        except (ColomemError, AttributeError):
            pass
        self._release()

    def _release(self) -> None:
        self._views = []
        self._pending = []
        self._sums_dev = self._sums_host = None
        for b in self._buffers:
            b.close()
        self._buffers = []
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> "WeightBridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.importers} importer(s) at {self._server.path}"
        return (f"WeightBridge({self.bucket_bytes} B x {len(self._buffers)} on {self.device}, "
                f"checksum={self.checksum}, {state})")


class _ViewOwner:
    """Held by every tensor viewing an imported buffer: keeps the mapping alive while a view exists."""

    __slots__ = ("buffer", "__weakref__")

    def __init__(self, buffer):
        self.buffer = buffer


class BridgeImporter:
    """Consumer side: the producer's buffers mapped in this process, and the views of each bucket."""

    def __init__(self, conn, buffers: list, hello: dict, device: torch.device, timeout: float):
        self._conn = conn
        self._buffers = buffers
        self._owners = [weakref.WeakSet() for _ in buffers]  # live views per buffer
        self.device = device
        self.uuid = str(hello["uuid"])
        self.bucket_bytes = int(hello["bucket_bytes"])
        self.producer_pid = int(hello["pid"])
        self.producer_checksum = str(hello.get("checksum", ""))
        self.timeout = timeout
        self.version: Optional[int] = None  # last version whose last bucket was applied
        self._next: Optional[tuple] = None  # (version, seq) expected next
        self._reasm = Reassembler()
        self._sum_dev: Optional[torch.Tensor] = None  # the asynchronous checksum's slot
        self._closed = False

    @classmethod
    def connect(cls, address: str, timeout: float = 30.0,
                device: Union[int, str, torch.device, None] = None) -> "BridgeImporter":
        """Attaches to the WeightBridge at `address`: checks the producer is the same user, maps its buffers
        on the GPU it names by UUID (device=None) or on `device` (which must be that GPU)."""
        conn = _C.UnixConnection.connect(address, timeout, "exporter")
        buffers: list = []
        try:
            data, fds = conn.recv(timeout)
            try:
                hello = json.loads(data)
                if not isinstance(hello, dict) or hello.get("kind") != "hello":
                    raise PeerError(f"{address} is not a colomem weight bridge (bad handshake)")
                if hello.get("protocol") != PROTOCOL:
                    raise PeerError(f"bridge protocol {hello.get('protocol')} at {address}, this colomem speaks "
                                    f"{PROTOCOL}: install the same colomem version in both processes")
                sizes = [int(n) for n in hello["buffers"]]
                if len(sizes) != len(fds):
                    raise PeerError(f"bridge handshake announced {len(sizes)} buffers but carried {len(fds)} fds")
                if device is None:
                    idx = _C.device_by_uuid(hello["uuid"])
                else:
                    idx = _cuda_index(device)
                    if _C.device_uuid(idx).lower() != str(hello["uuid"]).lower():
                        raise DeviceMismatchError(f"the bridge's buffers live on GPU {hello['uuid']}, but cuda:{idx} "
                                                  f"here is {_C.device_uuid(idx)}; pass device=None")
                for fd, n in zip(fds, sizes):
                    buffers.append(_C.ImportedBuffer(fd, n, idx))
            except (KeyError, TypeError, ValueError) as exc:
                raise PeerError(f"malformed bridge handshake from {address}: {exc}") from None
            finally:
                for fd in fds:
                    os.close(fd)
            conn.send(_encode("attached", ok=True, pid=os.getpid()), [], timeout)
        except BaseException as exc:
            try:
                conn.send(_encode("attached", ok=False, error=str(exc)), [], 1.0)
            except Exception:  # noqa: BLE001 - the peer may be gone already; the original error matters
                pass
            for b in buffers:
                b.close()
            conn.close()
            raise
        return cls(conn, buffers, hello, torch.device("cuda", idx), float(timeout))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def live_views(self) -> int:
        """Tensors (views) of the mapped buffers still alive in this process."""
        return sum(len(o) for o in self._owners)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this BridgeImporter was closed; connect again")

    # -- applying buckets ------------------------------------------------------------------------------------
    def tensors(self, msg: Union[dict, BucketMessage], verify: str = "sampled") -> Iterator[tuple]:
        """(name, tensor) for each tensor of the bucket: views into the mapped buffer (whole tensors) or
        reassembled scratch tensors (split ones, yielded once their last part arrived).

        verify: "none", "sampled" (checks the message's checksum, whatever its stride) or "full" (requires a
        producer with checksum="full"). The checksum runs on the current stream ahead of the caller's copies;
        a mismatch raises WeightCheckError when the iterator ends, before the bucket may be ACKed (what was
        copied out of it must then be discarded: the version failed). When the iterator is exhausted, the current stream has finished every copy out of the buffer, so the
        caller may ACK. Copy what you keep: the buffer is refilled after the ACK.
        """
        return self._whole(self.entries(msg, verify))  # entries() checks its arguments now, not lazily

    def _whole(self, parts: Iterator[tuple]) -> Iterator[tuple]:
        for e, view in parts:
            out = self.reassemble(e, view)
            if out is not None:
                yield out

    def entries(self, msg: Union[dict, BucketMessage], verify: str = "sampled") -> Iterator[tuple]:
        """(Entry, view) for each entry of the bucket, parts of split tensors as they are (1-D views of
        their element range): for consumers that place parts themselves. Feed the parts you do not place
        to reassemble(). Ordering, verification and the final stream wait are as in tensors()."""
        self._check_bucket_call(verify)
        m = BucketMessage.from_dict(msg)
        self._check_order(m)
        return self._entries(m, verify)

    def _check_bucket_call(self, verify: str) -> None:
        self._check_open()
        if verify not in CHECKSUM_STRIDES:
            raise InvalidArgumentError(f"verify must be one of {sorted(CHECKSUM_STRIDES)}, got {verify!r}")

    def reassemble(self, e, view: torch.Tensor) -> Optional[tuple]:
        """(name, tensor) once a tensor is complete: the view itself for a whole entry, a scratch tensor
        gathering a split tensor's parts (across buckets) after its last part; None while parts are missing."""
        return self._reasm.add(e, view)

    def _check_order(self, m: BucketMessage) -> None:
        if m.buffer >= len(self._buffers):
            raise PeerError(f"bucket {m.seq} names buffer {m.buffer}, the bridge has {len(self._buffers)}")
        if m.nbytes > self._buffers[m.buffer].nbytes:
            raise PeerError(f"bucket {m.seq} has {m.nbytes} bytes, buffer {m.buffer} holds "
                            f"{self._buffers[m.buffer].nbytes}")
        if m.seq == 0:
            if self.version is not None and m.version < self.version:
                raise PeerError(f"bucket of version {m.version} after version {self.version} was applied; the "
                                f"producer went back in time")
            if self._reasm.pending():
                log.warning("weight bridge: version %s started while split tensors %s of the previous one were "
                            "incomplete; dropping them", m.version, self._reasm.pending())
                self._reasm.reset()
        elif self._next != (m.version, m.seq):
            raise PeerError(f"bucket out of order: got version {m.version} seq {m.seq}, expected "
                            f"{self._next}; restart the version from its first bucket")
        self._next = (m.version, m.seq + 1)

    def _entries(self, m: BucketMessage, verify: str) -> Iterator[tuple]:
        buf = self._buffers[m.buffer]
        # The checksum runs on the current stream ahead of the caller's copies and is read once they are
        # done (one wait per bucket, not two); a mismatch raises before the bucket is ACKed, so the
        # consumer fails the version instead of keeping what it copied.
        check = self._start_verify(m, buf, verify) if verify != "none" else None
        if m.entries:
            owner = _ViewOwner(buf)
            self._owners[m.buffer].add(owner)
            base = _view(buf, max(m.nbytes, 1), self.device, owner)
            del owner
            for e in m.entries:
                yield e, entry_view(base, e)
            del base
        self._finish(m, check, bool(m.entries))

    def _finish(self, m: BucketMessage, check: Optional[Callable[[], None]], copied: bool) -> None:
        """After the caller's copies out of a bucket: waits for them, compares the checksum, closes the version
        on its last bucket."""
        if copied or check is not None:
            _wait_current_stream(self.device, self.timeout, f"copies out of bucket {m.seq}")
        if check is not None:
            check()
        if m.last:
            pending = self._reasm.pending()
            self._reasm.reset()
            if pending:
                raise PeerError(f"version {m.version} ended with split tensors missing parts: {pending[:8]}")
            self.version = m.version

    def copy_out(self, msg: Union[dict, BucketMessage], ranges: torch.Tensor, verify: str = "sampled") -> None:
        """Copies out of a bucket along precomputed raw ranges, without parsing its entries or making views:
        `ranges` is an (n, 3) int64 CPU tensor of (destination address, offset in the bucket, bytes), built
        by the caller from an earlier message with the same `layout` (see colomem.engines.load_plan). One
        call into the core on the current stream; ordering checks, verification and the final wait are as in
        entries(), so the caller may ACK when this returns."""
        self._check_bucket_call(verify)
        m = BucketMessage.from_dict(msg, entries=False)
        self._check_order(m)
        buf = self._buffers[m.buffer]
        if ranges.shape[0] and int(ranges[:, 1].add(ranges[:, 2]).max()) > m.nbytes:
            raise InvalidArgumentError(f"copy_out: a range reads past bucket {m.seq}'s {m.nbytes} bytes; the "
                                       f"ranges belong to another layout")
        check = self._start_verify(m, buf, verify) if verify != "none" else None
        copy_ranges(ranges, self.device, src_base=buf.ptr)
        self._finish(m, check, ranges.shape[0] > 0)

    def verify(self, msg: Union[dict, BucketMessage], verify: str = "sampled") -> None:
        """Checks the message's buffer still holds the bytes the producer packed (WeightCheckError if not).
        Does not touch the ordering state: call it any time before the message's ACK."""
        self._check_open()
        m = BucketMessage.from_dict(msg)
        if m.buffer >= len(self._buffers) or m.nbytes > self._buffers[m.buffer].nbytes:
            raise PeerError(f"bucket {m.seq} does not fit buffer {m.buffer} of this bridge")
        if verify != "none":
            self._start_verify(m, self._buffers[m.buffer], verify)()

    def _start_verify(self, m: BucketMessage, buf, verify: str) -> Callable[[], None]:
        """Queues the bucket's checksum on the current stream; the returned check() compares it (call it
        after the stream passed that point)."""
        self._check_verifiable(m, verify)
        if self.device.type != "cuda":  # host buffers (tests): nothing to overlap with
            got = _buffer_checksum(buf.ptr, m.nbytes, m.checksum_stride, self.device)
            return lambda: self._compare(m, got)
        if self._sum_dev is None:
            self._sum_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        out = self._sum_dev
        _C.checksum_into(buf.ptr, m.nbytes, m.checksum_stride, out.data_ptr(),
                         int(torch.cuda.current_stream(self.device).cuda_stream), self.device.index)

        def check() -> None:
            self._compare(m, int(out.item()) & _U64)

        return check

    def _check_verifiable(self, m: BucketMessage, verify: str) -> None:
        if m.checksum is None or m.checksum_stride == 0:
            raise InvalidArgumentError(f"verify={verify!r} but the producer sends no checksum (checksum='none'); "
                                       f"use verify='none' or a producer with checksum='sampled'/'full'")
        if verify == "full" and m.checksum_stride != 1:
            raise InvalidArgumentError("verify='full' needs a producer with checksum='full' (this one samples "
                                       f"every {m.checksum_stride}-th word); use verify='sampled'")

    def _compare(self, m: BucketMessage, got: int) -> None:
        if got != m.checksum:
            raise WeightCheckError(f"bucket {m.seq} of version {m.version} (buffer {m.buffer}, {m.nbytes} B) has "
                                   f"checksum 0x{got:016x}, the producer packed 0x{m.checksum:016x}: the buffer was "
                                   f"overwritten before its ACK or corrupted. Send the version again")

    # -- socket transport ------------------------------------------------------------------------------------
    def receive(self, timeout: Optional[float] = None, tag: Optional[str] = None) -> dict:
        """The next message sent over the bridge socket (WeightBridge.sync(send=None)).

        tag: only messages of the sync with this tag count; what an earlier sync left unread is skipped.
        PeerError when the producer closed the bridge, died, or abandoned the version; TransferTimeoutError
        when nothing came in time (the connection stays usable).
        """
        self._check_open()
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        while True:
            data, fds = self._conn.recv(max(1e-3, deadline - time.monotonic()))
            d = _decode(data, self._conn, fds)
            if tag is None or d.get("kind") == "closed" or d.get("tag") == tag:
                break
            log.debug("weight bridge: skipping a %s message of an earlier sync", d.get("kind"))
        kind = d.pop("kind")
        if kind == "closed":
            exc = PeerError(f"exporter process {self.producer_pid} closed the weight bridge")
            exc.kind = "closed"
            raise exc
        if kind == "abort":
            exc = PeerError(f"exporter process {self.producer_pid} abandoned version {d.get('version')}: "
                            f"{d.get('error', 'no reason given')}")
            exc.kind = "abort"  # this version only: the connection stays usable
            raise exc
        if kind != "bucket":
            raise PeerError(f"exporter process {self.producer_pid} sent an unexpected {kind!r} message")
        return d

    def ack(self, msg: Union[dict, BucketMessage], ok: bool = True, error: Optional[str] = None,
            timeout: Optional[float] = None, report: Optional[dict] = None) -> None:
        """Tells the producer (socket transport) it may refill the message's buffer. Waits for the current
        stream first, so copies still queued out of the buffer finish before the refill. report: a small
        JSON-able dict the producer finds in WeightBridge.last_reports (e.g. what the last bucket completed)."""
        self._check_open()
        timeout = self.timeout if timeout is None else float(timeout)
        if isinstance(msg, dict):   # the fields it needs, without parsing every entry again
            version, seq, tag = int(msg["version"]), int(msg["seq"]), msg.get("tag")
        else:
            version, seq, tag = msg.version, msg.seq, None
        _wait_current_stream(self.device, timeout, f"copies out of bucket {seq}")
        self._conn.send(_encode("ack", ok=bool(ok), version=version, seq=seq, error=error, tag=tag, report=report),
                        [], timeout)

    def messages(self, timeout: Optional[float] = None, tag: Optional[str] = None,
                 first: Optional[dict] = None) -> Iterator[dict]:
        """Receives the messages of one version over the socket, until its last. Each is ACKed when the loop
        body is done with it (the generator resumes); leaving the loop early (an exception, a break) refuses
        it instead. To send the producer your own error text, call ack(msg, ok=False, error=...) yourself.
        A dict sent into the generator (gen.send(report)) travels with that message's ACK (see ack()).
        tag: as in receive(). first: a message already received (it is yielded first)."""
        while True:
            msg, first = (first, None) if first is not None else (self.receive(timeout, tag), None)
            try:
                report = yield msg
            except BaseException as exc:
                why = ("the consumer stopped inside its loop (an error in its body, or a break)"
                       if isinstance(exc, GeneratorExit) else f"{type(exc).__name__}: {exc}")
                try:
                    self.ack(msg, ok=False, error=why, timeout=1.0)
                except ColomemError:
                    pass
                raise
            self.ack(msg, timeout=timeout, report=report)
            if msg.get("last"):
                return

    # -- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmaps every buffer no view holds any more; a buffer with live views is unmapped when its last
        view is freed. Detaches from the producer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.close()
        finally:
            for buf, owners in zip(self._buffers, self._owners):
                if len(owners) == 0:
                    buf.close()
                # else: the views' owners hold the buffer; its destructor unmaps when the last one goes
            self._buffers = []
            self._reasm.reset()

    def __enter__(self) -> "BridgeImporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BridgeImporter({len(self._buffers)} buffer(s) of exporter process {self.producer_pid} on "
                f"{self.device}, version {self.version}{', closed' if self._closed else ''})")
