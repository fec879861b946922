"""The bridge's wire protocol: JSON messages over the bridge socket, the one validator every message goes
through before anything reads it, and the ACK rules every transport shares.

Producer -> importer: "hello" (carries one fd per buffer: CUDA VMM handles, or memfds when the hello says
backend="host"; a CUDA hello names no backend), "bucket" (a BucketMessage's dict), "abort" (the
version in flight will not be finished), "closed" (the bridge is gone). Importer -> producer: "attached" (the
buffers are mapped, or why not), "ack" (a bucket's buffer may be refilled, or the consumer's refusal).

A refused ACK carries the consumer's error as an error payload (colomem.errors.error_payload), so the
producer raises the consumer's class (WeightCheckError, CudaOutOfMemoryError, ...) rather than a PeerError.

Validation: the peer is another process of the same user, but a bug or a version skew there must not become
a crash, a wrong copy or an untyped error here. validate_message() accepts exactly the schema below (types,
ranges, uniqueness and order of the entries) and raises PeerError naming the field otherwise. Integers are
JSON integers (not bools, floats or strings), flags are JSON booleans.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional, Union

from colomem import _C
from colomem.errors import (ColomemError, PeerAbortedError, PeerClosedError, PeerError, error_payload,
                            is_error_payload, payload_error)

if TYPE_CHECKING:
    from colomem.bridge.buckets import BucketMessage

PROTOCOL = 1
CHECKSUM_STRIDES = {"none": 0, "sampled": 64, "full": 1}  # 8-byte words between samples (0: no checksum)
U64 = (1 << 64) - 1
I64 = (1 << 63) - 1    # sizes, offsets, versions: what the core's signed 64-bit fields hold
MAX_DIMS = 64          # a tensor's dimensions (torch's own limit)
MAX_BUFFERS = 64       # the socket carries at most this many descriptors per message
MAX_TEXT = 1 << 16     # characters of a name, tag, dtype, uuid or error message

HELLO, ATTACHED, BUCKET, ACK, ABORT, CLOSED = "hello", "attached", "bucket", "ack", "abort", "closed"
HOST_BACKEND = "host"  # hello["backend"] of a bridge whose buffers are in shared host memory

_BUCKET_FIELDS = {"buffer", "version", "seq", "last", "nbytes", "checksum", "checksum_stride", "layout",
                  "entries", "tag", "kind"}
_ENTRY_FIELDS = {"name", "dtype", "shape", "offset", "nbytes", "part"}


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def parse(data: bytes, who: str) -> dict:
    """The JSON object of a received message (PeerError if it is none: bad JSON, nesting too deep, not an
    object, no string "kind")."""
    try:
        d = json.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError, TypeError):  # RecursionError: absurdly deep JSON
        d = None
    if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
        raise PeerError(f"{who} sent a malformed bridge message (not a JSON object with a kind); install the "
                        f"same colomem version in both processes")
    return d


def decode(data: bytes, conn: "_C.UnixConnection", fds: list) -> dict:
    """A received message as a validated dict with a "kind"; closes any descriptors it carried (only the
    handshake carries some, and it does not go through here)."""
    for fd in fds:
        os.close(fd)
    who = f"{conn.peer_role} process {conn.peer_pid}"
    d = parse(data, who)
    validate_message(d, who)
    return d


# -- the validator -------------------------------------------------------------------------------------------
def _bad(what: str, field: str, why: str) -> PeerError:
    return PeerError(f"malformed bridge {what}: field {field!r} {why}; producer and consumer colomem "
                     f"versions may differ")


def _present(d: dict, key: str, what: str, required: bool, field: str) -> bool:
    """Whether d has key; a missing required key is a PeerError naming the field."""
    if key in d:
        return True
    if required:
        raise _bad(what, field, "is missing")
    return False


def _int(d: dict, key: str, what: str, lo: int = 0, hi: int = I64, required: bool = True,
         field: Optional[str] = None) -> Optional[int]:
    field = field or key
    if not _present(d, key, what, required, field):
        return None
    return _as_int(d[key], what, field, lo, hi)


def _as_int(v: Any, what: str, field: str, lo: int = 0, hi: int = I64) -> int:
    if type(v) is not int:  # bool is an int subclass; 1.9, "3" and True are refused
        raise _bad(what, field, f"must be an integer, got {type(v).__name__} {_short(v)}")
    if not lo <= v <= hi:
        raise _bad(what, field, f"must be in [{lo}, {hi}], got {v}")
    return v


def _bool(d: dict, key: str, what: str, required: bool = True) -> Optional[bool]:
    if not _present(d, key, what, required, key):
        return None
    v = d[key]
    if type(v) is not bool:  # "false" and 0 are not booleans
        raise _bad(what, key, f"must be true or false, got {type(v).__name__} {_short(v)}")
    return v


def _str(d: dict, key: str, what: str, required: bool = True, none_ok: bool = False,
         field: Optional[str] = None) -> Optional[str]:
    field = field or key
    if not _present(d, key, what, required, field):
        return None
    v = d[key]
    if v is None and none_ok:
        return None
    if not isinstance(v, str):
        raise _bad(what, field, f"must be a string, got {type(v).__name__} {_short(v)}")
    if len(v) > MAX_TEXT:
        raise _bad(what, field, f"is {len(v)} characters long (at most {MAX_TEXT})")
    return v


def _list(d: dict, key: str, what: str, max_len: int, field: Optional[str] = None) -> list:
    field = field or key
    _present(d, key, what, True, field)
    v = d[key]
    if not isinstance(v, (list, tuple)):
        raise _bad(what, field, f"must be a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise _bad(what, field, f"has {len(v)} items (at most {max_len})")
    return list(v)


def _short(v: Any) -> str:
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 - a repr that fails must not hide the validation error
        r = "?"
    return r if len(r) <= 80 else r[:77] + "..."


def _no_extra(d: dict, allowed: set, what: str) -> None:
    extra = sorted(str(k) for k in d if k not in allowed)
    if extra:
        raise PeerError(f"malformed bridge {what}: unknown field(s) {extra[:8]}; producer and consumer "
                        f"colomem versions may differ")


def validate_entry(e: Any, i: int) -> tuple:
    """(name, dtype, shape, offset, nbytes, part) of entry i of a bucket, checked (PeerError otherwise)."""
    from colomem.bridge.buckets import ALIGN, dtype_from_name  # buckets imports this module

    what = f"bucket entry {i}"
    if not isinstance(e, dict):
        raise PeerError(f"malformed bridge {what}: must be an object, got {type(e).__name__}")
    _no_extra(e, _ENTRY_FIELDS, what)
    name = _str(e, "name", what)
    assert name is not None
    what = f"bucket entry {i} ({_short(name)})"
    dtype = _str(e, "dtype", what)
    shape = tuple(_as_int(s, what, f"shape[{k}]")
                  for k, s in enumerate(_list(e, "shape", what, MAX_DIMS)))
    offset = _int(e, "offset", what)
    nbytes = _int(e, "nbytes", what)
    assert offset is not None and nbytes is not None and dtype is not None
    if offset % ALIGN:
        raise _bad(what, "offset", f"must be a multiple of {ALIGN}, got {offset}")
    itemsize = dtype_from_name(dtype).itemsize
    full = 1
    for s in shape:
        full *= s
    part = e.get("part")
    if part is not None:
        if not isinstance(part, (list, tuple)) or len(part) != 3:
            raise _bad(what, "part", f"must be [start, end, total] or null, got {_short(part)}")
        part = tuple(_as_int(p, what, f"part[{k}]") for k, p in enumerate(part))
        if not 0 <= part[0] < part[1] <= part[2] == full:
            raise _bad(what, "part", f"{list(part)} is not an element range of a tensor of {full} elements")
    numel = part[1] - part[0] if part is not None else full
    if nbytes != numel * itemsize:
        raise _bad(what, "nbytes", f"is {nbytes}, but {numel} elements of {dtype} take {numel * itemsize}")
    return name, dtype, shape, offset, nbytes, part


def validate_bucket(d: Any, entries: bool = True) -> dict:
    """Checks a bucket message (socket or callable transport); entries=False skips the entries (a consumer
    that knows the layout). Returns the parsed fields: the message's, plus "entries" as tuples of
    validate_entry() (empty when entries=False)."""
    what = "bucket message"
    if not isinstance(d, dict):
        raise PeerError(f"a bridge message must be a dict, got {type(d).__name__}")
    _no_extra(d, _BUCKET_FIELDS, what)
    out: dict = {
        "buffer": _int(d, "buffer", what, hi=MAX_BUFFERS - 1),
        "version": _int(d, "version", what),
        "seq": _int(d, "seq", what),
        "last": _bool(d, "last", what),
        "nbytes": _int(d, "nbytes", what),
        "checksum": _int(d, "checksum", what, hi=U64) if d.get("checksum") is not None else None,
        "checksum_stride": _int(d, "checksum_stride", what, hi=1 << 32) if d.get("checksum_stride")
        is not None else 0,
        "layout": _str(d, "layout", what, required=False, none_ok=True),
        "tag": _str(d, "tag", what, required=False, none_ok=True),
    }
    if "kind" in d and d["kind"] != BUCKET:
        raise _bad(what, "kind", f"must be {BUCKET!r}, got {_short(d['kind'])}")
    if (out["checksum"] is None) != (out["checksum_stride"] == 0):
        raise _bad(what, "checksum", f"is {out['checksum']} with checksum_stride {out['checksum_stride']} (both "
                   f"or neither)")
    raw = _list(d, "entries", what, 1 << 20)
    parsed: list = []
    if entries:
        names: set = set()
        end = 0
        for i, e in enumerate(raw):
            p = validate_entry(e, i)
            name, _, _, offset, nbytes, _ = p
            if name in names:
                raise _bad(what, f"entries[{i}].name", f"{_short(name)} appears twice in one bucket")
            names.add(name)
            if nbytes and offset < end:
                raise _bad(what, f"entries[{i}].offset", f"{offset} overlaps the previous entry (which ends "
                           f"at byte {end}); entries must be in increasing, disjoint byte ranges")
            if offset + nbytes > out["nbytes"] and nbytes:
                raise _bad(what, f"entries[{i}]", f"ends at byte {offset + nbytes}, past the bucket's "
                           f"{out['nbytes']} bytes")
            end = max(end, offset + nbytes)
            parsed.append(p)
    out["entries"] = tuple(parsed)
    return out


def validate_hello(d: Any, nfds: int) -> dict:
    """The producer's handshake as the importer receives it (with nfds descriptors)."""
    what = "handshake"
    if not isinstance(d, dict):
        raise PeerError(f"malformed bridge {what}: not an object")
    sizes = [_as_int(n, what, f"buffers[{i}]", lo=1) for i, n in
             enumerate(_list(d, "buffers", what, MAX_BUFFERS))]
    if len(sizes) != nfds:
        raise PeerError(f"bridge handshake announced {len(sizes)} buffers but carried {nfds} fds")
    if not sizes:
        raise _bad(what, "buffers", "is empty")
    checksum = _str(d, "checksum", what, required=False)
    if checksum is not None and checksum not in CHECKSUM_STRIDES:
        raise _bad(what, "checksum", f"must be one of {sorted(CHECKSUM_STRIDES)}, got {_short(checksum)}")
    return {"buffers": sizes, "uuid": _str(d, "uuid", what), "pid": _int(d, "pid", what, lo=1, hi=(1 << 31) - 1),
            "bucket_bytes": _int(d, "bucket_bytes", what, lo=1), "checksum": checksum or "",
            "backend": _str(d, "backend", what, required=False) or "cuda"}


