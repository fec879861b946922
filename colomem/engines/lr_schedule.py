"""The learning rate over a run: warmup, then constant, linear or cosine decay (transformers' schedulers, the
ones TRL's `lr_scheduler_type` names), stepped once per optimizer step by either trainer.

The run counts in its own steps (--steps, --warmup-steps); a step makes `per_step` optimizer steps
(num_iterations x mini_batches), so the schedule is laid out in optimizer steps. On resume it is built again
from the run's flags and stood at the checkpoint's optimizer-step count (`started`), so a resumed run given
more --steps stretches the decay over the new length, and a changed --lr is the new peak.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

from colomem.errors import InvalidArgumentError

# transformers' SchedulerType names colomem offers (warmup, when asked for, is linear from 0 in each)
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr")


@dataclass(frozen=True)
class LrSchedule:
    """One run's learning-rate schedule in optimizer steps: `name` (LR_SCHEDULERS), `warmup` steps rising
    linearly from 0, `total` steps to the end of the decay, `min_lr_rate` (cosine_with_min_lr: the floor as
    a fraction of --lr)."""
    name: str = "constant"
    warmup: int = 0
    total: int = 1
    min_lr_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in LR_SCHEDULERS:
            raise InvalidArgumentError(f"lr scheduler {self.name!r}: choose one of {', '.join(LR_SCHEDULERS)}")
        if self.total < 1 or not 0 <= self.warmup <= self.total:
            raise InvalidArgumentError(f"lr schedule of {self.total} optimizer steps with {self.warmup} of warmup: "
                                       "the warmup must be at least 0 and at most the whole run")
        if not 0.0 <= self.min_lr_rate <= 1.0:
            raise InvalidArgumentError(f"min_lr_rate={self.min_lr_rate}: a fraction of the learning rate, 0 to 1")

    @property
    def is_constant(self) -> bool:
        """The learning rate never changes: no scheduler is needed (the trainers then step none)."""
        return self.name == "constant" or (self.name == "constant_with_warmup" and self.warmup == 0)

    def build(self, optimizer: Any) -> Any:
        """The torch LR scheduler over `optimizer` (its param groups' "lr" is the peak)."""
        from transformers import get_scheduler

        extra = {"min_lr_rate": self.min_lr_rate} if self.name == "cosine_with_min_lr" else None
        return get_scheduler(self.name, optimizer, num_warmup_steps=self.warmup, num_training_steps=self.total,
                             scheduler_specific_kwargs=extra)

    def started(self, optimizer: Any, lr: float, steps: int = 0) -> Optional[Any]:
        """The scheduler of a trainer that has made `steps` optimizer steps (0: a new run; a resumed one: its
        checkpoint's count), None for a constant rate. Every group's peak is `lr` again, whatever a loaded
        optimizer state held, so a resumed run follows this run's flags (a changed --lr takes effect) and
        the rate it resumes with is the one it would have had at that step (the schedule is a closed form
        of the step, so stepping it again gives the same numbers)."""
        for group in optimizer.param_groups:
            group["lr"] = lr
            group.pop("initial_lr", None)       # the scheduler takes its peak from "lr" only when this is unset
        if self.is_constant:
            return None
        scheduler = self.build(optimizer)
        with warnings.catch_warnings():         # torch warns of a scheduler step before any optimizer step
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                scheduler.step()
        return scheduler

    def describe(self, lr: float) -> str:
        """The schedule for the runner's log line."""
        if self.is_constant:
            return f"learning rate {lr:g}, constant"
        warm = f", {self.warmup} warmup steps from 0" if self.warmup else ""
        floor = f" to {lr * self.min_lr_rate:g}" if self.name == "cosine_with_min_lr" else ""
        return f"learning rate {lr:g}, {self.name}{floor} over {self.total} optimizer steps{warm}"


def current_lr(optimizer: Any) -> float:
    """The learning rate the optimizer's next step uses (its first param group's)."""
    return float(optimizer.param_groups[0]["lr"])


__all__ = ["LR_SCHEDULERS", "LrSchedule", "current_lr"]
