"""The widest batch a job can train on, and measured memory figures scaled to it.

The planner measures one step and plans every later one from it. A GRPO batch is as wide as its longest
prompt plus its longest completion, so a later step can be wider than the measured one: an instruct model's
answers grow as it learns, a dataset's prompts differ in length. Training activations grow with the width
(linearly, with the attention kernels transformers uses), so a plan that fits the measured step can run out of
memory steps later. The planner therefore plans for the widest row the job can produce: the longest prompt
plus max_new_tokens, at most the model length vLLM generates within.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .placement import ALL_CATEGORIES, MemoryFigures


def widest_row(max_model_len: int, task: Any, max_new_tokens: int) -> int:
    """Tokens in the widest row a step can train on: the task's longest prompt (when it knows it) plus
    max_new_tokens, at most max_model_len (a prompt and its completion never exceed it in vLLM)."""
    longest: Optional[int] = getattr(task, "longest_prompt_tokens", None)
    if longest is None:
        return int(max_model_len)
    return min(int(max_model_len), int(longest) + int(max_new_tokens))


def widened(fig: MemoryFigures, measured: int, widest: int) -> MemoryFigures:
    """fig as a step of rows `widest` tokens wide would measure it: its training activations (the peaks
    beyond the trainer's state, as placement._activation_share counts them) scaled by widest / measured.
    fig itself when the measured step was already that wide (or its width is unknown)."""
    if measured <= 0 or widest <= measured:
        return fig
    state = fig.kept_bytes(ALL_CATEGORIES)

    def scale(peak: int) -> int:
        return peak + int(max(0, peak - state) * (widest - measured) / measured) if peak else peak
    return dataclasses.replace(fig, train_peak=scale(fig.train_peak), pre_step_peak=scale(fig.pre_step_peak))


__all__ = ["widened", "widest_row"]
