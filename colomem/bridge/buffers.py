"""Where the bridge's buckets live, and the device work on them.

Two backends, chosen by the bridge's device:
- CUDA: VMM buffers (`_C.ExportableBuffer` / `_C.ImportedBuffer`); packs and checksums run on a side
  stream of the bridge's GPU (`CudaPacker`), the importer's views are CUDA tensors.
- Host (device="cpu"): shared host memory (`HostBuffer`, a memfd mapped by both processes); packs are the
  core's host copies in the calling thread (`HostPacker`), the importer's views are CPU tensors.
Either way the importer receives one file descriptor per buffer over the bridge socket and maps it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch

from colomem import _C
from colomem._torch import device_bytes
from colomem.bridge.buckets import PackedBytes, PlannedBucket, pack_bucket
from colomem.bridge.wire import U64
from colomem.errors import (ColomemError, DeviceMismatchError, InvalidArgumentError, NotAvailableError, PeerError,
                            PoolClosedError, PoolExhaustedError, TransferTimeoutError)

DeviceLike = Union[int, str, torch.device, None]
HOST_UUID = "host"  # what a host bridge's handshake names where a CUDA bridge names its GPU's UUID


# -- devices -----------------------------------------------------------------------------------------------------
def cuda_index(device: DeviceLike) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise InvalidArgumentError(f"the weight bridge needs a CUDA device, got {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def is_host(device: DeviceLike) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cpu"


def bridge_device(device: DeviceLike) -> torch.device:
    """cpu for a host bridge, else the CUDA device (default: the current one)."""
    if is_host(device):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise NotAvailableError("the weight bridge needs a CUDA device and torch sees none; on a CPU machine pass "
                                "device='cpu' (buckets in shared host memory) or use the host stand-ins "
                                "(colomem.engines.stand_ins)")
    return torch.device("cuda", cuda_index(device))


# -- host buffers ------------------------------------------------------------------------------------------------
class HostBuffer:
    """Host memory that another process of this machine maps: a memfd, mapped shared here. Stands where the
    CUDA backend has _C.ExportableBuffer / _C.ImportedBuffer (ptr, nbytes, uuid, closed, close, export_fd)."""

    uuid = HOST_UUID

    def __init__(self, fd: int, nbytes: int, owns_fd: bool):
        """Maps `nbytes` of `fd` (use create() or open()); owns_fd: the buffer closes fd when it closes."""
        self._map: Optional[mmap.mmap] = None
        self._fd = fd if owns_fd else -1
        self.nbytes = int(nbytes)
        try:
            self._map = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            self.close()
            raise _host_error(f"mapping a host bridge buffer of {self.nbytes} B", exc) from None
        anchor = ctypes.c_char.from_buffer(self._map)  # exports the mapping only while the address is read
        self._ptr = ctypes.addressof(anchor)
        del anchor

    @classmethod
    def create(cls, nbytes: int) -> "HostBuffer":
        """A new zero-filled buffer another process can map (export_fd)."""
        memfd_create = getattr(os, "memfd_create", None)
        if memfd_create is None:
            raise NotAvailableError("a weight bridge on the CPU needs memfd_create (Linux)")
        fd = -1
        try:
            fd = memfd_create("colomem-bridge", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            raise _host_error(f"creating a host bridge buffer of {nbytes} B", exc) from None
        return cls(fd, nbytes, owns_fd=True)

    @classmethod
    def open(cls, fd: int, nbytes: int) -> "HostBuffer":
        """Maps another process's buffer from the fd it sent; fd stays the caller's (the mapping keeps its own)."""
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise PeerError(f"the bridge handshake carried an unusable fd: {exc}") from None
        if size < nbytes:
            raise PeerError(f"a host bridge buffer of {size} B was announced as {nbytes} B")
        return cls(fd, nbytes, owns_fd=False)

    @property
    def ptr(self) -> int:
        if self._map is None:
            raise PoolClosedError("this host bridge buffer was closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._map is None

    def anchor(self) -> memoryview:
        """An export of the mapping: while one lives, close() leaves the unmapping to the last one's end."""
        if self._map is None:
            raise PoolClosedError("this host bridge buffer was closed")
        return memoryview(self._map)

    def export_fd(self) -> int:
        """A new fd for the buffer; the caller owns it (send it, then os.close it)."""
        if self._map is None or self._fd < 0:
            raise PoolClosedError("this host bridge buffer is closed or was imported; only its exporter exports it")
        return os.dup(self._fd)

    def close(self) -> None:
        """Unmaps, unless views made by view() still hold the mapping (it goes with the last of them), and
        closes the exporter's fd. Idempotent."""
        m, self._map = self._map, None
        fd, self._fd = self._fd, -1
        try:
            if m is not None:
                m.close()
        except BufferError:
            pass  # exported to live views: mmap unmaps when the last export is released
        finally:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a destructor warns nobody; the mapping goes with the object anyway
            pass


