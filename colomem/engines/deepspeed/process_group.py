"""The default process group DeepSpeed starts for colomem's trainers, destroyed when the last of them closes.

On one GPU without torchrun nothing starts a process group before the trainer: `deepspeed.initialize` does,
and nothing destroys it, so every job ended with torch's warning that `destroy_process_group()` was not called
(its communicator torn down at interpreter exit). A group that existed before a trainer's set-up (torchrun's
ranks, the user's own, another library's) belongs to whoever started it and is left alone.
"""
from __future__ import annotations

import gc
import warnings
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from .config import forget_distributed_env

T = TypeVar("T")


def _destroy_deepspeeds() -> None:
    """Through DeepSpeed when it is loaded: it also drops the groups it cached (data-parallel and others),
    which a later trainer would otherwise find stale. Then the environment init_distributed set goes, so a
    later trainer's group starts on a fresh port."""
    try:
        import deepspeed.comm as ds_comm
    except ImportError:
        ds_comm = None
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None:
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    forget_distributed_env()


class DefaultGroupGuard:
    """Counts the live trainers that use a default group a trainer's set-up started; the last release()
    destroys it. A trainer builds its engine through setup() and calls release() when it closes if setup()
    said it holds the group."""

    def __init__(self, destroy: Optional[Callable[[], None]] = None) -> None:
        self._destroy = destroy or _destroy_deepspeeds
        self._holders = 0

    @staticmethod
    def started() -> bool:
        return dist.is_available() and dist.is_initialized()

    def setup(self, build: Callable[[], T], before: Optional[bool] = None) -> tuple[T, bool]:
        """(build(), whether the caller holds the default group now and must release() it). before: whether a
        group existed before the caller's set-up began, when that was earlier than build() (a ZeRO-3 model
        built inside DeepSpeed's partitioning context starts the group already)."""
        before = self.started() if before is None else before
        try:
            out = build()
        except BaseException:
            if self._after_setup(before):
                self.release()
            raise
        return out, self._after_setup(before)

    def _after_setup(self, before: bool) -> bool:
        if not self.started():
            return False
        if self._holders == 0 and before:
            return False            # someone else's group
        self._holders += 1          # the set-up started it, or a live trainer's set-up did
        return True

    def release(self) -> None:
        """One holder fewer; the last destroys the group (failures are warnings: this runs while closing)."""
        if self._holders == 0:
            return
        self._holders -= 1
        if self._holders or not self.started():
            return
        try:
            self._destroy()
        except Exception as e:  # noqa: BLE001 - closing goes on
            warnings.warn(f"destroying the trainer's process group failed: {e!r}", RuntimeWarning, stacklevel=2)
        gc.collect()                # what still references the group lets it go now, not at interpreter exit

    @property
    def holders(self) -> int:
        return self._holders


DEFAULT_GROUP = DefaultGroupGuard()

__all__ = ["DEFAULT_GROUP", "DefaultGroupGuard"]
