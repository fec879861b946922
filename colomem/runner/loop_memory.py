"""What the colocated loop decides about GPU memory besides the planner's choice: the first step's placement,
the weight bridge's bucket size once the placement is known, and the out-of-memory error that says which knob
to turn."""
from __future__ import annotations

from typing import Callable, Optional

from colomem.errors import CudaOutOfMemoryError, oom_advice_replaced
from colomem.units import format_bytes

from .placement import EVERYTHING_MOVES, Placement, choose, needs_measuring
from .sync_bucket_plan import sync_bucket


def first_placement(c) -> Placement:
    """The placement of the first step: the one asked for, or everything moving (the step that measures)."""
    if c.switch != "colomem":
        return Placement((), True, "the time-split baseline: DeepSpeed offloads the trainer, vLLM sleeps")
    if needs_measuring(c.offload, c.rollout_sleep):
        return EVERYTHING_MOVES
    return choose(c.offload, c.rollout_sleep, [], None)


def grow_sync_bucket(c, r, placement: Placement, figs: list, sync_nbytes: int, margin: Optional[int],
                     say: Callable[[str], None]) -> int:
    """With --bucket-bytes auto: larger weight-bridge buckets of the rollout `r` when the placement leaves the
    memory (fewer round trips to vLLM's worker a sync). Returns the GPU bytes the larger buffers take."""
    current, buffers = getattr(r, "bucket_bytes", None), getattr(r, "bucket_buffers", None)
    if c.bucket_bytes != "auto" or c.effective_engine != "cross-process" or not hasattr(r, "set_bucket_bytes") \
            or not isinstance(current, int) or not isinstance(buffers, int):
        return 0
    new = sync_bucket(placement, figs, sync_nbytes, current, buffers, margin)
    if new is None:
        return 0
    r.set_bucket_bytes(new)
    say(f"[colomem] weight sync: buckets of {format_bytes(new)} x {buffers} from now on (were "
               f"{format_bytes(current)}: fewer round trips a sync; the placement leaves the memory)")
    return buffers * (new - current)


def oom_error(c, placement: Placement, phase: str, step: int, e: BaseException,
              note: Optional[str]) -> CudaOutOfMemoryError:
    """The out-of-memory error of a phase, saying which knob to turn."""
    if phase in ("wake_kv", "rollout", "eval"):
        knob = (f"lower --gpu-memory-utilization (now {c.gpu_memory_utilization}) or --max-model-len (now "
                f"{c.max_model_len}) so the KV cache is smaller")
    elif phase in ("wake_weights", "sync", "check"):
        knob = ("the rollout weights did not fit next to what stays on the GPU while the trainer is offloaded: "
                "use --switch colomem --offload all (offloads all trainer state), a larger "
                "--tensor-parallel-size, or a smaller model; check the memory table for what stays resident")
    else:
        knob = (f"lower --micro-batch (now {c.micro_batch}), turn on --gradient-checkpointing, or lower "
                f"--gpu-memory-utilization (now {c.gpu_memory_utilization}) so vLLM's sleeping leftovers are "
                "smaller; `python -m colomem.budget` estimates what fits")
    if placement.kv_release and phase not in ("wake_kv", "rollout", "eval"):
        knob += (f"; vLLM released only {format_bytes(placement.kv_release)} of its KV cache while training, "
                 "what the first step's figures said training needs: --kv-release all frees all of it")
    if placement.keep and c.switch == "colomem":
        knob += (f" (the placement was {placement.label!r}: --offload all --rollout-sleep always moves "
                 "everything)")
    # the error's own advice names library arguments: the flags above (with their values) replace it
    parts = [oom_advice_replaced(f"step {step}: out of GPU memory in phase {phase!r}: {e}", knob)]
    if note:
        parts.append(note[:1].upper() + note[1:] + "; the trainer was not reloaded")
    return CudaOutOfMemoryError(". ".join(p.rstrip(".") for p in parts) + ".")


__all__ = ["first_placement", "grow_sync_bucket", "oom_error"]
