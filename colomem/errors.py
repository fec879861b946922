"""The exceptions colomem raises. One base class, `ColomemError`; CUDA failures carry `.status`.

The classes of the core live in the compiled module and are re-exported here; the ones below are raised
only from Python. docs/design.md lists the hierarchy.
"""

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


class PhaseOrderError(ColomemError):
    """A colocated-runner transition was asked for out of order (for example wake before offload)."""


__all__ = [
    "ColomemError", "CudaError", "CudaOutOfMemoryError", "DeviceMismatchError", "DoubleReleaseError",
    "ForeignTensorError", "InvalidArgumentError", "NotAvailableError", "PeerError", "PhaseOrderError",
    "PoolBusyError", "PoolClosedError", "PoolExhaustedError", "StaleWeightsError", "TransferTimeoutError",
    "WeightCheckError",
]