def _host_error(what: str, exc: BaseException) -> ColomemError:
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return PoolExhaustedError(f"{what}: out of host memory")
    return NotAvailableError(f"{what} failed: {exc}")


class _HostArray:
    """Raw host memory through __array_interface__, so numpy and then torch view it without a copy; keeps
    `owner` (and with it the mapping) alive as long as a view exists."""

    def __init__(self, address: int, nbytes: int, owner: Any):
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
        self._owner = owner


# -- both backends -------------------------------------------------------------------------------------------------
def allocate(device: torch.device, nbytes: int) -> Any:
    """A buffer of this process that importers map (export_fd)."""
    if device.type == "cpu":
        return HostBuffer.create(nbytes)
    return _C.ExportableBuffer(device.index, nbytes)


def map_imported(fd: int, nbytes: int, device: torch.device) -> Any:
    """The exporter's buffer behind `fd`, mapped in this process (fd stays the caller's)."""
    if device.type == "cpu":
        return HostBuffer.open(fd, nbytes)
    return _C.ImportedBuffer(fd, nbytes, device.index)


def close_all(buffers: list) -> None:
    """Closes every buffer, also after one failed (a CUDA buffer's close() times out while work queued on the
    GPU still runs, and stays mapped), then raises the first failure."""
    first: Optional[ColomemError] = None
    for b in buffers:
        try:
            b.close()
        except ColomemError as exc:
            first = first or exc
    if first is not None:
        raise first


def view(buf: Any, nbytes: int, device: torch.device, owner: Any) -> torch.Tensor:
    """A uint8 tensor over the buffer's first `nbytes` that keeps `owner` alive."""
    if device.type == "cpu":
        # The view also holds an export of the mapping, so closing the buffer under it cannot unmap it.
        t = torch.from_numpy(np.asarray(_HostArray(buf.ptr, nbytes, (owner, buf.anchor()))))
    else:
        t = device_bytes(buf.ptr, nbytes, device, owner=owner)
    if t.data_ptr() != buf.ptr or t.device != device:  # torch must view, never copy
        raise ColomemError(f"torch copied the IPC buffer instead of viewing it (got {t.device} "
                           f"0x{t.data_ptr():x}, want {device} 0x{buf.ptr:x}); this torch version is unsupported")
    return t


def wait_event(event: torch.cuda.Event, timeout: float, what: str) -> float:
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
        pause = min(pause * 2, 5e-5)  # waits here are a bucket's copy (about a millisecond): poll finely
    return time.perf_counter() - t0


def wait_stream(stream: torch.cuda.Stream, timeout: float, what: str) -> float:
    ev = torch.cuda.Event()
    ev.record(stream)
    return wait_event(ev, timeout, what)


def wait_current_stream(device: torch.device, timeout: float, what: str) -> float:
    """Waits for the work queued so far on the current stream; nothing to wait for on the host (its copies
    are done when they return)."""
    if device.type != "cuda":
        return 0.0
    return wait_stream(torch.cuda.current_stream(device), timeout, what)


def host_checksum(ptr: int, nbytes: int, stride: int) -> int:
    return _C.checksum(ptr, nbytes, stride, 0, -1)


# -- packers (producer side) -------------------------------------------------------------------------------------
@dataclass
class PackRecord:
    """What one bucket's pack took (producer side; BridgeStats adds them up)."""

    nbytes: int
    packed: PackedBytes             # bytes by source kind (buckets.source_kind)
    issue_seconds: float            # host time launching the copies (per-tensor costs show here)
    copy_seconds: float             # the copies: device time on the pack stream (a host pack: their time)
    checksum_seconds: float         # the checksum after them (device time; a host pack: its time)
    wait_seconds: float = 0.0       # host time blocked in ready() for the pack to finish


