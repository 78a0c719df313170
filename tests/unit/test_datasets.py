"""The dataset store without a mount: appends, seal, records, orders, streams, restarts."""

from __future__ import annotations

import errno
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from distorefs.errors import DistorefsError
from distorefs.stores.datasets import dataset as dataset_module
from distorefs.stores.datasets import store as store_module
from distorefs.stores.datasets import stream as stream_module
from distorefs.stores.datasets.dataset import Dataset
from distorefs.stores.datasets.formats import MAX_RECORD_BYTES, OrderInput, OrderSpec, shuffled
from distorefs.stores.datasets.store import DatasetStore
from distorefs.stores.datasets.stream import FITS_IN_FLIGHT, Stream
from distorefs.stores.replay.formats import decode_blob_batch
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from distorefs.types import BlockKey, LogLocation
from tests.unit.tiers import open_tiers

BLOCK = 64 * 1024
WINDOW = 256 * 1024


def open_store(path: Path, dram_blocks: int = 64) -> tuple[DatasetStore, BlockStore, MetaDb]:
    blocks, meta = open_tiers(path, BLOCK, dram_blocks)
    return DatasetStore.load(blocks, meta, WINDOW), blocks, meta


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[DatasetStore]:
    datasets, blocks, meta = open_store(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        yield datasets
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


def blobs(count: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes() for _ in range(count)]


async def read_all(stream: Stream, chunk: int = 100_000) -> bytes:
    out = bytearray()
    while True:
        piece = await stream.read(len(out), chunk)
        if not piece:
            return bytes(out)
        out += piece


async def stream_once(datasets: DatasetStore, ds: Dataset) -> list[tuple[int, float, bytes | memoryview]]:
    """One whole blob stream of `ds` (its prefetch running), decoded."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        stream = await datasets.open_stream(ds, 0, 1)
        batch = decode_blob_batch(await read_all(stream, chunk=1 << 20))
        datasets.close_stream(stream)
        nursery.cancel_scope.cancel()
    return batch


def order_of(text: bytes, count: int) -> tuple[OrderSpec, np.ndarray | None]:
    parser = OrderInput("d", count)
    assert parser.feed(text) is None
    done = parser.finish()
    assert done is not None
    return done


async def test_blob_records_read_back_and_seal_refuses_appends(store: DatasetStore) -> None:
    ds = store.create("d")
    items = blobs(300)
    await ds.append(items[:100])
    await ds.append(items[100:])
    await ds.persist()
    assert ds.count == 300
    for i in (0, 17, 299):
        assert bytes(await ds.read_record(i, 0, 1 << 20)) == items[i]
    await ds.seal()
    with pytest.raises(DistorefsError) as err:
        await ds.append([b"late"])
    assert err.value.errno == errno.EROFS
    assert ds.count == 300


async def test_a_big_append_is_applied_in_slices_others_wait_their_turn_and_order_holds(
    store: DatasetStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A WRITE of 1 MiB of 8-byte records is 65,536 records: applied APPEND_SLICE at a
    time, other tasks run between slices; a second append made meanwhile waits for the
    whole first one, so each call's records stay together and in order, and a bad
    record refuses its call before any of it is added."""
    monkeypatch.setattr(dataset_module, "APPEND_SLICE", 100)
    ds = store.create("d")
    first = [b"a%07d" % i for i in range(1000)]
    second = [b"b%07d" % i for i in range(50)]
    turns = 0
    counts_seen: set[int] = set()

    async def other() -> None:
        nonlocal turns
        while ds.count < 1050:
            turns += 1
            counts_seen.add(ds.count)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        nursery.start_soon(ds.append, first)
        await trio.lowlevel.checkpoint()
        nursery.start_soon(ds.append, second)
    assert turns >= 9  # between the ten slices
    # visible slice by slice, each slice whole (which ones are seen depends on trio's order of runnable tasks)
    assert len({c for c in counts_seen if 0 < c < 1000}) >= 5
    assert all(c % 100 == 0 for c in counts_seen)
    assert [bytes(await ds.read_record(i, 0, 64)) for i in range(1050)] == first + second
    with pytest.raises(DistorefsError) as err:
        await ds.append([b"ok"] * 300 + [b"x" * (MAX_RECORD_BYTES + 1)])
    assert err.value.errno == errno.EINVAL
    assert ds.count == 1050


async def test_stream_follows_the_order_and_shards_split_it(store: DatasetStore) -> None:
    ds = store.create("d")
    items = blobs(500, seed=1)
    await ds.append(items)
    await ds.seal()
    await ds.set_order(*order_of(b"shuffle 7\n", ds.count))
    order = shuffled(7, 500)
    seen: list[int] = []
    for rank in range(3):
        stream = await store.open_stream(ds, rank, 3)
        batch = decode_blob_batch(await read_all(stream, chunk=4096))
        store.close_stream(stream)
        assert [i for i, _w, _b in batch] == order[rank::3].tolist()
        assert all(item == items[i] for i, _w, item in batch)
        seen += [i for i, _w, _b in batch]
    assert sorted(seen) == list(range(500))


async def test_schema_stream_is_a_npy_of_records_with_index(store: DatasetStore) -> None:
    dtype = np.dtype([("label", "<i4"), ("x", "<f4", (3,))])
    ds = store.create("s")
    ds.reconfigure({"schema": {"label": "int32", "x": ["float32", [3]]}})
    records = np.zeros(1000, dtype)
    records["label"] = np.arange(1000)
    records["x"] = np.random.default_rng(0).random((1000, 3))
    await ds.append([r.tobytes() for r in records])
    await ds.seal()
    await ds.set_order(OrderSpec("explicit", length=4), np.array([5, 999, 5, 0]))
    stream = await store.open_stream(ds, 0, 1)
    got = np.load(io.BytesIO(await read_all(stream)))
    store.close_stream(stream)
    assert got["_index"].tolist() == [5, 999, 5, 0]
    assert got["label"].tolist() == [5, 999, 5, 0]
    assert np.array_equal(got["x"], records["x"][[5, 999, 5, 0]])


async def test_stream_of_an_unsealed_dataset_is_busy(store: DatasetStore) -> None:
    ds = store.create("d")
    await ds.append([b"x"])
    with pytest.raises(DistorefsError) as err:
        await store.open_stream(ds, 0, 1)
    assert err.value.errno == errno.EBUSY


@pytest.mark.parametrize("text", [b"0 1 5\n", b"-1\n", b"shuffle x\n", b"1\nshuffle 3\n", b"abc\n"])
def test_a_bad_order_line_fails_the_write_that_carries_it(text: bytes) -> None:
    with pytest.raises(DistorefsError) as err:
        OrderInput("d", 5).feed(text)
    assert err.value.errno == errno.EINVAL


def test_a_bad_last_line_without_newline_fails_at_close() -> None:
    parser = OrderInput("d", 5)
    assert parser.feed(b"0 1\n7") is None
    with pytest.raises(DistorefsError) as err:
        parser.finish()
    assert err.value.errno == errno.EINVAL


def test_an_out_of_range_npy_order_fails_when_complete() -> None:
    npy = io.BytesIO()
    np.save(npy, np.array([0, 4, 5]))
    with pytest.raises(DistorefsError) as err:
        OrderInput("d", 5).feed(npy.getvalue())
    assert err.value.errno == errno.EINVAL


async def test_cold_stream_larger_than_dram_reads_the_right_records(tmp_path: Path) -> None:
    datasets, blocks, meta = open_store(tmp_path, dram_blocks=8)  # 512 KiB of DRAM
    ds = datasets.create("big")
    items = blobs(2000, seed=3)  # ~3 MB, 6x the DRAM budget
    for start in range(0, 2000, 100):
        await ds.append(items[start : start + 100])
    await ds.seal()
    await ds.set_order(*order_of(b"shuffle 11\n", ds.count))
    await blocks.close()
    meta.close()
    datasets, blocks, meta = open_store(tmp_path, dram_blocks=8)
    ds = datasets.get("big")
    assert ds.sealed
    assert ds.count == 2000
    batch = await stream_once(datasets, ds)
    assert [i for i, _w, _b in batch] == shuffled(11, 2000).tolist()
    assert all(item == items[i] for i, _w, item in batch)
    stats = blocks.statistics()
    assert stats.gathered_log_parts + stats.gathered_log_spans > 0
    assert stats.dram_reserved_bytes == 0  # every prefetched batch was given back
    await blocks.close()
    meta.close()


async def test_unacknowledged_appends_are_gone_after_restart(tmp_path: Path) -> None:
    datasets, blocks, meta = open_store(tmp_path)
    ds = datasets.create("d")
    await ds.append([b"kept"])
    await ds.persist()
    await ds.append([b"not acknowledged"])
    await blocks.flush()  # its bytes reach the log, but the row says one record
    meta.close()
    datasets, blocks, meta = open_store(tmp_path)
    ds = datasets.get("d")
    assert ds.count == 1
    assert bytes(await ds.read_record(0, 0, 100)) == b"kept"
    await ds.append([b"next"])
    assert bytes(await ds.read_record(1, 0, 100)) == b"next"
    await blocks.close()
    meta.close()


async def test_a_copy_of_another_nodes_dataset_changes_only_as_its_writer_says(tmp_path: Path) -> None:
    datasets, blocks, meta = open_store(tmp_path)
    ds = datasets.create("meta")
    datasets.make_copy(ds, "n0")
    items = blobs(50)
    for call in (ds.append(items), ds.seal()):
        with pytest.raises(DistorefsError, match="written on node n0") as excinfo:
            await call
        assert excinfo.value.errno == errno.EROFS
    with pytest.raises(DistorefsError, match="written on node n0"):
        ds.reconfigure({"prefetch_window_bytes": 8 << 20})
    assert ds.count == 0
    await ds.append(items, from_writer=True)
    await ds.seal(from_writer=True)
    await blocks.close()
    meta.close()

    datasets, blocks, meta = open_store(tmp_path)  # the writer is kept across a restart
    ds = datasets.get("meta")
    assert ds.writer == "n0"
    assert ds.sealed
    assert [bytes(await ds.read_record(i, 0, 1 << 20)) for i in range(50)] == items
    await datasets.delete("meta")
    await blocks.close()
    meta.close()
    datasets, blocks, meta = open_store(tmp_path)
    assert datasets.names() == []
    assert meta.get_kv("dataset_writer/meta") is None
    await blocks.close()
    meta.close()


async def test_read_run_returns_whole_records_back_to_back_within_a_byte_bound(store: DatasetStore) -> None:
    ds = store.create("runs")
    items = blobs(300, seed=3)
    await ds.append(items)
    start, got = 0, []
    while start < ds.count:
        entries, data = await ds.read_run(start, 20_000)
        assert len(data) == int(entries["length"].sum())
        assert len(data) <= 20_000 or len(entries) == 1  # one record always comes, even a big one
        ends = np.cumsum(entries["length"]).tolist()
        got += [bytes(data[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        start += len(entries)
    assert got == items
    with pytest.raises(DistorefsError) as excinfo:
        await ds.read_run(300, 20_000)
    assert excinfo.value.errno == errno.ENOENT


@pytest.mark.parametrize("window", [64 * 1024, 1 << 20], ids=["record-by-record", "fits"])
async def test_a_record_changed_on_disk_fails_the_stream_instead_of_being_served(tmp_path: Path, window: int) -> None:
    datasets, blocks, meta = open_store(tmp_path)
    ds = datasets.create("d")
    items = [bytes([i]) * 700 for i in range(200)]  # 140 KB: three blocks of 64 KiB
    items[123] = b"NEEDLE" + bytes(694)
    await ds.append(items)
    await ds.seal()
    await blocks.close()
    meta.close()
    blocks, meta = open_tiers(tmp_path, BLOCK, 64)
    datasets = DatasetStore.load(blocks, meta, window)
    hits = 0  # after the start-up's checks of the log's tail, as a disk going bad would
    for segment in (tmp_path / "log").iterdir():
        data = bytearray(segment.read_bytes())
        at = data.find(b"NEEDLE")
        if at >= 0:
            data[at + 3] ^= 0xFF  # one bit flipped in a record
            segment.write_bytes(data)
            hits += 1
    assert hits == 1
    ds = datasets.get("d")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        stream = await datasets.open_stream(ds, 0, 1)
        assert stream.fits == (window > ds.data_bytes)
        with pytest.raises(DistorefsError) as err:
            await read_all(stream, chunk=1 << 20)
        assert err.value.errno == errno.EIO
        datasets.close_stream(stream)
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


@pytest.mark.parametrize("window", [64 * 1024, 1 << 20], ids=["record-by-record", "fits"])
async def test_a_fitting_dataset_is_hinted_whole_in_log_order_and_a_bigger_one_record_by_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    monkeypatch.setattr(stream_module, "HINT_GROUP_BYTES", 2 * BLOCK)  # four groups of two blocks
    monkeypatch.setattr(stream_module, "FIRST_BATCH_BYTES", 32 * 1024)  # batches of 32, 64, 128, 256 KB
    datasets, blocks, meta = open_store(tmp_path)
    ds = datasets.create("d")
    items = [bytes([i % 251]) * 1000 for i in range(500)]  # 500 KB: eight blocks of 64 KiB
    await ds.append(items)
    await ds.seal()
    await blocks.close()
    meta.close()
    blocks, meta = open_tiers(tmp_path, BLOCK, 64)  # nothing cached: every block is in the log only
    datasets = DatasetStore.load(blocks, meta, window)
    hinted: list[list[LogLocation]] = []
    ahead: list[bool] = []  # each gather's read_ahead
    events: list[str] = []
    real_gather = blocks.gather

    async def hint(locations: list[LogLocation]) -> None:
        hinted.append(list(locations))
        events.append("hint")

    async def gather(*args: Any, read_ahead: bool = True) -> Any:
        ahead.append(read_ahead)
        try:
            return await real_gather(*args, read_ahead=read_ahead)
        finally:
            events.append("gathered")

    monkeypatch.setattr(blocks, "will_need", hint)
    monkeypatch.setattr(blocks, "gather", gather)
    ds = datasets.get("d")
    await ds.set_order(*order_of(b"shuffle 4\n", len(items)))
    batch = await stream_once(datasets, ds)
    assert [item for _i, _w, item in batch] == [items[i] for i in (await ds.order_indices()).tolist()]
    if window > ds.data_bytes:
        every = [location for group in hinted for location in group]
        assert every == sorted(every), "hinted in log order"
        assert len(every) == len(set(every)) == 8, "each block once"
        assert [len(group) for group in hinted] == [2, 2, 2, 2]
        assert events.index("gathered") < events.index("hint"), "the first batch reads before the hints queue"
        assert ahead[0], "the first batch hints its own records"
        assert not ahead[-1], "records hinted with the dataset need no hints of their own"
    else:
        assert not hinted
        assert ahead
        assert all(ahead)
    await blocks.close()
    meta.close()


@pytest.mark.parametrize(
    ("page_cache", "available", "whole"),
    [(0, None, False), (None, 1 << 20, True), (None, 600_000, False), (None, None, False), (1 << 20, 0, True)],
    ids=["off", "auto-room", "auto-no-room", "auto-unknown", "a-size"],
)
async def test_a_dataset_beyond_the_window_is_read_whole_when_the_page_cache_may_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page_cache: int | None, available: int | None, whole: bool
) -> None:
    """500 KB of records, a window of 256 KiB: read whole through the page cache when
    `page_cache_bytes` allows it (None: half of what the kernel calls available)."""
    monkeypatch.setattr(store_module, "available_bytes", lambda: available)
    blocks, meta = open_tiers(tmp_path, BLOCK, 64)
    datasets = DatasetStore.load(blocks, meta, WINDOW, page_cache)
    ds = datasets.create("d")
    items = [bytes([i % 251]) * 1000 for i in range(500)]
    await ds.append(items)
    await ds.seal()
    stream = await datasets.open_stream(ds, 0, 1)
    assert stream.fits == whole
    assert stream.statistics()["whole"] == int(whole)
    assert stream.ahead_bytes <= WINDOW  # the window still bounds what is held ahead
    datasets.close_stream(stream)
    batch = await stream_once(datasets, ds)
    assert [item for _i, _w, item in batch] == items
    await blocks.close()
    meta.close()


async def test_a_fitting_stream_closed_before_its_first_batch_ends_its_prefetch(tmp_path: Path) -> None:
    """The hints wait for the first batch; a stream closed before one (here: its batch
    never fits the DRAM budget) must still end its prefetch task, not leave it waiting."""
    blocks, meta = open_tiers(tmp_path, BLOCK, 4)  # 256 KiB of DRAM: a 500 KB batch never fits
    datasets = DatasetStore.load(blocks, meta, 1 << 20)  # the dataset fits the window
    ds = datasets.create("d")
    await ds.append([bytes([i % 251]) * 1000 for i in range(500)])
    await ds.seal()
    stream = await datasets.open_stream(ds, 0, 1)
    assert stream.fits
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.run_prefetch)
            await trio.sleep(0.1)
            assert stream.fetched_batches == 0
            datasets.close_stream(stream)
    await blocks.close()
    meta.close()


async def test_a_stream_fetches_at_most_its_in_flight_batches_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks, meta = open_tiers(tmp_path, BLOCK, 512)
    datasets = DatasetStore.load(blocks, meta, 64 << 20)  # fits: 64 MiB of batches may be held ahead
    ds = datasets.create("d")
    items = [bytes([i % 251]) * 8000 for i in range(1500)]  # 12 MB: batches of 1, 2, 4 and 8 MiB
    await ds.append(items)
    await ds.seal()
    real_gather = blocks.gather
    active = peak = 0

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            await trio.sleep(0.02)  # long enough for every batch started meanwhile to get here
            return await real_gather(*args, **kwargs)
        finally:
            active -= 1

    monkeypatch.setattr(blocks, "gather", counted)
    batch = await stream_once(datasets, ds)
    assert [item for _i, _w, item in batch] == items
    # the prefetch's batches, and one the reader may fetch itself
    assert peak <= FITS_IN_FLIGHT + 1, f"{peak} batches fetched at once"
    await blocks.close()
    meta.close()


def big_blobs(count: int, seed: int) -> list[bytes]:
    """Records of 3-5 KB: big enough for a stream to be read as pieces (Stream.from_dram)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(3000, 5000)), dtype=np.uint8).tobytes() for _ in range(count)]


async def read_joined(stream: Stream, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Each range read as pieces, joined (the pieces checked against the stream's bound)."""
    out = []
    for offset, size in ranges:
        pieces = stream.read_pieces(offset, size)
        assert pieces is not None
        assert len(pieces) <= stream.max_pieces
        out.append(b"".join(pieces))
        await trio.lowlevel.checkpoint()
    return out


@pytest.mark.parametrize("schema", [False, True])
async def test_a_stream_in_dram_reads_as_pieces_the_bytes_its_batches_read(store: DatasetStore, schema: bool) -> None:
    ds = store.create("d")
    if schema:
        dtype = np.dtype([("label", "<i4"), ("x", "u1", (4000,))])
        ds.reconfigure({"schema": {"label": "int32", "x": {"dtype": "uint8", "shape": [4000]}}})
        records = np.zeros(300, dtype)
        records["label"] = np.arange(300)
        records["x"] = np.random.default_rng(1).integers(0, 256, (300, 4000))
        await ds.append([r.tobytes() for r in records])
    else:
        await ds.append(big_blobs(300, seed=1))  # about 1.2 MB in 64 KiB blocks: records cross blocks
    await ds.seal()
    await ds.set_order(*order_of(b"shuffle 5\n", ds.count))
    batches = await store.open_stream(ds, 0, 1)  # no pieces: the batch path, as before
    assert not batches.from_dram
    expected = await read_all(batches)
    store.close_stream(batches)
    stream = await store.open_stream(ds, 0, 1, pieces=1023)
    assert stream.from_dram  # the appended records are still in DRAM
    rng = np.random.default_rng(2)
    ranges = [(0, 1), (0, len(expected)), (len(expected) - 3, 100), (len(expected), 10), (5, 4096)]
    ranges += [(int(rng.integers(0, len(expected))), int(rng.integers(1, 300_000))) for _ in range(200)]
    got = await read_joined(stream, ranges)
    assert got == [expected[offset : offset + size] for offset, size in ranges]
    assert stream.statistics()["dram_reads"] == len(ranges)
    assert stream.statistics()["fetched_batches"] == 0  # nothing was gathered
    store.close_stream(stream)


async def stream_in_dram(datasets: DatasetStore, items: list[bytes], seed: int) -> Stream:
    """A sealed dataset of `items` in order `shuffle seed`, just appended (so in DRAM), and
    a stream of it served from DRAM."""
    ds = datasets.create("d")
    await ds.append(items)
    await ds.seal()
    await ds.set_order(*order_of(f"shuffle {seed}\n".encode(), ds.count))
    stream = await datasets.open_stream(ds, 0, 1, pieces=1023)
    assert stream.from_dram
    return stream


async def read_rest(stream: Stream, got: bytearray, chunk: int, before: Callable[[], Awaitable[object]]) -> bytes:
    """Read `stream` on from `len(got)` as the fs layer does (pieces while it can, else
    `read`), `before()` awaited before each read; returns the whole stream's bytes."""
    while True:
        await before()
        pieces = stream.read_pieces(len(got), chunk)
        piece = b"".join(pieces) if pieces is not None else await stream.read(len(got), chunk)
        if not piece:
            return bytes(got)
        got += piece


def assert_blob_stream(data: bytes, items: list[bytes], seed: int) -> None:
    batch = decode_blob_batch(data)
    assert [i for i, _w, _b in batch] == shuffled(seed, len(items)).tolist()
    assert all(item == items[i] for i, _w, item in batch)


async def test_a_stream_whose_records_leave_dram_goes_back_to_batches(tmp_path: Path) -> None:
    datasets, blocks, meta = open_store(tmp_path, dram_blocks=24)  # 1.5 MiB of DRAM
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        items = big_blobs(200, seed=4)  # about 0.8 MB
        stream = await stream_in_dram(datasets, items, 6)
        ds = stream.dataset
        first = await read_joined(stream, [(0, 50_000)])
        other = datasets.create("other")  # 3 MB through DRAM: the first dataset's blocks go
        await other.append(big_blobs(750, seed=5))
        await other.seal()
        await other.set_order(*order_of(b"shuffle 7\n", other.count))
        assert len(decode_blob_batch(await read_all(await datasets.open_stream(other, 0, 1)))) == 750
        assert blocks.dram_blocks(ds.data_owner, -(-ds.data_bytes // BLOCK)) is None
        assert_blob_stream(await read_rest(stream, bytearray(first[0]), 65536, trio.lowlevel.checkpoint), items, 6)
        assert not stream.from_dram
        datasets.close_stream(stream)
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


async def test_a_stream_in_dram_beside_churn_goes_back_to_batches(tmp_path: Path) -> None:
    """Blocks of another owner keep leaving DRAM: the stream looks at its own blocks again
    a few times, then takes batches (looking at all of them for every read costs more),
    and reads the same bytes either way."""
    datasets, blocks, meta = open_store(tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        items = big_blobs(100, seed=8)
        stream = await stream_in_dram(datasets, items, 2)
        other = BlockKey(10**9, 0)  # an owner of nobody's: one block written, then deleted, before each read

        async def churn() -> None:
            await blocks.write_whole(other, bytes(BLOCK))
            blocks.delete(other)

        assert_blob_stream(await read_rest(stream, bytearray(), 7000, churn), items, 2)
        assert not stream.from_dram
        assert 0 < stream.statistics()["dram_reads"] < 30  # a few reads from DRAM, then batches
        datasets.close_stream(stream)
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


async def cold_store(
    tmp_path: Path, items: list[bytes], seed: int, dram_blocks: int, page_cache: int, dram_bytes: int
) -> tuple[DatasetStore, BlockStore, MetaDb]:
    """A sealed dataset `d` of `items` in order `shuffle seed`, in a store opened again (so
    none of its blocks is in DRAM) with the given page-cache and DRAM shares."""
    datasets, blocks, meta = open_store(tmp_path, dram_blocks)
    ds = datasets.create("d")
    await ds.append(items)
    await ds.seal()
    await ds.set_order(*order_of(f"shuffle {seed}\n".encode(), ds.count))
    await blocks.close()
    meta.close()
    blocks, meta = open_tiers(tmp_path, BLOCK, dram_blocks)
    return DatasetStore.load(blocks, meta, WINDOW, page_cache, dram_bytes), blocks, meta


def sized_blobs(count: int, seed: int, low: int, high: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(low, high)), dtype=np.uint8).tobytes() for _ in range(count)]


async def wait_in_dram(stream: Stream) -> None:
    with trio.fail_after(10):
        while not stream.in_dram:
            await trio.sleep(0.01)


@pytest.mark.parametrize("page_cache", [0, 1 << 30])  # read record by record, or whole after hints
async def test_a_dataset_of_small_records_is_kept_in_dram_and_its_streams_served_from_there(
    tmp_path: Path, page_cache: int
) -> None:
    """About 1.5 MB of 2.5-3.5 KB records, 4 MiB of DRAM, a DRAM share of 2 MiB: the
    first stream (a cold epoch) loads the blocks as it reads and, once all are in, serves
    the rest from DRAM; the next one (the next epoch) is served from DRAM from its open.
    Same bytes all along."""
    items = sized_blobs(500, 11, 2500, 3500)
    datasets, blocks, meta = await cold_store(tmp_path, items, 3, 64, page_cache, 2 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        ds = datasets.get("d")
        count = -(-ds.data_bytes // BLOCK)
        assert blocks.dram_blocks(ds.data_owner, count) is None
        stream = await datasets.open_stream(ds, 0, 1, pieces=1023)
        assert stream.keeps_dram
        assert not stream.from_dram
        got = bytearray(await stream.read(0, 65536))
        await wait_in_dram(stream)
        assert stream.statistics()["loaded_blocks"] == count
        assert blocks.dram_blocks(ds.data_owner, count) is not None
        assert stream.from_dram  # the rest from DRAM
        assert_blob_stream(await read_rest(stream, got, 65536, trio.lowlevel.checkpoint), items, 3)
        assert stream.statistics()["dram_reads"] > 0
        datasets.close_stream(stream)
        again = await datasets.open_stream(ds, 0, 1, pieces=1023)
        assert again.from_dram
        assert not again.keeps_dram
        assert_blob_stream(await read_rest(again, bytearray(), 65536, trio.lowlevel.checkpoint), items, 3)
        assert again.statistics()["fetched_batches"] == 0
        datasets.close_stream(again)
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


async def test_a_dataset_of_records_of_4_kb_and_more_streams_through_the_page_cache(tmp_path: Path) -> None:
    """5-7 KB records, a DRAM share that holds them: epoch after epoch, nothing is loaded
    into DRAM (their batches come from the page cache about as fast)."""
    items = sized_blobs(300, 15, 5000, 7000)
    datasets, blocks, meta = await cold_store(tmp_path, items, 3, 64, 1 << 30, 2 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        ds = datasets.get("d")
        for _epoch in range(2):
            stream = await datasets.open_stream(ds, 0, 1, pieces=1023)
            assert not stream.keeps_dram
            assert_blob_stream(await read_rest(stream, bytearray(), 65536, trio.lowlevel.checkpoint), items, 3)
            datasets.close_stream(stream)
            assert blocks.dram_blocks(ds.data_owner, 1) is None
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


async def test_a_dataset_of_small_records_is_kept_in_dram_from_its_first_stream(tmp_path: Path) -> None:
    """About 1.2 MB of 0.5-1.5 KB records (too small to be replied as pieces): the first
    stream loads the blocks as it reads; the next one's batches are copied from DRAM, with
    no read of the log. Same bytes all along."""
    items = sized_blobs(1200, 12, 500, 1500)
    datasets, blocks, meta = await cold_store(tmp_path, items, 5, 64, 1 << 30, 2 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        ds = datasets.get("d")
        stream = await datasets.open_stream(ds, 0, 1, pieces=1023)
        assert stream.keeps_dram
        got = bytearray(await stream.read(0, 65536))
        await wait_in_dram(stream)
        assert not stream.from_dram  # records this small stay in batches
        assert_blob_stream(await read_rest(stream, got, 65536, trio.lowlevel.checkpoint), items, 5)
        datasets.close_stream(stream)
        log_reads = blocks.statistics().gathered_log_parts + blocks.statistics().gathered_log_spans
        again = await datasets.open_stream(ds, 0, 1, pieces=1023)
        assert again.in_dram
        assert not again.keeps_dram
        assert_blob_stream(await read_rest(again, bytearray(), 65536, trio.lowlevel.checkpoint), items, 5)
        assert again.statistics()["fetched_batches"] > 0
        assert blocks.statistics().gathered_log_parts + blocks.statistics().gathered_log_spans == log_reads
        datasets.close_stream(again)
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


@pytest.mark.parametrize(("dram_blocks", "dram_bytes"), [(64, 0), (64, 1 << 20), (16, 8 << 20)])
async def test_a_dataset_beyond_its_dram_share_or_the_cache_streams_in_batches(
    tmp_path: Path, dram_blocks: int, dram_bytes: int
) -> None:
    """Small records (kept from the first stream where they may be), about 1.2 MB: no share
    (0), a share smaller than the dataset, or a share the cache cannot hold (16 blocks, 1
    MiB: the load stops when its own blocks start to leave). The stream reads its records
    in batches, the same bytes, and holds nothing after."""
    items = sized_blobs(1200, 13, 500, 1500)
    datasets, blocks, meta = await cold_store(tmp_path, items, 4, dram_blocks, 0, dram_bytes)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        ds = datasets.get("d")
        count = -(-ds.data_bytes // BLOCK)
        stream = await datasets.open_stream(ds, 0, 1, pieces=1023)
        assert stream.keeps_dram == (dram_bytes >= ds.data_bytes)
        assert_blob_stream(await read_rest(stream, bytearray(), 65536, trio.lowlevel.checkpoint), items, 4)
        await trio.sleep(0.2)  # a load still running would have finished
        assert not stream.in_dram
        assert stream.statistics()["loaded_blocks"] < count
        assert blocks.dram_blocks(ds.data_owner, count) is None
        datasets.close_stream(stream)
        assert blocks.statistics().dram_reserved_bytes == 0
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


async def test_a_load_goes_on_past_the_close_of_a_stream_read_to_its_end_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loads of one block at a time, held until both streams are closed: the stream closed
    after its first read stops its load after the block in flight; the one closed after
    its last byte lets its load finish, so the next epoch is served from DRAM."""
    monkeypatch.setattr(stream_module, "LOAD_GROUP_BYTES", BLOCK)
    items = sized_blobs(1200, 14, 500, 1500)  # small records: kept from the first stream
    datasets, blocks, meta = await cold_store(tmp_path, items, 6, 64, 1 << 30, 2 << 20)
    gate = trio.Event()
    get_many = blocks.get_many

    async def held(keys: list[BlockKey]) -> list[Any]:  # only the loads call it here
        await gate.wait()
        return await get_many(keys)

    monkeypatch.setattr(blocks, "get_many", held)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(datasets.run_streams)
        ds = datasets.get("d")
        count = -(-ds.data_bytes // BLOCK)
        early = await datasets.open_stream(ds, 0, 1)
        await early.read(0, 1 << 20)
        datasets.close_stream(early)
        whole = await datasets.open_stream(ds, 0, 1)
        assert_blob_stream(await whole.read(0, whole.size), items, 6)
        datasets.close_stream(whole)
        assert whole.statistics()["loaded_blocks"] == 0
        gate.set()
        with trio.fail_after(10):
            while blocks.dram_blocks(ds.data_owner, count) is None:
                await trio.sleep(0.01)
        assert whole.statistics()["loaded_blocks"] == count
        assert early.statistics()["loaded_blocks"] <= 1
        again = await datasets.open_stream(ds, 0, 1)
        assert again.in_dram
        assert not again.keeps_dram
        datasets.close_stream(again)
        nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()
