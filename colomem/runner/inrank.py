"""The in-rank vLLM engine (--engine in-rank): vLLM inside every torchrun rank, the layout TRL's colocate mode
and verl use, and what the runner does around it.

vLLM's `distributed_executor_backend="external_launcher"` builds one worker in the calling process and takes
its groups from torch.distributed's world: with W ranks and tensor-parallel size TP, the ranks r with equal
r // TP make one engine (vLLM lays the world out as W / TP independent engines of TP shards each), so every
rank holds its shard of its group's engine. The weight sync is then in process on every rank (the `direct`
transport: the trainer's tensors go to the worker as they are, no bridge), and each rank's worker takes the
full weights from its own trainer and keeps its shard (vLLM's loaders narrow them).

Which engine (`resolve_engine`): `auto` is the in-rank engine, the one that spans ranks (a cross-process
engine belongs to one rank, and its TP workers would be processes of its own on GPUs the other ranks train
on) and, at TP 1, the one that starts sooner: no engine process to spawn and import vLLM into, the weights
synced in process, as fast a rollout. `auto` takes the cross-process engine only where vLLM cannot sit in the
trainer's process: with --trainer-expandable (vLLM refuses torch's expandable segments in its process), or
where this process already built an engine with sleep mode (vLLM keeps one such allocator a process, and its
memory stays after the engine closes: a notebook's or a test's second job).

Prompts: every rank draws the same prompts for a step, and Ranks.generate_groups hands the ranks of one TP
group the same ones (Ranks says how the groups split the step and which rank trains on which part). The
shards of one engine must sample the same tokens, so the engine's seed is its group's (`engine_seed`; the
loop seeds each request per group too) and after the rollout `check_group_agrees` compares a digest of what
every rank generated with its group's other ranks: a difference is a RolloutMismatchError, not a silent
training on completions the engine never produced.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from colomem.errors import ColomemError

ENGINES = ("auto", "in-rank", "cross-process")


class RolloutMismatchError(ColomemError):
    """The ranks of one tensor-parallel engine generated different completions for the same prompts."""


def resolve_engine(choice: str, tensor_parallel_size: int, *, shared_base: bool = False,
                   trainer_expandable: bool = False, engine_held: bool = False, backend: str = "auto") -> str:
    """'in-rank' or 'cross-process' for --engine `choice`. auto: in-rank, except at TP 1 with
    `trainer_expandable`, when `engine_held` (this process already holds a sleeping vLLM engine's memory) or
    on the CPU backend (no vLLM: its stand-in keeps the cross-process engine's seeding); a shared LoRA base
    and TP above 1 are in-rank whatever else (the trainer reads vLLM's weights in its own process; the engine
    spans the ranks)."""
    if choice == "auto":
        if int(tensor_parallel_size) > 1 or shared_base:
            return "in-rank"
        return "cross-process" if trainer_expandable or engine_held or backend == "cpu" else "in-rank"
    if choice not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {choice!r}")
    return choice


def engine_problem(choice: str, tensor_parallel_size: int, backend: str) -> Optional[str]:
    """Why --engine `choice` cannot run with this TP and --backend (None: it can)."""
    if choice not in ENGINES:
        return f"engine must be one of {', '.join(ENGINES)}, got {choice!r}"
    if tensor_parallel_size > 1 and backend == "cpu":
        return (f"tensor_parallel_size={tensor_parallel_size} needs the gpu backend (the CPU stand-in generates "
                "with one process per rank)")
    if choice == "cross-process" and tensor_parallel_size > 1:
        return (f"--engine cross-process runs one vLLM engine per rank and cannot span the torchrun ranks "
                f"(tensor_parallel_size={tensor_parallel_size}); use --engine in-rank (or auto), which builds each "
                "rank's shard of the engine inside the rank")
    if choice == "in-rank" and backend == "cpu":
        return "--engine in-rank places vLLM inside the ranks; the CPU backend has no vLLM (use --backend gpu)"
    return None


def engine_seed(seed: int, rollout_group: int) -> int:
    """vLLM's seed on a rank of `rollout_group`: the same for the shards of one engine (they must sample the
    same tokens), another for each engine."""
    return int(seed) + int(rollout_group)


def rollout_digest(gen_idx: Sequence[int], completions: Sequence[Sequence]) -> str:
    """A short digest of which prompt groups were generated and the tokens of every completion."""
    h = hashlib.sha256()
    h.update(repr(list(gen_idx)).encode())
    for group in completions:
        h.update(b"|")
        for c in group:
            h.update(repr((list(c.token_ids), c.finish)).encode())
    return h.hexdigest()[:16]


def check_group_agrees(ranks, digest: str, what: str) -> None:
    """Every rank calls it (collectively, bounded by the barrier timeout): RolloutMismatchError on every rank of
    a tensor-parallel group whose ranks' digests differ; nothing when TP is 1."""
    if ranks.tp == 1 or ranks.world_size == 1:
        return
    every = ranks.exchange(str(digest))
    group = ranks.group_ranks
    if len({every[r] for r in group}) > 1:
        by_rank = ", ".join(f"rank {r}: {every[r]}" for r in group)
        raise RolloutMismatchError(
            f"rank {ranks.rank}: the ranks of rollout group {ranks.rollout_group} generated different completions "
            f"in {what} ({by_rank}); the shards of one engine must run the same requests with the same seed. "
            "Every rank must draw the same prompts (same --seed and data on every node) and run the same vLLM")


__all__ = ["ENGINES", "RolloutMismatchError", "check_group_agrees", "engine_problem", "engine_seed",
           "resolve_engine", "rollout_digest"]
