"""The KV tail's arithmetic and its hold on a block pool's free queue (colomem.engines.vllm.kv_tail).

vLLM is not installed on the CPU machine, so the pool here is a small stand-in with the same shape as vLLM
0.24's BlockPool (an intrusive free list, blocks with a reference count and a prefix-cache hash); the GPU test
(tests/gpu/test_kv_tail_gpu.py) runs the same code on vLLM's own pool.
"""

from __future__ import annotations

import pytest

from colomem.engines.vllm.kv_tail import BlockHold, Grower, tail_geometry
from colomem.errors import InvalidArgumentError, NotAvailableError, PhaseOrderError

MiB = 1 << 20


class Block:
    def __init__(self, i: int):
        self.block_id, self.ref_cnt, self.block_hash = i, 0, None
        self.prev_free_block = self.next_free_block = None


class Queue:
    """vLLM's FreeKVCacheBlockQueue: a doubly linked list through the blocks, with fake ends."""

    def __init__(self, blocks):
        self.head, self.tail = Block(-1), Block(-1)
        self.head.next_free_block, self.tail.prev_free_block = self.tail, self.head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def remove(self, b):
        if b.prev_free_block is None or b.next_free_block is None:
            raise RuntimeError(f"block {b.block_id} is not in the queue")
        b.prev_free_block.next_free_block = b.next_free_block
        b.next_free_block.prev_free_block = b.prev_free_block
        b.prev_free_block = b.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks):
        last = self.tail.prev_free_block
        for b in blocks:
            b.prev_free_block, last.next_free_block = last, b
            last = b
        last.next_free_block, self.tail.prev_free_block = self.tail, last
        self.num_free_blocks += len(blocks)

    def popleft_n(self, n):
        out = []
        for _ in range(n):
            b = self.head.next_free_block
            self.remove(b)
            out.append(b)
        return out

    def ids(self):
        out, b = [], self.head.next_free_block
        while b is not self.tail:
            out.append(b.block_id)
            b = b.next_free_block
        return out


