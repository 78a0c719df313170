"""The shared-memory arena of a buffer (stores/replay/mirror.py), without a mount: where
items go, that a held slot is never reused, growth against a budget, and a buffer's
draws through it (same accounting as a plain sample)."""

from __future__ import annotations

import mmap
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from distorefs.errors import NotSupported, OutOfMemory
from distorefs.stores.replay import mirror as mirror_module
from distorefs.stores.replay.buffer import MirroredBatch, ReplayBuffer
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.mirror import ArenaBudget, Mirror, add_at, repeats, stride_for
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.dram import DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import NvmeLog
from tests.unit.kernels import compiled_or_plain


class Budget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self.used -= nbytes


def item(index: int, size: int = 100) -> bytes:
    return bytes([index % 251]) * size


def read(mirror: Mirror, index: int, size: int = 100) -> bytes:
    arena_slot = int(mirror.ring[index % mirror.capacity])
    assert arena_slot >= 0
    return bytes(mirror.rows[arena_slot, :size])


def test_items_land_in_slots_a_reader_maps_read_only_and_leave_with_forget() -> None:
    budget = Budget(1 << 30)
    mirror = Mirror(capacity=10, stride=stride_for(100), reserve=budget.reserve, unreserve=budget.unreserve)
    mirror.place(np.arange(5), [item(i) for i in range(5)])
    assert [read(mirror, i) for i in range(5)] == [item(i) for i in range(5)]
    assert budget.used == mirror.size_bytes > 0
    fd = mirror.read_only_fd()
    try:
        with mmap.mmap(fd, mirror.size_bytes, prot=mmap.PROT_READ) as view:
            slot = int(mirror.ring[3])
            assert view[slot * mirror.stride : slot * mirror.stride + 100] == item(3)
        with pytest.raises(OSError):  # read-only: a sampler cannot change the arena
            os.write(fd, b"x")
    finally:
        os.close(fd)
    mirror.forget(np.array([3, 77]))  # 77 was never here: skipped
    assert mirror.ring[3] == -1
    assert mirror.statistics()["items"] == 4
    mirror.close()
    assert budget.used == 0


