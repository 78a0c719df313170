from __future__ import annotations

import random

from distorefs.tiers.dram import SPARE_IDLE_CHECKS, Block, DramCache, capacity_for
from distorefs.types import BlockKey


def test_capacity_doubles_for_small_contents_then_takes_the_whole_block() -> None:
    assert capacity_for(1, 1 << 20) == 4096
    assert capacity_for(5000, 1 << 20) == 8192
    assert capacity_for(64 * 1024, 1 << 20) == 64 * 1024
    assert capacity_for(64 * 1024 + 1, 1 << 20) == 1 << 20


def test_make_room_evicts_clean_blocks_in_lru_order_and_never_dirty_ones() -> None:
    cache = DramCache(budget_bytes=3 * 4096)
    for i in range(3):
        cache.insert(BlockKey(1, i), Block(bytearray(4096), 4096, dirty=(i == 0)))
    cache.get(BlockKey(1, 1))  # 2 is now the least recently used clean block
    assert cache.make_room(4096)
    assert cache.peek(BlockKey(1, 2)) is None
    assert cache.peek(BlockKey(1, 1)) is not None
    assert cache.make_room(2 * 4096)
    assert cache.peek(BlockKey(1, 0)) is not None  # dirty: kept
    assert not cache.make_room(3 * 4096)
    assert cache.used_bytes == cache.dirty_bytes == 4096


def test_accounting_follows_dirty_state_and_buffer_swaps() -> None:
    cache = DramCache(budget_bytes=1 << 20)
    block = Block(bytearray(4096), 10, dirty=False)
    cache.insert(BlockKey(1, 0), block)
    cache.insert(BlockKey(2, 0), Block(bytearray(1024), 10, dirty=False))
    cache.mark_dirty(block)
    cache.replace_buffer(BlockKey(1, 0), block, bytearray(8192))
    assert (cache.used_bytes, cache.dirty_bytes) == (8192 + 1024, 8192)
    assert (cache.owner_bytes(1), cache.owner_bytes(2), cache.owner_bytes(3)) == (8192, 1024, 0)
    cache.mark_clean(block)
    assert cache.dirty_bytes == 0
    cache.remove(BlockKey(1, 0))
    cache.remove(BlockKey(2, 0))
    assert cache.used_bytes == 0
    assert (cache.owner_bytes(1), cache.owner_bytes(2)) == (0, 0)


def test_an_owners_bytes_are_kept_not_walked_and_match_a_walk_through_evictions() -> None:
    """A buffer's `stats` and every metrics scrape ask for an owner's bytes in DRAM: a
    walk of the cache took 0.7 s of the event loop for a million items."""
    cache = DramCache(budget_bytes=300 * 4096)
    rng = random.Random(5)
    for i in range(2000):
        owner = rng.randrange(4)
        key = BlockKey(owner, i)
        if cache.make_room(4096):
            cache.insert(key, Block(bytearray(rng.choice([1024, 4096])), 10, dirty=False))
        if rng.random() < 0.2:
            cache.remove(BlockKey(rng.randrange(4), rng.randrange(i + 1)))
    walked = {o: sum(len(b.buf) for k, b in cache._blocks.items() if k[0] == o) for o in range(4)}  # noqa: SLF001
    assert {o: cache.owner_bytes(o) for o in range(4)} == walked
    assert sum(walked.values()) == cache.used_bytes


def test_make_room_on_a_full_cache_evicts_only_the_oldest_clean_blocks_it_needs() -> None:
    cache = DramCache(budget_bytes=10_000 * 4096)
    for i in range(10_000):
        cache.insert(BlockKey(1, i), Block(bytearray(4096), 4096, dirty=i < 3))
    assert cache.make_room(2 * 4096)
    assert [cache.peek(BlockKey(1, i)) is None for i in range(6)] == [False, False, False, True, True, False]
    assert cache.statistics().evictions == 2
    # the dirty blocks it stepped over are now the most recently used: the next walk
    # starts at the oldest clean block
    assert cache.make_room(3 * 4096)
    assert [cache.peek(BlockKey(1, i)) is None for i in range(3, 7)] == [True, True, True, False]
    assert all(cache.peek(BlockKey(1, i)) is not None for i in range(3))