class Pool:
    """vLLM's BlockPool as far as the hold uses it; block 0 is the null block, out of the queue."""

    def __init__(self, n: int):
        self.blocks = [Block(i) for i in range(n)]
        self.free_block_queue = Queue(self.blocks[1:])
        self.hashes = {}                          # hash -> block, the prefix cache

    def get_num_free_blocks(self):
        return self.free_block_queue.num_free_blocks

    def evict_blocks(self, ids):
        for i in ids:
            b = self.blocks[i]
            if b.block_hash is not None:
                del self.hashes[b.block_hash]
                b.block_hash = None

    def allocate(self, n, hashed=False):
        out = self.free_block_queue.popleft_n(n)
        for b in out:
            assert b.ref_cnt == 0
            b.ref_cnt = 1
            if hashed:
                b.block_hash = ("h", b.block_id)
                self.hashes[b.block_hash] = b
        return out

    def free(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1
        self.free_block_queue.append_n(blocks)

    def reset_prefix_cache(self):
        if len(self.blocks) - self.get_num_free_blocks() != 1:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.hashes.clear()
        return True


class SchedulerLike:
    """vLLM's scheduler as the tail's mixin uses it: kv_cache_manager.block_pool, schedule() (returns the free
    blocks it saw), reset_prefix_cache()."""

    def __init__(self, n: int):
        self.kv_cache_manager = type("Manager", (), {})()
        self.kv_cache_manager.block_pool = Pool(n)
        self.scheduled: list = []

    def schedule(self):
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        self.scheduled.append(free)
        return free

    def reset_prefix_cache(self):
        return self.kv_cache_manager.block_pool.reset_prefix_cache()


def geo(num_blocks=64, page=16 << 10, layers=4, chunk=128 << 10, gran=64 << 10):
    size = -(-num_blocks * page // gran) * gran
    return tail_geometry(page, num_blocks, [size] * layers, gran, chunk)


def test_geometry_chunks_hold_whole_blocks_and_the_tail_covers_the_bytes_asked():
    g = geo()
    assert g.chunk_bytes == 128 << 10 and g.blocks_per_chunk == 8 and g.nchunks == 8
    assert g.first_block(3) == 24 and g.first_block(9) == 64
    # each chunk over 4 layers is 512 KiB: 1 MiB asked -> the last two chunks
    assert g.tail_start(1 << 20) == 6 and g.tail_bytes(6) == 1 << 20
    assert g.tail_start((1 << 20) + 1) == 5
    assert g.tail_start(None) == 1 and g.tail_start(1 << 40) == 1     # chunk 0 (the null block) stays
    with pytest.raises(InvalidArgumentError):
        g.tail_start(0)


def test_geometry_rounds_the_chunk_to_pages_and_granularity():
    # pages of 48 KiB and a 64 KiB granularity: whole blocks need multiples of 192 KiB; 1 MiB -> 5 of them
    g = tail_geometry(48 << 10, 1000, [48000 << 10] * 2, 64 << 10, 1 << 20)
    assert g.chunk_bytes == 960 << 10 and g.blocks_per_chunk == 20
    assert tail_geometry(16 << 10, 64, [1 << 20], 64 << 10, 1).chunk_bytes == 64 << 10    # at least one unit


@pytest.mark.parametrize("sizes, page, blocks, why", [
    ([1 << 20, 2 << 20], 16 << 10, 64, "differ in size"),
    ([(1 << 20) + 4096], 16 << 10, 64, "granularity"),
    ([1 << 20], 16 << 10, 65, "do not fit"),
    ([640 << 10], 96 << 10, 6, "over a quarter"),
])
def test_geometry_refuses_layouts_it_cannot_lend_by_chunks(sizes, page, blocks, why):
    with pytest.raises(NotAvailableError, match=why):
        tail_geometry(page, blocks, sizes, 64 << 10, 1 << 20)


def test_hold_takes_the_tail_out_of_the_queue_and_gives_it_back_in_order():
    pool = Pool(64)
    hold = BlockHold(pool)
    assert hold.hold_from(40) == 24 and hold.held == 24
    assert pool.get_num_free_blocks() == 39 and max(pool.free_block_queue.ids()) == 39
    got = pool.allocate(39)                     # the scheduler can have every head block, never a tail one
    assert {b.block_id for b in got} == set(range(1, 40))
    assert hold.give(48) == 8 and hold.held == 16
    assert sorted(b.block_id for b in pool.allocate(8)) == list(range(40, 48))
    assert hold.give_all() == 16 and hold.held == 0 and hold.first is None


def test_hold_drops_the_prefix_cache_of_the_blocks_it_takes():
    pool = Pool(32)
    blocks = pool.allocate(31, hashed=True)
    pool.free(blocks)
    hold = BlockHold(pool)
    hold.hold_from(16)
    assert all(pool.blocks[i].block_hash is None for i in range(16, 32))
    assert all(pool.blocks[i].block_hash is not None for i in range(1, 16))
    assert set(h[1] for h in pool.hashes) == set(range(1, 16))


def test_hold_refuses_while_a_request_holds_a_tail_block_and_changes_nothing():
    pool = Pool(32)
    busy = pool.allocate(31)
    pool.free(busy[:-1])                         # block 31 still held by a request
    hold = BlockHold(pool)
    before = pool.free_block_queue.ids()
    with pytest.raises(PhaseOrderError, match="still held by requests"):
        hold.hold_from(16)
    assert pool.free_block_queue.ids() == before and hold.held == 0


def test_hold_again_takes_back_what_was_given_and_follows_a_longer_or_shorter_tail():
    pool = Pool(64)
    hold = BlockHold(pool)
    hold.hold_from(40)
    hold.give(56)                                # the rollout grew the tail by two chunks' blocks
    used = pool.allocate(pool.get_num_free_blocks())
    pool.free(used)
    assert hold.hold_from(40) == 16 and hold.held == 24     # only what came back goes out again
    assert hold.hold_from(32) == 8 and hold.held == 32      # a longer tail
    assert hold.hold_from(48) == 0 and hold.held == 16      # a shorter one: blocks 32..47 go back
    assert sorted(pool.free_block_queue.ids()) == list(range(1, 48))


def test_lent_puts_the_held_blocks_back_around_a_prefix_cache_reset():
    pool = Pool(32)
    pool.free(pool.allocate(10, hashed=True))
    hold = BlockHold(pool)
    hold.hold_from(16)
    assert pool.reset_prefix_cache() is False    # vLLM's reset refuses while blocks are out of the queue
    with hold.lent():
        assert pool.reset_prefix_cache() is True
    assert not pool.hashes and hold.held == 16 and pool.get_num_free_blocks() == 15


def test_grower_grows_the_tail_while_the_free_blocks_run_short_and_waits_after_a_failure():
    g = geo(num_blocks=256, chunk=64 << 10)      # 4 blocks a chunk; low water: max(8, 16) blocks
    pool = Pool(256)
    hold = BlockHold(pool)
    hold.hold_from(g.first_block(16))            # blocks 64.. held: 63 free
    mapped, now, room = [], [0.0], [3]

    def grow(c):
        if room[0] == 0:
            return False
        room[0] -= 1
        mapped.append(c)
        return True

    grower = Grower(g, grow, lambda: now[0], retry_s=0.05)
    assert grower.top_up(hold, pool.get_num_free_blocks()) == 0 and not mapped     # plenty free
    pool.allocate(60)                            # 3 free: under 16
    assert grower.top_up(hold, pool.get_num_free_blocks()) == 12 and mapped == [16, 17, 18]
    assert grower.failed == 1 and hold.held == 256 - 76
    assert grower.top_up(hold, 3) == 0 and mapped == [16, 17, 18] and grower.failed == 1   # spaced
    now[0], room[0] = 0.06, 1
    assert grower.top_up(hold, 3) == 4 and mapped[-1] == 19


def test_an_engine_with_kv_tail_is_built_with_the_tail_scheduler_unless_given_another():
    from colomem.engines.vllm.config import VLLMConfig
    from colomem.engines.vllm.tail_scheduler import QUALNAME, make_scheduler
    import importlib

    assert VLLMConfig(kv_tail=True).llm_arguments("m")["scheduler_cls"] == QUALNAME
    mod, name = QUALNAME.rsplit(".", 1)
    assert getattr(importlib.import_module(mod), name) is make_scheduler      # what vLLM resolves the name to
    assert "scheduler_cls" not in VLLMConfig().llm_arguments("m")            # off until its GPU tests pass
    mine = VLLMConfig(kv_tail=True, llm_kwargs={"scheduler_cls": "my.Scheduler"}).llm_arguments("m")
    assert mine["scheduler_cls"] == "my.Scheduler"


def test_the_scheduler_mixin_holds_grows_and_lends_around_a_reset():
    """TailMixin in front of a scheduler shaped like vLLM's (its kv_cache_manager.block_pool, schedule(),
    reset_prefix_cache()): registered for the worker, the tail grown before scheduling, the reset made to
    work while blocks are held."""
    from colomem.engines.vllm import tail_scheduler as ts
    from colomem.errors import NotAvailableError as NA

    cls = ts._with_tail(SchedulerLike)
    assert ts._with_tail(SchedulerLike) is cls
    s = cls(256)
    assert ts.active_scheduler(lambda n: n == 256) is s
    with pytest.raises(NA, match="no scheduler"):
        ts.active_scheduler(lambda n: n == 999)
    newer = cls(256)
    assert ts.active_scheduler(lambda n: n == 256) is newer         # of two alive, the newest
    del newer
    s.colomem_tail.hold_from(64)
    assert s.reset_prefix_cache() is True and s.colomem_tail.held == 192
    g = geo(num_blocks=256, chunk=64 << 10)
    grown = []
    s.colomem_grower = Grower(g, lambda c: grown.append(c) or True, lambda: 0.0)
    s.kv_cache_manager.block_pool.allocate(60)
    assert s.schedule() == 19 and grown == [16, 17, 18, 19] and s.scheduled == [19]
    del s


def test_a_chunk_without_memory_asks_the_trainers_hook_once_then_waits():
    """The trainer's hook (its copy out ended, its memory freed) runs once, the first time a chunk finds no
    memory, on the scheduler's thread; the growth then goes on into what it freed. Without memory after it,
    the growth waits for the next try."""
    from colomem.engines.vllm import tail_scheduler as ts

    g = geo(num_blocks=256, chunk=64 << 10)
    s = ts._with_tail(SchedulerLike)(256)
    s.colomem_tail.hold_from(64)
    s.kv_cache_manager.block_pool.allocate(60)            # 3 free, under the low-water mark of 16
    room, calls = [0], []

    def grow(c):
        if not room[0]:
            return False
        room[0] -= 1
        return True

    def make_room():
        calls.append("freed")
        room[0] = 2

    s.colomem_grower = Grower(g, grow, lambda: 0.0)
    s.colomem_make_room = make_room
    assert s.schedule() == 11 and calls == ["freed"] and s.colomem_make_room is None   # two chunks grew
    assert s.colomem_grower.failed == 1 and s.colomem_grower.grown_chunks == 2
    del s


@pytest.mark.parametrize("stride_order", [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4)])
def test_a_block_outermost_kv_tensor_gives_its_page(stride_order):
    """FlashAttention's layouts (NHD: identity; HND: heads before tokens) keep each block's bytes together,
    block outermost: the page is one block's bytes, whatever the order inside it."""
    import torch
    from colomem.engines.vllm.worker.kv_tail import _page_of

    blocks, shape = 10, (10, 2, 16, 2, 64)          # (blocks, K/V, tokens, kv heads, head size)
    physical = [shape[i] for i in stride_order]
    raw = torch.zeros(blocks * 2 * 16 * 2 * 64, dtype=torch.bfloat16)
    inverse = [stride_order.index(i) for i in range(5)]
    t = raw.view(physical).permute(inverse)
    assert tuple(t.shape) == shape and _page_of(t) == 2 * 16 * 2 * 64 * 2


def test_a_kv_tensor_with_the_blocks_inside_is_refused():
    import torch
    from colomem.engines.vllm.worker.kv_tail import _page_of

    raw = torch.zeros(2 * 10 * 16 * 2 * 64, dtype=torch.bfloat16)
    t = raw.view(2, 10, 16, 2, 64).transpose(0, 1)    # K and V outermost: a block's bytes in two places
    with pytest.raises(NotAvailableError, match="block outermost"):
        _page_of(t)


def test_the_worker_finds_one_tensor_per_layer_and_refuses_other_caches():
    import types

    import torch
    from colomem.engines.vllm.worker.kv_tail import _layer_tensors

    a, b = torch.zeros(64), torch.zeros(64)
    def worker(caches, groups=1, dtype="auto"):
        cfg = types.SimpleNamespace(kv_cache_groups=[object()] * groups)
        runner = types.SimpleNamespace(kv_caches=caches, kv_cache_config=cfg,
                                       cache_config=types.SimpleNamespace(cache_dtype=dtype))
        return types.SimpleNamespace(model_runner=runner)
    got = _layer_tensors(worker([b, a, b]))           # a layer sharing another's cache counts once
    assert [t.data_ptr() for t in got] == sorted({a.data_ptr(), b.data_ptr()})
    with pytest.raises(NotAvailableError, match="attention groups"):
        _layer_tensors(worker([a], groups=2))
    with pytest.raises(NotAvailableError, match="quantized"):
        _layer_tensors(worker([a], dtype="fp8"))
    with pytest.raises(NotAvailableError, match="no KV tensors"):
        _layer_tensors(worker([]))


def test_the_geometry_of_the_bigkv_job_lends_its_release_in_whole_chunks():
    """The 1.5B job beside a 112.5 GiB cache (28 layers, pages of 16 KiB, 2 MiB granularity): the 44.2 GiB
    asked is lent in whole 64 MiB chunks (at most one row of them more), and the head keeps most blocks."""
    layer = (112 * (1 << 30) + (1 << 29)) // 28
    blocks = layer // (16 << 10)
    g = tail_geometry(16 << 10, blocks, [-(-blocks * (16 << 10) // (2 * MiB)) * 2 * MiB] * 28, 2 * MiB)
    start = g.tail_start(int(44.2 * (1 << 30)))
    assert g.chunk_bytes == 64 * MiB and g.blocks_per_chunk == 4096
    assert 44.2 * (1 << 30) <= g.tail_bytes(start) < 44.2 * (1 << 30) + 28 * 64 * MiB
    assert 0.55 < g.first_block(start) / blocks < 0.65


def test_a_hook_that_fails_leaves_the_rollout_on_the_blocks_it_has(caplog):
    from colomem.engines.vllm import tail_scheduler as ts

    s = ts._with_tail(SchedulerLike)(256)
    s.colomem_tail.hold_from(64)
    s.kv_cache_manager.block_pool.allocate(60)

    def broken():
        raise TimeoutError("the copy out did not end")

    s.colomem_grower = Grower(geo(num_blocks=256, chunk=64 << 10), lambda c: False, lambda: 0.0)
    s.colomem_make_room = broken
    with caplog.at_level("WARNING"):
        assert s.schedule() == 3
    assert "the rollout goes on" in caplog.text and s.colomem_grower.failed == 1 and s.colomem_make_room is None
    del s