@dataclass
class _InFlight:
    events: tuple                   # (start, copied, end) on the pack stream
    sources: list                   # kept alive until the copies that read them finished
    nbytes: int
    packed: PackedBytes
    issue_seconds: float


class CudaPacker:
    """Packs buckets on a side stream of the bridge's GPU. The checksum is computed there too and stored into
    pinned host memory by its kernel; both are read once the buffer's event passed (ready())."""

    def __init__(self, device: torch.device, buffers: list, views: list):
        self.device = device
        self._buffers = buffers
        self._views = views
        self._stream = torch.cuda.Stream(device)
        self._pending: list = [None] * len(buffers)  # _InFlight of the last pack per buffer
        self._sums_dev = torch.zeros(len(buffers), dtype=torch.int64, device=device)
        self._sums_host = torch.zeros(len(buffers), dtype=torch.int64).pin_memory()

    def pack(self, i: int, plan: PlannedBucket, stride: int) -> None:
        for src in plan.sources:
            if src.device.type == "cuda" and src.device != self.device:
                raise DeviceMismatchError(f"a tensor on {src.device} was given to a bridge on {self.device}")
        t0 = time.perf_counter()
        s = self._stream
        s.wait_stream(torch.cuda.current_stream(self.device))  # the producer's writes to the tensors first
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(s):
            events[0].record(s)
            packed = pack_bucket(plan, self._views[i])
            events[1].record(s)
            if stride:
                # the kernel stores the sum into pinned host memory itself: a copy back would queue on a copy
                # engine behind whatever the process copies out meanwhile (a deferred optimizer offload)
                _C.checksum_into(self._buffers[i].ptr, plan.nbytes, stride, self._sums_dev[i:i + 1].data_ptr(),
                                 s.cuda_stream, self.device.index, self._sums_host[i:i + 1].data_ptr())
            events[2].record(s)
        # the sources stay alive until the pack finished: the copies read them after this returns
        self._pending[i] = _InFlight(events, plan.sources, plan.nbytes, packed, time.perf_counter() - t0)

    def ready(self, i: int, timeout: float, what: str) -> PackRecord:
        """Waits for buffer i's pack; returns what it took. Its sources may go afterwards."""
        p = self._pending[i]
        waited = wait_event(p.events[2], timeout, what)
        self._pending[i] = None
        start, copied, end = p.events
        return PackRecord(p.nbytes, p.packed, p.issue_seconds, start.elapsed_time(copied) / 1e3,
                          copied.elapsed_time(end) / 1e3, waited)

    def checksum(self, i: int) -> int:
        return int(self._sums_host[i]) & U64

    def drain(self, timeout: float, what: str) -> float:
        """Waits for every pack launched (they read their sources and write the buffers)."""
        return wait_stream(self._stream, timeout, what)

    def reset(self) -> None:
        self._pending = [None] * len(self._buffers)


class HostPacker:
    """Packs buckets into host buffers with the core's host copies, in the calling thread: a buffer is ready,
    and its checksum known, when pack() returns."""

    def __init__(self, buffers: list, views: list):
        self._buffers = buffers
        self._views = views
        self._sums = [0] * len(buffers)
        self._records: list = [None] * len(buffers)

    def pack(self, i: int, plan: PlannedBucket, stride: int) -> None:
        t0 = time.perf_counter()
        packed = pack_bucket(plan, self._views[i])
        for dev in {src.device for src in plan.sources if src.device.type == "cuda"}:
            torch.cuda.current_stream(dev).synchronize()  # a GPU tensor's copy into the buffer ran on its stream
        t1 = time.perf_counter()
        if stride:
            self._sums[i] = host_checksum(self._buffers[i].ptr, plan.nbytes, stride)
        t2 = time.perf_counter()
        self._records[i] = PackRecord(plan.nbytes, packed, t1 - t0, t1 - t0, t2 - t1)

    def ready(self, i: int, timeout: float, what: str) -> PackRecord:
        rec, self._records[i] = self._records[i], None
        return rec

    def checksum(self, i: int) -> int:
        return self._sums[i]

    def drain(self, timeout: float, what: str) -> float:
        return 0.0

    def reset(self) -> None:
        self._records = [None] * len(self._buffers)


def packer(device: torch.device, buffers: list, views: list) -> Union[CudaPacker, HostPacker]:
    return HostPacker(buffers, views) if device.type == "cpu" else CudaPacker(device, buffers, views)
