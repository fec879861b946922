"""BridgeImporter, the consumer side of the weight bridge (e.g. in vLLM's worker): the producer's buffers
mapped in this process, and the tensors of each bucket as views into them. See colomem.bridge."""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Callable, Iterator, Optional, Union

import torch

from colomem import _C
from colomem._torch import copy_ranges
from colomem.bridge import buffers as _buffers
from colomem.bridge.buffers import DeviceLike
from colomem.bridge.buckets import BucketMessage, Entry, Reassembler, entry_view
from colomem.bridge.wire import (ACK, ATTACHED, BUCKET, CHECKSUM_STRIDES, CLOSED, HELLO, HOST_BACKEND, PROTOCOL, U64,
                                 _short, ack_error, decode, encode, parse, peer_gone, validate_bucket,
                                 validate_hello)
from colomem.errors import (ColomemError, DeviceMismatchError, InvalidArgumentError, PeerError, PoolClosedError,
                            WeightCheckError)

log = logging.getLogger(__name__)


def _device_for(hello: dict, device: DeviceLike) -> torch.device:
    """Where this process maps the bridge's buffers: host memory for a host bridge, else the GPU its hello
    names by UUID (checked against `device` when one is given)."""
    backend = hello.get("backend", "cuda")
    if backend == HOST_BACKEND:
        if device is not None and not _buffers.is_host(device):
            raise DeviceMismatchError(f"the bridge's buffers are in host memory, not on {device}; pass "
                                      f"device=None or 'cpu'")
        return torch.device("cpu")
    if backend != "cuda":
        raise PeerError(f"unknown bridge buffer backend {backend!r}; install the same colomem "
                        f"version in both processes")
    if _buffers.is_host(device):
        raise DeviceMismatchError(f"the bridge's buffers live on GPU {hello['uuid']}, not in host memory; pass "
                                  f"device=None")
    if device is None:
        idx = _C.device_by_uuid(hello["uuid"])
    else:
        idx = _buffers.cuda_index(device)
        if _C.device_uuid(idx).lower() != str(hello["uuid"]).lower():
            raise DeviceMismatchError(f"the bridge's buffers live on GPU {hello['uuid']}, but cuda:{idx} "
                                      f"here is {_C.device_uuid(idx)}; pass device=None")
    return torch.device("cuda", idx)