@pytest.fixture(params=["compiled", "numpy"])
def counts(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The test runs with a batch's counts compiled (counts_jit.py: add_at and release)
    and with numpy's; True for the compiled run."""
    return compiled_or_plain(request, monkeypatch, mirror_module.COUNTS)


def test_a_held_slot_keeps_its_bytes_while_the_item_is_replaced_and_frees_at_release(counts: bool) -> None:
    budget = Budget(1 << 30)
    mirror = Mirror(capacity=4, stride=128, reserve=budget.reserve, unreserve=budget.unreserve)
    mirror.place(np.arange(4), [item(i) for i in range(4)])
    held = mirror.lease(mirror.ring[np.array([1, 1, 2])])  # item 1 drawn twice
    old_slot = int(mirror.ring[1])
    mirror.place(np.array([5]), [item(5)])  # index 5 takes ring slot 1 (FIFO)
    assert int(mirror.ring[1]) != old_slot
    assert bytes(mirror.rows[old_slot, :100]) == item(1)  # the holder still sees item 1
    for _ in range(mirror.max_slots):  # churn: the held slot is never handed out
        mirror.place(np.array([9]), [item(9)])
        assert int(mirror.ring[9 % 4]) != old_slot
    assert bytes(mirror.rows[old_slot, :100]) == item(1)
    mirror.release(held)
    assert mirror.held_slots() == 0
    assert old_slot in mirror._free
    assert mirror._free.count(old_slot) == 1


def test_growth_stops_at_the_budget_and_items_past_it_stay_out(counts: bool) -> None:
    stride = stride_for(1 << 20)
    budget = Budget(3 * stride)
    mirror = Mirror(capacity=100, stride=stride, reserve=budget.reserve, unreserve=budget.unreserve)
    mirror.place(np.arange(5), [item(i, 1 << 20) for i in range(5)])
    assert mirror.statistics()["items"] == 3
    assert mirror.full()
    assert (mirror.ring[3:5] == -1).all()
    with pytest.raises(OutOfMemory):
        mirror.lease(mirror.ring[np.array([0, 4])])
    assert mirror.held_slots() == 0  # the slot of item 0 is not held either
    assert mirror.reserve_slot(stride + 1) is None  # bigger than a slot: never here
    arenas = ArenaBudget(budget.reserve, budget.unreserve, limit_bytes=stride)
    assert arenas.reserve(stride) is False  # the budget itself is full
    mirror.close()
    assert arenas.reserve(stride)
    assert not arenas.reserve(1)  # past the arenas' own limit


@pytest.fixture
async def tiers(tmp_path: Path) -> AsyncIterator[tuple[BlockStore, MetaDb]]:
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    blocks = BlockStore(NvmeLog.open(str(tmp_path / "log")), DramCache(64 * 1024 * 1024), meta)
    yield blocks, meta
    await blocks.close()
    meta.close()


def make(tiers: tuple[BlockStore, MetaDb], name: str, owner: int, **config: object) -> ReplayBuffer:
    blocks, meta = tiers
    return ReplayBuffer(name, owner, BufferConfig().updated(name, config, has_items=False), blocks, meta)


async def draw_one(
    tiers: tuple[BlockStore, MetaDb], buf: ReplayBuffer, meanwhile: Callable[[], Awaitable[None]] | None = None
) -> tuple[Mirror, MirroredBatch]:
    """Open and fill `buf`'s arena and draw one batch of its batch size; the batch's
    place leases it, then runs `meanwhile` (what happens while the reply is sent)."""
    blocks, _meta = tiers
    mirror = buf.open_mirror(blocks.reserve, blocks.unreserve)
    await buf.fill_mirror(mirror)
    got: list[MirroredBatch] = []

    async def place(batch: MirroredBatch) -> None:
        batch.mirror.lease(batch.arena_slots, batch.repeated)
        got.append(batch)
        if meanwhile is not None:
            await meanwhile()

    await buf.draw_mirrored(mirror, None, False, place)
    [batch] = got
    return mirror, batch


async def test_a_buffers_mirrored_draws_count_like_plain_samples(
    tiers: tuple[BlockStore, MetaDb], counts: bool
) -> None:
    blocks, _meta = tiers
    buf = make(tiers, "m", 1 << 48, capacity=8, batch_size=4)
    await buf.append([item(i) for i in range(6)])
    mirror = buf.open_mirror(blocks.reserve, blocks.unreserve)
    assert buf.open_mirror(blocks.reserve, blocks.unreserve) is mirror
    assert await buf.fill_mirror(mirror) == 6
    got: list[MirroredBatch] = []

    async def place(batch: MirroredBatch) -> None:
        batch.mirror.lease(batch.arena_slots)
        got.append(batch)

    await buf.draw_mirrored(mirror, None, False, place)
    [batch] = got
    assert len(batch.indices) == 4
    for index, arena_slot, length in zip(batch.indices, batch.arena_slots, batch.lengths, strict=True):
        assert bytes(mirror.rows[arena_slot, :length]) == item(int(index))
    assert buf.stats()["samples"] == 4
    await buf.append([item(i) for i in range(6, 14)])  # a whole ring later: every held item was replaced
    for index, arena_slot in zip(batch.indices, batch.arena_slots, strict=True):
        assert bytes(mirror.rows[arena_slot, :100]) == item(int(index))
    assert buf.stats()["shared_memory"]["held_slots"] == len(set(batch.arena_slots.tolist()))

    async def refuse(batch: MirroredBatch) -> None:
        raise OutOfMemory("refused")

    with pytest.raises(OutOfMemory):
        await buf.draw_mirrored(mirror, 2, False, refuse)
    assert buf.stats()["samples"] == 4  # a refused batch counts nothing
    buf.reconfigure({"beta": 0.5})  # the same ring and items: the arena stays
    assert buf.mirror is mirror
    assert not mirror.closed
    buf.reconfigure({"capacity": 16})  # a new ring layout: the arena goes
    assert mirror.closed
    assert buf.mirror is None
    compressed = make(tiers, "z", 2 << 48, capacity=8, compression="zstd")
    await compressed.append([item(1)])
    with pytest.raises(NotSupported):
        compressed.open_mirror(blocks.reserve, blocks.unreserve)


async def test_items_that_leave_while_a_batch_is_placed_are_not_counted(
    tiers: tuple[BlockStore, MetaDb], counts: bool
) -> None:
    buf = make(tiers, "gone", 1 << 48, capacity=8, batch_size=32)
    await buf.append([item(i) for i in range(8)])

    async def four_more() -> None:
        await buf.append([item(i) for i in range(8, 12)])  # items 0-3 leave (FIFO) before the count

    mirror, batch = await draw_one(tiers, buf, four_more)
    drawn, times = np.unique(batch.indices, return_counts=True)
    assert drawn.min() < 4 < drawn.max()  # 32 draws of 8 items: both kinds for sure
    assert buf.samples == 32  # every item handed out counts as a sample
    for index, count in zip(drawn.tolist(), times.tolist(), strict=True):
        # an item still here counts each draw; one that left counts none, nor its successor
        assert buf._times[index % 8] == (count if index >= 4 else 0)
    mirror.release(batch.arena_slots, batch.repeated)
    assert mirror.held_slots() == 0


async def test_a_ring_remade_while_a_batch_is_placed_counts_it_in_the_new_ring(
    tiers: tuple[BlockStore, MetaDb], counts: bool
) -> None:
    buf = make(tiers, "grown", 1 << 48, capacity=8, batch_size=32)
    await buf.append([item(i) for i in range(12)])  # 4..11 live; 8..11 in ring slots 0..3, then 8..11 of 16

    async def grow() -> None:
        buf.reconfigure({"capacity": 16})  # the batch's ring slots no longer name its items
        await trio.lowlevel.checkpoint()

    _mirror, batch = await draw_one(tiers, buf, grow)
    assert buf.samples == 32
    drawn, times = np.unique(batch.indices, return_counts=True)
    assert drawn.max() >= 8  # 32 draws of 8 items: some moved to another slot, for sure
    for index, count in zip(drawn.tolist(), times.tolist(), strict=True):
        assert buf._times[index % 16] == count
    assert int(buf._times.sum()) == 32


async def test_a_count_takes_read_only_indices(tiers: tuple[BlockStore, MetaDb], counts: bool) -> None:
    buf = make(tiers, "ro", 1 << 48, capacity=8)
    await buf.append([item(i) for i in range(4)])
    indices = np.frombuffer(np.array([1, 1, 3], dtype=np.int64).tobytes(), dtype=np.int64)  # as a peer's commit comes
    assert not indices.flags.writeable
    buf.commit(indices)
    assert buf._times[:4].tolist() == [0, 2, 0, 1]
    assert buf.samples == 3


@given(st.lists(st.integers(0, 20), max_size=40), st.integers(-3, 3))
def test_add_at_counts_a_repeated_position_each_time(positions: list[int], delta: int) -> None:
    assert mirror_module.load_compiled(), "numba is a dependency: the compiled counts must load"
    named = np.array(positions, dtype=np.int64)
    expected = np.arange(21, dtype=np.int64)
    np.add.at(expected, named, delta)
    assert repeats(named) == (len(set(positions)) < len(positions))
    loaded = mirror_module.COUNTS.module
    for compiled in (True, False):
        mirror_module.COUNTS.module = loaded if compiled else None
        try:
            read_only = named.copy()
            read_only.setflags(write=False)  # (numba types a read-only array apart)
            for told in (None, repeats(named)):  # looked up, or told by the caller (a batch's one look)
                for dtype in (np.int64, np.int32):  # a buffer's counts, an arena's references
                    for positions in (named, read_only):
                        target = np.arange(21, dtype=dtype)
                        add_at(target, positions, delta, told)
                        assert (target == expected).all()
        finally:
            mirror_module.COUNTS.module = loaded


def test_add_at_refuses_a_position_outside_the_array_and_adds_none(counts: bool) -> None:
    target = np.zeros(4, dtype=np.int64)
    for outside in ([1, 4], [1, -1]):  # past the end; from the end, which numpy alone would take
        with pytest.raises(IndexError):
            add_at(target, np.array(outside, dtype=np.int64), 1)
        assert (target == 0).all()


async def test_a_batch_with_an_item_drawn_twice_holds_and_counts_it_twice(
    tiers: tuple[BlockStore, MetaDb], counts: bool
) -> None:
    buf = make(tiers, "twice", 1 << 48, capacity=8, batch_size=64)
    await buf.append([item(i) for i in range(3)])  # 64 draws of 3 items: repeats for sure
    mirror, batch = await draw_one(tiers, buf)
    assert batch.repeated is (None if counts else True)  # compiled counts need no look for repeats
    slots, held = np.unique(batch.arena_slots, return_counts=True)
    assert (mirror.refs[slots] == held).all()
    assert buf.stats()["shared_memory"]["held_slots"] == len(slots)
    drawn, times = np.unique(batch.indices, return_counts=True)
    assert (buf._times[drawn % 8] == times).all()  # each draw counted (max_times_sampled)
    mirror.release(batch.arena_slots, batch.repeated)
    assert (mirror.refs[slots] == 0).all()
    assert buf.samples == 64


async def test_a_mirror_fills_every_item_whatever_its_step(tiers: tuple[BlockStore, MetaDb]) -> None:
    """The fill goes in steps of about `step_bytes` (its sums made once): one item a step,
    a few, or all at once, every live item ends in the arena exactly once."""
    blocks, _meta = tiers
    for k, step in enumerate((1, 3 * len(item(0)) + 1, 1 << 30)):
        buf = make(tiers, f"f{k}", (1 << 48) + k, capacity=16, batch_size=4)
        await buf.append([item(i) for i in range(11)])
        mirror = buf.open_mirror(blocks.reserve, blocks.unreserve)
        assert await buf.fill_mirror(mirror, step_bytes=step) == 11
        assert sorted(np.flatnonzero(mirror.ring >= 0).tolist()) == list(range(11))
        assert await buf.fill_mirror(mirror, step_bytes=step) == 0  # nothing left to bring