SPARE = 64 * 1024  # a small block size for these tests


def spare_cache(blocks: int) -> DramCache:
    cache = DramCache(budget_bytes=blocks * SPARE)
    cache.spare_size = SPARE
    return cache


def test_a_removed_block_size_buffer_is_kept_as_a_counted_spare_and_taken_again() -> None:
    cache = spare_cache(4)
    cache.insert(BlockKey(1, 0), Block(bytearray(SPARE), SPARE, dirty=False))
    block = cache.remove(BlockKey(1, 0))
    assert block is not None
    buf = block.buf
    del buf
    cache.recycle(block)
    assert cache.statistics().spare_bytes == SPARE
    assert cache.used_bytes == SPARE  # still within the budget's count
    assert cache.take_spare(4096) is None  # only block-size buffers
    spare = cache.take_spare(SPARE)
    assert spare is not None
    assert len(spare) == SPARE
    assert cache.used_bytes == 0
    assert cache.statistics().reused_buffers == 1


def test_a_buffer_anything_else_holds_is_never_kept() -> None:
    cache = spare_cache(4)
    for i, size in enumerate((SPARE, SPARE, 4096)):
        cache.insert(BlockKey(1, i), Block(bytearray(size), size, dirty=False))
    viewed = cache.remove(BlockKey(1, 0))
    assert viewed is not None
    view = memoryview(viewed.buf)  # a reply still being sent
    cache.recycle(viewed)
    held = cache.remove(BlockKey(1, 1))
    keeper = [held]  # a flush's snapshot of the block
    cache.recycle(held)  # type: ignore[arg-type]
    small = cache.remove(BlockKey(1, 2))
    assert small is not None
    cache.recycle(small)
    assert cache.statistics().spare_bytes == 0
    assert cache.used_bytes == 0
    assert view[0] == 0
    assert keeper


def test_make_room_lets_only_the_spares_it_needs_go() -> None:
    cache = spare_cache(4)
    for i in range(3):
        cache.insert(BlockKey(1, i), Block(bytearray(SPARE), SPARE, dirty=False))
    for i in range(3):
        block = cache.remove(BlockKey(1, i))
        assert block is not None
        cache.recycle(block)
    assert cache.statistics().spare_bytes == 3 * SPARE
    assert cache.make_room(2 * SPARE)  # one free block-size place and one spare
    assert cache.statistics().spare_bytes == 2 * SPARE
    assert cache.used_bytes == 2 * SPARE


def test_a_new_buffer_on_a_full_cache_reuses_an_evicted_blocks() -> None:
    cache = spare_cache(4)
    for i in range(4):
        cache.insert(BlockKey(1, i), Block(bytearray(SPARE), SPARE, dirty=i == 0))
    assert cache.room_for_buffer(SPARE, SPARE)
    assert cache.peek(BlockKey(1, 1)) is None  # the oldest clean one went ...
    assert cache.peek(BlockKey(1, 2)) is not None  # ... and only it
    spare = cache.take_spare(SPARE)
    assert spare is not None
    cache.insert(BlockKey(2, 0), Block(spare, 0, dirty=False))
    assert cache.used_bytes == 4 * SPARE
    assert cache.statistics().evictions == 1


def test_idle_spares_are_shed_by_halves() -> None:
    cache = spare_cache(8)
    for i in range(8):
        cache.insert(BlockKey(1, i), Block(bytearray(SPARE), SPARE, dirty=False))
        block = cache.remove(BlockKey(1, i))
        assert block is not None
        cache.recycle(block)
    idle = [0] * (SPARE_IDLE_CHECKS - 1)
    shed = [cache.shed_spares() for _ in range(SPARE_IDLE_CHECKS + 1)]
    assert shed == [*idle, 4 * SPARE, 2 * SPARE]
    assert cache.take_spare(SPARE) is not None  # used again: the count starts over
    assert [cache.shed_spares() for _ in range(SPARE_IDLE_CHECKS)] == [*idle, SPARE]
    assert cache.used_bytes == 0
