"""What a wake of vLLM's sleeping memory finds free, and the out-of-memory message that says which knob to turn."""
from __future__ import annotations

from typing import Optional

from colomem._torch import driver_memory
from colomem.units import format_bytes


def free_bytes(device: int) -> Optional[int]:
    """Free GPU memory on the device, as the driver reports it; None without CUDA."""
    info = driver_memory(device)
    return None if info is None else info[0]


def wake_oom_message(tags: tuple, need: int, free: Optional[int], state: str, device: int) -> str:
    what = "weights" if "weights" in tags else "KV cache"
    knobs = ("offload more of the trainer first (it must be offloaded before the wake) or use a smaller "
             "model/tensor_parallel_size" if what == "weights" else
             "lower gpu_memory_utilization (--gpu-memory-utilization) or max_model_len (--max-model-len), "
             "or offload more of the trainer (smaller micro-batch)")
    free_s = "unknown" if free is None else format_bytes(free)
    return (f"waking vLLM's {what} needs {format_bytes(need)} but {free_s} is free on cuda:{device}; "
            f"{state}. To fit: {knobs}.")