def _check_ranges(ranges: torch.Tensor, m: BucketMessage) -> None:
    """copy_out's ranges must read inside the bucket. Compared without adding offset and length (an int64
    sum of two huge fields wraps negative and would pass)."""
    if not isinstance(ranges, torch.Tensor) or ranges.dtype != torch.int64 or ranges.device.type != "cpu" \
            or ranges.dim() != 2 or ranges.shape[1] != 3:
        raise InvalidArgumentError("copy_out: ranges must be an (n, 3) int64 CPU tensor of (destination "
                                   "address, offset in the bucket, bytes)")
    if not ranges.shape[0]:
        return
    off, n = ranges[:, 1], ranges[:, 2]
    if bool((off < 0).any()) or bool((n < 0).any()) or bool((ranges[:, 0] < 0).any()):
        raise InvalidArgumentError(f"copy_out: a range of bucket {m.seq} has a negative field; the ranges are corrupt")
    # off <= nbytes and n <= nbytes - off: no sum that could overflow
    if bool((off > m.nbytes).any()) or bool((n > m.nbytes - off).any()):
        raise InvalidArgumentError(f"copy_out: a range reads past bucket {m.seq}'s {m.nbytes} bytes; the "
                                   f"ranges belong to another layout")


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
        self._owners: list[weakref.WeakSet[_ViewOwner]] = [weakref.WeakSet() for _ in buffers]  # live views
        self.device = device
        self.uuid = str(hello["uuid"])
        self.bucket_bytes = int(hello["bucket_bytes"])
        self.producer_pid = int(hello["pid"])
        self.producer_checksum = str(hello.get("checksum") or "")
        self.timeout = timeout
        self.version: Optional[int] = None  # last version whose last bucket was applied
        self._next: Optional[tuple] = None  # (version, seq) expected next
        self._reasm = Reassembler()
        self._sum_dev: Optional[torch.Tensor] = None  # the asynchronous checksum's slot
        self._sum_host: Optional[torch.Tensor] = None  # its value, stored there by the kernel (pinned)
        self._closed = False

    @classmethod
    def connect(cls, address: str, timeout: float = 30.0, device: DeviceLike = None) -> "BridgeImporter":
        """Attaches to the WeightBridge at `address`: checks the producer is the same user, maps its buffers
        on the GPU it names by UUID (device=None) or on `device` (which must be that GPU). A bridge on the
        CPU shares host memory: its views are CPU tensors (device must be None or "cpu")."""
        conn = _C.UnixConnection.connect(address, timeout, "exporter")
        buffers: list = []
        try:
            data, fds = conn.recv(timeout)
            try:
                hello = parse(data, f"the process at {address}")
                if hello["kind"] != HELLO:
                    raise PeerError(f"{address} is not a colomem weight bridge (bad handshake)")
                if type(hello.get("protocol")) is not int or hello["protocol"] != PROTOCOL:
                    raise PeerError(f"bridge protocol {_short(hello.get('protocol'))} at {address}, this colomem "
                                    f"speaks {PROTOCOL}: install the same colomem version in both processes")
                fields = validate_hello(hello, len(fds))
                dev = _device_for(fields, device)
                for fd, n in zip(fds, fields["buffers"]):
                    buffers.append(_buffers.map_imported(fd, n, dev))
            except (DeviceMismatchError, PeerError):
                raise  # the wrong device, or a malformed hello the validator named
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise PeerError(f"malformed bridge handshake from {address}: {exc}") from None
            finally:
                for fd in fds:
                    os.close(fd)
            conn.send(encode(ATTACHED, ok=True, pid=os.getpid()), [], timeout)
        except BaseException as exc:
            try:
                conn.send(encode(ATTACHED, ok=False, error=str(exc)), [], 1.0)
            except Exception:  # noqa: BLE001 - the peer may be gone already; the original error matters
                pass
            try:
                _buffers.close_all(buffers)
            except ColomemError:
                pass  # a buffer the GPU still uses stays mapped; the error that ended the attach matters
            conn.close()
            raise
        return cls(conn, buffers, fields, dev, float(timeout))

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
        copied out of it must then be discarded: the version failed). When the iterator is exhausted, the
        current stream has finished every copy out of the buffer, so the caller may ACK. Copy what you keep:
        the buffer is refilled after the ACK. On a host bridge the views are CPU tensors and nothing is queued.
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

    def reassemble(self, e: Entry, view: torch.Tensor) -> Optional[tuple]:
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
            base = _buffers.view(buf, max(m.nbytes, 1), self.device, owner)
            del owner
            for e in m.entries:
                yield e, entry_view(base, e)
            del base
        self._finish(m, check, bool(m.entries))

    def _finish(self, m: BucketMessage, check: Optional[Callable[[], None]], copied: bool) -> None:
        """After the caller's copies out of a bucket: waits for them, compares the checksum, closes the version
        on its last bucket."""
        if copied or check is not None:
            _buffers.wait_current_stream(self.device, self.timeout, f"copies out of bucket {m.seq}")
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
        _check_ranges(ranges, m)
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
            got = _buffers.host_checksum(buf.ptr, m.nbytes, m.checksum_stride)
            return lambda: self._compare(m, got)
        if self._sum_dev is None:
            self._sum_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._sum_host = torch.zeros(1, dtype=torch.int64).pin_memory()
        stream = torch.cuda.current_stream(self.device)
        host = self._sum_host
        assert host is not None
        # the kernel stores the sum into pinned host memory: no copy back that could queue behind a long copy
        _C.checksum_into(buf.ptr, m.nbytes, m.checksum_stride, self._sum_dev.data_ptr(), int(stream.cuda_stream),
                         self.device.index, host.data_ptr())
        done = torch.cuda.Event()
        done.record(stream)

        def check() -> None:
            _buffers.wait_event(done, self.timeout, f"the checksum of bucket {m.seq}")
            self._compare(m, int(host[0]) & U64)

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
        PeerClosedError when the producer closed the bridge, PeerAbortedError when it abandoned the version
        (the connection stays usable), PeerError when it died; TransferTimeoutError when nothing came in
        time (the connection stays usable).
        """
        self._check_open()
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        while True:
            data, fds = self._conn.recv(max(1e-3, deadline - time.monotonic()))
            d = decode(data, self._conn, fds)
            if tag is None or d.get("kind") == CLOSED or d.get("tag") == tag:
                break
            log.debug("weight bridge: skipping a %s message of an earlier sync", d.get("kind"))
        kind = d.pop("kind")
        gone = peer_gone(kind, d, self.producer_pid)
        if gone is not None:
            raise gone
        if kind != BUCKET:
            raise PeerError(f"exporter process {self.producer_pid} sent an unexpected {kind!r} message")
        return d

    def ack(self, msg: Union[dict, BucketMessage], ok: bool = True, error: Union[BaseException, str, None] = None,
            timeout: Optional[float] = None, report: Optional[dict] = None) -> None:
        """Tells the producer (socket transport) it may refill the message's buffer. Waits for the current
        stream first, so copies still queued out of the buffer finish before the refill. report: a small
        JSON-able dict the producer finds in WeightBridge.last_reports (e.g. what the last bucket completed).

        ok=False refuses the bucket; error (an exception, or a string standing for a PeerError) travels as
        an error payload, and the producer's sync raises that exception's class with its text."""
        self._check_open()
        timeout = self.timeout if timeout is None else float(timeout)
        if isinstance(msg, dict):   # the fields it needs, without parsing every entry again
            f = validate_bucket(msg, entries=False)
            version, seq, tag = f["version"], f["seq"], f["tag"]
        else:
            version, seq, tag = msg.version, msg.seq, None
        _buffers.wait_current_stream(self.device, timeout, f"copies out of bucket {seq}")
        self._conn.send(encode(ACK, ok=bool(ok), version=version, seq=seq, error=ack_error(error), tag=tag,
                               report=report),
                        [], timeout)

    def messages(self, timeout: Optional[float] = None, tag: Optional[str] = None,
                 first: Optional[dict] = None) -> Iterator[dict]:
        """Receives the messages of one version over the socket, until its last. Each is ACKed when the loop
        body is done with it (the generator resumes); leaving the loop early (an exception, a break) refuses
        it instead: an exception thrown into the generator (gen.throw(exc)) is the refusal's error. To refuse
        with an error of your own outside the generator, call ack(msg, ok=False, error=...) yourself.
        A dict sent into the generator (gen.send(report)) travels with that message's ACK (see ack()).
        tag: as in receive(). first: a message already received (it is yielded first)."""
        while True:
            msg, first = (first, None) if first is not None else (self.receive(timeout, tag), None)
            try:
                report = yield msg
            except BaseException as exc:
                # The consumer's own exception travels as it is (its class reaches the producer).
                why: Union[BaseException, str] = (
                    "the consumer stopped inside its loop (an error in its body, or a break)"
                    if isinstance(exc, GeneratorExit) else exc)
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
            # a buffer with live views is left to its owners: its destructor unmaps when the last one goes
            idle = [buf for buf, owners in zip(self._buffers, self._owners) if len(owners) == 0]
            self._buffers = []
            self._reasm.reset()
            _buffers.close_all(idle)

    def __enter__(self) -> "BridgeImporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BridgeImporter({len(self._buffers)} buffer(s) of exporter process {self.producer_pid} on "
                f"{self.device}, version {self.version}{', closed' if self._closed else ''})")
