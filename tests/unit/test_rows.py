"""A schema buffer's record rows (stores/replay/rows.py) without a mount: draws served
from them hold the same records as the block tier, through appends, FIFO overwrites,
replacements, deletions and a restart, and their bytes are held against the budget."""

from __future__ import annotations

import io
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from distorefs.stores.replay.buffer import ReplayBuffer
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.rows import ring_bytes, rows_bytes_for
from distorefs.stores.replay.store import BufferStore
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from tests.unit.tiers import open_tiers

SCHEMA = {"obs": {"dtype": "<f4", "shape": [4]}, "step": "<i8"}
RECORD = np.dtype([("obs", "<f4", (4,)), ("step", "<i8")])


def record(step: int, version: int = 0) -> bytes:
    out = np.zeros(1, RECORD)
    out["obs"], out["step"] = version, step
    return out.tobytes()


def drawn(data: bytes | bytearray) -> np.ndarray:
    batch: np.ndarray = np.load(io.BytesIO(bytes(data)))
    return batch


@pytest.fixture
async def tiers(tmp_path: Path) -> AsyncIterator[tuple[BlockStore, MetaDb]]:
    blocks, meta = open_tiers(tmp_path, 1 << 20, 64)
    yield blocks, meta
    await blocks.close()
    meta.close()


def make(blocks: BlockStore, meta: MetaDb, **config: object) -> ReplayBuffer:
    store = BufferStore(blocks, meta)
    return store.create("r", BufferConfig().updated("r", {"schema": SCHEMA, **config}, has_items=False))


async def test_draws_come_from_the_rows_once_they_hold_the_items(tiers: tuple[BlockStore, MetaDb]) -> None:
    blocks, meta = tiers
    buf = make(blocks, meta, capacity=100, batch_size=16)
    await buf.append([record(i) for i in range(50)])
    for _ in range(20):
        batch = drawn((await buf.sample()).data)
        assert (batch["step"] == batch["_index"]).all()
    rows = buf.stats()["record_rows"]
    assert rows == {"bytes": 100 * (RECORD.itemsize + 8), "hits": 20, "misses": 0}  # records and held indices


async def test_rows_are_reserved_against_the_budget_and_given_back(tiers: tuple[BlockStore, MetaDb]) -> None:
    blocks, meta = tiers
    before = blocks._dram.reserved_bytes
    store = BufferStore(blocks, meta)
    store.create("r", BufferConfig().updated("r", {"schema": SCHEMA, "capacity": 1000}, has_items=False))
    assert blocks._dram.reserved_bytes == before + 1000 * (RECORD.itemsize + 8)
    store.get("r").reconfigure({"capacity": 2000})
    assert blocks._dram.reserved_bytes == before + 2000 * (RECORD.itemsize + 8)
    store.delete("r")
    assert blocks._dram.reserved_bytes == before


