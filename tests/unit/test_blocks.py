"""The block tier without a mount: write-back, eviction under the budget, reload, compaction."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

import crc32c
import numpy as np
import pytest
import trio

from distorefs.errors import DistorefsError, OutOfMemory, StoreFull
from distorefs.tiers import blocks as blocks_module
from distorefs.tiers import copy_ranges, nvme_log, writeback
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.dram import DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import NvmeLog
from distorefs.types import BlockKey, LogLocation

CRC32C = crc32c.crc32c  # taken before a test hides it

BLOCK = 64 * 1024


def open_store(tmp_path: Path, budget: int = 8 * BLOCK, segment: int = 4 * BLOCK) -> BlockStore:
    log = NvmeLog.open(str(tmp_path / "log"), segment_bytes=segment)
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    return BlockStore(log, DramCache(budget), meta, block_bytes=BLOCK)


async def read_all(store: BlockStore, key: BlockKey) -> bytes:
    block = await store.get(key)
    assert block is not None
    return bytes(block.buf[: block.length])


async def test_write_stays_dirty_until_flush_then_survives_reopen(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    await store.write(BlockKey(5, 0), 10, b"abc")
    assert store.dirty_bytes > 0
    assert await read_all(store, BlockKey(5, 0)) == bytes(10) + b"abc"
    await store.close()
    store = open_store(tmp_path)
    assert await read_all(store, BlockKey(5, 0)) == bytes(10) + b"abc"
    await store.close()


async def test_working_set_three_times_the_budget_stays_under_it_and_reads_back(tmp_path: Path) -> None:
    budget = 8 * BLOCK
    store = open_store(tmp_path, budget=budget)
    count = 24
    for i in range(count):
        await store.write(BlockKey(1, i), 0, bytes([i]) * BLOCK)
        assert store.statistics().dram_used_bytes <= budget
    for i in reversed(range(count)):
        assert await read_all(store, BlockKey(1, i)) == bytes([i]) * BLOCK
        assert store.statistics().dram_used_bytes <= budget
    assert store.statistics().dram_evictions > 0
    await store.close()


async def test_truncate_and_delete_drop_data(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    await store.write(BlockKey(1, 0), 0, b"0123456789")
    await store.flush()
    await store.truncate(BlockKey(1, 0), 4)
    assert await read_all(store, BlockKey(1, 0)) == b"0123"
    store.delete(BlockKey(1, 0))
    assert await store.get(BlockKey(1, 0)) is None
    assert store.owner_keys(1) == []
    await store.close()


async def test_compaction_moves_live_records_and_frees_dead_segments(tmp_path: Path) -> None:
    store = open_store(tmp_path, segment=4 * BLOCK)
    for i in range(16):
        await store.write(BlockKey(1, i), 0, bytes([i]) * BLOCK)
    await store.flush()
    for i in range(16):
        if i % 4:
            store.delete(BlockKey(1, i))
    before = store.statistics().log_bytes
    await store.compact(min_dead_ratio=0.5)  # drops fully dead segments only
    first = store.statistics()
    assert first.moved_bytes == 0  # sparse segments that just changed wait a pass
    reclaimed = await store.compact(min_dead_ratio=0.5)  # now they are stable: compacted
    after = store.statistics()
    assert reclaimed > 0
    assert after.moved_bytes > 0
    assert after.log_bytes < first.log_bytes <= before
    assert after.log_live_ratio > 0.5
    await store.close()
    store = open_store(tmp_path, segment=4 * BLOCK)
    for i in range(0, 16, 4):
        assert await read_all(store, BlockKey(1, i)) == bytes([i]) * BLOCK
    files = os.listdir(tmp_path / "log")
    assert len(files) < 5
    await store.close()


async def test_write_past_the_block_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="past the block size"):
        await store.write(BlockKey(1, 0), BLOCK - 1, b"ab")
    await store.close()


async def test_prefetcher_loads_queued_blocks_into_dram(tmp_path: Path) -> None:
    import trio

    store = open_store(tmp_path, budget=16 * BLOCK)
    for i in range(6):
        await store.write(BlockKey(3, i), 0, bytes([i]) * BLOCK)
    await store.close()
    store = open_store(tmp_path, budget=16 * BLOCK)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.run_prefetcher)
        store.prefetch(BlockKey(3, i) for i in range(1, 6))
        store.prefetch([BlockKey(3, 99)])  # a hole: skipped
        with trio.fail_after(10):
            while store.statistics().prefetched_blocks < 5:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    stats = store.statistics()
    assert stats.dram_blocks == 5
    misses = stats.dram_misses
    assert await read_all(store, BlockKey(3, 4)) == bytes([4]) * BLOCK
    assert store.statistics().dram_misses == misses  # served from DRAM
    await store.close()


async def test_get_many_reads_cold_blocks_in_one_go_and_handles_duplicates(tmp_path: Path) -> None:
    store = open_store(tmp_path, budget=16 * BLOCK)
    for i in range(4):
        await store.write(BlockKey(9, i), 0, bytes([i]) * 100)
    await store.close()
    store = open_store(tmp_path, budget=16 * BLOCK)
    keys = [BlockKey(9, 2), BlockKey(9, 0), BlockKey(9, 2), BlockKey(9, 7)]
    blocks = await store.get_many(keys)
    assert blocks[3] is None  # a hole
    assert [bytes(b.buf[: b.length]) for b in blocks[:3] if b is not None] == [
        b"\x02" * 100,
        b"\x00" * 100,
        b"\x02" * 100,
    ]
    assert blocks[0] is blocks[2]
    assert store.statistics().dram_blocks == 2
    await store.close()


async def test_lags_say_how_long_the_oldest_write_waits_for_the_log_and_for_fsync(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert store.lags() == {"flush_lag_s": 0.0, "durable_lag_s": 0.0}
    await store.write(BlockKey(5, 0), 0, b"abc")
    await trio.sleep(0.05)
    assert store.lags()["flush_lag_s"] >= 0.05
    await store.flush()
    lags = store.lags()
    assert lags["flush_lag_s"] == 0.0  # in the log now ...
    await trio.sleep(0.05)
    assert store.lags()["durable_lag_s"] >= 0.05  # ... but not fsync'ed
    await store.commit(durable=True)
    assert store.lags() == {"flush_lag_s": 0.0, "durable_lag_s": 0.0}
    await store.persist(7, durable=False)
    await store.write(BlockKey(7, 0), 0, b"x")
    await store.persist(7, durable=True)
    assert store.lags() == {"flush_lag_s": 0.0, "durable_lag_s": 0.0}
    await store.close()


async def test_recovery_reports_every_metadata_row_it_reads(tmp_path: Path) -> None:
    store = open_store(tmp_path, budget=64 * BLOCK, segment=64 * BLOCK)
    for i in range(20):
        await store.write(BlockKey(9, i), 0, b"r" * 100)
    await store.close()
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    told: list[int] = []
    meta.progress = told.append
    rows = list(meta.rows("blocks"))
    assert len(rows) == 20
    assert sum(told) == 20
    assert meta.count_rows() >= 20
    meta.close()


async def test_adopted_memory_is_borrowed_until_changed_then_copied_and_released_once_logged(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    source = bytearray(os.urandom(2 * BLOCK + 100))
    view = memoryview(bytes(source))  # read-only, as a sealed memfd's mapping is
    await store.adopt(7, view)
    stats = store.statistics()
    assert stats.dram_borrowed_bytes == len(view)
    assert stats.dram_dirty_bytes == len(view)
    assert [await read_all(store, BlockKey(7, i)) for i in range(3)] == [
        bytes(source[:BLOCK]),
        bytes(source[BLOCK : 2 * BLOCK]),
        bytes(source[2 * BLOCK :]),
    ]
    with pytest.raises(ValueError):
        await store.adopt(7, view)  # only onto an owner without blocks
    await store.write(BlockKey(7, 1), 5, b"changed")  # copy on write: the borrowed memory stays as it was
    assert bytes(view[BLOCK + 5 : BLOCK + 12]) == bytes(source[BLOCK + 5 : BLOCK + 12])
    assert store.statistics().dram_borrowed_bytes == len(view) - BLOCK
    await store.flush()
    await store.commit(durable=True)
    assert sorted(b.length for b in store.drop_borrowed(7)) == [100, BLOCK]  # block 1 is a copy of its own now
    assert store.statistics().dram_borrowed_bytes == 0
    await store.close()

    store = open_store(tmp_path)  # from the log
    expected = bytearray(source)
    expected[BLOCK + 5 : BLOCK + 12] = b"changed"
    assert b"".join([await read_all(store, BlockKey(7, i)) for i in range(3)]) == bytes(expected)
    await store.close()


async def test_adopting_more_than_the_budget_is_refused_without_change(tmp_path: Path) -> None:
    store = open_store(tmp_path, budget=8 * BLOCK)
    await store.write(BlockKey(1, 0), 0, b"kept")
    with pytest.raises(OutOfMemory):
        await store.adopt(2, memoryview(bytes(9 * BLOCK)))
    assert store.owner_keys(2) == []
    assert store.statistics().dram_borrowed_bytes == 0
    assert await read_all(store, BlockKey(1, 0)) == b"kept"
    await store.close()


async def test_a_big_get_many_is_read_in_pieces_by_several_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks_module, "READ_PIECE_BYTES", 2 * BLOCK)  # 40 blocks: 20 pieces
    store = open_store(tmp_path, budget=64 * BLOCK)
    for i in range(40):
        await store.write(BlockKey(3, i), 0, bytes([i]) * BLOCK)
    await store.close()
    store = open_store(tmp_path, budget=64 * BLOCK)
    keys = [BlockKey(3, i) for i in (39, *range(39), 5)]  # out of order, one twice
    got = await store.get_many(keys)
    assert [bytes(b.buf[: b.length]) if b is not None else None for b in got] == [
        bytes([k.number]) * BLOCK for k in keys
    ]
    assert store.statistics().dram_blocks == 40
    await store.close()


async def test_a_whole_block_write_keeps_the_requests_bytes_and_a_later_change_copies_them(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    data = os.urandom(BLOCK)
    await store.write_range(4, 0, data)  # a whole block at its start: kept as it came
    block = await store.get(BlockKey(4, 0))
    assert block is not None
    assert block.buf is data
    await store.write_range(4, BLOCK + 10, b"tail")  # not whole: written into a block of its own
    await store.write_range(4, 3, b"xyz")  # a change: into a copy (bytes cannot change)
    block = await store.get(BlockKey(4, 0))
    assert block is not None
    assert block.buf is not data
    assert await read_all(store, BlockKey(4, 0)) == data[:3] + b"xyz" + data[6:]
    await store.close()

    store = open_store(tmp_path)  # the log has both blocks
    misses = store.statistics().dram_misses
    again = os.urandom(BLOCK)
    await store.write_range(4, BLOCK, again)  # a whole overwrite of a block only in the log: not read first
    assert store.statistics().dram_misses == misses
    assert await read_all(store, BlockKey(4, 1)) == again
    assert await read_all(store, BlockKey(4, 0)) == data[:3] + b"xyz" + data[6:]
    await store.close()


async def test_notes_after_the_committed_mark_come_back_in_order_and_are_kept_from_compaction(tmp_path: Path) -> None:
    store = open_store(tmp_path, segment=4 * BLOCK)
    await store.commit()  # the first commit sets the notes mark: nothing to replay before it
    await store.append_note(7, b"before")
    store.stage_notes_mark(store.log_position())  # a snapshot took "before" in
    await store.commit()
    await store.append_note(7, b"one")
    await store.append_note(8, b"other owner")
    for i in range(12):  # seal the notes' segment among dead blocks
        await store.write(BlockKey(1, i), 0, bytes([i]) * BLOCK)
    await store.flush()
    for i in range(12):
        store.delete(BlockKey(1, i))
    await store.append_note(7, b"two")
    await store.compact(min_dead_ratio=0.5)
    held = store.notes_hold()
    assert held == 1  # the notes' first segment and every later one stay ...
    assert 1 in store._log.segment_sizes()
    killed(store)

    store = open_store(tmp_path, segment=4 * BLOCK)
    await store.read_tail()
    assert store.take_notes(7) == [b"one", b"two"]  # ... and a start-up replays them, in order
    assert store.take_notes(8) == [b"other owner"]
    assert store.take_notes(9) == []
    store.forget_tail()
    assert store.notes_hold() == 1  # held until a snapshot with them commits
    store.stage_notes_mark(store.log_position())
    await store.commit()
    assert store.notes_hold() is None
    await store.compact(min_dead_ratio=0.5)
    assert 1 not in store._log.segment_sizes()  # then the dead segment goes
    await store.close()
    store = open_store(tmp_path, segment=4 * BLOCK)
    await store.read_tail()
    assert store.take_notes(7) == []
    await store.close()


def killed(store: BlockStore) -> None:
    """What a kill -9 leaves: no flush, no commit, no close of anything."""
    store._log.close()
    store._meta._conn.close()


def inline(store: BlockStore) -> BlockStore:
    """Small persists may write on the event loop (the kernel's dirty page count, which
    decides this in the daemon, is not what these tests are about)."""
    store._inline_ok = True
    return store


async def test_a_small_persist_is_acknowledged_by_a_row_note_and_comes_back_after_a_kill(tmp_path: Path) -> None:
    store = inline(open_store(tmp_path))
    await store.commit()
    commits = store._meta.commits
    store._meta.put("kv", ("name",), ("one",))  # a store's row staged before the persist
    await store.write(BlockKey(5, 0), 0, b"closed data")
    await store.persist(5)
    assert store.row_notes == 1
    assert store._meta.commits == commits
    await store.write(BlockKey(6, 0), 0, b"never closed")  # dirty in DRAM only: lost below
    killed(store)

    store = open_store(tmp_path)
    await store.read_tail()
    assert await read_all(store, BlockKey(5, 0)) == b"closed data"
    assert not store.has_block(BlockKey(6, 0))
    assert store._meta.get_kv("name") == "one"
    killed(store)
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))  # the start-up committed what it replayed
    assert ("name", "one") in list(meta.rows("kv"))
    assert (5, 0) in [row[:2] for row in meta.rows("blocks")]


async def test_a_small_persist_writes_its_blocks_and_its_note_in_one_write_and_leaves_nothing_staged_to_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = inline(open_store(tmp_path))
    await store.commit()
    writes = []
    real = os.pwritev
    monkeypatch.setattr(nvme_log.os, "pwritev", lambda fd, bufs, off: writes.append(len(bufs)) or real(fd, bufs, off))
    await store.write(BlockKey(5, 0), 0, b"closed data")
    await store.persist(5)
    assert store.row_notes == 1
    assert writes == [4]  # a header and a payload for the block, and for its note
    assert not any(store._meta.take_delta()[1].values())  # the block's row went with the note
    assert store._meta.pending_changes  # and waits for the flusher's commit
    killed(store)

    store = open_store(tmp_path)
    await store.read_tail()
    assert await read_all(store, BlockKey(5, 0)) == b"closed data"
    await store.close()


async def test_a_note_too_big_to_go_with_the_blocks_leaves_them_logged_for_a_commit(tmp_path: Path) -> None:
    store = inline(open_store(tmp_path))
    await store.commit()
    commits = store._meta.commits
    store._meta.put("kv", ("big",), ("v" * (writeback.ROW_NOTE_BYTES + 1),))
    await store.write(BlockKey(5, 0), 0, b"closed data")
    await store.persist(5)
    assert store.row_notes == 0
    assert store._meta.commits == commits + 1
    killed(store)

    store = open_store(tmp_path)
    await store.read_tail()
    assert await read_all(store, BlockKey(5, 0)) == b"closed data"
    assert len(store._meta.get_kv("big")) == writeback.ROW_NOTE_BYTES + 1
    await store.close()


async def test_put_logged_items_are_clean_at_once_and_come_back_from_the_tail_after_a_kill(tmp_path: Path) -> None:
    store = inline(open_store(tmp_path))
    await store.commit()
    keys = [BlockKey(9, i) for i in range(3)]
    assert store.put_logged(keys, [b"item %d" % i for i in range(3)])
    assert store.dirty_bytes == 0  # written with their put: nothing left for a persist
    assert [await read_all(store, key) for key in keys] == [b"item 0", b"item 1", b"item 2"]
    assert all(store.has_block(key) for key in keys)
    killed(store)  # no commit carried their rows: the log's tail has them

    store = open_store(tmp_path)
    await store.read_tail()
    assert store.adopt_tail(9, lambda number: True) == 3
    assert [await read_all(store, key) for key in keys] == [b"item 0", b"item 1", b"item 2"]
    await store.close()


async def test_put_logged_does_nothing_where_the_inline_path_is_closed(tmp_path: Path) -> None:
    store = open_store(tmp_path)  # the dirty page watch has not looked yet: not inline
    key = BlockKey(9, 0)
    assert not store.put_logged([key], [b"x"])
    inline(store)
    async with store._flush_lock:  # a flush in flight
        assert not store.put_logged([key], [b"x"])
    assert not store.put_logged([key], [b"x" * (writeback.INLINE_APPEND_BYTES + 1)])
    assert not store.has_block(key)
    assert store.statistics().log_bytes == 0
    assert store.put_logged([key], [b"x"])
    await store.close()


async def held_notes_mark(store: BlockStore) -> None:
    """A replay buffer's priority note that no snapshot covered keeps the notes mark, and
    so the start of a start-up's walk, before everything below: the walk then meets row
    notes older than the last commit, which their tags must tell apart."""
    await store.commit()
    await store.append_note(7, b"a priority update")


async def test_row_notes_older_than_the_last_commit_are_not_replayed_over_it(tmp_path: Path) -> None:
    store = inline(open_store(tmp_path))
    await held_notes_mark(store)
    store._meta.put("kv", ("size",), (10,))
    await store.write(BlockKey(5, 0), 0, b"first")
    await store.write(BlockKey(6, 0), 0, b"gone later")
    await store.persist(5)
    await store.persist(6)
    assert store.row_notes == 2
    store._meta.put("kv", ("size",), (20,))
    store.delete(BlockKey(6, 0))
    await store.commit()  # newer than both notes
    killed(store)

    store = open_store(tmp_path)
    await store.read_tail()
    assert store._meta.get_kv("size") == 20
    assert not store.has_block(BlockKey(6, 0))
    assert await read_all(store, BlockKey(5, 0)) == b"first"
    await store.close()


async def test_what_a_failed_commit_took_is_carried_by_the_next_row_note(tmp_path: Path) -> None:
    store = inline(open_store(tmp_path))
    await store.commit()
    store._meta.put("kv", ("taken",), ("by the failed commit",))

    def fail() -> None:
        raise StoreFull("disk full")

    with pytest.raises(StoreFull):
        await store._meta.commit(before_commit=fail)
    store._meta.put("kv", ("later",), ("staged after it",))
    await store.write(BlockKey(5, 0), 0, b"closed")
    await store.persist(5)
    assert store.row_notes == 1
    killed(store)

    store = open_store(tmp_path)
    await store.read_tail()
    assert store._meta.get_kv("taken") == "by the failed commit"
    assert store._meta.get_kv("later") == "staged after it"
    assert await read_all(store, BlockKey(5, 0)) == b"closed"
    await store.close()


async def test_a_persist_with_too_much_staged_commits_instead_of_noting(tmp_path: Path) -> None:
    store = inline(open_store(tmp_path))
    for i in range(writeback.ROW_NOTE_CHANGES + 1):
        store._meta.put("kv", (f"k{i}",), (i,))
    await store.write(BlockKey(5, 0), 0, b"x")
    commits = store._meta.commits
    await store.persist(5)
    assert store.row_notes == 0
    assert store._meta.commits == commits + 1
    await store.write(BlockKey(5, 0), 0, b"y")
    await store.persist(5)  # the commit took everything: small again
    assert store.row_notes == 1
    assert store._meta.commits == commits + 1
    await store.close()


async def test_a_start_up_numbers_its_commits_past_the_notes_it_replayed(tmp_path: Path) -> None:
    """Notes tagged after a failed commit are replayed once: the start-up's own commit
    must count past them, or the next start-up would take them as newer than it."""
    store = inline(open_store(tmp_path))
    await held_notes_mark(store)

    def fail() -> None:
        raise StoreFull("disk full")

    store._meta.put("kv", ("v",), (1,))
    for _ in range(3):  # three failed takes: the notes below carry a tag past the committed one
        with pytest.raises(StoreFull):
            await store._meta.commit(before_commit=fail)
    await store.write(BlockKey(5, 0), 0, b"a")
    await store.persist(5)
    killed(store)

    store = inline(open_store(tmp_path))
    await store.read_tail()
    assert store._meta.get_kv("v") == 1
    store._meta.put("kv", ("v",), (2,))
    await store.commit()
    killed(store)
    store = open_store(tmp_path)
    await store.read_tail()
    assert store._meta.get_kv("v") == 2  # the old note did not come back over the commit
    await store.close()


async def cold_file(tmp_path: Path, blocks: int, budget: int) -> BlockStore:
    """A store reopened over `blocks` full blocks of owner 3 (block i filled with byte i)."""
    store = open_store(tmp_path, budget=budget, segment=64 * BLOCK)
    for i in range(blocks):
        await store.write(BlockKey(3, i), 0, bytes([i]) * BLOCK)
    await store.close()
    return open_store(tmp_path, budget=budget, segment=64 * BLOCK)


async def test_a_one_pass_reader_keeps_a_window_in_dram_and_loads_into_reused_buffers(tmp_path: Path) -> None:
    store = await cold_file(tmp_path, blocks=40, budget=16 * BLOCK)
    length = 40 * BLOCK
    for i in range(40):
        data = await store.read_range(3, i * BLOCK, BLOCK, length)
        assert bytes(data) == bytes([i]) * BLOCK
        del data  # (as the kernel's reply does: nothing keeps it)
        stats = store.statistics()
        assert stats.dram_transient_bytes <= 8 * BLOCK  # half the budget at most
        assert stats.dram_used_bytes <= 16 * BLOCK
    assert store.statistics().dram_reused_buffers >= 40 - 8 - 2  # all but the first window's loads
    assert store._dram.peek(BlockKey(3, 5)) is None  # read once, long ago: gone from DRAM
    await store.close()


async def test_a_block_read_a_second_time_stays_in_dram(tmp_path: Path) -> None:
    store = await cold_file(tmp_path, blocks=30, budget=16 * BLOCK)
    length = 30 * BLOCK
    for i in range(30):
        await store.read_range(3, i * BLOCK, BLOCK, length)
        if i == 3:
            assert await read_all(store, BlockKey(3, 2)) == bytes([2]) * BLOCK  # a second reader
    assert store._dram.peek(BlockKey(3, 2)) is not None
    assert store._dram.peek(BlockKey(3, 4)) is None
    await store.close()


async def test_a_buffer_still_viewed_is_never_reused(tmp_path: Path) -> None:
    store = await cold_file(tmp_path, blocks=40, budget=16 * BLOCK)
    length = 40 * BLOCK
    held = []
    for i in range(40):
        data = await store.read_range(3, i * BLOCK, BLOCK, length)
        if i % 5 == 1:
            held.append((i, data))  # a caller that keeps its view across later reads
    for i, data in held:
        assert bytes(data) == bytes([i]) * BLOCK
    assert store.statistics().dram_reused_buffers > 0
    await store.close()


async def test_a_deleted_files_buffers_hold_the_next_files_blocks_and_never_show_its_bytes(tmp_path: Path) -> None:
    """A new block made in a reused buffer (a spare) reads as what was written to it and
    zeros elsewhere, never as the bytes of the file the buffer held before."""
    store = open_store(tmp_path, budget=16 * BLOCK, segment=64 * BLOCK)
    for i in range(6):
        await store.write(BlockKey(3, i), 0, b"\xaa" * BLOCK)
    await store.persist(3)
    store.delete_owner(3)
    assert store.statistics().dram_spare_bytes == 6 * BLOCK
    at = BLOCK - 5000  # a short write far enough in for a block-size buffer
    for i in range(6):
        await store.write(BlockKey(4, i), at, b"new")
    stats = store.statistics()
    assert stats.dram_reused_buffers == 6
    assert stats.dram_spare_bytes == 0
    content = bytes(await store.read_range(4, 0, 6 * BLOCK, 6 * BLOCK))  # past each block's end: a hole
    expected = (bytes(at) + b"new" + bytes(BLOCK - at - 3)) * 6
    assert content == expected
    await store.persist(4)
    await store.close()
    store = open_store(tmp_path, budget=16 * BLOCK, segment=64 * BLOCK)  # and so the log has them
    assert bytes(await store.read_range(4, 0, 6 * BLOCK, 6 * BLOCK)) == expected
    await store.close()


async def test_new_blocks_on_a_full_cache_reuse_the_evicted_ones_buffers(tmp_path: Path) -> None:
    store = open_store(tmp_path, budget=8 * BLOCK, segment=64 * BLOCK)
    for i in range(8):
        await store.write(BlockKey(3, i), 0, bytes([i]) * BLOCK)
    await store.persist(3)  # clean: evictable
    for i in range(6):
        await store.write(BlockKey(4, i), 0, bytes([100 + i]) * BLOCK)
        assert store.statistics().dram_used_bytes <= 8 * BLOCK
    assert store.statistics().dram_reused_buffers == 6
    for i in range(6):
        assert await read_all(store, BlockKey(4, i)) == bytes([100 + i]) * BLOCK
    for i in range(8):  # the evicted ones come back from the log
        assert await read_all(store, BlockKey(3, i)) == bytes([i]) * BLOCK
    await store.close()


async def random_file(tmp_path: Path, blocks: int) -> tuple[BlockStore, bytes]:
    """A store reopened over `blocks` blocks of random bytes of owner 3, nothing in DRAM."""
    content = np.random.default_rng(5).integers(0, 256, blocks * BLOCK, dtype=np.uint8).tobytes()
    store = open_store(tmp_path, budget=4 * blocks * BLOCK, segment=64 * BLOCK)
    await store.write_range(3, 0, content)
    await store.close()
    return open_store(tmp_path, budget=4 * blocks * BLOCK, segment=64 * BLOCK), content


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
async def test_gather_copies_every_range_and_says_which_were_not_all_from_cached_blocks(
    tmp_path: Path, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled:
        assert copy_ranges.load_compiled(), "numba is a dependency: the compiled copy must load"
    else:
        monkeypatch.setattr(copy_ranges.KERNELS, "module", None)
    store, content = await random_file(tmp_path, blocks=12)
    for number in (0, 1, 2, 5, 6, 7):  # the rest only in the log
        await store.get(BlockKey(3, number))
    rng = np.random.default_rng(1)
    cached = {0, 1, 2, 5, 6, 7}
    # many ranges (some across one or two block boundaries, some empty): dense blocks, read
    # as spans; then few small ones: each read on its own
    for count, longest in ((400, 3 * BLOCK // 2), (20, 2000)):
        before = store.statistics()
        lengths = rng.integers(0, longest, count)
        starts = rng.integers(0, len(content) - lengths)
        out_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        out = bytearray(int(lengths.sum()))
        unchecked = await store.gather(3, starts, lengths, out, out_starts)
        expected = b"".join(content[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist(), strict=True))
        assert out == expected
        for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            touched = set(range(s // BLOCK, (s + n - 1) // BLOCK + 1)) if n else set()
            assert bool(unchecked[i]) == (not touched or not touched <= cached), (s, n)
        after = store.statistics()
        if count == 400:
            assert after.gathered_log_spans > before.gathered_log_spans
        else:
            assert after.gathered_log_parts > before.gathered_log_parts
            assert after.gathered_log_spans == before.gathered_log_spans
    await store.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
async def test_gather_reads_a_block_whole_only_where_its_ranges_fill_half_of_where_they_lie(
    tmp_path: Path, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many small ranges scattered over a block (a shuffle's small records: each batch
    wants a few of every block) are read one by one; as many packed together, or few
    that fill half the block, are read as one span and copied out of it."""
    if compiled:
        assert copy_ranges.load_compiled()
    else:
        monkeypatch.setattr(copy_ranges.KERNELS, "module", None)
    store, content = await random_file(tmp_path, blocks=4)
    scattered = BLOCK + np.arange(64, dtype=np.int64) * (BLOCK // 64)  # 64 x 100 bytes over block 1
    packed = 2 * BLOCK + 5000 + np.arange(64, dtype=np.int64) * 100  # 64 x 100 bytes back to back in block 2
    halves = np.array([3 * BLOCK, 3 * BLOCK + BLOCK // 2 + 10], dtype=np.int64)  # two ranges, most of block 3
    cases = ((scattered, 100, 64, 0), (packed, 100, 0, 1), (halves, BLOCK // 2 - 10, 0, 1))
    for starts, length, parts, spans in cases:
        lengths = np.full(len(starts), length, dtype=np.int64)
        out_starts = np.arange(len(starts), dtype=np.int64)[::-1] * length  # any order in the output
        out = bytearray(int(lengths.sum()))
        before = store.statistics()
        unchecked = await store.gather(3, starts, lengths, out, out_starts)
        for s, to in zip(starts.tolist(), out_starts.tolist(), strict=True):
            assert out[to : to + length] == content[s : s + length]
        assert unchecked.all()  # from the log: the caller checks them
        after = store.statistics()
        assert after.gathered_log_parts - before.gathered_log_parts == parts
        assert after.gathered_log_spans - before.gathered_log_spans == spans
    await store.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_first_bad_crc_names_the_first_range_whose_crc32c_differs(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled:
        assert copy_ranges.load_compiled()
        assert copy_ranges.KERNELS.module is not None
        if copy_ranges.KERNELS.module.check is None:
            pytest.skip("the crc32c package does not use its x86-64 hardware function here")
        monkeypatch.setattr(crc32c, "crc32c", None)  # the compiled check must not need the Python call
    else:
        monkeypatch.setattr(copy_ranges.KERNELS, "module", None)
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    lengths = rng.integers(0, 20_000, 200)  # some empty
    lengths[::17] = 0
    at = rng.integers(0, len(data) - lengths)
    pieces = zip(at.tolist(), lengths.tolist(), strict=True)
    crcs = np.array([CRC32C(data[a : a + n].tobytes()) for a, n in pieces], dtype=np.uint32)
    assert copy_ranges.first_bad_crc(data, at, lengths, crcs) == -1
    for bad in (0, 57, 199):
        changed = crcs.copy()
        changed[bad] ^= 1 << (bad % 32)
        changed[bad + 1 :] ^= 1  # later ones wrong too: the first is named
        assert copy_ranges.first_bad_crc(data, at, lengths, changed) == bad
    assert copy_ranges.first_bad_crc(data, at[:0], lengths[:0], crcs[:0]) == -1


async def read_in_order(store: BlockStore, blocks: int) -> None:
    """Read owner 3's blocks (of `cold_file`) one after the other with the prefetcher
    running, checking each one's bytes."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.run_prefetcher)
        for i in range(blocks):
            data = await store.read_range(3, i * BLOCK, BLOCK, blocks * BLOCK)
            assert bytes(data) == bytes([i]) * BLOCK
            del data
            await trio.sleep(0.001)  # let the prefetcher run between reads, as a reader's wait would
        nursery.cancel_scope.cancel()


async def test_a_sequential_reader_has_each_block_hinted_and_loaded_ahead_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await cold_file(tmp_path, blocks=60, budget=256 * BLOCK)  # a FIFO of transient blocks beyond 32 ahead
    hinted: list[int] = []
    real_will_need = store._log.will_need

    def counted(locations: Sequence[LogLocation]) -> int:
        hinted.extend(loc.offset for loc in locations)
        return real_will_need(locations)

    monkeypatch.setattr(store._log, "will_need", counted)
    await read_in_order(store, blocks=60)
    assert hinted, "a sequential reader's next blocks are hinted"
    assert len(hinted) == len(set(hinted)), "a block was hinted (and queued) again while still waiting"
    await store.close()


async def test_a_sequential_reader_of_blocks_out_of_the_page_cache_loads_them_in_runs_with_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 64 KiB read with O_DIRECT (the mechanism of 1 MiB blocks from 256 KiB
    on): the prefetcher asks for a sequential reader's next blocks four at a time, and
    four neighbours in the log go to the device as one read."""
    monkeypatch.setattr(nvme_log, "DIRECT_READ_MIN_BYTES", BLOCK)
    monkeypatch.setattr(nvme_log, "DIRECT_READ_MAX_BYTES", 4 * BLOCK)
    store = await cold_file(tmp_path, blocks=60, budget=256 * BLOCK)
    if not store._log.direct_reads or nvme_log.cached_pages(store._log._segments[1].fd, 0, 4096) is None:
        await store.close()
        pytest.skip("this file system refuses O_DIRECT, or this kernel has no cachestat")
    for seg in store._log._segments.values():  # out of the page cache, as after a while
        os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    runs: list[int] = []
    real_read_run = store._log.read_run

    def counted(records: Sequence[tuple[BlockKey, LogLocation]], into: Sequence[bytearray | None]) -> list[bytearray]:
        runs.append(len(records))
        return real_read_run(records, into)

    monkeypatch.setattr(store._log, "read_run", counted)
    hints: list[int] = []
    monkeypatch.setattr(store._log, "will_need", lambda locations: hints.append(len(locations)) or 0)
    await read_in_order(store, blocks=60)
    assert not hints, "blocks read with O_DIRECT are not hinted into the page cache (nor a thread woken for it)"
    assert max(runs) == 4, runs
    assert runs.count(4) >= 10, runs
    stats = store.statistics()
    assert stats.log_direct_read_bytes >= 50 * BLOCK  # all but the reader's first blocks, read before any prefetch
    assert stats.prefetched_blocks == sum(runs)
    await store.close()


async def test_gather_never_copies_past_a_cached_blocks_valid_bytes(tmp_path: Path) -> None:
    assert copy_ranges.load_compiled()
    store = open_store(tmp_path)
    await store.write(BlockKey(3, 0), 0, b"x" * 1000)  # a short block: 1,000 valid bytes in a 4 KiB buffer
    await store.write(BlockKey(3, 1), 0, b"y" * BLOCK)
    out = bytearray(b"?" * 3000)
    # the second range claims bytes the block does not hold (as an index that disagrees
    # with the block would): nothing of it is copied, and it is reported unchecked
    unchecked = await store.gather(
        3, np.array([0, 900, BLOCK]), np.array([1000, 1500, 500]), out, np.array([0, 1000, 2500])
    )
    assert unchecked.tolist() == [False, True, False]
    assert out == b"x" * 1000 + b"?" * 1500 + b"y" * 500
    with pytest.raises(AssertionError):  # a range outside the output is a bug, never a write there
        await store.gather(3, np.array([0]), np.array([100]), bytearray(50), np.array([0]))
    await store.close()


@pytest.mark.parametrize(("count", "longest"), [(20, 2000), (400, 3 * BLOCK // 2)], ids=["parts", "spans"])
async def test_gather_reads_again_through_the_index_what_compaction_moved_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, longest: int
) -> None:
    store, content = await random_file(tmp_path, blocks=12)
    # half the reads find their segment "gone" between the plan and the read, as when
    # compaction deleted it: the gather must fetch those pieces (and only those) again
    # through the index
    real_ranges = store._log.read_ranges
    gone = 0

    def ranges_gone(
        segments: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        out: bytearray,
        at: np.ndarray,
        read_ahead: bool = True,
    ) -> list[int]:
        nonlocal gone
        real_ranges(segments[::2], offsets[::2], lengths[::2], out, at[::2], read_ahead)
        gone += len(segments[1::2])
        return list(range(1, len(segments), 2))

    monkeypatch.setattr(store._log, "read_ranges", ranges_gone)
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, longest, count)
    starts = rng.integers(0, len(content) - lengths)
    out_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = bytearray(int(lengths.sum()))
    unchecked = await store.gather(3, starts, lengths, out, out_starts)
    assert out == b"".join(content[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist(), strict=True))
    assert unchecked.all()  # nothing was cached: the caller checks every range
    assert gone > 0
    stats = store.statistics()
    assert (stats.gathered_log_spans if count == 400 else stats.gathered_log_parts) > 0
    await store.close()


async def wait_written_behind(store: BlockStore, nbytes: int) -> None:
    with trio.fail_after(10):
        while store.written_behind_bytes < nbytes:
            await trio.sleep(0.01)


async def test_full_blocks_go_to_the_log_while_written_and_a_close_writes_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writeback, "WRITE_BEHIND_BYTES", 3 * BLOCK)
    store = open_store(tmp_path, budget=16 * BLOCK, segment=16 * BLOCK)
    data = bytearray(os.urandom(5 * BLOCK + 100))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.run_write_behind)
        await store.write_range(3, 0, bytes(data[: 2 * BLOCK]))  # two full blocks: under the mark
        await trio.sleep(0.05)
        assert store.written_behind_bytes == 0
        await store.write_range(3, 2 * BLOCK, bytes(data[2 * BLOCK :]))  # three more, and a partial one
        await wait_written_behind(store, 5 * BLOCK)
        assert store.owner_dirty_bytes(3) == 100  # only the last, partial block waits for the close
        for number in range(5):
            block = store._dram.peek(BlockKey(3, number))
            assert block is not None
            assert not block.dirty
        data[BLOCK + 7 : BLOCK + 10] = b"new"  # a block written behind changes again: dirty again
        await store.write_range(3, BLOCK + 7, b"new")
        assert store.owner_dirty_bytes(3) == BLOCK + 100
        nursery.cancel_scope.cancel()
    assert store.written_behind_bytes == 5 * BLOCK
    await store.persist(3)  # the close
    assert store.owner_dirty_bytes(3) == 0
    killed(store)

    store = open_store(tmp_path)
    await store.read_tail()
    got = b"".join([await read_all(store, BlockKey(3, number)) for number in range(6)])
    assert got == data
    await store.close()


async def test_a_block_rewritten_while_written_behind_keeps_its_last_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writeback, "WRITE_BEHIND_BYTES", 2 * BLOCK)
    store = open_store(tmp_path, budget=16 * BLOCK, segment=16 * BLOCK)
    last = [b""] * 4
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.run_write_behind)
        for round_ in range(40):  # full rewrites of four blocks, racing the passes' threads
            number = round_ % 4
            last[number] = os.urandom(BLOCK)
            await store.write_range(9, number * BLOCK, last[number])
            if round_ % 3 == 0:
                await trio.sleep(0.001)  # a pass may be in its thread meanwhile
        await wait_written_behind(store, 2 * BLOCK)
        nursery.cancel_scope.cancel()
    await store.persist(9)
    killed(store)
    store = open_store(tmp_path)
    await store.read_tail()
    assert [await read_all(store, BlockKey(9, number)) for number in range(4)] == last
    await store.close()


async def test_durable_persists_asked_for_together_share_commits_and_all_come_back(tmp_path: Path) -> None:
    """32 owners, each writing and persisting durably five times at once (32 fsync loops):
    the persists that come while a commit runs wait for it and share the next one, and
    after a kill every owner's last write is there."""
    store = open_store(tmp_path, budget=64 * BLOCK, segment=64 * BLOCK)
    owners = range(10, 42)

    async def fsync_loop(owner: int) -> None:
        for i in range(5):
            await store.write(BlockKey(owner, 0), 0, b"%d:%d|" % (owner, i) * 100)
            await store.persist(owner, durable=True)

    async with trio.open_nursery() as nursery:
        for owner in owners:
            nursery.start_soon(fsync_loop, owner)
    stats = store.statistics()
    assert stats.durable_persists == 160
    assert stats.durable_commits <= 160 // 4, stats.durable_commits
    assert store.dirty_bytes == 0
    killed(store)
    store = open_store(tmp_path, budget=64 * BLOCK, segment=64 * BLOCK)
    await store.read_tail()
    for owner in owners:
        assert await read_all(store, BlockKey(owner, 0)) == b"%d:4|" % owner * 100
    await store.close()


async def test_members_of_a_durable_group_whose_commit_failed_commit_again_by_themselves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log's second fsync fails: the persist that led that group's commit gets the
    error, and each other member commits again by itself and returns durable."""
    store = open_store(tmp_path, budget=64 * BLOCK, segment=64 * BLOCK)
    syncs = 0
    real_sync = store._log.sync

    def sync_failing_once() -> None:
        nonlocal syncs
        syncs += 1
        if syncs == 2:
            raise OSError(errno.EIO, "injected")
        real_sync()

    monkeypatch.setattr(store._log, "sync", sync_failing_once)
    failures: list[int] = []

    async def fsync_loop(owner: int) -> None:
        for i in range(3):
            await store.write(BlockKey(owner, 0), 0, b"%d:%d|" % (owner, i) * 100)
            try:
                await store.persist(owner, durable=True)
            except (OSError, DistorefsError):
                failures.append(owner)

    async with trio.open_nursery() as nursery:
        for owner in range(10, 18):
            nursery.start_soon(fsync_loop, owner)
    assert len(failures) == 1
    assert syncs > 2
    assert store.durable_commits < store.durable_persists  # (persists did come together)
    await store.persist(failures[0], durable=True)  # the failed one, again: fine now
    killed(store)
    store = open_store(tmp_path, budget=64 * BLOCK, segment=64 * BLOCK)
    await store.read_tail()
    for owner in range(10, 18):
        assert await read_all(store, BlockKey(owner, 0)) == b"%d:2|" % owner * 100
    await store.close()
