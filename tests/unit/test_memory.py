from __future__ import annotations

import trio

from distorefs.memory import rss_bytes, run_memory_trim
from distorefs.tiers.dram import Block, DramCache
from distorefs.types import BlockKey

SPARE = 1 << 20


async def test_the_memory_trim_sheds_idle_spares_and_gives_their_memory_back() -> None:
    """The daemon's trim task (memory.py) asks the DRAM cache to shed idle spares at each
    pass, then returns what malloc holds beyond what the cache accounts for."""
    cache = DramCache(budget_bytes=64 * SPARE)
    cache.spare_size = SPARE
    for i in range(64):
        cache.insert(BlockKey(1, i), Block(bytearray(SPARE), SPARE, dirty=False))
        block = cache.remove(BlockKey(1, i))
        assert block is not None
        cache.recycle(block)
    assert cache.statistics().spare_bytes == 64 * SPARE
    held = rss_bytes()
    with trio.move_on_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_memory_trim, lambda: cache.used_bytes, cache.shed_spares, 0.001)
            while cache.statistics().spare_bytes:
                await trio.sleep(0.01)
            await trio.sleep(0.05)  # a pass after the last spare went
            nursery.cancel_scope.cancel()
    assert cache.statistics().spare_bytes == 0
    assert cache.used_bytes == 0
    assert rss_bytes() < held - 32 * SPARE  # the 64 MiB went back to the system
