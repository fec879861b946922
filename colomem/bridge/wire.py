"""The bridge's wire protocol: JSON messages over the bridge socket, and the ACK rules every transport shares.

Producer -> importer: "hello" (carries one fd per buffer: CUDA VMM handles, or memfds when the hello says
backend="host"; a CUDA hello names no backend), "bucket" (a BucketMessage's dict), "abort" (the
version in flight will not be finished), "closed" (the bridge is gone). Importer -> producer: "attached" (the
buffers are mapped, or why not), "ack" (a bucket's buffer may be refilled, or the consumer's refusal).

A refused ACK carries the consumer's error as an error payload (colomem.errors.error_payload), so the
producer raises the consumer's class (WeightCheckError, CudaOutOfMemoryError, ...) rather than a PeerError.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from colomem import _C
from colomem.bridge.buckets import BucketMessage
from colomem.errors import (ColomemError, PeerAbortedError, PeerClosedError, PeerError, error_payload,
                            is_error_payload, payload_error)

PROTOCOL = 1
CHECKSUM_STRIDES = {"none": 0, "sampled": 64, "full": 1}  # 8-byte words between samples (0: no checksum)
U64 = (1 << 64) - 1

HELLO, ATTACHED, BUCKET, ACK, ABORT, CLOSED = "hello", "attached", "bucket", "ack", "abort", "closed"
HOST_BACKEND = "host"  # hello["backend"] of a bridge whose buffers are in shared host memory


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def decode(data: bytes, conn: "_C.UnixConnection", fds: list) -> dict:
    """A received message as a dict with a "kind"; closes any descriptors it carried (only the handshake
    carries some, and it does not go through here)."""
    for fd in fds:
        os.close(fd)
    try:
        d = json.loads(data)
    except ValueError:
        d = None
    if not isinstance(d, dict) or "kind" not in d:
        raise PeerError(f"{conn.peer_role} process {conn.peer_pid} sent a malformed bridge message")
    return d


# -- ACKs ------------------------------------------------------------------------------------------------------
def ack_error(error: Union[BaseException, str, None]) -> Optional[dict]:
    """What a refused ACK carries: the error payload of an exception; a string stands for a PeerError."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        return error_payload(error)
    return error_payload(PeerError(str(error)))


def refusal(error: Any, msg: BucketMessage, who: str) -> ColomemError:
    """The exception for a refused bucket: the consumer's class when its ACK carries an error payload
    (a bare string, from an older consumer or a callable transport, is a PeerError)."""
    what = f"{who} refused bucket {msg.seq} of version {msg.version}"
    if not is_error_payload(error):
        return PeerError(f"{what}: {error if error is not None else 'no reason given'}")
    cls = type(payload_error(error, what))  # the class the payload names (PeerError if none of ours)
    return cls(f"{what}: {error.get('message', 'no message')}")


def check_ack(ack: Any, msg: BucketMessage, who: str) -> None:
    """An ACK is anything but a refusal: False, an error payload, or a dict (or a list of them, one per
    worker) with ok=False or another seq/version than the message's."""
    acks = ack if isinstance(ack, (list, tuple)) else [ack]
    for a in acks:
        if a is False:
            raise PeerError(f"{who} refused bucket {msg.seq} of version {msg.version}")
        if not isinstance(a, dict):
            continue
        if a.get("ok", True) is False:
            raise refusal(a.get("error"), msg, who)
        if is_error_payload(a):  # e.g. an RPC whose consumer failed returns its error payload
            raise refusal(a, msg, who)
        if ("seq" in a and int(a["seq"]) != msg.seq) or ("version" in a and int(a["version"]) != msg.version):
            raise PeerError(f"{who} acknowledged version {a.get('version')} seq {a.get('seq')} for bucket "
                            f"{msg.seq} of version {msg.version}")


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
