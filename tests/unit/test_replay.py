"""The replay store without a mount: segment tree, samplers, rate limiter, buffer, restore."""

from __future__ import annotations

import errno
import gc
import io
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distorefs.errors import Busy, InvalidArgument, NotFound, TryAgain
from distorefs.stores.replay import buffer as buffer_module
from distorefs.stores.replay import formats, sumtree
from distorefs.stores.replay.buffer import (
    COPIED_ITEM_BYTES,
    MIN_DEFAULT_CAPACITY,
    ReplayBuffer,
    default_capacity,
    ring_index_bytes,
)
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.draws import THREAD_ENCODE_ITEMS, encode_batch, encoded_batch
from distorefs.stores.replay.formats import (
    BlobStream,
    RecordStream,
    ScatteredBytes,
    decode_blob_batch,
    encode_blob_batch,
    encode_npy_batch,
    frame_items,
    joined,
    parse_priorities,
)
from distorefs.stores.replay.rate_limiter import RateLimiter
from distorefs.stores.replay.samplers.base import stratified_prefixes
from distorefs.stores.replay.store import BufferStore
from distorefs.stores.replay.sumtree import SegmentTree
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.dram import DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import NvmeLog
from distorefs.types import BlockKey
from tests.unit.kernels import compiled_or_plain

# --- segment tree ----------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    capacity=st.integers(1, 70),
    updates=st.lists(
        st.lists(st.tuples(st.integers(0, 69), st.floats(0, 1e6, allow_nan=False)), min_size=1, max_size=10),
        min_size=1,
        max_size=15,
    ),
)
def test_tree_sums_stay_exact_and_find_lands_in_the_right_leaf(
    capacity: int, updates: list[list[tuple[int, float]]]
) -> None:
    tree = SegmentTree(capacity, with_min_max=True)
    leaves = np.zeros(capacity)
    for batch in updates:
        slots = np.array([s % capacity for s, _ in batch])
        values = np.array([v for _, v in batch])
        tree.update(slots, values)
        for s, v in zip(slots, values, strict=True):
            leaves[s] = v
        assert tree.total == pytest.approx(leaves.sum(), rel=1e-9, abs=1e-9)
        positive = leaves[leaves > 0]
        assert tree.min == (positive.min() if len(positive) else np.inf)
        assert tree.max == leaves.max()
    if leaves.sum() > 0:
        cumulative = np.cumsum(leaves)
        prefixes = np.linspace(0, leaves.sum(), 50, endpoint=False)
        found = tree.find(prefixes)
        assert (leaves[found] > 0).all()
        for prefix, slot in zip(prefixes, found, strict=True):
            low = cumulative[slot] - leaves[slot]
            assert low - 1e-6 * leaves.sum() <= prefix <= cumulative[slot] + 1e-6 * leaves.sum()


def test_few_slot_updates_give_the_same_tree_as_the_vectorised_path(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    few = SegmentTree(100_000, with_min_max=True, compiled=False)
    batched = SegmentTree(100_000, with_min_max=True, compiled=False)
    for _ in range(200):
        slots = rng.integers(0, 100_000, int(rng.integers(1, 9)))
        values = np.where(rng.random(len(slots)) < 0.2, 0.0, rng.random(len(slots)) * 10)
        few.update(slots, values)
        with monkeypatch.context() as m:
            m.setattr(sumtree, "FEW_SLOTS", 0)
            batched.update(slots, values)
    for mine, theirs in ((few._sum, batched._sum), (few._min, batched._min), (few._max, batched._max)):
        assert np.array_equal(mine, theirs)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 3000),
    seed=st.integers(0, 2**32 - 1),
    batches=st.integers(1, 12),
)
def test_compiled_walks_give_the_numpy_walks_tree_and_draws(capacity: int, seed: int, batches: int) -> None:
    assert sumtree.load_compiled(), "numba is a dependency: the compiled walks must load"
    rng = np.random.default_rng(seed)
    compiled, plain = SegmentTree(capacity, with_min_max=True), SegmentTree(capacity, with_min_max=True, compiled=False)
    ones, plain_ones = SegmentTree(capacity), SegmentTree(capacity, compiled=False)
    assert compiled.compiled
    assert ones.compiled
    assert not plain.compiled
    for _ in range(batches):
        count = int(rng.integers(1, min(capacity, 300) + 1))
        slots = rng.integers(0, capacity, count)  # duplicates included: the later one wins
        values = np.where(rng.random(count) < 0.3, 0.0, rng.random(count) * 10.0 ** rng.integers(-3, 4))
        for tree in (compiled, plain):
            tree.update(slots, values)
        for tree in (ones, plain_ones):
            tree.update(slots, (values > 0).astype(np.float64))
        for mine, theirs in ((compiled._sum, plain._sum), (compiled._min, plain._min), (compiled._max, plain._max)):
            assert np.array_equal(mine, theirs)
        assert np.array_equal(ones._sum, plain_ones._sum)
        if compiled.total > 0:  # edges too: 0, the total itself (rounds onto an empty leaf), just under it
            # (shuffled: the edges land among the descents `find` walks eight side by side)
            edges = [0.0, compiled.total, np.nextafter(compiled.total, 0)]
            prefixes = rng.permutation(np.concatenate([rng.random(64) * compiled.total, edges]))
            found = compiled.find(prefixes)
            assert np.array_equal(found, plain.find(prefixes))
            assert (plain.leaves()[found] > 0).all()
            # a whole prioritized draw in one compiled call: the numpy way's slots and probabilities
            draw_seed = int(rng.integers(0, 2**32))
            drawn = compiled.find_stratified(count, np.random.default_rng(draw_seed))
            assert drawn is not None
            assert plain.find_stratified(count, np.random.default_rng(draw_seed)) is None
            numpy_slots = plain.find(stratified_prefixes(plain.total, count, np.random.default_rng(draw_seed)))
            assert np.array_equal(drawn[0], numpy_slots)
            assert drawn[1].tobytes() == (plain.leaves()[numpy_slots] / plain.total).tobytes()


@pytest.mark.parametrize("compiled", [True, False])
def test_one_leaf_updates_give_the_same_tree_as_batched_ones(compiled: bool) -> None:
    assert sumtree.load_compiled()
    rng = np.random.default_rng(5)
    for capacity in (1, 7, 1000):
        one = SegmentTree(capacity, with_min_max=True, compiled=compiled)
        batched = SegmentTree(capacity, with_min_max=True, compiled=compiled)
        for _ in range(300):
            slot, value = int(rng.integers(0, capacity)), float(rng.random() * 10 if rng.random() > 0.2 else 0.0)
            one.update_one(slot, value)
            batched.update(np.array([slot]), np.array([value]))
        for mine, theirs in ((one._sum, batched._sum), (one._min, batched._min), (one._max, batched._max)):
            assert np.array_equal(mine, theirs)
        for bad in (-1, capacity):
            with pytest.raises(IndexError):
                one.update_one(bad, 1.0)


async def test_appends_one_at_a_time_leave_the_ring_a_batched_append_leaves(tiers: tuple[BlockStore, MetaDb]) -> None:
    blocks, meta = tiers
    config = BufferConfig().updated("t", {"capacity": 7, "sampler": "prioritized"}, has_items=False)
    singly, batched = (
        ReplayBuffer(name, owner, config, blocks, meta) for name, owner in (("a", 1 << 40), ("b", 2 << 40))
    )
    items = [b"x" * (i + 1) for i in range(17)]  # past the capacity twice: FIFO evictions on both paths
    for item in items[:9]:
        await singly.append([item])
    await batched.append(items[:9])
    await singly.update_priorities(np.array([5, 8]), np.array([3.0, 0.5]))
    await batched.update_priorities(np.array([5, 8]), np.array([3.0, 0.5]))
    for item in items[9:]:  # new items take the max priority, 3.0 now
        await singly.append([item])
    await batched.append(items[9:])
    for name in ("_slot_index", "_priority", "_times", "_size"):
        assert np.array_equal(getattr(singly, name), getattr(batched, name)), name
    for mine, theirs in ((singly._tree, batched._tree), (singly._live, batched._live)):
        assert np.array_equal(mine._sum, theirs._sum)
    assert (singly.stored_bytes, singly.removed, singly.size) == (batched.stored_bytes, batched.removed, 7)
    assert singly.stored_bytes == sum(len(i) for i in items[10:])


def test_compiled_update_refuses_a_slot_outside_the_tree() -> None:
    assert sumtree.load_compiled()
    tree = SegmentTree(100, with_min_max=True)
    tree.update(np.arange(10), np.ones(10))
    before = tree._sum.copy()
    for bad in ([5, 100], [-1], [1 << 40]):
        with pytest.raises(IndexError):
            tree.update(np.array(bad), np.ones(len(bad)))
    assert np.array_equal(tree._sum, before)
    with pytest.raises(ValueError):
        tree.update(np.arange(3), np.ones(2))


# --- rate limiter ----------------------------------------------------------------------


def test_rate_limiter_keeps_samples_and_inserts_within_the_margin() -> None:
    limiter = RateLimiter(min_size=10, samples_per_insert=2.0, margin=8.0)
    assert limiter.can_insert(0, 0)
    assert not limiter.can_sample(5, 5, 0, 1)  # below min size
    assert limiter.can_sample(10, 10, 0, 4)  # diff 20 - 4 >= 12
    assert not limiter.can_sample(10, 10, 5, 4)  # diff 15 - 4 < 12: samples ran ahead
    assert limiter.can_insert(13, 20)  # diff 6 + 2 <= 28
    assert not limiter.can_insert(20, 10)  # diff 30 + 2 > 28: inserts ran ahead