def validate_message(d: dict, who: str) -> None:
    """Checks a parsed socket message of any kind (PeerError naming the field otherwise). A hello is checked
    by the importer with its descriptors (validate_hello)."""
    kind = d["kind"]
    what = f"{kind!r} message from {who}" if kind in (ATTACHED, ACK, ABORT, CLOSED, BUCKET) else None
    if what is None:
        if kind == HELLO:
            return
        raise PeerError(f"{who} sent an unknown bridge message kind {_short(kind)}; install the same colomem "
                        f"version in both processes")
    if kind == BUCKET:  # its entries are checked where they are used (a consumer reusing a layout reads none)
        validate_bucket(d, entries=False)
    elif kind == ACK:
        _bool(d, "ok", what)
        _int(d, "version", what)
        _int(d, "seq", what)
        _str(d, "tag", what, required=False, none_ok=True)
        err = d.get("error")
        if err is not None and not isinstance(err, (str, dict)):
            raise _bad(what, "error", f"must be an error payload, a string or null, got {type(err).__name__}")
        if d.get("report") is not None and not isinstance(d["report"], dict):
            raise _bad(what, "report", f"must be an object or null, got {type(d['report']).__name__}")
    elif kind == ATTACHED:
        if _bool(d, "ok", what):
            _int(d, "pid", what, lo=1, hi=(1 << 31) - 1)
        else:
            _str(d, "error", what, required=False, none_ok=True)
    elif kind == ABORT:
        _int(d, "version", what)
        _str(d, "tag", what, required=False, none_ok=True)
        _str(d, "error", what, required=False, none_ok=True)
    elif kind == CLOSED:
        _int(d, "pid", what, required=False, lo=1, hi=(1 << 31) - 1)


