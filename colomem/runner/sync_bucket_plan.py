"""The weight bridge's bucket size once the placement is known: one bucket a sync from GPU tensors, a few
when the sync reads the pool's host copies, as large as the memory the placement leaves free allows."""
from __future__ import annotations

from typing import Optional, Sequence

from .placement import MemoryFigures, Placement, rollout_spare, train_spare

# The largest bucket the planner grows the weight bridge to: beyond it a sync gains nothing measurable (a 7B
# model syncs fastest with 4 GiB buckets), while each buffer of it stays allocated for the whole job.
MAX_SYNC_BUCKET = 4 << 30
_BUCKET_ROUND = 64 << 20
# When the sync reads the pool's host copies (the bf16 weights were offloaded), a bucket's H2D copy overlaps
# the worker's load of the one before only if a sync has several: one bucket leaves the worker's load and ack
# after the whole copy. So such a sync keeps about this many buckets, none below the smallest size given
# here (benchmarks/bench_sync_inloop.py measures both against the H2D link).
HOST_SYNC_BUCKETS = 6
_MIN_HOST_BUCKET = 512 << 20


def sync_bucket_target(sync_bytes: int, from_host: bool) -> int:
    """The bucket a sync of sync_bytes runs fastest with, memory permitting: all of it in one bucket when it
    reads GPU tensors, about HOST_SYNC_BUCKETS of them when it reads host copies; 64 MiB multiples, at most
    MAX_SYNC_BUCKET."""
    want = max(-(-sync_bytes // HOST_SYNC_BUCKETS), min(sync_bytes, _MIN_HOST_BUCKET)) if from_host else sync_bytes
    return min(MAX_SYNC_BUCKET, -(-want // _BUCKET_ROUND) * _BUCKET_ROUND)


def sync_bucket(p: Placement, figures: Sequence[MemoryFigures], sync_bytes: int, current: int, buffers: int,
                margin: Optional[int] = None) -> Optional[int]:
    """A larger weight-bridge bucket when placement p leaves the GPU memory for it, else None. Each bucket of
    a sync costs a round trip to vLLM's worker, so from GPU tensors one bucket holding all sync_bytes is
    fastest; from the pool's host copies (p offloads the bf16 weights) a few buckets pipeline the copy with the
    worker (sync_bucket_target). The bridge holds `buffers` of them for the whole job, so the growth must fit
    in what p leaves free, keeping 1 GiB beside the margin. Halved until it fits; None when no larger bucket
    does."""
    if not figures or sync_bytes <= current:
        return None
    # the buffers stay through training too
    spare = min(rollout_spare(p, figures, margin, 0), train_spare(p, figures, margin, 0)) - (1 << 30)
    target = sync_bucket_target(sync_bytes, from_host="params" not in p.keep)
    while target > current:
        if buffers * (target - current) <= spare:
            return target
        target = -(-(target // 2) // _BUCKET_ROUND) * _BUCKET_ROUND
    return None


__all__ = ["HOST_SYNC_BUCKETS", "MAX_SYNC_BUCKET", "sync_bucket", "sync_bucket_target"]