def test_rate_limiter_without_a_ratio_only_needs_min_size() -> None:
    limiter = RateLimiter(min_size=3, samples_per_insert=None, margin=0.0)
    assert limiter.can_insert(10**6, 0)
    assert not limiter.can_sample(2, 2, 0, 1)
    assert limiter.can_sample(3, 3, 10**6, 1)


# --- config ----------------------------------------------------------------------------


def test_config_rejects_unknown_fields_and_bad_values_whole() -> None:
    config = BufferConfig()
    with pytest.raises(InvalidArgument, match=r"^b: an unknown config field, a string of 7 characters \(known: "):
        config.updated("b", {"capacty": 5}, has_items=False)
    with pytest.raises(InvalidArgument, match=r"^b.capacity must be an integer in 1\.\.268435456, got 0$"):
        config.updated("b", {"batch_size": 8, "capacity": 0}, has_items=False)
    with pytest.raises(InvalidArgument, match=r"^b.sampler must be one of uniform, prioritized, fifo, lifo"):
        config.updated("b", {"sampler": "random"}, has_items=False)
    assert config.batch_size == 32  # untouched


def test_config_fields_that_cannot_change_with_items_give_ebusy() -> None:
    config = BufferConfig().updated("b", {"capacity": 10, "schema": {"x": "float32"}}, has_items=False)
    with pytest.raises(Busy, match="schema cannot change"):
        config.updated("b", {"schema": {"x": "float64"}}, has_items=True)
    with pytest.raises(Busy, match="capacity cannot shrink"):
        config.updated("b", {"capacity": 5}, has_items=True)
    assert config.updated("b", {"capacity": 20}, has_items=True).capacity == 20


# --- formats ---------------------------------------------------------------------------


def test_record_stream_takes_raw_records_and_npy_and_refuses_partial_tails() -> None:
    dtype = np.dtype([("a", "<i4"), ("b", "<f8")])
    stream = RecordStream(dtype)
    records = np.array([(1, 1.5), (2, 2.5)], dtype=dtype).tobytes()
    assert stream.feed(0, records[:5]) == []
    assert stream.feed(5, records[5:]) == [records[:12], records[12:]]
    stream.finish()
    npy = io.BytesIO()
    np.save(npy, np.array([(3, 3.5)], dtype=dtype))
    stream = RecordStream(dtype)
    assert stream.feed(0, npy.getvalue()) == [np.array([(3, 3.5)], dtype=dtype).tobytes()]
    stream.finish()
    stream = RecordStream(dtype)
    stream.feed(0, records[:20])
    with pytest.raises(InvalidArgument, match="8 trailing bytes are not a whole record of 12 bytes"):
        stream.finish()


def test_blob_stream_one_item_or_frames() -> None:
    single = BlobStream()
    assert single.feed(0, b"hello ") == []
    single.feed(6, b"world")
    assert single.finish() == [b"hello world"]
    framed = BlobStream()
    data = frame_items([b"a", b"", b"ccc"])
    assert framed.feed(0, data[:17]) == [b"a"]  # magic 8 + length 8 + 1 byte
    assert framed.feed(17, data[17:]) == [b"", b"ccc"]
    assert framed.finish() == []


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12), sizes=st.lists(st.integers(0, 4), min_size=1, max_size=5))
def test_streams_take_whole_npy_files_and_dsitems1_streams_one_after_another(cuts: list[int], sizes: list[int]) -> None:
    # what np.save per batch, or an Appender's append per call, writes to one open
    dtype = np.dtype([("a", "<i4"), ("b", "<f8")])
    arrays = [np.array([(10 * k + i, i / 2) for i in range(n)], dtype=dtype) for k, n in enumerate(sizes)]
    npy_files = []
    for array in arrays:
        out = io.BytesIO()
        np.save(out, array)
        npy_files.append(out.getvalue())
    items = [[b"DSITEMS1" * i + bytes([k]) * i for i in range(n)] for k, n in enumerate(sizes)]  # the magic as data too
    for stream, data, want in (
        (RecordStream(dtype), b"".join(npy_files), [r.tobytes() for a in arrays for r in a]),
        (BlobStream(), b"".join(frame_items(group) for group in items), [i for group in items for i in group]),
    ):
        got: list[bytes] = []
        at = 0
        for end in [*sorted(c for c in cuts if c < len(data)), len(data)]:  # any write boundaries
            got += [bytes(r) for r in stream.feed(at, data[at:end])]
            at = end
        assert got == want
        assert stream.finish() == []


@pytest.fixture(params=["compiled", "numpy"])
def pairs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The test runs with a priority update's pairs compiled (pairs_jit.py) and with
    numpy's; True for the compiled run."""
    return compiled_or_plain(request, monkeypatch, formats.PAIRS)


def test_priorities_parse_from_text_and_npy(pairs: bool) -> None:
    assert parse_priorities(b"1 0.5\n2 3") is None  # no final newline yet
    indices, priorities = parse_priorities(b"1 0.5\n\n2 3\n")  # type: ignore[misc]
    assert indices.tolist() == [1, 2]
    assert priorities.tolist() == [0.5, 3.0]
    out = io.BytesIO()
    np.save(out, np.array([(4, 1.25)], dtype=[("index", "<i8"), ("priority", "<f8")]))
    indices, priorities = parse_priorities(out.getvalue())  # type: ignore[misc]
    assert (indices.tolist(), priorities.tolist()) == ([4], [1.25])
    with pytest.raises(InvalidArgument, match="line 1: expected 'index priority'"):
        parse_priorities(b"oops\n")
    floats = np.array([[3.0, 0.5], [-2.0, 2.0], [9.0e15, 1.0]])  # np.save of float pairs: the usual update
    out = io.BytesIO()
    np.save(out, floats)
    indices, priorities = parse_priorities(out.getvalue())  # type: ignore[misc]
    assert indices.dtype == np.int64
    assert (indices.tolist(), priorities.tolist()) == ([3, -2, 9_000_000_000_000_000], [0.5, 2.0, 1.0])
    for bad in (2.5, np.nan, np.inf, 2.0**63, -(2.0**63)):
        floats[1, 0] = bad
        out = io.BytesIO()
        np.save(out, floats)
        with pytest.raises(InvalidArgument, match="indices must be whole numbers in the int64 range"):
            parse_priorities(out.getvalue())


# --- the buffer ------------------------------------------------------------------------


@pytest.fixture
async def tiers(tmp_path: Path) -> AsyncIterator[tuple[BlockStore, MetaDb]]:
    log = NvmeLog.open(str(tmp_path / "log"))
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    blocks = BlockStore(log, DramCache(64 * 1024 * 1024), meta)
    yield blocks, meta
    await blocks.close()
    meta.close()


def make(tiers: tuple[BlockStore, MetaDb], **config: object) -> ReplayBuffer:
    blocks, meta = tiers
    cfg = BufferConfig().updated("t", config, has_items=False)
    return ReplayBuffer("t", 1 << 48, cfg, blocks, meta)


async def test_indices_are_sequential_and_fifo_evicts_the_oldest(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, capacity=3)
    assert await buf.append([b"a", b"b", b"c", b"d"]) == [0, 1, 2, 3]
    assert buf.live_indices().tolist() == [1, 2, 3]
    assert (buf.size, buf.removed) == (3, 1)
    assert bytes(await buf.read_item(3)) == b"d"
    with pytest.raises(NotFound, match=r"^buffers/t: no item 0$"):
        await buf.read_item(0)


async def test_blob_batches_decode_to_live_items(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, capacity=10, batch_size=4)
    await buf.append([b"x%d" % i for i in range(5)])
    batch = await buf.sample()
    assert isinstance(batch.data, ScatteredBytes)  # blob batches are served as pieces
    items = decode_blob_batch(batch.data.tobytes())
    assert len(items) == 4
    for index, weight, data in items:
        assert data == b"x%d" % index
        assert weight == 1.0
    assert buf.samples == 4


async def test_schema_batches_are_npy_with_index_and_weight(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, schema={"obs": {"dtype": "uint8", "shape": [4]}, "r": "float32"}, batch_size=3)
    dtype = buf.config.dtype
    assert dtype is not None
    records = np.zeros(5, dtype=dtype)
    records["obs"] = np.arange(5)[:, None]
    records["r"] = np.arange(5) * 0.5
    await buf.append([r.tobytes() for r in records])
    batch = np.load(io.BytesIO(bytes((await buf.sample()).data)))
    assert batch.dtype.names == ("obs", "r", "_index", "_weight")
    for row in batch:
        assert row["obs"].tolist() == [row["_index"]] * 4
        assert row["r"] == pytest.approx(row["_index"] * 0.5)


@pytest.mark.parametrize("record", [16, formats.RECORD_COPY_BYTES - 1, formats.RECORD_COPY_BYTES, 3000])
@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize("as_rows", [False, True])
def test_a_copied_batch_writes_every_byte_it_hands_out(
    monkeypatch: pytest.MonkeyPatch, record: int, count: int, as_rows: bool
) -> None:
    """A batch of records under SCATTER_RECORD_BYTES is built in memory that is not
    zeroed first: the header, each record (copied one by one from RECORD_COPY_BYTES,
    joined below it, or from a buffer's rows) and its `_index`/`_weight` must cover every
    byte. The memory is filled with 0xAB here, so any byte left unwritten shows."""
    monkeypatch.setattr(formats, "unzeroed", lambda size: bytearray(b"\xab" * size))
    schema = np.dtype([("obs", np.uint8, (record - 4,)), ("r", "<f4")])
    rng = np.random.default_rng(record + count)
    raw = rng.integers(0, 256, (count, record), dtype=np.uint8)
    payloads = raw if as_rows else [memoryview(row.tobytes()) for row in raw]
    indices = rng.integers(0, 10**9, count)
    weights = rng.random(count, dtype=np.float32)
    data = encode_npy_batch(schema, payloads, indices, weights)
    assert isinstance(data, bytearray)
    expected = np.zeros(count, dtype=formats.batch_dtype(schema))
    expected.view(np.uint8).reshape(count, expected.dtype.itemsize)[:, :record] = raw  # the records, bit for bit
    expected["_index"], expected["_weight"] = indices, weights
    header = formats.npy_batch_header(schema, count)
    assert bytes(data[: len(header)]) == header
    assert bytes(data[len(header) :]) == expected.tobytes()
    assert len(data) == len(header) + expected.nbytes
    batch = np.load(io.BytesIO(bytes(data)))
    assert batch.tobytes() == expected.tobytes()


