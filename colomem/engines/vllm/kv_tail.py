"""The KV cache's tail on demand: which bytes of each layer's cache hold which blocks, and the blocks held out
of vLLM's free queue while their memory is unmapped.

A partial KV release (the trainer needs part of the cache's memory) used to unmap whole layers and map them
back, every byte, before the rollout could start. Instead every layer's cache keeps its head mapped and lends
its tail: vLLM's FlashAttention layout puts the block outermost, so blocks `first` and up are the contiguous
tail `[first * page, num_blocks * page)` of every layer's tensor. The scheduler decides from its count of
free blocks alone, so blocks taken out of its free queue are invisible to it: the rollout starts at once on
the head's blocks, and the tail's chunks map back (and their blocks return to the queue) only when the head
runs short (tail_scheduler.py, worker/kv_tail.py). docs/kv-on-demand.md has the reading of vLLM this rests on.

This module holds the arithmetic (TailGeometry) and the queue bookkeeping (BlockHold); it imports no vLLM, so
both run, and are tested, without a GPU. BlockHold works on anything shaped like vLLM's BlockPool: `blocks`
(KVCacheBlock with block_id, ref_cnt, block_hash), `free_block_queue` (remove, append_n, num_free_blocks) and
`evict_blocks(ids)`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from colomem.errors import InvalidArgumentError, NotAvailableError, PhaseOrderError

MiB = 1 << 20
# One chunk is mapped per layer when the tail grows: on the 1.5B shape 64 MiB holds 4096 blocks (64k tokens)
# of every layer, enough for a burst of admissions, and a release of tens of GiB stays a few hundred chunks.
CHUNK_BYTES_DEFAULT = 64 * MiB


@dataclass(frozen=True)
class TailGeometry:
    """Where a cache's blocks lie in each layer's allocation, in chunks that map and unmap on their own.

    page_bytes   one scheduler block's bytes in one layer's tensor
    num_blocks   the scheduler's blocks (block 0 is vLLM's null block: its chunk never goes)
    layer_bytes  each layer's allocation (a multiple of the mapping granularity)
    chunk_bytes  one chunk: a multiple of page_bytes and of the granularity
    nlayers      the layers' allocations (every one lends the same tail)
    """
    page_bytes: int
    num_blocks: int
    layer_bytes: int
    chunk_bytes: int
    nlayers: int

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_bytes // self.page_bytes

    @property
    def nchunks(self) -> int:
        return -(-self.layer_bytes // self.chunk_bytes)

    def chunk_size(self, c: int) -> int:
        return min(self.chunk_bytes, self.layer_bytes - c * self.chunk_bytes)

    def first_block(self, c: int) -> int:
        """The first block of chunk c (num_blocks past the last block)."""
        return min(self.num_blocks, c * self.blocks_per_chunk)

    def tail_bytes(self, c: int) -> int:
        """Bytes that chunks [c, nchunks) hold, over every layer."""
        return self.nlayers * sum(self.chunk_size(i) for i in range(c, self.nchunks))

    def tail_start(self, nbytes: Optional[int]) -> int:
        """The first chunk of the shortest tail that frees at least nbytes over every layer (None: all of the
        cache but chunk 0, which holds the null block)."""
        if nbytes is not None and int(nbytes) <= 0:
            raise InvalidArgumentError(f"nbytes={nbytes}: release a positive number of bytes, or None for the "
                                       "whole tail")
        c, got = self.nchunks, 0
        while c > 1 and (nbytes is None or got < int(nbytes)):
            c -= 1
            got += self.nlayers * self.chunk_size(c)
        return c


def tail_geometry(page_bytes: int, num_blocks: int, layer_bytes: list[int], granularity: int,
                  chunk_bytes: int = CHUNK_BYTES_DEFAULT) -> TailGeometry:
    """The geometry of a cache of len(layer_bytes) allocations (all of one size, each at least num_blocks
    pages), chunks near chunk_bytes: the least common multiple of the page and the granularity, times the
    whole number that comes closest from below (at least one). NotAvailableError when the layout cannot lend
    a tail by chunks (the reason said), InvalidArgumentError for sizes that are not sizes."""
    if min([page_bytes, num_blocks, granularity, chunk_bytes] + list(layer_bytes) + [1]) <= 0 or not layer_bytes:
        raise InvalidArgumentError(f"a KV tail needs positive sizes, got page {page_bytes}, {num_blocks} blocks, "
                                   f"allocations {layer_bytes[:4]}, granularity {granularity}, chunk {chunk_bytes}")
    if len(set(layer_bytes)) != 1:
        raise NotAvailableError(f"the KV cache's allocations differ in size ({sorted(set(layer_bytes))[:4]}): a "
                                "tail by blocks needs one page size for every layer")
    size = layer_bytes[0]
    if size % granularity:
        raise NotAvailableError(f"a KV allocation of {size} bytes is not a multiple of the mapping granularity "
                                f"({granularity})")
    if page_bytes * num_blocks > size:
        raise NotAvailableError(f"{num_blocks} blocks of {page_bytes} bytes do not fit the allocation of {size}: "
                                "the cache is not one page per block in each layer")
    unit = page_bytes * granularity // math.gcd(page_bytes, granularity)
    if unit * 4 > size:
        raise NotAvailableError(f"the smallest chunk that holds whole blocks ({unit} bytes: pages of "
                                f"{page_bytes}, granularity {granularity}) is over a quarter of a layer's "
                                f"{size} bytes")
    chunk = unit * max(1, int(chunk_bytes) // unit)
    return TailGeometry(int(page_bytes), int(num_blocks), int(size), chunk, len(layer_bytes))


class BlockHold:
    """The blocks of a lent tail, out of vLLM's free queue so the scheduler never hands one out.

    hold_from(first) takes every block from `first` on out of the queue (each must be free: no request holds
    it) after dropping its prefix-cache hashes: a later prefix hit on a held block would try to take it out of
    the queue a second time. give(upto) returns the held blocks below `upto` (their chunks are mapped again),
    fresh: reference count 0, no hash. `lent()` puts them back around vLLM's prefix-cache reset, which refuses
    while any block but the null one is out of the queue.
    """

    def __init__(self, pool: Any):
        self.pool = pool
        self.first: Optional[int] = None      # the tail's first block while one is held
        self.upto = 0                          # blocks [first, upto) are back in the queue

    @property
    def held(self) -> int:
        """How many blocks are out of the queue now."""
        return 0 if self.first is None else len(self.pool.blocks) - self.upto

    def hold_from(self, first: int) -> int:
        """Holds blocks [first, num_blocks); returns how many it took out now (blocks given back since the
        last hold go out again). PhaseOrderError, nothing changed, when a request still holds one."""
        blocks = self.pool.blocks
        n = len(blocks)
        if not 1 <= int(first) <= n:
            raise InvalidArgumentError(f"the tail's first block {first} is outside 1..{n} (block 0 is vLLM's "
                                       "null block)")
        first = int(first)
        if self.first is not None and first > self.upto:
            self.give(first)                  # a shorter tail: the blocks it no longer covers go back
        out = self._in_queue(first)
        busy = [b.block_id for b in out if b.ref_cnt != 0]
        if busy:
            raise PhaseOrderError(f"{len(busy)} KV blocks of the tail are still held by requests (e.g. "
                                  f"{busy[:3]}): release the tail only while vLLM runs nothing")
        self.pool.evict_blocks({b.block_id for b in out if b.block_hash is not None})
        queue = self.pool.free_block_queue
        for b in out:
            queue.remove(b)
        self.first, self.upto = first, first
        return len(out)

    def _in_queue(self, first: int) -> list:
        """The blocks from `first` on that are in the queue now: all of them, less those held."""
        blocks = self.pool.blocks
        if self.first is None:
            return blocks[first:]
        return [blocks[i] for i in range(first, min(self.upto, len(blocks)))]

    def give(self, upto: int) -> int:
        """Returns the held blocks below `upto` to the queue (at its end: reused after the free head's);
        returns how many."""
        if self.first is None:
            return 0
        upto = min(int(upto), len(self.pool.blocks))
        lo = self.upto                        # never below first: blocks [first, upto) are back
        if upto <= lo:
            return 0
        back = self.pool.blocks[lo:upto]
        self.pool.free_block_queue.append_n(back)
        self.upto = upto
        if self.upto >= len(self.pool.blocks):
            self.first = None
        return len(back)

    def give_all(self) -> int:
        return self.give(len(self.pool.blocks))

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """The held blocks in the queue for the length of the block (nothing may allocate meanwhile: the
        prefix-cache reset inside it only drops hashes), out again after it."""
        first, upto = self.first, self.upto
        if first is None:
            yield
            return
        back = self.pool.blocks[upto:]
        self.pool.free_block_queue.append_n(back)
        try:
            yield
        finally:
            queue = self.pool.free_block_queue
            for b in back:
                queue.remove(b)


class Grower:
    """What the scheduler calls when its free blocks run short while part of the tail is held: `grow(c)` maps
    chunk c of every layer and returns whether it could (False: no memory now). Failed attempts are spaced
    `retry_s` apart so a scheduler that waits for memory does not spin on the driver."""

    def __init__(self, geometry: TailGeometry, grow: Callable[[int], bool], clock: Callable[[], float],
                 retry_s: float = 0.05):
        self.geometry = geometry
        self._grow = grow
        self._clock = clock
        self.retry_s = float(retry_s)
        self._not_before = 0.0
        self.grown_chunks = 0
        self.failed = 0

    @property
    def low(self) -> int:
        """The free count under which the tail grows: two chunks' blocks, at least a sixteenth of the cache."""
        return max(2 * self.geometry.blocks_per_chunk, self.geometry.num_blocks // 16)

    def top_up(self, hold: BlockHold, free: int, make_room: Optional[Callable[[], bool]] = None) -> int:
        """Grows the held tail chunk by chunk, from its low end, while `free` blocks are under low(); returns
        the blocks given back. make_room: called once when a chunk finds no memory (the trainer's copy out
        ended and its memory freed, where it runs in this process); True: it freed some, try again."""
        given = 0
        g = self.geometry
        while hold.held and free + given < self.low and self._clock() >= self._not_before:
            c = hold.upto // g.blocks_per_chunk
            if not self._grow(c):
                if make_room is not None and make_room():
                    make_room = None
                    continue
                self.failed += 1
                self._not_before = self._clock() + self.retry_s
                break
            self.grown_chunks += 1
            given += hold.give(g.first_block(c + 1))
        return given


__all__ = ["CHUNK_BYTES_DEFAULT", "BlockHold", "Grower", "TailGeometry", "tail_geometry"]
