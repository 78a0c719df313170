"""Datasets through a real mount: append, seal, records, order, stream, shards, errors, restarts."""

from __future__ import annotations

import errno
import io
import json
import mmap
import multiprocessing
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs import client
from distorefs.stores.datasets.formats import shuffled
from distorefs.stores.replay.formats import decode_blob_batch
from tests.conftest import Mount, wait_for

pytestmark = pytest.mark.mount

MountFactory = Callable[..., Mount]
SCHEMA = {"label": "int32", "x": {"dtype": "float32", "shape": [4]}}
DTYPE = np.dtype([("label", "<i4"), ("x", "<f4", (4,))])


@pytest.fixture
def dataset(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh dataset for one test, removed afterwards."""
    path = mounted.path / "datasets" / request.node.name.replace("[", "_").replace("]", "_")[:60]
    path.mkdir()
    yield path
    if path.exists():
        os.rmdir(path)


def blob(i: int, size: int | None = None) -> bytes:
    """Record i's bytes: its index, then a pattern of a length that depends on i."""
    size = size if size is not None else 8 + (i * 37) % 3000
    return i.to_bytes(8, "little") + ((np.arange(size - 8) + i) % 251).astype(np.uint8).tobytes()


def schema_records(n: int) -> np.ndarray:
    out = np.zeros(n, DTYPE)
    out["label"] = np.arange(n)
    out["x"] = np.arange(n)[:, None] * np.array([1.0, 0.5, 0.25, 2.0])
    return out


def stats(path: Path) -> dict[str, object]:
    result: dict[str, object] = json.loads(client.read_all(path / "stats"))
    return result


def errno_of(fn: Callable[[], object]) -> int:
    with pytest.raises(OSError) as excinfo:
        fn()
    return int(excinfo.value.errno or 0)


def write_order(path: Path, data: bytes) -> None:
    with open(path / "order", "wb") as f:
        f.write(data)


def npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def read_stream(path: Path) -> list[tuple[int, bytes]]:
    return [(i, bytes(b)) for i, _w, b in decode_blob_batch(client.read_all(path))]


def test_framed_appends_read_back_as_records_with_cat_and_ls(dataset: Path) -> None:
    items = [blob(i) for i in range(300)]
    client.append(dataset, items[:100])
    client.append(dataset, items[100:])
    assert (dataset / "len").read_text() == "300\n"
    assert (
        subprocess.run(["cat", str(dataset / "records" / "123")], capture_output=True, check=True).stdout == items[123]
    )
    assert os.stat(dataset / "records" / "299").st_size == len(items[299])
    listed = subprocess.run(["ls", str(dataset / "records")], capture_output=True, check=True, text=True).stdout.split()
    assert sorted(int(n) for n in listed) == list(range(300))
    got = stats(dataset)
    assert got["records"] == 300
    assert got["bytes"] == sum(len(x) for x in items)
    assert got["sealed"] is False


def test_schema_dataset_takes_npy_and_raw_records(dataset: Path, tmp_path: Path) -> None:
    (dataset / "config").write_text(json.dumps({"schema": SCHEMA}))
    records = schema_records(50)
    with open(dataset / "append", "wb") as f:
        np.save(f, records[:30])
    raw = tmp_path / "raw.bin"
    raw.write_bytes(records[30:].tobytes())
    subprocess.run(["dd", f"if={raw}", f"of={dataset / 'append'}", "bs=7", "status=none"], check=True)
    assert (dataset / "len").read_text() == "50\n"
    assert np.frombuffer((dataset / "records" / "42").read_bytes(), DTYPE)[0] == records[42]
    assert json.loads((dataset / "config").read_text())["schema"]["x"] == {"dtype": "<f4", "shape": [4]}
    # numpy adds .npy to a path that lacks it: these were EROFS (a create in the dataset)
    np.save(dataset / "append", schema_records(10))
    assert (dataset / "len").read_text() == "60\n"
    (dataset / "state").write_text("seal")
    np.save(dataset / "order", np.arange(60)[::-1])
    assert np.load(io.BytesIO(client.read_all(dataset / "stream")))["_index"].tolist() == list(range(59, -1, -1))
    assert "append.npy" not in os.listdir(dataset)


def test_seal_makes_appends_fail_with_erofs_and_stream_needs_it(dataset: Path) -> None:
    client.append(dataset, [blob(i) for i in range(10)])
    assert errno_of(lambda: open(dataset / "stream", "rb").read()) == errno.EBUSY
    assert (dataset / "state").read_text() == "open\n"
    subprocess.run(f"echo seal > {dataset / 'state'}", shell=True, check=True)
    assert (dataset / "state").read_text() == "sealed\n"
    assert errno_of(lambda: client.append(dataset, [b"late"])) == errno.EROFS
    assert (dataset / "len").read_text() == "10\n"
    assert [i for i, _b in read_stream(dataset / "stream")] == list(range(10))


def test_orders_as_npy_text_and_shuffle_drive_the_stream(dataset: Path) -> None:
    items = [blob(i) for i in range(200)]
    client.append(dataset, items)
    (dataset / "state").write_text("seal\n")
    write_order(dataset, npy_bytes(np.array([7, 3, 3, 199, 0])))
    assert read_stream(dataset / "stream") == [(i, items[i]) for i in (7, 3, 3, 199, 0)]
    subprocess.run(f"printf '5\\n6\\n' > {dataset / 'order'}", shell=True, check=True)
    assert [i for i, _b in read_stream(dataset / "stream")] == [5, 6]
    subprocess.run(f"echo 'shuffle 42' > {dataset / 'order'}", shell=True, check=True)
    expected = shuffled(42, 200)
    assert np.array_equal(np.load(io.BytesIO(client.read_all(dataset / "order"))), expected)
    assert read_stream(dataset / "stream") == [(i, items[i]) for i in expected.tolist()]
    assert stats(dataset)["order"] == "shuffle 42 (200 records)"


def test_an_out_of_range_order_fails_with_einval_and_changes_nothing(dataset: Path) -> None:
    client.append(dataset, [blob(i) for i in range(20)])
    write_order(dataset, b"3\n1\n")
    assert errno_of(lambda: write_order(dataset, b"0\n20\n")) == errno.EINVAL
    assert errno_of(lambda: write_order(dataset, npy_bytes(np.array([1, -1])))) == errno.EINVAL
    assert errno_of(lambda: write_order(dataset, b"shuffle seven\n")) == errno.EINVAL
    shell = subprocess.run(["bash", "-c", f"echo 25 > {dataset / 'order'}"], capture_output=True, text=True)
    assert shell.returncode != 0
    assert "Invalid argument" in shell.stderr
    assert np.load(io.BytesIO(client.read_all(dataset / "order"))).tolist() == [3, 1]
    assert "out of range" in str(stats(dataset)["errors"])


def namespace_recipe(after: str) -> str:
    """The first ```python block of docs/namespace.md after the line `after`."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "namespace.md").read_text()
    rest = text[text.index(after) :]
    start = rest.index("```python\n") + len("```python\n")
    return rest[start : rest.index("```", start)]


def test_the_windowed_shuffle_recipe_of_namespace_md_orders_the_stream(dataset: Path) -> None:
    """namespace.md's recipe for a dataset bigger than memory, run as written: the stream
    reads every record once, in its order, each window's records from a few runs of
    neighbours."""
    items = [blob(i, 500) for i in range(1000)]
    client.append(dataset, items)
    (dataset / "state").write_text("seal\n")
    scope: dict[str, object] = {"d": str(dataset), "epoch": 3}
    exec(namespace_recipe("so it is a recipe, not an order form:"), scope)
    windowed = scope["windowed"]
    assert callable(windowed)
    order = windowed(3, 1000, run=10, window=100)
    assert sorted(order.tolist()) == list(range(1000))  # a permutation
    for w in range(0, 1000, 100):  # a window's records come from its ten runs of ten
        assert len({i // 10 for i in order[w : w + 100].tolist()}) == 10
    expected = windowed(3, 1000)  # what the recipe wrote, with its own run and window
    with open(dataset / "order", "rb") as f:
        assert np.load(f).tolist() == expected.tolist()
    assert read_stream(dataset / "stream") == [(i, items[i]) for i in expected.tolist()]


def _read_shard(path: str, queue: multiprocessing.Queue[list[int]]) -> None:
    queue.put([i for i, _w, _b in decode_blob_batch(client.read_all(path))])


def test_shards_split_the_epoch_between_processes(dataset: Path) -> None:
    client.append(dataset, [blob(i) for i in range(1000)])
    (dataset / "state").write_text("seal\n")
    (dataset / "order").write_text("shuffle 3\n")
    queue: multiprocessing.Queue[list[int]] = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(target=_read_shard, args=(str(dataset / f"stream-{r}-of-4"), queue)) for r in range(4)
    ]
    for p in procs:
        p.start()
    shards = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    order = shuffled(3, 1000).tolist()
    assert sorted(map(tuple, shards)) == sorted(tuple(order[r::4]) for r in range(4))
    assert sorted(i for shard in shards for i in shard) == list(range(1000))


def sealed_schema_dataset(dataset: Path, schema: object, records: np.ndarray, order: str) -> None:
    """`records` appended with np.save to a dataset of `schema`, sealed, `order` set."""
    (dataset / "config").write_text(json.dumps({"schema": schema}))
    with open(dataset / "append", "wb") as f:
        np.save(f, records)
    (dataset / "state").write_text("seal\n")
    (dataset / "order").write_text(order)


def test_schema_stream_loads_with_numpy(dataset: Path) -> None:
    records = schema_records(5000)
    sealed_schema_dataset(dataset, SCHEMA, records, "shuffle 9\n")
    with open(dataset / "stream-1-of-2", "rb") as f:
        got = np.load(f)
    expected = shuffled(9, 5000)[1::2]
    assert got["_index"].tolist() == expected.tolist()
    assert np.array_equal(got["x"], records["x"][expected])
    assert np.all(got["_weight"] == 1.0)


def stream_reads(mounted: Mount) -> float:
    """READ requests of dataset files the daemon has served so far (`.distore/metrics`)."""
    for line in client.read_all(mounted.path / ".distore" / "metrics").decode().splitlines():
        if line.startswith('distorefs_data_request_seconds_count{kind="datasets",op="read"}'):
            return float(line.split()[-1])
    raise AssertionError("no datasets read count in .distore/metrics")


def test_a_stream_read_into_a_buffer_off_a_page_boundary_costs_two_requests(mounted: Mount, dataset: Path) -> None:
    """What namespace.md tells stream readers: a 1 MiB read into a buffer that starts on a
    page is one request, into one that does not (a bytearray's) two, the same bytes."""
    items = [blob(i, 10_000) for i in range(330)]  # a stream of 3.3 MB: 3 full MiB and a rest
    client.append(dataset, items)
    (dataset / "state").write_text("seal\n")
    expected = client.read_all(dataset / "stream")
    full, rest = divmod(len(expected), 1 << 20)
    assert full == 3
    assert rest > 0
    memory = mmap.mmap(-1, (1 << 20) + mmap.PAGESIZE)
    for skew, per_full_read in ((0, 1), (16, 2)):
        buf = memoryview(memory)[skew : skew + (1 << 20)]
        before = stream_reads(mounted)
        got = bytearray()
        fd = os.open(dataset / "stream", os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                got += buf[:n]
        finally:
            os.close(fd)
        assert bytes(got) == expected
        # the full reads, the rest (within 256 pages either way), the read at the end
        assert stream_reads(mounted) - before == full * per_full_read + 1 + 1
        buf.release()
    memory.close()


def stream_stats(path: Path) -> dict[str, int]:
    """The `stats` entry of the one stream open on the dataset at `path`."""
    streams = stats(path)["streams"]
    assert isinstance(streams, list)
    assert len(streams) == 1
    entry: dict[str, int] = streams[0]
    return entry


def test_a_stream_of_records_in_dram_is_read_from_the_block_cache(dataset: Path) -> None:
    """Records just appended are in the daemon's DRAM: a stream of them is served as
    pieces of the block cache (no batch gathered), and reads the same bytes in any sizes."""
    items = [blob(i, 3000 + (i * 997) % 4000) for i in range(400)]  # 1.5-2.8 MB of 3-7 KB records
    client.append(dataset, items)
    (dataset / "state").write_text("seal\n")
    (dataset / "order").write_text("shuffle 12\n")
    order = shuffled(12, 400).tolist()
    with open(dataset / "stream", "rb", buffering=0) as f:
        got = bytearray()
        for size in [1, 19, 4096, 100_000, 1 << 20, 7] * 10:
            got += f.read(size)
        got += f.read()
        during = stream_stats(dataset)
    assert during["from_dram"] == 1, "not served from DRAM: is pyfuse3 patched (scripts/setup.sh)?"
    assert during["dram_reads"] > 0
    assert during["fetched_batches"] == 0
    assert [(i, bytes(b)) for i, _w, b in decode_blob_batch(bytes(got))] == [(i, items[i]) for i in order]


def test_a_schema_stream_in_dram_loads_with_numpy(dataset: Path) -> None:
    records = np.zeros(300, [("label", "<i4"), ("x", "u1", (6000,))])
    records["label"] = np.arange(300)
    records["x"] = np.random.default_rng(3).integers(0, 256, (300, 6000))
    sealed_schema_dataset(dataset, {"label": "int32", "x": ["uint8", [6000]]}, records, "shuffle 4\n")
    with open(dataset / "stream", "rb") as f:
        got = np.load(f)
        assert stream_stats(dataset)["from_dram"] == 1, "not served from DRAM: is pyfuse3 patched (setup.sh)?"
    expected = shuffled(4, 300)
    assert got["_index"].tolist() == expected.tolist()
    assert np.array_equal(got["x"], records["x"][expected])
    assert np.all(got["_weight"] == 1.0)


def test_bad_input_gets_clear_errnos(dataset: Path) -> None:
    (dataset / "config").write_text(json.dumps({"schema": SCHEMA}))
    assert errno_of(lambda: (dataset / "append").write_bytes(b"x" * 19)) == errno.EINVAL
    assert (dataset / "len").read_text() == "0\n"
    assert errno_of(lambda: (dataset / "config").write_text('{"prefetch_window_bytes": 5}')) == errno.EINVAL
    assert errno_of(lambda: (dataset / "config").write_text('{"color": 1}')) == errno.EINVAL
    assert errno_of(lambda: (dataset / "state").write_text("unseal\n")) == errno.EINVAL
    client.append(dataset, schema_records(3))
    assert errno_of(lambda: (dataset / "config").write_text('{"schema": {"a": "int8"}}')) == errno.EBUSY
    assert errno_of(lambda: os.stat(dataset / "records" / "3")) == errno.ENOENT
    assert errno_of(lambda: open(dataset / "records" / "1", "wb")) == errno.EROFS
    assert errno_of(lambda: os.stat(dataset / "stream-4-of-4")) == errno.ENOENT
    assert errno_of(lambda: (dataset / "stream").write_bytes(b"x")) == errno.EROFS
    assert errno_of(lambda: os.mkdir(dataset.parent / dataset.name)) == errno.EEXIST


def test_rm_r_removes_a_dataset(mounted: Mount) -> None:
    path = mounted.path / "datasets" / "doomed"
    path.mkdir()
    client.append(path, [blob(i) for i in range(50)])
    subprocess.run(["rm", "-r", str(path)], check=True)
    assert not path.exists()
    assert "doomed" not in os.listdir(mounted.path / "datasets")


def test_opens_of_one_stream_share_its_layout_counted_in_the_budget(mount_factory: MountFactory) -> None:
    """Each open stream holds where its records lie (8 bytes a record). Opens of the
    same share hold one layout, counted once; all layouts together may hold the DRAM
    budget, and an open past it is ENOMEM: 200 opens of a stream of 2,000,000 records
    used to hold 6 GB of a daemon with a 1 GiB budget."""
    mount = mount_factory("--dram-budget", "64MiB")
    path = mount.path / "datasets" / "d"
    path.mkdir()
    (path / "config").write_text(json.dumps({"schema": {"x": "int8"}}))
    count = 1_000_000
    with open(path / "append", "wb") as f:
        np.save(f, np.zeros(count, [("x", "i1")]))
    (path / "state").write_text("seal")

    def layout_bytes() -> int:
        value = mount.status()["dataset_stream_layout_bytes"]
        assert isinstance(value, int)
        return value

    one = 8 * count
    same = [os.open(path / "stream", os.O_RDONLY) for _ in range(20)]
    halves = [os.open(path / f"stream-{rank}-of-2", os.O_RDONLY) for rank in (0, 1)]
    others: list[int] = []
    try:
        assert 2 * one <= layout_bytes() < 2 * one + 4096  # one for the 20 opens, and the two halves
        refused = 0
        for seed in range(1, 100):  # each order a new layout: the budget runs out
            (path / "order").write_text(f"shuffle {seed}")
            try:
                others.append(os.open(path / "stream", os.O_RDONLY))
            except OSError as exc:
                refused = exc.errno or 0
                break
        assert refused == errno.ENOMEM
        assert 2 <= len(others) < 8
        assert layout_bytes() <= 64 << 20
    finally:
        for fd in same + halves + others:
            os.close(fd)
    assert wait_for(lambda: layout_bytes() == 0)
    with open(path / "stream", "rb") as f:
        assert len(np.load(f)) == count  # and the next open works
    assert mount.unmount() == 0


def test_a_stream_opened_after_a_new_order_of_the_same_length_reads_that_order(dataset: Path) -> None:
    """Explicit orders alternate between two slots, so the first and the third of the
    same length look alike (same slot, same length): a stream opened after the third,
    while one of the first is still open, must not share the first's layout."""
    client.append(dataset, [blob(i, 100) for i in range(3)])
    (dataset / "state").write_text("seal")

    def order_of(f: io.BufferedReader) -> list[int]:
        return [int.from_bytes(bytes(item)[:8], "little") for _index, _weight, item in decode_blob_batch(f.read())]

    (dataset / "order").write_text("0 1 2\n")
    with open(dataset / "stream", "rb") as first:
        (dataset / "order").write_text("2 1 0\n")
        (dataset / "order").write_text("1 2 0\n")
        with open(dataset / "stream", "rb") as third:
            assert order_of(third) == [1, 2, 0]
        assert order_of(first) == [0, 1, 2]


def test_reads_of_a_removed_dataset_are_enoent_not_a_failed_crc(mount_factory: MountFactory) -> None:
    """A record or a stream opened before its dataset's rmdir, and one of a dataset of the
    same name made since: each read is ENOENT. They read the removed dataset's blocks,
    which went with it, and failed their crc32c check (EIO, "fails its crc32c check":
    corruption, to whoever read the log)."""
    mount = mount_factory()
    path = mount.path / "datasets" / "d"
    path.mkdir()
    client.append(path, [blob(i, 3000) for i in range(20)])
    (path / "state").write_text("seal")
    record = os.open(path / "records" / "3", os.O_RDONLY)
    stream = os.open(path / "stream", os.O_RDONLY)
    try:
        os.rmdir(path)
        assert errno_of(lambda: os.pread(record, 5000, 0)) == errno.ENOENT
        assert errno_of(lambda: os.pread(stream, 1 << 20, 0)) == errno.ENOENT
        path.mkdir()
        client.append(path, [blob(i, 404) for i in range(5)])
        assert errno_of(lambda: os.pread(record, 5000, 0)) == errno.ENOENT
    finally:
        os.close(record)
        os.close(stream)
    assert (path / "records" / "3").read_bytes() == blob(3, 404)
    assert mount.status()["internal_errors"] == 0
    assert mount.unmount() == 0
    log = (mount.data_dir.parent / f"{mount.data_dir.name}.daemon.log").read_text()
    assert "crc32c" not in log


def test_remount_and_kill9_keep_acknowledged_records_seal_and_order(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    path = mount.path / "datasets" / "d"
    path.mkdir()
    items = [blob(i) for i in range(500)]
    client.append(path, items[:400])
    write_order(path, npy_bytes(np.arange(399, -1, -1)))
    mount.kill9()
    mount = mount_factory()
    assert (path / "len").read_text() == "400\n"
    assert (path / "records" / "399").read_bytes() == items[399]
    client.append(path, items[400:])
    (path / "state").write_text("seal\n")
    assert mount.unmount() == 0
    mount = mount_factory()
    assert (path / "state").read_text() == "sealed\n"
    assert read_stream(path / "stream") == [(i, items[i]) for i in range(399, -1, -1)]
    assert mount.unmount() == 0


@pytest.mark.parametrize("page_cache", ["0", "1GiB"], ids=["record-by-record", "whole-via-page-cache"])
def test_a_dataset_3x_the_dram_budget_streams_a_random_order_exactly(
    mount_factory: MountFactory, page_cache: str
) -> None:
    """100 MB of records, a DRAM budget of 32 MiB and a window of 8 MiB: read record by
    record, or (`--dataset-page-cache 1GiB`) whole through the kernel's page cache; the
    DRAM held stays within the budget either way."""
    budget = 32 << 20
    options = ("--dram-budget", "32MiB", "--prefetch-window", "8MiB", "--dataset-page-cache", page_cache)
    mount = mount_factory(*options)
    path = mount.path / "datasets" / "big"
    path.mkdir()
    count, size = 10_000, 10_000  # 100 MB of records
    for start in range(0, count, 500):
        client.append(path, [blob(i, size) for i in range(start, start + 500)])
    (path / "state").write_text("seal\n")
    (path / "order").write_text("shuffle 2026\n")
    assert mount.unmount() == 0
    mount = mount_factory(*options)  # cold: nothing in DRAM
    seen = 0
    order = shuffled(2026, count).tolist()
    peak = 0
    with open(path / "stream", "rb") as f:
        head = f.read(20)
        assert head[:8] == b"DSBATCH1"
        streams = json.loads((path / "stats").read_text())["streams"]
        assert [s["whole"] for s in streams] == [int(page_cache != "0")]
        for expected in order:
            index, _weight, length = np.frombuffer(f.read(20), dtype=np.uint8).view("<i8,<f4,<u8")[0].tolist()
            assert (index, length) == (expected, size)
            assert f.read(length) == blob(expected, size)
            seen += 1
            if seen % 2000 == 0:
                peak = max(peak, int(mount.status()["dram_used_bytes"]))  # type: ignore[call-overload]
        assert f.read(1) == b""
    assert seen == count
    assert 0 < peak <= budget
    status = mount.status()
    assert status["blocks"]["gathered_log_parts"] + status["blocks"]["gathered_log_spans"] > 0  # type: ignore[index]
    # the stream's reservations go with its RELEASE, which the kernel sends after the close returns
    wait_for(
        lambda: mount.status()["blocks"]["dram_reserved_bytes"] == 0,  # type: ignore[index]
        what="the stream's RELEASE, sent after the close",
    )
    assert mount.unmount() == 0


@pytest.mark.parametrize("share", ["auto", "0"])
def test_a_dataset_of_small_records_within_its_dram_share_is_served_from_dram(
    mount_factory: MountFactory, share: str
) -> None:
    """9 MB of 3 KB records, a DRAM budget of 64 MiB. By default (`--dataset-dram auto`,
    half of the budget) the cold epoch loads the dataset into the block cache as it reads
    and is served from there once it is in; the next epoch is served from DRAM from its
    open. With `--dataset-dram 0` neither is. Both epochs read the same records in the
    order."""
    options = ("--dram-budget", "64MiB", "--dataset-dram", share)
    mount = mount_factory(*options)
    path = mount.path / "datasets" / "epochs"
    path.mkdir()
    count, size = 3000, 3000
    client.append(path, [blob(i, size) for i in range(count)])
    (path / "state").write_text("seal\n")
    (path / "order").write_text("shuffle 33\n")
    assert mount.unmount() == 0
    mount = mount_factory(*options)  # cold: nothing in DRAM
    expected = [(i, blob(i, size)) for i in shuffled(33, count).tolist()]
    kept = share == "auto"
    blocks = -(-count * size // (1 << 20))
    for epoch in range(2):
        with open(path / "stream", "rb", buffering=0) as f:
            got = bytearray(f.read(1 << 20))
            opened = stream_stats(path)
            assert opened["keeps_dram"] == int(kept and epoch == 0)
            if epoch == 1:
                assert opened["from_dram"] == int(kept), "not from DRAM: is pyfuse3 patched (setup.sh)?"
            elif kept:  # loaded behind the reader; the rest of this epoch from DRAM
                wait_for(lambda: stream_stats(path)["in_dram"], timeout_s=20, what="the dataset loaded")
                assert stream_stats(path)["loaded_blocks"] == blocks
                assert stream_stats(path)["from_dram"] == 1
            got += f.read()
            assert stream_stats(path)["in_dram"] == int(kept)
        assert [(i, bytes(b)) for i, _w, b in decode_blob_batch(bytes(got))] == expected
    # the stream's reservations go with its RELEASE, which the kernel sends after the close returns
    wait_for(
        lambda: mount.status()["blocks"]["dram_reserved_bytes"] == 0,  # type: ignore[index]
        what="the stream's RELEASE, sent after the close",
    )
    assert mount.unmount() == 0