@pytest.mark.parametrize("record", [100, 3000])
def test_a_payload_of_another_length_fails_the_batch(record: int) -> None:
    schema = np.dtype([("obs", np.uint8, (record,))])
    payloads = [memoryview(b"x" * record), memoryview(b"y" * (record - 1))]
    with pytest.raises(ValueError):
        encode_npy_batch(schema, payloads, np.array([1, 2]), np.ones(2, np.float32))


def test_a_blob_batch_keeps_big_items_as_views_and_joins_the_small_ones_between() -> None:
    """A view per item cost more than a copy of a small one (200,000 items of 8 bytes:
    0.16 s of views, and numpy's searchsorted made an array of every piece's start at
    each read). Big items stay views of the payloads; headers and small items are joined."""
    big = [memoryview(bytes([k]) * formats.SCATTER_RECORD_BYTES) for k in range(2)]
    payloads = [b"a", big[0], b"bc", b"", b"def", big[1], b"g" * 100]
    indices, weights = np.arange(7) * 3, np.linspace(0.5, 1.0, 7, dtype=np.float32)
    batch = encode_blob_batch(payloads, indices, weights)
    pieces = batch.pieces()
    assert len(pieces) == 5  # head + "a" | big 0 | "bc", "", "def" | big 1 | "g" * 100
    assert [pieces[1].obj, pieces[3].obj] == [big[0].obj, big[1].obj]  # no copy of a big item
    decoded = decode_blob_batch(batch.tobytes())
    assert [bytes(item) for _i, _w, item in decoded] == [bytes(p) for p in payloads]
    assert [i for i, _w, _item in decoded] == indices.tolist()
    assert np.allclose([w for _i, w, _item in decoded], weights)
    for offset, size in ((0, 10), (20, 4200), (4000, 9000), (len(batch) - 3, 100)):  # reads across pieces
        assert b"".join(batch.parts(offset, size)) == batch.tobytes()[offset : offset + size]
    small = encode_blob_batch([b"%d" % i for i in range(1000)], np.arange(1000), np.ones(1000, np.float32))
    assert len(small.pieces()) == -(-1000 // formats.JOINED_RUN_ITEMS)
    assert len(encode_blob_batch([b"%d" % i for i in range(256)], np.arange(256), np.ones(256)).pieces()) == 1
    # a long run of small items is joined JOINED_RUN_ITEMS at a time (one join holds the GIL)
    many = [bytes([i % 251]) * 3000 for i in range(1000)]  # 3 MB
    joined = encode_blob_batch(many, np.arange(1000), np.ones(1000, np.float32))
    sizes = [len(piece) for piece in joined.pieces()]
    assert len(sizes) == -(-1000 // formats.JOINED_RUN_ITEMS)
    assert max(sizes) <= formats.JOINED_RUN_ITEMS * (3000 + formats.BATCH_ITEM.size) + formats.BATCH_HEAD.size
    assert [bytes(item) for _i, _w, item in decode_blob_batch(joined.tobytes())] == many
    assert decode_blob_batch(encode_blob_batch([], np.arange(0), np.ones(0)).tobytes()) == []


def test_big_record_batches_are_views_that_read_as_the_same_npy(monkeypatch: pytest.MonkeyPatch) -> None:
    schema = np.dtype([("obs", np.uint8, (5000,)), ("r", "<f4")])
    records = np.zeros(3, dtype=schema)
    records["obs"] = np.arange(3)[:, None]
    records["r"] = [0.5, 1.5, 2.5]
    payloads = [memoryview(r.tobytes()) for r in records]
    indices, weights = np.array([7, 8, 7]), np.array([0.25, 1.0, 0.25])
    scattered = encode_npy_batch(schema, payloads, indices, weights)
    assert isinstance(scattered, ScatteredBytes)  # no copy of the records
    monkeypatch.setattr(formats, "SCATTER_RECORD_BYTES", 10**9)
    contiguous = encode_npy_batch(schema, payloads, indices, weights)
    assert isinstance(contiguous, bytearray)
    assert scattered.tobytes() == bytes(contiguous)
    assert bytes(joined(scattered.parts(100, 9000))) == bytes(contiguous[100:9100])  # a read across pieces
    batch = np.load(io.BytesIO(scattered.tobytes()))
    assert batch["_index"].tolist() == [7, 8, 7]
    assert batch["_weight"].tolist() == [0.25, 1.0, 0.25]
    assert batch["obs"][1].tolist() == [1] * 5000


@settings(max_examples=25, deadline=None)
@given(
    priorities=st.lists(st.floats(0.05, 20.0), min_size=2, max_size=6),
    alpha=st.floats(0.0, 1.5),
)
def test_prioritized_frequencies_follow_priorities_to_the_alpha(priorities: list[float], alpha: float) -> None:
    """Sampled frequencies match p^alpha / sum(p^alpha) within 5 binomial standard
    deviations per item, for any priorities and alpha."""

    async def run(tmp: str) -> None:
        meta = MetaDb.open(tmp + "/meta.sqlite")
        blocks = BlockStore(NvmeLog.open(tmp + "/log"), DramCache(16 << 20), meta)
        cfg = BufferConfig().updated("t", {"sampler": "prioritized", "alpha": alpha, "epsilon": 0.0}, has_items=False)
        buf = ReplayBuffer("t", 1 << 48, cfg, blocks, meta)
        n = len(priorities)
        await buf.append([b"i%d" % i for i in range(n)])
        await buf.update_priorities(np.arange(n), np.array(priorities))
        counts = np.zeros(n)
        draws = 0
        for _ in range(60):
            drawn = await buf.pick(64)  # picked, not counted: the draws stay independent
            counts += np.bincount(drawn.indices, minlength=n)
            draws += 64
        expected = np.power(priorities, alpha) / np.power(priorities, alpha).sum()
        sd = np.sqrt(draws * expected * (1 - expected)) + 1.0
        assert (np.abs(counts - draws * expected) < 5 * sd).all(), (counts / draws, expected)
        await blocks.close()
        meta.close()

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trio.run(run, tmp)


async def test_importance_weights_are_normalised_to_the_rarest_item(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, sampler="prioritized", alpha=1.0, beta=1.0, epsilon=0.0, batch_size=16)
    await buf.append([b"a", b"b"])
    await buf.update_priorities(np.array([0, 1]), np.array([1.0, 3.0]))
    batch = await buf.sample(16)
    assert set(batch.indices.tolist()) == {0, 1}
    for index, weight in zip(batch.indices, batch.weights, strict=True):
        # w = (N P)^-beta / max_w; P = p / 4; the rarest item (p = 1) has weight 1.
        assert weight == pytest.approx(1.0 if index == 0 else 1 / 3, rel=1e-6)


@pytest.fixture(params=["compiled", "numpy"])
def weights_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    return compiled_or_plain(request, monkeypatch, sumtree.KERNELS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 5e-324, 1e-300, float("inf"), float("nan")])),
        min_size=1, max_size=64,
    ),
    st.sampled_from([0.0, 5e-324, 1e-300, 1e-6, 0.5, 1.0, 2.0]),
    st.sampled_from([0.0, 0.4, 1.0, 1e308, -0.5, -1.0]),
)  # fmt: skip
def test_importance_weights_match_numpys_nan_to_num(
    weights_kernel: bool, probabilities: list[float], min_probability: float, beta: float
) -> None:
    """The weights' cleanup (NaN -> 1, past the float32 range -> its largest value) gives
    what np.nan_to_num(nan=1.0) gave for any probabilities (in [0, 1], inf and NaN as
    well), P_min and beta: bit for bit
    in numpy, within a float32 unit of the last place compiled (libm's pow against
    numpy's, which may be a vectorised one), the same NaN and infinity mapping either way."""
    from distorefs.stores.replay.draws import importance_weights

    p = np.array(probabilities, dtype=np.float64)
    with np.errstate(all="ignore"):
        raw = np.power(p / min_probability, -beta) if min_probability > 0 else np.zeros(len(p))
        expected = np.nan_to_num(raw.astype(np.float32), nan=1.0)
    got = importance_weights(p, len(p), 1000, min_probability, beta)
    assert got.dtype == np.float32
    if not weights_kernel:
        assert got.tobytes() == expected.tobytes()
    else:
        assert np.isfinite(got).all()
        np.testing.assert_array_max_ulp(got, expected, maxulp=1)