# -- ACKs ------------------------------------------------------------------------------------------------------
def ack_error(error: Union[BaseException, str, None]) -> Optional[dict]:
    """What a refused ACK carries: the error payload of an exception; a string stands for a PeerError."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        return error_payload(error)
    return error_payload(PeerError(str(error)))


def refusal(error: Any, msg: "BucketMessage", who: str) -> ColomemError:
    """The exception for a refused bucket: the consumer's class when its ACK carries an error payload
    (a bare string, from an older consumer or a callable transport, is a PeerError)."""
    what = f"{who} refused bucket {msg.seq} of version {msg.version}"
    if not is_error_payload(error):
        return PeerError(f"{what}: {error if error is not None else 'no reason given'}")
    cls = type(payload_error(error, what))  # the class the payload names (PeerError if none of ours)
    return cls(f"{what}: {error.get('message', 'no message')}")


class _BadAck(PeerError):
    """An ACK that breaks the protocol (not a refusal): the importer that sent it is detached."""


def check_socket_ack(a: dict, msg: "BucketMessage", who: str) -> None:
    """A socket ACK (already through validate_message): ok must be true and seq/version those of the
    message; ok=false is the consumer's refusal (its error class). Wrong seq/version: _BadAck."""
    if a["ok"] is not True:
        raise refusal(a.get("error"), msg, who)
    if a["seq"] != msg.seq or a["version"] != msg.version:
        raise _BadAck(f"{who} acknowledged version {a['version']} seq {a['seq']} for bucket {msg.seq} "
                               f"of version {msg.version}; detached it")


