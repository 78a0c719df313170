from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import trio

from distorefs.memory import (
    automatic_collections_paused,
    collect_young,
    full_collections_held,
    gc_statistics,
    rss_bytes,
    run_memory_trim,
)
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


FAULT_PROBE = """
import resource, sys
from distorefs.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
held = [bytearray(1 << 20) for _ in range(4)]  # glibc raises its thresholds at the first large frees
del held
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):  # a request's buffers: three at the heap's top, then all three freed
    buffers = [bytearray(1 << 20) for _ in range(3)]
    del buffers
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", FAULT_PROBE, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_freed_memory_is_kept_for_the_next_allocation() -> None:
    """`keep_freed_memory` (what the daemon calls at start): 1 MiB buffers allocated and
    freed over and over reuse the same pages. glibc's own thresholds give the heap's top
    back whenever more than twice the largest freed chunk lies free there, and every
    allocation after that faults its pages in again: shown here too, so that this test
    fails if the call stops changing anything."""
    pages = 100 * 3 * (1 << 20) // 4096
    assert _faults("default") > pages // 4
    assert _faults("keep") < pages // 100


def test_held_full_collections_nest_and_young_garbage_still_goes() -> None:
    """`full_collections_held` turns Python's automatic collections off for a bulk load,
    nested and across an exception; `collect_young` between chunks still frees cycles."""
    assert gc.isenabled()

    class Cycle:
        other: object = None

    def cycle() -> weakref.ref[Cycle]:
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        return weakref.ref(a)

    with full_collections_held():
        assert not gc.isenabled()
        with pytest.raises(KeyError), full_collections_held():
            raise KeyError("a load that fails")
        assert not gc.isenabled()  # the outer hold is still on
        gone = cycle()
        assert gone() is not None  # no automatic collection
        collect_young()
        assert gone() is None
        full = gc.get_stats()[2]["collections"]
    assert gc.get_stats()[2]["collections"] == full + 1  # the last hold ends with a full collection
    assert gc.isenabled()
    gc.disable()  # (no automatic collection may free it meanwhile)
    try:
        kept = cycle()
        collect_young()  # not held: nothing
        assert kept() is not None
    finally:
        gc.enable()
    gc.collect()
    assert kept() is None


def test_paused_collections_come_back_without_a_full_one_and_nest_with_holds() -> None:
    """A draw of a million items made six full collections of the daemon's objects; it now
    runs with automatic collections paused, which come back with no collection of their
    own, unless a full hold that ends inside the pause leaves its collection to it."""
    assert gc.isenabled()
    full = gc.get_stats()[2]["collections"]
    with automatic_collections_paused():
        assert not gc.isenabled()
        with pytest.raises(KeyError), automatic_collections_paused():
            raise KeyError("a draw that fails")
        assert not gc.isenabled()
        with full_collections_held():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the pause is still on: the hold did not turn them back
    assert gc.isenabled()
    assert gc.get_stats()[2]["collections"] == full  # neither ran one (the pause ended last)
    with full_collections_held():
        with automatic_collections_paused():
            pass
        assert not gc.isenabled()  # the hold is still on
    assert gc.get_stats()[2]["collections"] == full + 1  # the hold ended last: its full collection
    assert gc.isenabled()


def test_gc_statistics_name_frozen_objects_and_collections() -> None:
    status = gc_statistics()["gc"]
    assert isinstance(status, dict)
    assert status["frozen_objects"] == gc.get_freeze_count()
    assert len(status["collections"]) == 3
