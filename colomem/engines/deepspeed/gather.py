"""ZeRO-3 partitions made whole for the weight sync, several modules per all-gather.

With ZeRO-3 on several ranks every rank holds a slice of each parameter; the rollout engine of every rank
needs the full weights. Gathering module by module costs one collective per module (a few tensors each,
hundreds per model); `BucketedGather` gathers consecutive modules together up to `bucket_bytes`, so a sync
makes about model bytes / bucket_bytes collectives. It is the `full` of colomem.engines.lora.named_weights:
named_weights asks for one module's parameters at a time, in the order lora.param_groups lists them, and
BucketedGather opens the gather of the bucket holding them when the previous bucket is used up. A gathered
tensor stays valid until the iterator moves past its bucket. Every rank must iterate to the end (each
gather is collective); `close` releases the last bucket.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Sequence

from colomem.errors import ColomemError


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges over `sizes` (consecutive, covering all of them): each at most bucket_bytes, but
    never empty (a group larger than bucket_bytes is a bucket of its own)."""
    out: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + int(n) > bucket_bytes:
            out.append((start, i))
            start, total = i, 0
        total += int(n)
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


class BucketedGather:
    """`full(params)` over `groups` (the parameter lists, in the order they will be asked for): gathers whole
    buckets with `gather(params) -> context manager` (deepspeed.zero.GatheredParameters)."""

    def __init__(self, groups: Sequence[list], bucket_bytes: int, nbytes_of: Callable[[Any], int],
                 gather: Callable[[list], ContextManager]):
        self.groups = [list(g) for g in groups]
        self.buckets = plan_buckets([sum(nbytes_of(p) for p in g) for g in self.groups], int(bucket_bytes))
        self._gather = gather
        self._next = 0                 # index of the group asked for next
        self._end = 0                  # end of the bucket gathered now
        self._stack = contextlib.ExitStack()
        self.gathers = 0               # collectives made (buckets opened)

    @contextlib.contextmanager
    def __call__(self, params: list) -> Iterator[list]:
        i = self._next
        if i >= len(self.groups) or [id(p) for p in params] != [id(p) for p in self.groups[i]]:
            raise ColomemError(f"the weight export asked for parameters out of the planned order (call {i} of "
                               f"{len(self.groups)}); this is a bug in the DeepSpeed adapter (please report it)")
        if i >= self._end:
            self._stack.close()
            start, end = next(b for b in self.buckets if b[0] == i)
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(self._gather([p for g in self.groups[start:end] for p in g]))
            self._end = end
            self.gathers += 1
        self._next = i + 1
        yield [p.data for p in params]

    def close(self) -> None:
        """Releases the bucket still gathered (the partitions go back to their slices)."""
        self._stack.close()
        self._end = self._next


__all__ = ["BucketedGather", "plan_buckets"]
