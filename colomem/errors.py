"""The exceptions colomem raises. One base class, `ColomemError`; CUDA failures carry `.status`.

The classes of the core live in the compiled module and are re-exported here; the ones below are raised
only from Python. docs/design.md lists the hierarchy.

Two helpers belong to the hierarchy: `is_oom` (the one out-of-memory test every layer uses) and the error
payload (`error_payload` / `raise_payload`): how an error crosses a process boundary (an RPC's return value
or a bridge ACK) and comes back as the same class on the other side.
"""

from __future__ import annotations

from typing import Any, Optional

from colomem._C import (  # noqa: F401  (re-exported)
    ColomemError,
    CudaError,
    CudaOutOfMemoryError,
    DoubleReleaseError,
    InvalidArgumentError,
    NotAvailableError,
    PeerError,
    PoolBusyError,
    PoolClosedError,
    PoolExhaustedError,
    TransferTimeoutError,
)


class DeviceMismatchError(InvalidArgumentError):
    """A tensor is on another device than the set, engine or bridge it was given to."""


class ForeignTensorError(InvalidArgumentError):
    """A tensor whose memory colomem cannot free and re-grow (from_blob, DLPack, vLLM's pool, IPC)."""


class StaleWeightsError(ColomemError):
    """The rollout engine was asked to generate with weights older than the trainer's."""


class WeightCheckError(ColomemError):
    """The check after a wake or a weight sync found other bytes than the trainer sent."""


class SharedBaseError(InvalidArgumentError):
    """A trainer base parameter cannot be a view of the rollout engine's weights (name, shape, dtype, device or
    layout differ); the message names the parameter."""


class BaseWrittenError(WeightCheckError):
    """The frozen base the trainer shares with the rollout engine changed: something wrote into it. The
    message names the tensor and the byte range."""


class AdapterLayoutError(InvalidArgumentError):
    """A LoRA adapter cannot be written in place into the slot vLLM's LoRA manager filled (a module vLLM has no
    LoRA layer for, another shape, tensor parallelism, an embedding or lm_head adapter, no active slot); the
    message names the module. The adapter goes through vLLM's own loader instead."""


class PhaseOrderError(ColomemError):
    """A colocated-runner transition was asked for out of order (for example wake before offload)."""


class ConfigError(InvalidArgumentError):
    """A config value is missing, of the wrong type or out of range; the message names the field and, where
    known, where the value came from (a flag or a YAML file)."""


class PeerClosedError(PeerError):
    """The other end of a bridge closed it (or its process ended): nothing more will come."""


class PeerAbortedError(PeerError):
    """The producer abandoned one version mid-sync; the connection stays usable for the next one."""


# ------------------------------------------------------------------------------------------ out of memory
_OOM_NAMES = ("OutOfMemoryError", "CudaOutOfMemoryError")
# Where an out-of-memory message's advice starts: a caller that knows better knobs (the runner's flags and their
# values) puts its own advice in place of the library's instead of after it.
TO_FIT = " To fit: "


def oom_advice_replaced(message: str, advice: str) -> str:
    """`message` with the advice after TO_FIT (if any) replaced by `advice`, behind the same marker."""
    head = message.split(TO_FIT, 1)[0].rstrip(". ")
    return f"{head}.{TO_FIT}{advice}"


def is_oom(exc: BaseException) -> bool:
    """True for every out-of-memory failure colomem can meet: Python's MemoryError (so PoolExhaustedError and
    CudaOutOfMemoryError), torch's OutOfMemoryError, and a RuntimeError whose text says "out of memory"
    (what vLLM and NCCL raise when CUDA's allocator fails outside torch)."""
    if isinstance(exc, MemoryError):
        return True
    if any(t.__name__ in _OOM_NAMES for t in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


# ---------------------------------------------------------------------------------------- error payloads
def error_payload(exc: BaseException) -> dict:
    """The dict that carries `exc` across a process boundary: {"error": class name, "message": text}.

    A colomem class keeps its name; an out-of-memory of any origin becomes CudaOutOfMemoryError; anything
    else (a bug or a library's error on the other side) becomes PeerError with the original class in the text.
    """
    name = type(exc).__name__
    if is_oom(exc) and not isinstance(exc, ColomemError):
        name = "CudaOutOfMemoryError"
    elif not isinstance(exc, ColomemError) or _class_named(name) is None:
        name = "PeerError"
    return {"error": name, "message": f"{type(exc).__name__}: {exc}"}


def is_error_payload(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("error"), str) and "message" in obj


def payload_error(payload: dict, what: str) -> ColomemError:
    """The exception an error payload stands for, its message prefixed with `what` failed."""
    cls = _class_named(str(payload.get("error"))) or PeerError
    return cls(f"{what} failed in the peer process: {payload.get('message', 'no message')}")


def raise_payload(result: Any, what: str, *, where: Optional[str] = None) -> Any:
    """Returns `result`, or raises the error it carries as its colomem class (see error_payload)."""
    if is_error_payload(result):
        exc = payload_error(result, what)
        if where:
            exc = type(exc)(f"{what} failed in {where}: {result.get('message', 'no message')}")
        raise exc
    return result


def _class_named(name: str) -> Optional[type]:
    cls = globals().get(name)
    return cls if isinstance(cls, type) and issubclass(cls, ColomemError) else None


__all__ = [
    "AdapterLayoutError", "BaseWrittenError", "ColomemError", "ConfigError", "CudaError", "CudaOutOfMemoryError", "DeviceMismatchError",
    "DoubleReleaseError", "ForeignTensorError", "InvalidArgumentError", "NotAvailableError", "PeerAbortedError", "PeerClosedError",
    "PeerError", "PhaseOrderError", "PoolBusyError", "PoolClosedError", "PoolExhaustedError", "SharedBaseError",
    "StaleWeightsError", "TransferTimeoutError", "WeightCheckError", "error_payload", "is_error_payload",
    "is_oom", "payload_error", "raise_payload",
]