async def test_weights_stay_in_0_1_for_any_beta_and_scaled_priorities_stay_finite(
    tiers: tuple[BlockStore, MetaDb], pairs: bool
) -> None:
    """(N P_min)^-beta overflowed for a large beta (the draw raised OverflowError); and a
    priority whose (p + epsilon)^alpha overflows would make the tree's total infinite:
    refused whole, as a config whose alpha or epsilon would do it to the held items."""
    buf = make(tiers, sampler="prioritized", alpha=1.0, beta=1e308, epsilon=0.0, batch_size=16)
    await buf.append([b"a", b"b"])
    await buf.update_priorities(np.array([0, 1]), np.array([1.0, 3.0]))
    batch = await buf.sample(16)
    assert {int(i): float(w) for i, w in zip(batch.indices, batch.weights, strict=True)} == {0: 1.0, 1: 0.0}
    tree_total, priorities = buf._tree.total, buf._priority.copy()
    with pytest.raises(InvalidArgument, match=r"priority 1e\+300 scales past 1e\+290 .*; none applied"):
        await buf.update_priorities(np.array([0, 1]), np.array([2.0, 1e300]))
    with pytest.raises(InvalidArgument, match=r"got nan for index 1"):  # a NaN is named before a priority too high
        await buf.update_priorities(np.array([0, 1, 0]), np.array([1e300, np.nan, 1.0]))
    buf.reconfigure({"alpha": 2.0})  # 3^2: fine
    with pytest.raises(InvalidArgument, match=r"alpha, epsilon: priority 3 scales past .*; the config stays"):
        buf.reconfigure({"alpha": 1000.0})
    assert buf.config.alpha == 2.0
    assert buf._tree.total == 10.0
    assert (buf._priority == priorities).all()
    assert tree_total == 4.0


async def test_priority_update_with_one_bad_pair_applies_none(tiers: tuple[BlockStore, MetaDb], pairs: bool) -> None:
    buf = make(tiers, sampler="prioritized")
    await buf.append([b"a", b"b"])
    before = buf._priority.copy()
    with pytest.raises(InvalidArgument, match="no live item 7; none applied"):
        await buf.update_priorities(np.array([0, 7]), np.array([5.0, 1.0]))
    with pytest.raises(InvalidArgument, match="priority must be finite and >= 0, got nan for index 1"):
        await buf.update_priorities(np.array([0, 1]), np.array([5.0, np.nan]))
    assert (buf._priority == before).all()


async def test_priority_of_an_item_that_left_is_skipped_and_the_rest_applied(
    tiers: tuple[BlockStore, MetaDb], pairs: bool
) -> None:
    buf = make(tiers, sampler="prioritized", capacity=2)
    await buf.append([b"a", b"b", b"c"])  # item 0 left (FIFO) after a learner could have sampled it
    await buf.update_priorities(np.array([0, 1, 2]), np.array([5.0, 6.0, 7.0]))
    assert buf._priority[1 % 2] == 6.0
    assert buf._priority[2 % 2] == 7.0
    assert buf.stats()["priority_updates_skipped"] == 1
    with pytest.raises(InvalidArgument, match="no live item 3; none applied"):  # never appended
        await buf.update_priorities(np.array([1, 3]), np.array([1.0, 1.0]))
    assert buf._priority[1 % 2] == 6.0


