"""The weight bridge's packing plan: named tensors -> flat buckets of aligned byte ranges, and back.

A bucket holds whole tensors at 256-byte aligned offsets. A tensor that does not fit in what is left of the
current bucket starts the next one; a tensor larger than a whole bucket is split into parts (element
ranges of the flattened tensor) that fill the rest of the current bucket and as many further ones as it
needs. The consumer views whole tensors in place and reassembles parts into a scratch tensor.

Messages are plain dicts of ints, strings, lists and None (no tensors), so they survive JSON, msgpack
(msgspec) and pickle. Works on any device: the CPU tests pack into a uint8 CPU tensor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from colomem.errors import InvalidArgumentError, PeerError

ALIGN = 256  # bytes; every entry starts at a multiple of this


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the wire name of a dtype."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(dt, torch.dtype):
        raise PeerError(f"unknown dtype {name!r} in a bridge message (producer and consumer torch differ?)")
    return dt


@dataclass(frozen=True)
class Entry:
    """One tensor, or one part of a split tensor, in a bucket."""

    name: str
    dtype: str
    shape: tuple
    offset: int                     # bytes from the start of the bucket, a multiple of ALIGN
    nbytes: int                     # bytes of this entry (the part's bytes for a part)
    part: Optional[tuple] = None    # (start, end, total) elements of the flattened tensor, or None (whole)

    @property
    def numel(self) -> int:
        """Elements held by this entry."""
        if self.part is not None:
            return self.part[1] - self.part[0]
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "part": list(self.part) if self.part is not None else None}

    @staticmethod
    def from_dict(d: dict) -> "Entry":
        """Parses and checks one entry of a message (colomem.bridge.wire.validate_entry; PeerError if bad)."""
        from colomem.bridge.wire import validate_entry  # wire imports this module

        return Entry(*validate_entry(d, 0))


@dataclass
class PlannedBucket:
    """A bucket's layout plus the source of each entry (a flat 1-D tensor of the entry's elements)."""

    entries: list = field(default_factory=list)
    sources: list = field(default_factory=list)
    nbytes: int = 0                 # end of the last entry: the bytes to copy and to checksum

    def add(self, entry: Entry, source: torch.Tensor) -> None:
        self.entries.append(entry)
        self.sources.append(source)
        self.nbytes = max(self.nbytes, entry.offset + entry.nbytes)


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1)


def plan_buckets(named_tensors: Iterable, bucket_bytes: int) -> Iterator[PlannedBucket]:
    """Lays out (name, tensor) pairs into buckets of at most bucket_bytes; yields each bucket when full.

    Consumes the iterable lazily (tensors computed on the fly are planned one bucket at a time). Names must
    be unique within one call.
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise InvalidArgumentError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes!r}")
    cur = PlannedBucket()
    seen: set = set()
    for item in named_tensors:
        try:
            name, t = item
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"expected (name, tensor) pairs, got {type(item).__name__}") from None
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"expected (str, Tensor), got ({type(name).__name__}, {type(t).__name__})")
        if name in seen:
            raise InvalidArgumentError(f"tensor name {name!r} appears twice in one publish")
        seen.add(name)
        if t.is_sparse or t.layout != torch.strided:
            raise InvalidArgumentError(f"{name!r}: only dense (strided) tensors can be sent, got {t.layout}")
        flat = _flat(t)
        itemsize, total = t.element_size(), t.numel()
        nbytes = total * itemsize
        dtype, shape = dtype_name(t.dtype), tuple(t.shape)

        off = align_up(cur.nbytes)
        if off + nbytes <= bucket_bytes:  # fits in what is left (zero-size tensors always do)
            cur.add(Entry(name, dtype, shape, off, nbytes), flat)
            continue
        if nbytes <= bucket_bytes:  # fits in an empty bucket: keep it whole
            yield cur
            cur = PlannedBucket()
            cur.add(Entry(name, dtype, shape, 0, nbytes), flat)
            continue
        # Larger than a bucket: element ranges fill the rest of this bucket and the next ones.
        start = 0
        while start < total:
            off = align_up(cur.nbytes)
            room = max(0, bucket_bytes - off) // itemsize
            if room == 0:
                yield cur
                cur = PlannedBucket()
                continue
            end = min(total, start + room)
            cur.add(Entry(name, dtype, shape, off, (end - start) * itemsize, (start, end, total)), flat[start:end])
            start = end
    if cur.entries:
        yield cur


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous 1-D tensor."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


# Where a source's bytes come from, as the pack sees it (see source_kind).
LOCAL = "local"        # the bucket's own memory: the same GPU for a CUDA bucket, host memory for a host bucket
PINNED = "pinned"      # page-locked host memory into a CUDA bucket (the pool's host views are)
TORCH = "torch"        # the rest: pageable host memory into a CUDA bucket, a GPU tensor into a host bucket
SOURCE_KINDS = (LOCAL, PINNED, TORCH)


def source_kind(src: torch.Tensor, dst_device: torch.device) -> str:
    """How pack_bucket copies `src` into a bucket on `dst_device`: LOCAL and PINNED sources are raw copies
    batched into one call of the core (under unified addressing the DMA engines read page-locked host memory
    directly, as they read device memory), TORCH ones go through torch's copy (a DMA engine cannot read
    pageable memory while the call returns: torch stages it)."""
    if src.device == dst_device:
        return LOCAL
    # is_pinned() asks the driver about the storage's address: True for cudaHostAlloc'ed memory and for
    # memory made page-locked with cudaHostRegister (the pinned pool's segments)
    if dst_device.type == "cuda" and src.device.type == "cpu" and src.is_pinned():
        return PINNED
    return TORCH


