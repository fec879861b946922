"""The default process group DeepSpeed starts for colomem's trainers, destroyed when the last of them closes.

On one GPU without torchrun nothing starts a process group before the trainer: `deepspeed.initialize` does,
and nothing destroys it, so every job ended with torch's warning that `destroy_process_group()` was not called
(its communicator torn down at interpreter exit). A group that existed before a trainer's set-up (torchrun's
ranks, the user's own, another library's) belongs to whoever started it and is left alone.
"""
from __future__ import annotations

import gc
import warnings
from typing import Callable, Optional

import torch.distributed as dist

from .config import forget_distributed_env
from .setup_hold import SetupHold


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


class DefaultGroupGuard(SetupHold):
    """Counts the live trainers that use a default group a trainer's set-up started; the last release()
    destroys it (failures are warnings: that runs while closing). The state before a set-up is whether a
    group existed; pass it as setup()'s `before` when the set-up began before build() (a ZeRO-3 model built
    inside DeepSpeed's partitioning context starts the group already)."""

    def __init__(self, destroy: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self._destroy = destroy or _destroy_deepspeeds

    @staticmethod
    def started() -> bool:
        return dist.is_available() and dist.is_initialized()

    def _snapshot(self) -> bool:
        return self.started()

    def _took(self, before: bool) -> bool:
        if not self.started():
            return False
        return self._holders > 0 or not before     # a live trainer's set-up started it, or this one did

    def _give_back(self) -> None:
        if not self.started():
            return
        try:
            self._destroy()
        except Exception as e:  # noqa: BLE001 - closing goes on
            warnings.warn(f"destroying the trainer's process group failed: {e!r}", RuntimeWarning, stacklevel=3)
        gc.collect()                # what still references the group lets it go now, not at interpreter exit


DEFAULT_GROUP = DefaultGroupGuard()

__all__ = ["DEFAULT_GROUP", "DefaultGroupGuard"]
