"""The order of one colocated step, enforced, and a watchdog that bounds each phase.

    offload -> barrier_wake -> wake_weights -> sync -> check -> wake_kv -> rollout -> sleep
            -> barrier_train -> reload -> train -> (next step) offload ...

Why this order: vLLM may only wake once every rank's trainer has left the GPU (barrier_wake), the weights
wake before the KV cache so old weights, new weights and the KV cache never coexist, the sync and its check
come before any token is generated, and the trainer reloads only after every rank's vLLM is asleep
(barrier_train). With --overlap-offload the trainer's optimizer state (read by nobody until the next
optimizer step) is still copying out while the weights wake, sync and are checked: each rank waits for it
(`offload_wait`) before its KV cache wakes, which needs that memory, and before the weights already when they
would not fit beside it. The run starts as if a train phase had just ended: trainer resident, rollout asleep.

One optional phase: `eval` (held-out greedy completions, colomem.runner.evaluation) runs in the awake window,
after `rollout` and before `sleep`, when an evaluation is due; the evaluation after the last step has a
window of its own (offload .. wake_kv -> eval -> sleep .. reload, no rollout and no train).
"""
from __future__ import annotations

import _thread
import faulthandler
import sys
import threading
from typing import Optional

from colomem.errors import PhaseOrderError, TransferTimeoutError

CYCLE = ("offload", "barrier_wake", "wake_weights", "sync", "check", "wake_kv", "rollout", "sleep",
         "barrier_train", "reload", "train")
# reload_wait: the part of train that waited for trainer state still reloading behind the forward and
# backward (overlap_reload); a switch cost, so it is taken out of train and counted here. offload_wait: the
# wait for the optimizer state an overlapped offload (--overlap-offload) left copying, before the KV cache
# wakes (or before the weights, when they do not fit beside it). reload_step: the optimizer state brought
# back inside the optimizer step (optimizer_reload step), also taken out of train.
SWITCH_PHASES = ("offload", "barrier_wake", "wake_weights", "sync", "check", "offload_wait", "wake_kv", "sleep",
                 "barrier_train", "reload", "reload_wait", "reload_step")
# eval is neither switch nor training work: the step's time leaves it out, the tables show it on its own row
OPTIONAL = ("eval",)
ORDER = CYCLE[:7] + OPTIONAL + CYCLE[7:]                        # every phase a step may have, in order
# checkpoint: a save due after the previous step, written from the pool right after this step's offload
REPORT_ORDER = (ORDER[:1] + ("checkpoint",) + ORDER[1:5] + ("offload_wait",) + ORDER[5:8] + ("score",)
                + ORDER[8:11] + ("reload_wait", "reload_step") + ORDER[11:])   # tables and plots
WORK_PHASES = ("rollout", "score", "train")

# phase -> the phases that may follow it: the cycle's next one, plus eval after rollout (an evaluation in a
# training step) or after wake_kv (the eval-only window after the last step)
NEXT: dict[str, tuple[str, ...]] = {p: (CYCLE[(i + 1) % len(CYCLE)],) for i, p in enumerate(CYCLE)}
NEXT["rollout"] = ("eval", "sleep")
NEXT["wake_kv"] = ("rollout", "eval")
NEXT["eval"] = ("sleep",)

WHY = {
    "barrier_wake": "every rank must finish offloading its trainer before vLLM wakes",
    "wake_weights": "the trainer must be offloaded (and all ranks past the barrier) before vLLM wakes",
    "sync": "vLLM's weights must be awake before new weights are written into them",
    "check": "the check reads the weights the sync just wrote",
    "wake_kv": "the KV cache wakes only after the weights were synced and checked",
    "rollout": "generation needs synced, checked weights and the KV cache",
    "eval": "the evaluation generates with synced, checked weights and the KV cache, before vLLM sleeps",
    "sleep": "vLLM sleeps after the rollout",
    "barrier_train": "every rank's vLLM must be asleep before any trainer reloads",
    "reload": "the trainer reloads only after every rank's vLLM is asleep",
    "train": "training needs the trainer reloaded",
    "offload": "a step starts by offloading the trainer after it trained",
}


class PhaseTimeoutError(TransferTimeoutError):
    """A runner phase or a barrier ran past its bound."""


class PhaseMachine:
    """Allows only a phase that may follow the last one (NEXT); after a failure, nothing but cleanup."""

    def __init__(self):
        self.last = "train"              # trainer resident, rollout asleep
        self.current: Optional[str] = None
        self.failed: Optional[str] = None

    @property
    def expected(self) -> str:
        """The next phase of the cycle (an optional one may come before it: see `allowed`)."""
        return CYCLE[(CYCLE.index(self.last) + 1) % len(CYCLE)] if self.last in CYCLE else NEXT[self.last][0]

    @property
    def allowed(self) -> tuple[str, ...]:
        return NEXT[self.last]

    def enter(self, phase: str) -> None:
        if phase not in ORDER:
            raise PhaseOrderError(f"unknown phase {phase!r}; phases are {', '.join(ORDER)}")
        if self.failed is not None:
            raise PhaseOrderError(f"cannot start {phase!r}: phase {self.failed!r} failed; the run must stop "
                                  "(clean up and start a new one)")
        if self.current is not None:
            raise PhaseOrderError(f"cannot start {phase!r} while {self.current!r} is still running")
        if phase not in self.allowed:
            nxt = " or ".join(repr(p) for p in self.allowed)
            raise PhaseOrderError(f"cannot start {phase!r} after {self.last!r}: {nxt} comes next "
                                  f"({WHY.get(phase, '')})")
        self.current = phase

    def leave(self, ok: bool = True) -> None:
        if self.current is None:
            raise PhaseOrderError("no phase is running")
        if ok:
            self.last = self.current
        else:
            self.failed = self.current
        self.current = None


def _stderr():
    """The process's real stderr when it has a file descriptor (faulthandler writes to the fd)."""
    for f in (sys.__stderr__, sys.stderr):
        try:
            if f is not None:
                f.fileno()
                return f
        except (OSError, ValueError, AttributeError):
            continue
    return None


class Watchdog:
    """Bounds one phase: at `timeout_s` it dumps every thread's stack and interrupts the main thread (the
    phase then raises PhaseTimeoutError); `grace_s` later, if the main thread is stuck in C code that
    cannot be interrupted, faulthandler ends the process (exit code 1) rather than hang forever."""

    def __init__(self, timeout_s: float, grace_s: float = 120.0, hard_exit: bool = True):
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.hard_exit = hard_exit
        self.fired: Optional[str] = None
        self._timer: Optional[threading.Timer] = None
        self._is_main = threading.current_thread() is threading.main_thread()

    def start(self, what: str) -> None:
        self.fired = None

        def fire():
            self.fired = what
            err = _stderr()
            if err is not None:
                err.write(f"\n[colomem] {what} ran past {self.timeout_s:.0f} s; stacks of every thread:\n")
                err.flush()
                faulthandler.dump_traceback(file=err, all_threads=True)
            if self._is_main:
                _thread.interrupt_main()
        self._timer = threading.Timer(self.timeout_s, fire)
        self._timer.daemon = True
        self._timer.start()
        self._armed = False
        err = _stderr()
        if self.hard_exit and self._is_main and err is not None:
            faulthandler.dump_traceback_later(self.timeout_s + self.grace_s, exit=True, file=err)
            self._armed = True

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if getattr(self, "_armed", False):
            faulthandler.cancel_dump_traceback_later()
            self._armed = False
