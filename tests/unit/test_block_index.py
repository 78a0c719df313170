"""BlockIndex invariants: after any sequence of sets and deletes, the per-segment live
bytes and the per-owner numbers and lengths agree with the plain map, and the staged rows
reload into the same index."""

from __future__ import annotations

import gc
import tempfile

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from distorefs.tiers.block_index import BlockIndex, record_bytes
from distorefs.tiers.metadb import MetaDb
from distorefs.types import BlockKey, LogLocation

keys = st.builds(BlockKey, st.integers(0, 3), st.integers(0, 5))
locations = st.builds(LogLocation, st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 4096))
steps = st.lists(st.one_of(st.tuples(st.just("set"), keys, locations), st.tuples(st.just("delete"), keys, st.none())))


def check(index: BlockIndex, model: dict[BlockKey, LogLocation]) -> None:
    assert dict((key, index[key]) for key in index) == model
    assert len(index) == len(model)
    for segment in range(4):
        in_segment = {k: loc for k, loc in model.items() if loc.segment == segment}
        assert index.live_bytes(segment) == sum(record_bytes(loc) for loc in in_segment.values())
    assert index.owners() == {k.owner for k in model}
    for owner in range(4):
        assert index.numbers(owner) == {k.number for k in model if k.owner == owner}
        assert index.lengths(owner) == {k.number: loc.length for k, loc in model.items() if k.owner == owner}
    assert index.live_total() == sum(record_bytes(loc) for loc in model.values())


@settings(max_examples=150, deadline=None)
@given(steps)
def test_views_follow_the_map_and_rows_reload_the_same_index(script: list[tuple[str, BlockKey, LogLocation]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        meta = MetaDb.open(tmp + "/meta.sqlite")
        index = BlockIndex(meta)
        model: dict[BlockKey, LogLocation] = {}
        for op, key, location in script:
            if op == "set":
                assert index.set(key, location) == model.get(key)
                model[key] = location
            else:
                assert index.delete(key) == model.pop(key, None)
            check(index, model)
        trio.run(meta.commit)
        check(BlockIndex.load(meta), model)
        meta.close()


def test_a_segment_is_forgotten_only_once_it_holds_nothing_live() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        meta = MetaDb.open(tmp + "/meta.sqlite")
        index = BlockIndex(meta)
        index.set(BlockKey(1, 0), LogLocation(7, 0, 100))
        index.set(BlockKey(1, 0), LogLocation(8, 0, 100))  # moved on: segment 7 is dead
        assert index.live_bytes(7) == 0
        index.forget_segment(7)
        assert index.live_bytes(8) == record_bytes(LogLocation(8, 0, 100))
        meta.close()


def test_entries_are_not_tracked_by_the_garbage_collector_and_come_out_typed() -> None:
    """A full collection visits every tracked object while the daemon answers nothing: a
    million items' index entries (a BlockKey and a LogLocation each, NamedTuples, which
    the collector tracks for good) made it 0.2 s. Entries loaded and set are plain
    tuples, which it stops tracking once seen; what the index hands out is typed."""
    count = 20_000
    with tempfile.TemporaryDirectory() as tmp:
        meta = MetaDb.open(tmp + "/meta.sqlite")
        seed = BlockIndex(meta)
        for number in range(count // 2):
            seed.set(BlockKey(1, number), LogLocation(3, number * 4096, 4096))
        trio.run(meta.commit)
        del seed
        gc.collect()
        before = len(gc.get_objects())
        index = BlockIndex.load(meta)  # half loaded from rows ...
        for number in range(count // 2, count):  # ... half set while running
            index.set(BlockKey(2, number), LogLocation(4, number * 4096, 4096))
        gc.collect()
        assert len(gc.get_objects()) - before < 100, "the index's entries are tracked by the garbage collector"
        assert len(index) == count
        key = next(iter(index))
        assert type(key) is BlockKey
        assert key == BlockKey(1, 0)
        assert type(index[key]) is LogLocation
        assert index[key] == LogLocation(3, 0, 4096)
        assert type(index.get(BlockKey(2, count - 1))) is LogLocation
        assert index.get(BlockKey(2, count)) is None
        assert type(index.delete(key)) is LogLocation
        assert key not in index
        meta.close()