async def test_compiled_and_numpy_priority_updates_give_the_same_result_or_the_same_error(
    tiers: tuple[BlockStore, MetaDb], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random updates (pairs named twice, items that left, indices never appended,
    priorities below 0 or not finite; writable arrays, and read-only ones as a peer's
    shard gets them) applied from the same state by both paths: the same
    priorities, sums, skip count and rollback arrays, or the same error with nothing
    changed."""
    assert formats.load_compiled(), "numba is a dependency: the compiled pairs must load"
    compiled = formats.PAIRS.module
    buf = make(tiers, sampler="prioritized", capacity=8, alpha=0.6)
    await buf.append([b"x%d" % i for i in range(13)])  # items 0-4 left (FIFO)
    tree = buf._tree
    rng = np.random.default_rng(7)

    def arrays() -> list[np.ndarray]:
        return [a for a in (buf._priority, tree._sum, tree._min, tree._max) if a is not None]

    def state() -> list[np.ndarray]:
        return [a.copy() for a in arrays()]

    def restore(saved: list[np.ndarray], skipped: int) -> None:
        for target, value in zip(arrays(), saved, strict=True):
            target[:] = value
        buf.priority_updates_skipped = skipped

    for case in range(300):
        count = int(rng.integers(1, 12))
        indices = rng.integers(-1 if case % 10 == 0 else 0, 14 if case % 7 == 0 else 13, count)
        priorities = rng.random(count) * 5
        if case % 11 == 0:
            priorities[int(rng.integers(count))] = rng.choice([-1.0, np.nan, np.inf])
        start, skipped = state(), buf.priority_updates_skipped
        outcomes = []
        for module in (None, compiled):
            monkeypatch.setattr(formats.PAIRS, "module", module)
            restore(start, skipped)
            try:
                if case % 2:  # as a peer's shard gets them: read-only arrays over its message
                    pairs = np.frombuffer(indices.tobytes(), np.int64), np.frombuffer(priorities.tobytes())
                else:
                    pairs = indices.copy(), priorities.copy()
                applied, before = buf.set_priorities(*pairs)
                outcomes.append((applied.tolist(), before.tolist(), state(), buf.priority_updates_skipped))
            except InvalidArgument as exc:
                outcomes.append((str(exc), state()))
        numpy_outcome, compiled_outcome = outcomes
        assert len(numpy_outcome) == len(compiled_outcome), (case, indices, priorities)
        for a, b in zip(numpy_outcome, compiled_outcome, strict=True):
            if isinstance(a, list) and a and isinstance(a[0], np.ndarray):
                assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b, strict=True)), case
            else:
                assert a == b, (case, indices, priorities)
        if len(numpy_outcome) == 2:
            assert all(np.array_equal(x, y) for x, y in zip(numpy_outcome[1], start, strict=True)), "none applied"


async def test_new_items_get_the_current_max_priority(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, sampler="prioritized")
    await buf.append([b"a"])
    await buf.update_priorities(np.array([0]), np.array([7.0]))
    await buf.append([b"b"])
    assert buf._priority[1] == pytest.approx(7.0)


async def test_max_times_sampled_removes_items(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, sampler="fifo", max_times_sampled=1, batch_size=2)
    await buf.append([b"a", b"b", b"c"])
    assert (await buf.sample()).indices.tolist() == [0, 1]
    assert buf.live_indices().tolist() == [2]
    assert (await buf.sample(1)).indices.tolist() == [2]
    assert buf.size == 0


async def test_a_draw_uncounted_counts_nothing_until_committed(tiers: tuple[BlockStore, MetaDb]) -> None:
    """`draw_uncounted` (a sample file's next batch, drawn ahead) leaves counts, removals
    and the rate limiter as they were; `commit` counts it as `sample` would have."""
    buf = make(tiers, sampler="fifo", max_times_sampled=1, batch_size=2, samples_per_insert=1.0, error_margin=2.0)
    await buf.append([b"a", b"b", b"c"])
    changes = buf.changes
    batch = await buf.draw_uncounted(None, nonblocking=True)
    assert batch.indices.tolist() == [0, 1]
    assert (buf.samples, buf.changes, buf.live_indices().tolist()) == (0, changes, [0, 1, 2])
    assert (await buf.draw_uncounted(None, nonblocking=True)).indices.tolist() == [0, 1]  # the same state, again
    buf.commit(batch.indices)
    assert (buf.samples, buf.live_indices().tolist()) == (2, [2])
    assert buf.changes > changes


async def test_every_change_a_draw_depends_on_moves_changes(tiers: tuple[BlockStore, MetaDb]) -> None:
    """A batch drawn ahead is handed out only while `changes` stays: it moves on an
    append, a priority update, a commit, an item rewritten or removed, a reconfigure."""
    buf = make(tiers, sampler="prioritized", capacity=8)
    await buf.append([b"a", b"b", b"c"])

    async def append() -> None:
        await buf.append([b"d"])

    async def prioritise() -> None:
        await buf.update_priorities(np.array([1]), np.array([3.0]))

    async def commit() -> None:
        buf.commit(np.array([2]))

    async def rewrite() -> None:
        await buf.write_item(2, b"z")

    async def remove() -> None:
        buf.delete_item(0)
        await trio.lowlevel.checkpoint()

    async def reconfigure() -> None:
        buf.reconfigure({"batch_size": 3})

    for change in (append, prioritise, commit, rewrite, remove, reconfigure):
        before = buf.changes
        await change()
        assert buf.changes > before, change.__name__


async def test_sample_waits_for_min_size_then_times_out_or_fails_nonblocking(
    tiers: tuple[BlockStore, MetaDb],
) -> None:
    buf = make(tiers, min_size_to_sample=2, sample_timeout=0.2)
    await buf.append([b"a"])
    with pytest.raises(TryAgain, match="would block"):
        await buf.sample(1, nonblocking=True)
    with pytest.raises(TryAgain, match="after sample_timeout=0.2 s"):
        await buf.sample(1)
    assert buf.samples == 0  # nothing counted when it fails

    async def late_append() -> None:
        await trio.testing.wait_all_tasks_blocked()  # the sample is waiting for min_size
        assert buf.blocked_readers == 1
        await buf.append([b"b"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(late_append)
        batch = await buf.sample(1)
    assert len(batch.indices) == 1


async def test_appends_block_when_they_run_ahead_of_samples(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, samples_per_insert=1.0, error_margin=2.0, min_size_to_sample=1, batch_size=1, sample_timeout=0.2)
    await buf.append([b"a", b"b"])
    with pytest.raises(TryAgain, match="append"):
        await buf.append([b"c", b"d"])  # diff would pass 1 + 2
    assert buf.inserts == 3
    await buf.sample(1)
    await buf.append([b"e"])


async def test_capacity_grows_with_items_and_keeps_them(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, capacity=3)
    await buf.append([b"a", b"b", b"c", b"d"])
    buf.reconfigure({"capacity": 5})
    assert buf.live_indices().tolist() == [1, 2, 3]
    await buf.append([b"e", b"f"])
    assert buf.live_indices().tolist() == [1, 2, 3, 4, 5]
    assert bytes(await buf.read_item(1)) == b"b"


async def test_store_restores_items_priorities_and_counters(tmp_path: Path) -> None:
    _log, blocks, meta = open_tiers(tmp_path)
    store = BufferStore.load(blocks, meta)
    buf = store.create("dqn", BufferConfig(capacity=4, sampler="prioritized", compression="zstd:3"))
    await buf.append([b"item-%d" % i * 100 for i in range(6)])
    await buf.update_priorities(np.array([3, 4]), np.array([2.0, 5.0]))
    store.snapshot()
    await buf.append([b"late"])
    await buf.persist()
    await blocks.close()
    meta.close()

    _log, blocks, meta = open_tiers(tmp_path)
    store = BufferStore.load(blocks, meta)
    buf = store.get("dqn")
    assert buf.live_indices().tolist() == [3, 4, 5, 6]
    assert bytes(await buf.read_item(4)) == b"item-4" * 100
    assert buf._priority[3 % 4] == 2.0
    assert buf._priority[4 % 4] == 5.0
    assert buf._priority[6 % 4] == 5.0  # newer than the snapshot: the max
    assert (buf.next_index, buf.inserts) == (7, 7)
    assert buf.item_size(4) == 600
    await blocks.close()
    meta.close()


async def test_an_append_stages_a_row_that_does_not_grow_with_the_buffer(tiers: tuple[BlockStore, MetaDb]) -> None:
    blocks, meta = tiers
    store = BufferStore(blocks, meta)
    buf = store.create("big", BufferConfig(capacity=100_000))
    await buf.append([b"x"] * 50_000)
    store.snapshot()
    await blocks.commit()
    await buf.append([b"y"])
    staged = meta._pending["buffers"][("big",)]
    assert staged is not None
    assert staged[-1] is None  # the snapshot has a row of its own, written by snapshots only
    assert ("big",) not in meta._pending["buffer_snapshots"]


async def test_a_snapshot_in_an_older_buffers_row_is_still_restored(tmp_path: Path) -> None:
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    blocks = BlockStore(NvmeLog.open(str(tmp_path / "log")), DramCache(64 << 20), meta)
    store = BufferStore.load(blocks, meta)
    buf = store.create("old", BufferConfig(capacity=8, sampler="prioritized"))
    await buf.append([b"a", b"b"])
    await buf.update_priorities(np.array([0, 1]), np.array([3.0, 7.0]))
    store.snapshot()
    await buf.persist()
    row = next(r for r in meta.rows("buffers") if r[0] == "old")[1:]
    meta.put("buffers", ("old",), (*row[:-1], buf._snapshot))  # the snapshot in the row, as schema 4 kept it
    meta.delete("buffer_snapshots", ("old",))
    await blocks.close()
    meta.close()
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    blocks = BlockStore(NvmeLog.open(str(tmp_path / "log")), DramCache(64 << 20), meta)
    restored = BufferStore.load(blocks, meta).get("old")
    assert restored._priority[:2].tolist() == [3.0, 7.0]
    await blocks.close()
    meta.close()


def test_a_stream_reset_after_bad_input_accepts_later_writes_at_their_offsets() -> None:
    dtype = np.dtype([("a", "<i4")])
    stream = RecordStream(dtype)
    bad = io.BytesIO()
    np.save(bad, np.zeros(2, dtype=[("x", "<f8")]))
    with pytest.raises(InvalidArgument, match="is not the buffer's schema"):
        stream.feed(0, bad.getvalue())
    stream.reset()
    good = np.array([(7,)], dtype=dtype).tobytes()
    assert stream.feed(len(bad.getvalue()), good) == [good]
    assert stream.finish() == []


def test_scattered_bytes_reads_any_range_as_the_joined_bytes() -> None:
    pieces = [b"head", b"", b"x" * 10, b"yz", b"tail-end"]
    whole = b"".join(pieces)
    data = ScatteredBytes(pieces)
    assert len(data) == len(whole)
    for offset in range(len(whole) + 2):
        for size in (1, 3, 7, 30):
            parts = data.parts(offset, size)  # what a READ replies in pieces
            assert bytes(joined(parts)) == whole[offset : offset + size]
            assert b"".join(parts) == whole[offset : offset + size]
            assert all(len(part) > 0 for part in parts)


def test_scattered_bytes_join_a_read_into_the_callers_buffer() -> None:
    """A read that spans pieces goes into the buffer the caller keeps (a stream's open:
    no new memory per read) where it is big enough, whatever it held before; a read
    inside one piece stays a view of it; a buffer too small is left alone."""
    pieces = [b"head", b"", b"x" * 10, b"yz", b"tail-end"]
    whole = b"".join(pieces)
    data = ScatteredBytes(pieces)
    into = bytearray(b"#" * 16)
    for offset in range(len(whole) + 2):
        for size in (1, 3, 7, 16):
            got = joined(data.parts(offset, size), into)
            assert bytes(got) == whole[offset : offset + size]
            if isinstance(got, memoryview) and got.obj is into:
                assert len(got) == min(size, len(whole) - offset)
    spanning = joined(data.parts(2, 10), into)
    assert isinstance(spanning, memoryview)
    assert spanning.obj is into
    small = bytearray(4)
    assert bytes(joined(data.parts(2, 10), small)) == whole[2:12]
    assert small == bytearray(4)


async def test_concurrent_appenders_keep_fifo_order_in_a_small_ring(tiers: tuple[BlockStore, MetaDb]) -> None:
    """Two appenders race through a ring of 4 with DRAM waits in between; whatever the
    interleaving, the live items are the newest 4 indices, each with its own bytes."""
    buf = make(tiers, capacity=4)
    payload = {}

    async def writer(tag: bytes) -> None:
        for i in range(10):
            item = tag + b"%d" % i
            (index,) = await buf.append([item])
            payload[index] = item
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, b"a")
        nursery.start_soon(writer, b"b")
    assert buf.live_indices().tolist() == [16, 17, 18, 19]
    for index in range(16, 20):
        assert bytes(await buf.read_item(index)) == payload[index]
    assert (buf.inserts, buf.removed, buf.size) == (20, 16, 4)


async def test_fifo_churn_drops_whole_segments_and_copies_nothing(tmp_path: Path) -> None:
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    blocks = BlockStore(NvmeLog.open(str(tmp_path / "log"), segment_bytes=4 << 20), DramCache(256 << 20), meta)
    buf = ReplayBuffer("ring", 1 << 48, BufferConfig(capacity=20), blocks, meta)
    for start in range(0, 120, 10):
        await buf.append([bytes([i]) * 1_000_000 for i in range(start, start + 10)])
        await buf.persist()
        await blocks.compact()  # a pass between every two appends
    stats = blocks.statistics()
    assert stats.moved_bytes == 0  # edge segments were still shrinking: never copied
    assert stats.reclaimed_bytes > 70_000_000
    await blocks.compact()
    await blocks.compact()  # appends stopped: the edge segment is stable, compacted once
    assert blocks.statistics().moved_bytes <= 4 << 20
    assert buf.live_indices().tolist() == list(range(100, 120))
    assert bytes(await buf.read_item(119)) == bytes([119]) * 1_000_000
    await blocks.close()
    meta.close()


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
async def test_an_item_removed_at_the_draws_schedule_point_never_sends_it_past_the_ring(
    tiers: tuple[BlockStore, MetaDb], sampler: str
) -> None:
    """A draw asks the rate limiter, then yields once before it picks. Another request
    that removes the last item there (an item's unlink) left it walking an empty tree:
    past the ring's last slot, IndexError, an internal error of the mount. Trio runs
    the two in either order; forty rounds meet the bad one with certainty (2**-40)."""
    buf = make(tiers, sampler=sampler, capacity=1000)
    outcomes: Counter[str] = Counter()
    for round_ in range(40):
        await buf.append([b"item"])

        async def draw(index: int) -> None:
            try:
                batch = await buf.sample(4, nonblocking=True)
                outcomes["drawn"] += 1
                assert batch.indices.tolist() == [index] * 4
            except TryAgain:
                outcomes["EAGAIN"] += 1

        async def remove(index: int) -> None:
            await trio.lowlevel.checkpoint()
            buf.delete_item(index)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(draw, round_)
            nursery.start_soon(remove, round_)
        assert buf.size == 0
    assert outcomes["drawn"] + outcomes["EAGAIN"] == 40
    assert outcomes["EAGAIN"] > 0  # (the order that used to fail)


async def test_an_item_drawn_twice_in_a_batch_counts_twice(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, sampler="uniform", batch_size=3, max_times_sampled=5)
    await buf.append([b"only"])
    assert (await buf.sample()).indices.tolist() == [0, 0, 0]
    assert buf._times[0] == 3
    await buf.sample()  # 6 >= 5: removed after this batch
    assert buf.size == 0
    assert buf.removed == 1


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(0, 3000), max_size=6),
)
def test_framed_items_come_out_whole_however_the_writes_are_cut(items: list[bytes], cuts: list[int]) -> None:
    data = frame_items(items)
    bounds = sorted({0, len(data), *[c % (len(data) + 1) for c in cuts]})
    stream = BlobStream()
    out: list[bytes] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        out.extend(bytes(i) for i in stream.feed(start, data[start:end]))
    out.extend(bytes(i) for i in stream.finish())
    assert out == items


def test_a_frame_over_the_item_limit_is_refused_whole_frames_before_it_or_not() -> None:
    for before in ([], [b"ok"] * 3):
        stream = BlobStream()
        data = frame_items(before) + formats.FRAME.pack(formats.MAX_ITEM_BYTES + 1) + b"x" * 16
        with pytest.raises(InvalidArgument, match=rf"frame of {formats.MAX_ITEM_BYTES + 1} bytes exceeds"):
            stream.feed(0, data)


def test_a_partial_frame_at_close_is_refused() -> None:
    stream = BlobStream()
    data = frame_items([b"abcdef"])
    stream.feed(0, data[:-2])
    with pytest.raises(InvalidArgument, match=r"a partial frame at close \(4 of 6 bytes\); not added"):
        stream.finish()


async def test_compressed_items_sample_back_as_their_original_bytes(tiers: tuple[BlockStore, MetaDb]) -> None:
    buf = make(tiers, compression="zstd:3", batch_size=8)
    items = [bytes([i]) * 50_000 for i in range(4)]
    await buf.append(items)
    stats = buf._blocks.statistics()
    assert stats.dram_used_bytes - stats.dram_index_bytes < 4 * 50_000  # stored compressed (the ring aside)
    batch = decode_blob_batch((await buf.sample()).data.tobytes())  # type: ignore[union-attr]
    assert len(batch) == 8
    for index, _weight, item in batch:
        assert item == items[index]


def test_segment_tree_bulk_update_matches_small_updates() -> None:
    rng = np.random.default_rng(3)
    capacity = 1000
    slots = rng.permutation(capacity)[:900]
    values = rng.random(900) * (rng.random(900) > 0.1)  # some zero leaves
    bulk, small = SegmentTree(capacity, with_min_max=True), SegmentTree(capacity, with_min_max=True)
    bulk.update(slots, values)  # 900 >= 1024 // 8: rebuilds every level
    for start in range(0, 900, 7):
        small.update(slots[start : start + 7], values[start : start + 7])
    assert bulk.total == pytest.approx(small.total)
    assert (bulk.min, bulk.max) == (small.min, small.max)
    prefixes = rng.random(200) * bulk.total
    assert (bulk.find(prefixes) == small.find(prefixes)).all()
    bulk.update(slots[:3], np.array([5.0, 0.0, 2.0]))  # small updates on a rebuilt tree
    small.update(slots[:3], np.array([5.0, 0.0, 2.0]))
    assert bulk.total == pytest.approx(small.total)
    assert (bulk.min, bulk.max) == (small.min, small.max)


# --- log-only appends and the log's tail ------------------------------------------------


def open_tiers(tmp_path: Path, budget: int = 64 << 20) -> tuple[NvmeLog, BlockStore, MetaDb]:
    log = NvmeLog.open(str(tmp_path / "log"))
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    return log, BlockStore(log, DramCache(budget), meta), meta


async def crash_and_reload(tmp_path: Path, old: tuple[NvmeLog, BlockStore, MetaDb]) -> tuple[BlockStore, BufferStore]:
    """What a kill -9 leaves: the log's bytes and the committed rows; nothing staged."""
    old_log, _old_blocks, old_meta = old
    _log, blocks, meta = open_tiers(tmp_path)
    old_log.close()  # no flush, no commit: the old process is gone
    old_meta._conn.close()
    await blocks.read_tail()
    store = BufferStore.load(blocks, meta)
    blocks.forget_tail()
    return blocks, store


@pytest.mark.parametrize("inline", [True, False], ids=["on-the-event-loop", "from-a-thread"])
async def test_appends_persisted_log_only_come_back_after_a_crash_before_any_commit(
    tmp_path: Path, inline: bool
) -> None:
    tiers = open_tiers(tmp_path)
    _log, blocks, meta = tiers
    blocks._inline_ok = inline  # what the dirty page watch decides (kernel below its background threshold)
    store = BufferStore.load(blocks, meta)
    buf = store.create("dqn", BufferConfig(capacity=100, compression="zstd:3"))
    await blocks.commit()
    commits = meta.commits
    for i in range(20):
        await buf.append([b"item-%d" % i * 50])
        await buf.persist_appends()
    assert meta.commits == commits  # nothing committed: the records are in the log alone
    assert blocks.inline_appends == (20 if inline else 0)
    assert blocks.owner_dirty_bytes(buf.owner) == 0

    blocks, store = await crash_and_reload(tmp_path, tiers)
    buf = store.get("dqn")
    assert buf.live_indices().tolist() == list(range(20))
    assert [bytes(await buf.read_item(i)) for i in (0, 7, 19)] == [b"item-%d" % i * 50 for i in (0, 7, 19)]
    assert (buf.next_index, buf.inserts) == (20, 20)
    await blocks.commit()  # the adopted rows commit: a second crash keeps them without a tail
    await buf.append([b"next"])
    assert buf.live_indices().tolist()[-1] == 20
    await blocks.close()


async def test_appends_into_a_buffer_whose_row_never_committed_commit_it_first(tmp_path: Path) -> None:
    # A peer's shard is made by the store with no commit after it: a log-only append
    # would leave items that a start-up cannot adopt (it finds no row to adopt them into).
    tiers = open_tiers(tmp_path)
    _log, blocks, meta = tiers
    store = BufferStore.load(blocks, meta)
    buf = store.create("shard", BufferConfig(capacity=100))
    assert not buf.row_committed
    commits = meta.commits
    await buf.append([b"first"])
    await buf.persist_appends()
    assert buf.row_committed  # this append committed the row
    assert meta.commits == commits + 1
    for i in range(5):
        await buf.append([b"item-%d" % i])
        await buf.persist_appends()
    assert meta.commits == commits + 1  # and the next ones went to the log alone

    blocks, store = await crash_and_reload(tmp_path, tiers)
    buf = store.get("shard")
    assert buf.row_committed
    assert buf.live_indices().tolist() == list(range(6))
    assert bytes(await buf.read_item(0)) == b"first"
    assert bytes(await buf.read_item(5)) == b"item-4"
    await blocks.close()


async def test_a_failed_commit_does_not_count_as_carrying_the_row(tmp_path: Path) -> None:
    _log, blocks, meta = open_tiers(tmp_path)
    store = BufferStore.load(blocks, meta)
    buf = store.create("b", BufferConfig())

    def refuse() -> None:
        raise OSError(errno.EIO, "the log's fsync failed")

    with pytest.raises(OSError):
        await meta.commit(before_commit=refuse)
    assert not buf.row_committed
    await meta.commit()
    assert buf.row_committed
    await blocks.close()


async def test_priority_updates_since_the_last_snapshot_come_back_exactly_after_a_crash(tmp_path: Path) -> None:
    tiers = open_tiers(tmp_path)
    _log, blocks, meta = tiers
    store = BufferStore.load(blocks, meta)
    config = BufferConfig(capacity=10, sampler="prioritized", alpha=1.0, epsilon=0.0)
    buf = store.create("per", config)
    await buf.append([b"item-%d" % i for i in range(8)])
    await buf.persist()
    await buf.update_priorities(np.array([0, 1, 2]), np.array([5.0, 6.0, 7.0]))
    assert await store.snapshot_in_thread() == 1  # a snapshot has 5, 6, 7 ...
    await blocks.commit()
    await buf.update_priorities(np.array([1, 3]), np.array([0.5, 2.0]))  # ... these come after it
    await buf.update_priorities(np.array([3, 7]), np.array([4.0, 0.25]))  # the last word on 3
    buf.delete_item(2)
    await buf.persist()
    expected = {0: 5.0, 1: 0.5, 3: 4.0, 4: 1.0, 5: 1.0, 6: 1.0, 7: 0.25}

    blocks, store = await crash_and_reload(tmp_path, tiers)
    buf = store.get("per")
    assert buf.live_indices().tolist() == sorted(expected)
    leaves = buf.priority_tree.leaves()
    assert {i: float(leaves[i]) for i in buf.live_indices().tolist()} == expected
    assert buf.priority_tree.total == pytest.approx(sum(expected.values()))
    await blocks.close()


async def test_a_priority_update_whose_note_is_not_written_is_not_applied(tmp_path: Path) -> None:
    # Cancelled while an earlier note holds the log (as a full disk's StoreFull would
    # fail it): the write reports the failure and the buffer keeps its priorities.
    _log, blocks, meta = open_tiers(tmp_path)
    store = BufferStore.load(blocks, meta)
    buf = store.create("per", BufferConfig(capacity=10, sampler="prioritized", alpha=1.0, epsilon=0.0))
    await buf.append([b"a", b"b", b"c"])
    await buf.update_priorities(np.array([0, 1, 2]), np.array([1.0, 2.0, 3.0]))
    held, done = trio.Event(), trio.Event()

    async def earlier_note() -> None:
        async with blocks._notes_lock:  # an earlier note still being written
            held.set()
            await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(earlier_note)
        await held.wait()
        with trio.move_on_after(0.05) as scope:
            await buf.update_priorities(np.array([1, 2]), np.array([9.0, 9.0]))
        done.set()
    assert scope.cancelled_caught
    assert buf.priority_tree.leaves()[:3].tolist() == [1.0, 2.0, 3.0]
    await blocks.close()


async def test_notes_of_a_deleted_buffer_do_not_hold_the_log_past_the_next_snapshot_pass(tmp_path: Path) -> None:
    _log, blocks, meta = open_tiers(tmp_path)
    store = BufferStore.load(blocks, meta)
    buf = store.create("gone", BufferConfig(capacity=10, sampler="prioritized"))
    await buf.append([b"a", b"b"])
    await buf.persist()
    await buf.update_priorities(np.array([0]), np.array([3.0]))
    assert blocks.notes_waiting()  # compaction keeps the note's segment ...
    store.delete("gone")
    assert await store.snapshot_in_thread() == 0  # no buffer to snapshot, but the mark moves
    assert blocks.notes_mark_staged()
    await blocks.commit()
    assert not blocks.notes_waiting()  # ... until then
    assert blocks.notes_hold() is None
    await blocks.close()


async def test_a_tail_past_the_capacity_evicts_again_and_counts_it(tmp_path: Path) -> None:
    tiers = open_tiers(tmp_path)
    _log, blocks, meta = tiers
    store = BufferStore.load(blocks, meta)
    buf = store.create("ring", BufferConfig(capacity=4))
    await blocks.commit()
    for i in range(6):
        await buf.append([b"%d" % i])
        await buf.persist_appends()

    blocks, store = await crash_and_reload(tmp_path, tiers)
    buf = store.get("ring")
    assert buf.live_indices().tolist() == [2, 3, 4, 5]
    assert (buf.inserts, buf.removed) == (6, 2)
    assert not blocks.has_block(buf.key(0))
    assert not blocks.has_block(buf.key(1))
    await blocks.close()


async def test_a_tail_record_of_an_item_whose_removal_committed_stays_removed(tmp_path: Path) -> None:
    tiers = open_tiers(tmp_path)
    log, blocks, meta = tiers
    store = BufferStore.load(blocks, meta)
    buf = store.create("q", BufferConfig(capacity=10))
    await blocks.commit()
    mark = log.position()
    await buf.append([b"a", b"b", b"c"])
    await buf.persist_appends()
    buf.delete_item(1)
    await blocks.commit()
    # A commit whose mark is older than these records (a flush was in flight): the tail
    # holds item 1's record although its removal committed.
    meta.put("kv", ("log_mark",), (f"{mark.segment} {mark.offset}",))
    await meta.commit()

    blocks, store = await crash_and_reload(tmp_path, tiers)
    buf = store.get("q")
    assert buf.live_indices().tolist() == [0, 2]
    assert bytes(await buf.read_item(2)) == b"c"
    await blocks.close()


async def test_tail_records_of_other_owners_are_not_adopted(tmp_path: Path) -> None:
    tiers = open_tiers(tmp_path)
    log, blocks, meta = tiers
    store = BufferStore.load(blocks, meta)
    store.create("b", BufferConfig())
    await blocks.commit()
    await blocks.put(BlockKey(5, 0), b"a file's block, flushed but not committed")
    await blocks.flush()

    blocks, store = await crash_and_reload(tmp_path, tiers)
    assert not blocks.has_block(BlockKey(5, 0))
    assert store.get("b").size == 0
    await blocks.close()


async def test_warm_up_reads_restored_buffers_into_dram_while_they_fit_in_half_the_budget(tmp_path: Path) -> None:
    _log, blocks, meta = open_tiers(tmp_path, budget=4 << 20)
    store = BufferStore.load(blocks, meta)
    small, big = store.create("small", BufferConfig(capacity=1000)), store.create("big", BufferConfig(capacity=1000))
    await small.append([b"s" * 1000] * 500)  # 0.5 MB: fits in half of 4 MiB
    await big.append([b"b" * 100_000] * 30)  # 3 MB: does not
    await blocks.close()
    meta.close()

    _log, blocks, meta = open_tiers(tmp_path, budget=4 << 20)
    store = BufferStore.load(blocks, meta)
    assert blocks.dram_bytes(store.get("small").owner) == 0  # a restart starts cold
    assert await store.warm_up(4 << 20) == 500
    assert blocks.dram_bytes(store.get("small").owner) == 500 * 1000
    assert blocks.dram_bytes(store.get("big").owner) == 0
    await blocks.close()
    meta.close()


async def test_the_warm_up_runs_no_full_collection_and_gives_collections_back(tmp_path: Path) -> None:
    """A block object per item read in: Python's automatic full collections, each visiting
    every object, took 2.9 s of a million items' 7.3 s warm-up. The warm-up holds them off
    (memory.full_collections_held), collects only the young generations between chunks
    and runs one full collection as it ends."""
    _log, blocks, meta = open_tiers(tmp_path, budget=256 << 20)
    store = BufferStore.load(blocks, meta)
    items = 60_000
    await store.create("many", BufferConfig(capacity=items)).append([b"%d" % i for i in range(items)])
    await blocks.close()
    meta.close()

    _log, blocks, meta = open_tiers(tmp_path, budget=256 << 20)
    store = BufferStore.load(blocks, meta)
    gc.collect()
    full: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(info["collected"])

    gc.callbacks.append(seen)
    try:
        assert await store.warm_up(256 << 20) == items
    finally:
        gc.callbacks.remove(seen)
    assert len(full) == 1, f"{len(full)} full collections during the warm-up, not only the one that ends it"
    assert gc.isenabled()
    assert blocks.dram_bytes(store.get("many").owner) > 0
    await blocks.close()
    meta.close()


async def test_the_periodic_snapshot_encodes_in_a_thread_and_restores_the_same(tmp_path: Path) -> None:
    tiers = open_tiers(tmp_path)
    _log, blocks, meta = tiers
    store = BufferStore.load(blocks, meta)
    buf = store.create("p", BufferConfig(capacity=8, sampler="prioritized"))
    await buf.append([b"%d" % i for i in range(10)])  # 0 and 1 left (FIFO)
    await buf.update_priorities(np.array([2, 9]), np.array([3.0, 7.0]))
    assert await store.snapshot_in_thread() == 1
    assert await store.snapshot_in_thread() == 0  # nothing changed since
    await buf.persist()

    blocks, store = await crash_and_reload(tmp_path, tiers)
    buf = store.get("p")
    assert buf.live_indices().tolist() == list(range(2, 10))
    assert (buf._priority[2 % 8], buf._priority[9 % 8]) == (3.0, 7.0)
    await blocks.close()


# --- a draw's blocks by ring slot -----------------------------------------------------------


def held_blocks_are_resident(buf: ReplayBuffer, blocks: BlockStore) -> int:
    """Every item view a buffer keeps by ring slot is of the buffer of the block DRAM
    holds for the item in that slot now; returns how many it keeps."""
    held = buf._held
    assert held is not None
    kept = 0
    for slot, view in enumerate(held.tolist()):
        if view is not None:
            index = int(buf._slot_index[slot])
            assert index >= 0, slot
            block = blocks._dram.peek(BlockKey(buf.owner, index))
            assert block is not None, slot
            if isinstance(view, bytes):  # a small item's copy (COPIED_ITEM_BYTES)
                assert view == bytes(block.buf[: block.length]), slot
            else:
                assert view.obj is block.buf, slot
            assert len(view) == block.length, slot
            kept += 1
    return kept


def numbered(index: int) -> bytes:
    return index.to_bytes(8, "little") * 8192  # 64 KiB naming its index


async def draw_and_check(buf: ReplayBuffer) -> None:
    for index, _weight, data in decode_blob_batch((await buf.sample()).data.tobytes()):  # type: ignore[union-attr]
        assert bytes(data) == numbered(index)


async def test_draws_by_ring_slot_stay_right_while_dram_evicts_and_the_ring_turns(tmp_path: Path) -> None:
    """A buffer whose items are not in record rows keeps each drawn item's block by ring
    slot; DRAM tells it of every block that leaves (evicted to make room, deleted when
    the ring turns past it), so a draw never serves bytes of another item or a block
    DRAM let go (whose buffer it may reuse)."""
    _log, blocks, meta = open_tiers(tmp_path, budget=4 << 20)  # room for about 60 items of 64 KiB
    config = BufferConfig().updated("held", {"capacity": 128, "batch_size": 16}, has_items=False)
    buf = ReplayBuffer("held", 1 << 44, config, blocks, meta)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocks.run_flusher, 0.01)  # cleans what appends dirty, so DRAM can evict
        appended = 0
        for step in range(120):
            if step % 3 == 0:  # the ring turns past 128: FIFO evictions delete the oldest items' blocks
                await buf.append([numbered(appended + k) for k in range(8)])
                appended += 8
            await draw_and_check(buf)
            held_blocks_are_resident(buf, blocks)
        nursery.cancel_scope.cancel()
    assert appended > 128
    assert blocks.statistics().dram_evictions > 0  # DRAM did evict under the draws
    await blocks.close()
    meta.close()


async def test_draws_come_from_the_ring_slot_table_once_each_item_was_drawn(tiers: tuple[BlockStore, MetaDb]) -> None:
    blocks, meta = tiers
    config = BufferConfig().updated("roomy", {"capacity": 64, "batch_size": 16}, has_items=False)
    buf = ReplayBuffer("roomy", 1 << 45, config, blocks, meta)
    await buf.append([numbered(k) for k in range(64)])
    for _ in range(40):
        await draw_and_check(buf)
    assert held_blocks_are_resident(buf, blocks) > 48
    hits = blocks.statistics().dram_hits
    for _ in range(5):
        await draw_and_check(buf)
    assert blocks.statistics().dram_hits < hits + 5 * 16  # (items found in the table ask DRAM nothing)
    buf._held[:] = None  # type: ignore[index]  # as after a start-up: the warm-up fills the table
    await buf.warm(np.arange(64))
    assert held_blocks_are_resident(buf, blocks) == 64
    await buf.append([numbered(k) for k in range(64, 128)])  # the ring turns: 0..63 leave
    await buf.warm(np.arange(64))  # items that left: nothing kept for their slots
    assert held_blocks_are_resident(buf, blocks) == 0
    await buf.warm(np.arange(64, 128))
    assert held_blocks_are_resident(buf, blocks) == 64
    await draw_and_check(buf)
    buf.delete_all()
    assert buf._held is None
    # a ring whose table would take more than its share of the DRAM budget (64 MiB / 64 here) has none
    config = BufferConfig().updated("wide", {"capacity": 200_000, "batch_size": 16}, has_items=False)
    wide = ReplayBuffer("wide", 1 << 47, config, blocks, meta)
    assert wide._held is None
    await wide.append([numbered(k) for k in range(64)])
    await draw_and_check(wide)


async def test_small_items_are_drawn_as_copies_that_follow_their_items(tiers: tuple[BlockStore, MetaDb]) -> None:
    """Items up to COPIED_ITEM_BYTES are drawn as bytes, which Python's cyclic collector
    does not track (a million views drawn at once ran six full collections); the copy
    kept by ring slot goes when its item is replaced or leaves, as a view does."""
    blocks, meta = tiers
    config = BufferConfig().updated("tiny", {"capacity": 16, "batch_size": 64}, has_items=False)
    buf = ReplayBuffer("tiny", 1 << 43, config, blocks, meta)
    expected = {k: b"item %d " % k * 2 for k in range(16)}
    await buf.append(list(expected.values()))

    async def draw() -> None:
        for index, _weight, data in decode_blob_batch((await buf.sample()).data.tobytes()):  # type: ignore[union-attr]
            assert bytes(data) == expected[index]

    for _ in range(10):
        await draw()
    assert held_blocks_are_resident(buf, blocks) == 16
    assert buf._held is not None
    assert all(isinstance(v, bytes) and not gc.is_tracked(v) for v in buf._held.tolist())
    expected[3] = b"three, replaced!" * 8  # 128 bytes: still a copy
    await buf.write_item(3, expected[3])
    for _ in range(10):
        await draw()
    assert held_blocks_are_resident(buf, blocks) == 16
    expected = {16 + k: b"later %d" % k for k in range(16)}  # the ring turns: every item leaves
    await buf.append(list(expected.values()))
    for _ in range(10):
        await draw()
    assert held_blocks_are_resident(buf, blocks) == 16
    wide = b"w" * (COPIED_ITEM_BYTES + 1)  # a view
    await buf.append([wide] * 16)
    expected = {32 + k: wide for k in range(16)}
    await draw()
    assert any(isinstance(v, memoryview) for v in buf._held.tolist())


async def test_the_ring_slot_table_takes_no_block_whose_item_left_or_that_dram_let_go(
    tiers: tuple[BlockStore, MetaDb], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a draw reads from the block tier while its items leave the ring (an append
    during the read's await) or without DRAM keeping it (no room) is served, but never
    kept by ring slot: the next draws would serve it for another item."""
    blocks, meta = tiers
    config = BufferConfig().updated("racy", {"capacity": 8, "batch_size": 16}, has_items=False)
    buf = ReplayBuffer("racy", 1 << 46, config, blocks, meta)
    await buf.append([numbered(k) for k in range(8)])
    get_many = blocks.get_many

    async def ring_turns_meanwhile(keys: list[BlockKey]) -> list[object]:
        found = await get_many(keys)
        monkeypatch.setattr(blocks, "get_many", get_many)
        await buf.append([numbered(8 + k) for k in range(8)])  # every item drawn leaves
        return found

    monkeypatch.setattr(blocks, "get_many", ring_turns_meanwhile)
    batch = decode_blob_batch((await buf.sample()).data.tobytes())  # type: ignore[union-attr]
    assert all(bytes(data) == numbered(index) and index < 8 for index, _w, data in batch)
    assert held_blocks_are_resident(buf, blocks) == 0
    for _ in range(5):
        await draw_and_check(buf)

    async def not_kept(keys: list[BlockKey]) -> list[object]:
        found = await get_many(keys)
        for key in keys:
            blocks._dram.remove(key)  # as a read that found no room in DRAM leaves it
        return found

    monkeypatch.setattr(blocks, "get_many", not_kept)
    buf._held[:] = None  # type: ignore[index]
    await draw_and_check(buf)
    assert held_blocks_are_resident(buf, blocks) == 0


async def test_a_big_batch_is_encoded_in_a_worker_thread_and_a_small_one_on_the_spot() -> None:
    """encoded_batch: the same bytes as encode_batch; from THREAD_ENCODE_ITEMS items on,
    made in a worker thread while other tasks run (a million small items took 0.35 s of
    Python), and below it without a schedule point (a batch of 32 would pay a thread's
    round trip)."""
    config = BufferConfig()
    state = {"turns": 0, "encoding": True}

    async def other() -> None:
        while state["encoding"]:
            state["turns"] += 1
            await trio.lowlevel.checkpoint()

    for count in (32, THREAD_ENCODE_ITEMS):
        payloads = [b"%d" % i for i in range(count)]
        indices, weights = np.arange(count), np.ones(count, np.float32)
        state["encoding"] = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.lowlevel.checkpoint()
            state["turns"] = 0
            batch = await encoded_batch(config, payloads, indices, weights)
            turns = state["turns"]
            state["encoding"] = False
        assert batch.data.tobytes() == encode_batch(config, payloads, indices, weights).tobytes()  # type: ignore[union-attr]
        assert (turns > 0) == (count >= THREAD_ENCODE_ITEMS)


@pytest.mark.parametrize("item_bytes", [16, 200])  # copies (COPIED_ITEM_BYTES) and views
async def test_a_big_draw_gathers_its_items_in_slices_while_other_tasks_run_and_appends_turn_the_ring(
    tiers: tuple[BlockStore, MetaDb], monkeypatch: pytest.MonkeyPatch, item_bytes: int
) -> None:
    """A draw whose items the ring slot table lacks gathers them HELD_FILL_SLICE at a time,
    with other tasks run between slices (sample.1000000 of a blob buffer whose items were
    never drawn held the mount for 1.5-3 s). Items that leave meanwhile (an appender turns
    the ring in every pause) make it draw again, from the buffer as it is then; the last
    of HELD_FILL_ROUNDS draws looks its items up in one go. Every item served is the
    item its index names, and was live when the draw was made."""
    monkeypatch.setattr(buffer_module, "HELD_FILL_SLICE", 256)
    blocks, meta = tiers
    capacity = 12_000  # (a draw under THREAD_ENCODE_ITEMS: its encoding yields nothing)
    config = BufferConfig().updated("big", {"capacity": capacity, "batch_size": 16}, has_items=False)
    buf = ReplayBuffer("big", 1 << 42, config, blocks, meta)

    def item(index: int) -> bytes:
        return (b"%015d " % index) * (item_bytes // 16)

    await buf.append([item(k) for k in range(capacity)])
    assert buf._held is not None
    assert all(v is None for v in buf._held.tolist())
    turns = 0
    appended = capacity
    appending = True

    async def other(appends: bool) -> None:
        nonlocal turns, appended
        while appending:
            turns += 1
            if appends:
                await buf.append([item(appended + k) for k in range(64)])
                appended += 64
            await trio.lowlevel.checkpoint()

    for appends in (False, True):
        buf._held[:] = None
        turns = 0
        appending = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other, appends)
            batch = await buf.sample(capacity)
            live = set(buf.live_indices().tolist())
            appending = False
        decoded = decode_blob_batch(batch.data.tobytes())  # type: ignore[union-attr]
        assert len(decoded) == capacity
        assert all(bytes(data) == item(index) for index, _w, data in decoded)
        if not appends:
            assert turns >= 15  # ~7,600 distinct items not held, 256 a slice
            assert {index for index, _w, _d in decoded} <= live
            assert held_blocks_are_resident(buf, blocks) > capacity // 2
        else:
            assert appended > capacity + 64 * 20  # the ring turned under the draw (all of it, here)
            held_blocks_are_resident(buf, blocks)  # what is kept by slot is each slot's item now


def test_a_buffer_made_without_a_config_gets_the_biggest_ring_that_fits_its_room() -> None:
    assert default_capacity(1 << 30) == BufferConfig().capacity
    assert default_capacity(ring_index_bytes(MIN_DEFAULT_CAPACITY) - 1) is None
    for room in (ring_index_bytes(MIN_DEFAULT_CAPACITY), 100_000, 4 << 20, 8 << 20, ring_index_bytes(100_000) - 1):
        capacity = default_capacity(room)
        assert capacity is not None
        assert MIN_DEFAULT_CAPACITY <= capacity < BufferConfig().capacity
        assert ring_index_bytes(capacity) <= room < ring_index_bytes(capacity + 1)


async def test_a_rings_arrays_and_trees_count_against_the_dram_budget(tmp_path: Path) -> None:
    """A capacity of 2**26 made 2 GB of arrays and trees for an empty buffer (3.5 s of the
    event loop), outside the DRAM budget: now a ring's memory (ring_index_bytes) is counted
    in it, a config whose ring does not fit is EINVAL with nothing changed, and the
    ring's share is given back when the buffer goes."""
    _log, blocks, meta = open_tiers(tmp_path, budget=64 << 20)
    store = BufferStore.load(blocks, meta)
    buf = store.create("r", BufferConfig(capacity=1000))
    assert blocks.statistics().dram_index_bytes == ring_index_bytes(1000)
    await buf.append([b"x" * 100] * 10)
    with pytest.raises(InvalidArgument, match=r"capacity: a ring of 16777216 slots takes \d+ bytes"):
        buf.reconfigure({"capacity": 1 << 24})
    assert buf.config.capacity == 1000
    assert blocks.statistics().dram_index_bytes == ring_index_bytes(1000)
    buf.reconfigure({"capacity": 100_000})  # 11.6 MB: fits
    assert blocks.statistics().dram_index_bytes == ring_index_bytes(100_000)
    assert buf.size == 10
    store.delete("r")
    assert blocks.statistics().dram_index_bytes == 0
    await blocks.close()
    meta.close()
