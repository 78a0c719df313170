from __future__ import annotations

from distorefs.tiers.dram import Block, DramCache, capacity_for
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
    cache.mark_dirty(block)
    cache.replace_buffer(block, bytearray(8192))
    assert (cache.used_bytes, cache.dirty_bytes) == (8192, 8192)
    cache.mark_clean(block)
    assert cache.dirty_bytes == 0
    cache.remove(BlockKey(1, 0))
    assert cache.used_bytes == 0


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