@dataclass
class PackedBytes:
    """The bytes one pack copied, by source kind (source_kind)."""

    local_bytes: int = 0
    pinned_bytes: int = 0
    torch_bytes: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        name = f"{kind}_bytes"
        setattr(self, name, getattr(self, name) + nbytes)


def pack_bucket(bucket: PlannedBucket, dst: torch.Tensor) -> PackedBytes:
    """Copies the bucket's sources into dst (a 1-D uint8 tensor of at least bucket.nbytes), on the current
    stream; returns the bytes copied by source kind. Bytes between entries are left as they were.

    Into a CUDA bucket the copies are asynchronous: the sources (and the memory under them, e.g. a set's pool
    copy: keep the set offloaded) must stay until the current stream has passed them."""
    if dst.dtype != torch.uint8 or dst.dim() != 1 or dst.numel() < bucket.nbytes:
        raise InvalidArgumentError(f"pack destination must be a 1-D uint8 tensor of >= {bucket.nbytes} bytes")
    counts = PackedBytes()
    ranges = []  # raw copies (LOCAL and PINNED sources): one call into the core for the whole bucket
    for e, src in zip(bucket.entries, bucket.sources):
        if not e.nbytes:
            continue
        kind = source_kind(src, dst.device)
        counts.add(kind, e.nbytes)
        if kind == TORCH:
            dst[e.offset:e.offset + e.nbytes].copy_(_as_bytes(src), non_blocking=True)
        else:
            ranges.append((e.offset, src.data_ptr(), e.nbytes))
    if ranges:
        from colomem import _torch

        _torch.copy_ranges(_torch.ranges_tensor(ranges), dst.device, dst_base=dst.data_ptr())
    return counts


def entry_view(buf: torch.Tensor, e: Entry) -> torch.Tensor:
    """The entry's elements inside buf (a 1-D uint8 tensor holding the bucket), without a copy: shaped like
    the tensor for a whole entry, 1-D for a part."""
    dtype = dtype_from_name(e.dtype)
    if e.offset + e.nbytes > buf.numel():
        raise PeerError(f"bridge entry {e.name!r} ends at byte {e.offset + e.nbytes}, past the bucket's "
                        f"{buf.numel()} bytes")
    if e.nbytes == 0:
        return torch.empty(e.shape if e.part is None else (0,), dtype=dtype, device=buf.device)
    flat = buf[e.offset:e.offset + e.nbytes].view(dtype)
    return flat if e.part is not None else flat.view(e.shape)


class Reassembler:
    """Gathers the parts of split tensors (in order, possibly across buckets) into scratch tensors."""

    def __init__(self):
        self._partial: dict = {}  # name -> (flat scratch, next expected element, entry of the first part)

    def add(self, e: Entry, view: torch.Tensor) -> Optional[tuple]:
        """(name, tensor) once the tensor is complete; None while parts are missing."""
        if e.part is None:
            return e.name, view
        start, end, total = e.part
        st = self._partial.get(e.name)
        if st is None:
            if start != 0:
                raise PeerError(f"split tensor {e.name!r}: first part starts at element {start}, not 0 "
                                f"(a bucket was lost or applied out of order)")
            st = (torch.empty(total, dtype=view.dtype, device=view.device), 0, e)
        flat, expected, first = st
        if start != expected or e.dtype != first.dtype or e.shape != first.shape:
            raise PeerError(f"split tensor {e.name!r}: got part {e.part} of {e.dtype}{list(e.shape)}, expected "
                            f"elements from {expected} of {first.dtype}{list(first.shape)}")
        flat[start:end].copy_(view, non_blocking=True)
        if end == total:
            self._partial.pop(e.name, None)
            return e.name, flat.view(first.shape)
        self._partial[e.name] = (flat, end, first)
        return None

    def pending(self) -> list:
        """Names of split tensors still missing parts."""
        return sorted(self._partial)

    def reset(self) -> None:
        self._partial.clear()


def layout_digest(entries) -> str:
    """A short digest of a bucket's entries: equal digests mean the same names, dtypes, shapes and places,
    so a consumer can reuse what it derived from an earlier bucket with that layout without parsing."""
    h = hashlib.blake2b(digest_size=16)
    for e in entries:
        h.update(repr((e.name, e.dtype, e.shape, e.offset, e.nbytes, e.part)).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class BucketMessage:
    """One bucket, as the consumer sees it. `to_dict()` is what crosses processes."""

    buffer: int
    version: int
    seq: int
    last: bool
    nbytes: int
    checksum: Optional[int]         # uint64, or None when the producer computes none
    checksum_stride: int            # 1: every 8-byte word, N: every N-th (sampled), 0: no checksum
    entries: tuple
    layout: Optional[str] = None    # layout_digest(entries), or None (then nothing is reused)

    def to_dict(self) -> dict:
        return {"buffer": self.buffer, "version": self.version, "seq": self.seq, "last": self.last,
                "nbytes": self.nbytes, "checksum": self.checksum, "checksum_stride": self.checksum_stride,
                "layout": self.layout, "entries": [e.to_dict() for e in self.entries]}

    @staticmethod
    def from_dict(d, entries: bool = True) -> "BucketMessage":
        """Parses and checks a message dict (colomem.bridge.wire.validate_bucket: exactly the schema, else
        PeerError naming the field); entries=False leaves the entries out (a consumer that knows the layout
        already)."""
        if isinstance(d, BucketMessage):
            return d
        from colomem.bridge.wire import validate_bucket  # wire imports this module

        f = validate_bucket(d, entries)
        return BucketMessage(buffer=f["buffer"], version=f["version"], seq=f["seq"], last=f["last"],
                             nbytes=f["nbytes"], checksum=f["checksum"], checksum_stride=f["checksum_stride"],
                             entries=tuple(Entry(*e) for e in f["entries"]), layout=f["layout"])