def test_only_small_records_in_a_small_ring_get_rows() -> None:
    budget = 1 << 30
    assert rows_bytes_for(1000, 48, False, budget, 0) == 56_000  # 48 bytes a record, 8 for its held index
    assert rows_bytes_for(1000, None, False, budget, 0) == 0  # blobs
    assert rows_bytes_for(1000, 48, True, budget, 0) == 0  # compressed
    assert rows_bytes_for(1000, 4096, False, budget, 0) == 0  # served as views of the items
    assert rows_bytes_for(budget // 8 // 56, 48, False, budget, 0) == ring_bytes(budget // 8 // 56, 48)
    assert rows_bytes_for(budget // 8 // 56 + 1, 48, False, budget, 0) == 0  # past its share of the budget
    assert rows_bytes_for(1000, 48, False, budget, budget // 4 - 56_000) == 56_000
    assert rows_bytes_for(1000, 48, False, budget, budget // 4 - 55_999) == 0  # reservations past a quarter


async def test_many_small_buffers_leave_three_quarters_of_the_budget_to_the_cache(
    tiers: tuple[BlockStore, MetaDb],
) -> None:
    blocks, meta = tiers
    store = BufferStore(blocks, meta)
    # Records of 1 KiB: rows of an eighth of the budget each, whose rings (their arrays
    # and trees, ~0.1 KiB a slot, counted apart: ring_index_bytes) leave the cache room.
    schema = {"obs": {"dtype": "<f4", "shape": [254]}, "step": "<i8"}
    dtype = np.dtype([("obs", "<f4", (254,)), ("step", "<i8")])
    capacity = blocks.dram_budget_bytes // 8 // (dtype.itemsize + 8)  # each ring at its own limit
    made = [
        store.create(
            f"r{i}", BufferConfig().updated(f"r{i}", {"schema": schema, "capacity": capacity}, has_items=False)
        )
        for i in range(6)
    ]
    with_rows = [buf for buf in made if "record_rows" in buf.stats()]
    assert len(with_rows) == 2  # an eighth each: the third would pass a quarter
    assert blocks.dram_reserved_bytes <= blocks.dram_budget_bytes // 4
    one = np.zeros(1, dtype)
    one["step"] = 7
    await made[-1].append([one.tobytes()])  # the others still work, without rows
    assert drawn((await made[-1].sample(1)).data)["step"].tolist() == [7]


async def test_a_restarted_buffer_fills_its_rows_from_draws(tmp_path: Path) -> None:
    blocks, meta = open_tiers(tmp_path, 1 << 20, 64)
    buf = make(blocks, meta, capacity=64, batch_size=32)
    await buf.append([record(i, version=7) for i in range(40)])
    await buf.persist()
    await blocks.close()
    meta.close()
    blocks, meta = open_tiers(tmp_path, 1 << 20, 64)
    try:
        buf = BufferStore.load(blocks, meta).get("r")
        seen: set[int] = set()
        for _ in range(30):
            batch = drawn((await buf.sample()).data)
            assert (batch["step"] == batch["_index"]).all()
            assert (batch["obs"] == 7).all()
            seen.update(batch["_index"].tolist())
        stats = buf.stats()["record_rows"]
        assert stats["misses"] >= 1  # the first draw read the block tier ...
        assert stats["hits"] >= 1  # ... and later ones found everything in the rows
        assert len(seen) == 40
    finally:
        await blocks.close()
        meta.close()


async def test_the_start_up_warm_up_fills_the_rows_so_draws_never_miss(tmp_path: Path) -> None:
    """`BufferStore.warm_up` reads a restored buffer's items into DRAM and, for a buffer
    with rows, into its rows: every draw after it is served whole from the rows."""
    blocks, meta = open_tiers(tmp_path, 1 << 20, 64)
    buf = make(blocks, meta, capacity=64, batch_size=32)
    await buf.append([record(i, version=3) for i in range(80)])  # 16..79 live: FIFO past 64
    await buf.persist()
    await blocks.close()
    meta.close()
    blocks, meta = open_tiers(tmp_path, 1 << 20, 64)
    try:
        store = BufferStore.load(blocks, meta)
        buf = store.get("r")
        assert await store.warm_up(1 << 20) == 64
        assert buf._rows is not None
        assert (buf._rows.held[np.arange(16, 80) % 64] == np.arange(16, 80)).all()
        for _ in range(10):
            batch = drawn((await buf.sample()).data)
            assert (batch["step"] == batch["_index"]).all()
            assert (batch["obs"] == 3).all()
        assert buf.stats()["record_rows"]["misses"] == 0
        assert buf.stats()["record_rows"]["hits"] == 10
    finally:
        await blocks.close()
        meta.close()


async def test_a_replacement_during_a_draw_that_reads_the_block_tier_is_not_undone(
    tiers: tuple[BlockStore, MetaDb],
) -> None:
    blocks, meta = tiers
    buf = make(blocks, meta, capacity=8, batch_size=1, sampler="fifo")
    await buf.append([record(0)])
    assert buf._rows is not None
    buf._rows.held[0] = -1  # as after a restart: the draw reads item 0 from the block tier
    real_payloads = buf._payloads

    async def replaced_while_reading(indices: np.ndarray) -> list[bytes | memoryview]:
        payloads = await real_payloads(indices)
        await buf.write_item(0, record(0, version=2))  # lands while the draw waits
        return payloads

    buf._payloads = replaced_while_reading  # type: ignore[method-assign]
    first = drawn((await buf.sample()).data)
    buf._payloads = real_payloads  # type: ignore[method-assign]
    assert first["obs"][0].tolist() == [0, 0, 0, 0]  # the bytes as read
    second = drawn((await buf.sample()).data)
    assert second["obs"][0].tolist() == [2, 2, 2, 2]  # the rows kept the replacement


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 6)),
        st.tuples(st.just("replace"), st.integers(0, 40)),
        st.tuples(st.just("delete"), st.integers(0, 40)),
        st.tuples(st.just("forget"), st.integers(0, 40)),
        st.tuples(st.just("sample"), st.integers(1, 8)),
        st.tuples(st.just("reconfigure"), st.integers(4, 12)),  # (grows only while items are held)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_every_drawn_record_is_the_items_current_record(ops: list[tuple[str, int]]) -> None:
    async def run(path: Path) -> None:
        blocks, meta = open_tiers(path, 1 << 20, 64)
        buf = make(blocks, meta, capacity=6, batch_size=4)
        current: dict[int, bytes] = {}
        version = 0
        try:
            for op, n in ops:
                version += 1
                live = buf.live_indices().tolist()
                if op == "append":
                    first = buf.next_index
                    await buf.append([record(first + k, version) for k in range(n)])
                    current.update({first + k: record(first + k, version) for k in range(n)})
                elif op == "replace" and live:
                    index = live[n % len(live)]
                    await buf.write_item(index, record(index, version))
                    current[index] = record(index, version)
                elif op == "delete" and live:
                    buf.delete_item(live[n % len(live)])
                elif op == "forget" and live and buf._rows is not None:  # a row lost, as after a restart
                    buf._rows.held[live[n % len(live)] % buf.capacity] = -1
                elif op == "sample" and live:
                    batch = drawn((await buf.sample(n)).data)
                    for row in batch:
                        expected = np.frombuffer(current[int(row["_index"])], RECORD)[0]
                        assert row["step"] == expected["step"]
                        assert row["obs"].tolist() == expected["obs"].tolist()
                elif op == "reconfigure":
                    buf.reconfigure({"capacity": max(n, buf.capacity) if live else n})
        finally:
            await blocks.close()
            meta.close()

    with tempfile.TemporaryDirectory() as path:
        trio.run(run, Path(path))