def check_ack(ack: Any, msg: "BucketMessage", who: str) -> None:
    """The ACK of a callable transport (e.g. an RPC's return): anything but a refusal. A refusal is False, an
    error payload, or a dict (or a list of them, one per worker) with ok other than true, or another
    seq/version than the message's; an ok, seq or version of the wrong type is a PeerError too."""
    acks = ack if isinstance(ack, (list, tuple)) else [ack]
    for a in acks:
        if a is False:
            raise PeerError(f"{who} refused bucket {msg.seq} of version {msg.version}")
        if not isinstance(a, dict):
            continue
        if is_error_payload(a):  # e.g. an RPC whose consumer failed returns its error payload
            raise refusal(a, msg, who)
        if "ok" in a and a["ok"] is not True:  # "false", 0 and None are no success either
            raise refusal(a.get("error"), msg, who)
        for key, want in (("seq", msg.seq), ("version", msg.version)):
            if key in a and (type(a[key]) is not int or a[key] != want):
                raise PeerError(f"{who} acknowledged version {_short(a.get('version'))} seq "
                                f"{_short(a.get('seq'))} for bucket {msg.seq} of version {msg.version}")


# -- what the producer tells a waiting importer -------------------------------------------------------------
def peer_gone(kind: str, d: dict, producer_pid: int) -> Optional[PeerError]:
    """The exception for a "closed" or "abort" message (None for any other kind)."""
    if kind == CLOSED:
        exc: PeerError = PeerClosedError(f"exporter process {producer_pid} closed the weight bridge")
    elif kind == ABORT:  # this version only: the connection stays usable
        exc = PeerAbortedError(f"exporter process {producer_pid} abandoned version {d.get('version')}: "
                               f"{d.get('error', 'no reason given')}")
    else:
        return None
    return exc
