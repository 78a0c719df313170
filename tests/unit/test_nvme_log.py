"""The segment log without a mount: records, checks, torn tails, crashes at any byte."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distorefs.errors import Corrupted, StoreFull
from distorefs.tiers import copy_ranges, nvme_log
from distorefs.tiers.nvme_log import HEADER, LogPosition, NvmeLog, segment_name
from distorefs.types import BlockKey, LogLocation
from tests.unit.kernels import compiled_or_plain


def test_append_then_read_returns_the_payload(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path))
    loc = log.append(BlockKey(7, 3), b"hello")
    assert bytes(log.read(loc, BlockKey(7, 3))) == b"hello"
    log.close()


def test_read_with_the_wrong_key_is_corrupted(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path))
    loc = log.append(BlockKey(7, 3), b"hello")
    with pytest.raises(Corrupted, match=r"is not BlockKey\(owner=7, number=4\)"):
        log.read(loc, BlockKey(7, 4))
    log.close()


def test_flipped_payload_byte_fails_the_crc(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path))
    loc = log.append(BlockKey(1, 0), b"x" * 1000)
    path = tmp_path / segment_name(loc.segment)
    with open(path, "r+b") as f:
        f.seek(loc.offset + HEADER.size + 500)
        f.write(b"y")
    with pytest.raises(Corrupted, match="crc32c mismatch"):
        log.read(loc, BlockKey(1, 0))
    log.close()


def test_segments_roll_over_and_are_fsynced_whole(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=4096)
    locs = [log.append(BlockKey(1, i), bytes([i]) * 1000) for i in range(10)]
    assert len({loc.segment for loc in locs}) >= 3
    for i, loc in enumerate(locs):
        assert bytes(log.read(loc, BlockKey(1, i))) == bytes([i]) * 1000
    log.close()


def test_reopen_starts_a_new_segment_and_keeps_records(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path))
    loc = log.append(BlockKey(2, 0), b"kept")
    log.close()
    log = NvmeLog.open(str(tmp_path))
    assert log.active_segment == loc.segment + 1
    assert bytes(log.read(loc, BlockKey(2, 0))) == b"kept"
    log.close()


def test_delete_segment_removes_the_file_and_refuses_the_active_one(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=4096)
    first = log.append(BlockKey(1, 0), b"a" * 3000)
    log.append(BlockKey(1, 1), b"b" * 3000)
    log.delete_segment(first.segment)
    assert not (tmp_path / segment_name(first.segment)).exists()
    with pytest.raises(Corrupted, match="is gone"):
        log.read(first, BlockKey(1, 0))
    with pytest.raises(ValueError, match="active segment"):
        log.delete_segment(log.active_segment)
    log.close()


def test_torn_tail_is_dropped_at_recovery(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path))
    good = log.append(BlockKey(1, 0), b"a" * 100)
    torn = log.append(BlockKey(1, 1), b"b" * 100)
    log.close()
    path = tmp_path / segment_name(good.segment)
    os.truncate(path, torn.offset + HEADER.size + 50)
    log = NvmeLog.open(str(tmp_path))
    assert log.dropped_tail_bytes == HEADER.size + 50
    assert [r.key for r in log.scan()] == [BlockKey(1, 0)]
    assert os.path.getsize(path) == torn.offset
    with pytest.raises(Corrupted):
        log.read(torn, BlockKey(1, 1))
    log.close()


payloads = st.lists(st.binary(min_size=0, max_size=3000), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    records=payloads,
    sync_after=st.integers(min_value=0, max_value=25),
    cut=st.floats(min_value=0.0, max_value=1.0),
    garbage=st.binary(min_size=0, max_size=64),
)
def test_crash_at_any_byte_keeps_exactly_the_records_before_it(
    tmp_path_factory: pytest.TempPathFactory, records: list[bytes], sync_after: int, cut: float, garbage: bytes
) -> None:
    """Append, sync part way, crash at a byte past the synced point (with garbage after it);
    recovery returns exactly the records wholly written before the crash, all synced ones
    among them, and appends go on afterwards."""
    directory = tmp_path_factory.mktemp("log")
    log = NvmeLog.open(str(directory), segment_bytes=16384)
    locations: list[LogLocation] = []
    synced = 0
    for i, payload in enumerate(records):
        locations.append(log.append(BlockKey(9, i), payload))
        if i + 1 == sync_after:
            log.sync()
            synced = i + 1
    active = log.active_segment
    active_path = directory / segment_name(active)
    size = os.path.getsize(active_path)
    synced_in_active = max(
        [loc.offset + HEADER.size + loc.length for loc in locations[:synced] if loc.segment == active] or [0]
    )
    crash_at = synced_in_active + int(cut * (size - synced_in_active))
    # Simulate the crash: the OS lost everything after crash_at, and junk may follow. Junk
    # whose first byte equals the lost one could restore a record whole (hypothesis found
    # that), so it always differs there.
    lost = active_path.read_bytes()[crash_at : crash_at + 1]
    if garbage and lost and garbage[0] == lost[0]:
        garbage = bytes([garbage[0] ^ 0xFF]) + garbage[1:]
    os.truncate(active_path, crash_at)
    with open(active_path, "ab") as f:
        f.write(garbage)
    killed(log)

    recovered = NvmeLog.open(str(directory), segment_bytes=16384)
    survivors = [
        i
        for i, loc in enumerate(locations)
        if loc.segment != active or loc.offset + HEADER.size + loc.length <= crash_at
    ]
    assert survivors == list(range(len(survivors))), "survivors form a prefix"
    assert len(survivors) >= synced
    found = [(r.key, r.payload) for r in recovered.scan()]
    expected = [(BlockKey(9, i), records[i]) for i in survivors]
    # Garbage that happens to parse as a valid record is impossible without a crc match.
    assert found == expected
    after = recovered.append(BlockKey(9, 999), b"after")
    assert bytes(recovered.read(after, BlockKey(9, 999))) == b"after"
    recovered.close()


def test_try_append_now_writes_while_the_log_is_free_and_never_starts_a_segment(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=4096)
    first = log.try_append_now([(BlockKey(1, 0), b"a" * 1000), (BlockKey(1, 1), b"b" * 1000)])
    assert first is not None
    assert [bytes(log.read(loc, BlockKey(1, i))) for i, loc in enumerate(first)] == [b"a" * 1000, b"b" * 1000]
    segment = log.active_segment
    assert log.try_append_now([(BlockKey(1, 2), b"c" * 3000)]) is None  # would need a new segment
    assert log.active_segment == segment
    with log._append_lock:  # another append in progress (a worker thread)
        assert log.try_append_now([(BlockKey(1, 3), b"d")]) is None
    log.close()


def test_a_note_made_from_where_the_records_land_goes_with_them_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=8192)
    writes = []
    real = os.pwritev
    monkeypatch.setattr(nvme_log.os, "pwritev", lambda fd, bufs, off: writes.append(off) or real(fd, bufs, off))
    records = [(BlockKey(2, 0), b"a" * 100), (BlockKey(2, 1), b"b" * 200)]
    seen: list[list[LogLocation]] = []

    def note(locations: list[LogLocation]) -> tuple[BlockKey, bytes]:
        seen.append(locations)
        return BlockKey(3, 0), repr([tuple(at) for at in locations]).encode()

    appended = log.try_append_noted(records, note)
    assert appended is not None
    locations, noted = appended
    assert noted
    assert seen == [locations]
    assert len(writes) == 1
    read = [bytes(log.read(at, key)) for (key, _p), at in zip(records, locations, strict=True)]
    assert read == [b"a" * 100, b"b" * 200]
    (_at, key, _seq, payload), *_ = log.walk(LogPosition(log.active_segment, locations[-1].offset + HEADER.size + 200))
    assert key == BlockKey(3, 0)
    assert bytes(payload) == repr([tuple(at) for at in locations]).encode()

    # A note that would not fit in the segment stays out; the records go alone.
    appended = log.try_append_noted([(BlockKey(2, 2), b"c" * 100)], lambda _at: (BlockKey(3, 1), b"n" * 8000))
    assert appended is not None
    assert appended[1] is False
    assert bytes(log.read(appended[0][0], BlockKey(2, 2))) == b"c" * 100
    # Records that do not fit, or a log busy with another append: nothing is written, no note made.
    assert log.try_append_noted([(BlockKey(2, 3), b"d" * 8000)], note) is None
    with log._append_lock:
        assert log.try_append_noted([(BlockKey(2, 3), b"d")], note) is None
    assert len(seen) == 1
    assert len(writes) == 2
    log.close()


def test_short_writes_are_carried_on_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pwritev may write less than asked (a signal, a nearly full disk): every append,
    small or not, one record or many, and of any buffer type, goes on from where the
    kernel stopped, and the records read back whole, then and after a reopen."""
    real = os.pwritev
    calls = []

    def short(fd: int, buffers: list[bytes | bytearray | memoryview], offset: int) -> int:
        flat = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        calls.append(len(flat))
        return real(fd, [flat[:777]], offset)  # at most 777 bytes a call

    monkeypatch.setattr(nvme_log.os, "pwritev", short)
    log = NvmeLog.open(str(tmp_path), segment_bytes=1 << 20)
    payloads = [b"x" * 5, bytearray(b"y" * 3000), memoryview(bytearray(range(256)) * 10), b""]
    records = [(BlockKey(4, i), p) for i, p in enumerate(payloads)]
    locations = log.append_many(records[:2]) + (log.try_append_now(records[2:]) or [])
    assert len(locations) == 4
    assert len(calls) == 8  # 3,077 bytes in four calls, then 2,632 in four
    expected = [bytes(p) for p in payloads]
    assert [bytes(log.read(loc, key)) for loc, (key, _p) in zip(locations, records, strict=True)] == expected
    log.close()
    monkeypatch.setattr(nvme_log.os, "pwritev", real)
    log = NvmeLog.open(str(tmp_path), segment_bytes=1 << 20)
    assert [bytes(log.read(loc, key)) for loc, (key, _p) in zip(locations, records, strict=True)] == expected
    log.close()


def test_position_and_scan_from_it_give_the_records_after_a_point(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=4096)
    log.append(BlockKey(1, 0), b"before")
    mark = log.position()
    after = [log.append(BlockKey(1, i), bytes([i]) * 1500) for i in range(1, 6)]  # rolls segments
    assert len({loc.segment for loc in after}) > 1
    assert [(r.key, r.location) for r in log.scan(mark)] == [(BlockKey(1, i), loc) for i, loc in enumerate(after, 1)]
    end = log.position()
    assert list(log.scan(end)) == []
    log.close()


def test_read_many_reads_neighbours_in_spans_and_still_checks_every_record(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=1 << 20)
    locs = [log.append(BlockKey(3, i), bytes([i]) * (100 + i)) for i in range(200)]
    far = log.append(BlockKey(4, 0), b"far" * 30_000)  # past the gap: read on its own
    wanted = [(BlockKey(3, i), locs[i]) for i in (5, 6, 7, 150, 6, 199)] + [(BlockKey(4, 0), far)]
    got = log.read_many(wanted)
    assert [bytes(p) for p in got[:-1]] == [bytes([i]) * (100 + i) for i in (5, 6, 7, 150, 6, 199)]
    assert bytes(got[-1]) == b"far" * 30_000
    with open(tmp_path / segment_name(locs[7].segment), "r+b") as f:  # damage one record of a span
        f.seek(locs[7].offset + HEADER.size + 3)
        f.write(b"\xff")
    with pytest.raises(Corrupted, match="crc32c mismatch"):
        log.read_many(wanted)
    with pytest.raises(Corrupted, match="is not"):
        log.read_many([(BlockKey(3, 5), locs[5]), (BlockKey(3, 99), locs[6])])  # a key that is not there
    log.close()


def test_will_need_gives_one_hint_per_run_of_neighbouring_records(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=1 << 20)
    near = log.append_many([(BlockKey(1, i), bytes([i]) * 1000) for i in range(5)])
    big = log.append_many([(BlockKey(2, 0), b"x" * 200_000)])
    after = log.append_many([(BlockKey(3, 0), b"y" * 100)])  # 200 KB past near: its own run
    assert log.will_need(near) == 1  # neighbours: one hint for all five
    assert log.will_need([near[0], near[2], near[4], *big]) == 1  # small gaps: still one run
    assert log.will_need([near[0], *after]) == 2
    assert log.will_need([LogLocation(99, 0, 10)]) == 0  # a segment that is gone: skipped
    assert log.read(near[3], BlockKey(1, 3)) == bytes([3]) * 1000  # a hint changes nothing
    log.close()


def test_a_long_run_is_hinted_in_pieces_and_the_kernel_reads_it_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One WILLNEED reads at most the device's read-ahead (8 MiB on this VM's disk): a
    hint of a 24 MiB run in one call left 16 MiB of it cold. `direct_too` hints big
    records that would otherwise be read with O_DIRECT (a fitting dataset's stream)."""
    log = NvmeLog.open(str(tmp_path))
    records = log.append_many([(BlockKey(1, i), bytes([i]) * (1 << 20)) for i in range(24)])
    fd = log._segments[records[0].segment].fd
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start, end = records[0].offset, records[-1].offset + HEADER.size + records[-1].length
    if nvme_log.cached_pages(fd, start, end - start) is None:
        log.close()
        pytest.skip("this kernel has no cachestat")
    hints: list[int] = []
    real_fadvise = os.posix_fadvise

    def counted(fd: int, offset: int, length: int, advice: int) -> None:
        hints.append(length)
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", counted)
    assert log.will_need(records, direct_too=True) == 1  # one run
    assert max(hints) <= nvme_log.HINT_BYTES
    assert sum(hints) == end - start
    pages = -(-end // 4096) - start // 4096
    deadline = time.monotonic() + 10
    while nvme_log.cached_pages(fd, start, end - start) != pages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nvme_log.cached_pages(fd, start, end - start) == pages
    log.close()


@pytest.mark.parametrize("read_ahead", [True, False], ids=["hinted-ahead", "no-hints"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_read_ranges_reads_every_range_and_names_those_of_a_segment_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool, read_ahead: bool
) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=64 * 1024)
    if compiled:
        assert copy_ranges.load_compiled(), "numba is a dependency: the compiled reads must load"

        def python_read(*args: object) -> int:
            raise AssertionError("a range read in Python where the compiled reads run")

        monkeypatch.setattr(os, "preadv", python_read)
    else:
        monkeypatch.setattr(copy_ranges.KERNELS, "module", None)
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, 5000, dtype=np.uint8).tobytes() for _ in range(60)]
    locations = log.append_many([(BlockKey(1, i), p) for i, p in enumerate(payloads)])
    gone_segment = locations[20].segment
    log.delete_segment(gone_segment)
    picks = sorted(rng.choice(60, 300), key=lambda i: locations[i])  # in log order, some twice
    inner = rng.integers(0, 4000, len(picks))
    lengths = rng.integers(0, 1000, len(picks))
    out_at = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = bytearray(b"?" * int(lengths.sum()))
    gone = log.read_ranges(
        np.array([locations[i].segment for i in picks]),
        np.array([locations[i].offset for i in picks]) + inner,
        lengths,
        out,
        out_at,
        read_ahead,
    )
    assert gone == [k for k, i in enumerate(picks) if locations[i].segment == gone_segment]
    assert gone
    for k, i in enumerate(picks):
        got = bytes(out[out_at[k] : out_at[k] + lengths[k]])
        if k in gone:
            assert got == b"?" * int(lengths[k])
        else:
            assert got == payloads[i][inner[k] : inner[k] + lengths[k]]
    log.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_read_ranges_refuses_a_short_read_and_a_range_outside_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    if compiled:
        assert copy_ranges.load_compiled()
    else:
        monkeypatch.setattr(copy_ranges.KERNELS, "module", None)
    log = NvmeLog.open(str(tmp_path))
    loc = log.append(BlockKey(1, 0), b"r" * 3000)
    segment, size = np.array([loc.segment] * 2), os.fstat(log._segments[loc.segment].fd).st_size
    out = bytearray(8000)
    with pytest.raises(Corrupted, match="short read"):  # the second range runs past the segment's end
        log.read_ranges(
            segment, np.array([loc.offset, size - HEADER.size - 100]), np.array([3000, 4000]), out, np.array([0, 3000])
        )
    assert out[:3000] == b"r" * 3000
    out = bytearray(8000)
    with pytest.raises(AssertionError, match="outside the output"):  # checked before anything is read
        log.read_ranges(segment, np.array([loc.offset, loc.offset]), np.array([3000, 3000]), out, np.array([0, 6000]))
    assert out == bytearray(8000)
    log.close()


def test_read_many_spans_with_gaps_and_spans_of_many_small_records(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path), segment_bytes=4 << 20)
    locs = [log.append(BlockKey(5, i), i.to_bytes(4, "little") * (10 + i % 7)) for i in range(600)]
    # every other record: one span, with the records between read into scratch (a gap)
    every_other = [(BlockKey(5, i), locs[i]) for i in range(0, 40, 2)]
    assert [bytes(p) for p in log.read_many(every_other)] == [
        i.to_bytes(4, "little") * (10 + i % 7) for i in range(0, 40, 2)
    ]
    # more records in one span than one preadv takes buffers for: read whole, then cut
    many = [(BlockKey(5, i), locs[i]) for i in range(600)]
    got = log.read_many(many)
    assert [bytes(p) for p in got] == [i.to_bytes(4, "little") * (10 + i % 7) for i in range(600)]
    with open(tmp_path / segment_name(locs[20].segment), "r+b") as f:  # damage one record of each kind of span
        f.seek(locs[20].offset + HEADER.size)
        f.write(b"\xff")
    for records in (every_other, many):
        with pytest.raises(Corrupted, match="crc32c mismatch"):
            log.read_many(records)
    log.close()


def killed(log: NvmeLog) -> None:
    """Drop the process's view of the log without the clean close's fsync (a kill -9)."""
    for seg in list(log._segments.values()):
        os.close(seg.fd)
        if seg.direct_fd >= 0:
            os.close(seg.direct_fd)
        if seg.read_direct_fd >= 0:
            os.close(seg.read_direct_fd)
    log._segments.clear()


def small_direct_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct writes from 8 KiB on, through a staging buffer of 16 KiB (the mechanism of
    4 MiB and 16 MiB, at sizes a property test can run many times)."""
    monkeypatch.setattr(nvme_log, "DIRECT_MIN_BYTES", 8192)
    monkeypatch.setattr(nvme_log, "STAGE_BYTES", 16384)


@pytest.fixture(params=["compiled", "python"])
def staging(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """A big append's crcs and staging copies: one compiled call each (copy_ranges_jit's
    `crcs` and `copy`, without the GIL) or a Python call per record and per piece; True
    for the compiled run."""
    return compiled_or_plain(request, monkeypatch, copy_ranges.KERNELS)


def test_a_big_batchs_headers_are_the_same_compiled_or_not(staging: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_headers gives each record the header encode_header gives it (the crc over
    the header, then the payload), whichever way its crcs are computed."""
    monkeypatch.setattr(nvme_log, "DIRECT_MIN_BYTES", 8192)
    rng = random.Random(7)
    records: list[tuple[BlockKey, bytes | memoryview]] = [
        (BlockKey(rng.randrange(1 << 40), k), rng.randbytes(rng.choice([0, 1, 4096, 30_000]))) for k in range(40)
    ]
    records.append((BlockKey(9, 9), memoryview(bytearray(rng.randbytes(10_000)))[17:9_000]))
    expected = [nvme_log.encode_header(key, 1000 + i, payload) for i, (key, payload) in enumerate(records)]
    assert nvme_log.encode_headers(records, 1000) == expected
    compiled = copy_ranges.compiled_crcs([b"x"], [0]) is not None
    assert compiled == staging  # (and the compiled run did compute them in the kernel)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(
        st.lists(st.integers(min_value=0, max_value=40_000), min_size=1, max_size=4), min_size=1, max_size=12
    ),
    seed=st.integers(min_value=0, max_value=255),
)
def test_big_appends_bypass_the_page_cache_between_small_ones_and_all_come_back_after_a_kill(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    staging: bool,
    batches: list[list[int]],
    seed: int,
) -> None:
    small_direct_writes(monkeypatch)
    directory = tmp_path_factory.mktemp("log")
    log = NvmeLog.open(str(directory), segment_bytes=65536)
    if not log.direct:
        log.close()
        pytest.skip("this file system refuses O_DIRECT")
    written: list[tuple[BlockKey, bytes, LogLocation]] = []
    for b, sizes in enumerate(batches):
        records = [
            (BlockKey(3, 100 * b + k), random.Random(seed * 1000 + b * 10 + k).randbytes(size))
            for k, size in enumerate(sizes)
        ]
        for (key, payload), location in zip(records, log.append_many(records), strict=True):
            written.append((key, payload, location))
    for key, payload, location in written:  # read back through the page cache while the log is live
        assert bytes(log.read(location, key)) == payload
    assert (log.direct_bytes > 0) == any(sum(HEADER.size + n for n in sizes) >= 8192 for sizes in batches)
    killed(log)

    recovered = NvmeLog.open(str(directory), segment_bytes=65536)
    assert recovered.dropped_tail_bytes == 0  # the zeros past the last record are no torn tail
    assert [(r.key, r.payload) for r in recovered.scan()] == [(key, payload) for key, payload, _at in written]
    after = recovered.append(BlockKey(3, 1), b"after")
    assert bytes(recovered.read(after, BlockKey(3, 1))) == b"after"
    recovered.close()


def test_a_torn_direct_write_loses_only_its_own_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small_direct_writes(monkeypatch)
    log = NvmeLog.open(str(tmp_path))
    if not log.direct:
        log.close()
        pytest.skip("this file system refuses O_DIRECT")
    kept = [log.append(BlockKey(1, i), b"small %d" % i) for i in range(3)]  # in the page it rewrites
    big = log.append_many([(BlockKey(2, i), bytes([i + 1]) * 30_000) for i in range(3)])
    assert log.direct_bytes > 0
    path = tmp_path / segment_name(big[0].segment)
    killed(log)
    os.truncate(path, big[2].offset + 1000)  # the device took the write but for its last part

    recovered = NvmeLog.open(str(tmp_path))
    assert recovered.dropped_tail_bytes == 1000
    assert [r.key for r in recovered.scan()] == [
        BlockKey(1, 0),
        BlockKey(1, 1),
        BlockKey(1, 2),
        BlockKey(2, 0),
        BlockKey(2, 1),
    ]
    assert bytes(recovered.read(kept[2], BlockKey(1, 2))) == b"small 2"
    recovered.close()


def test_where_o_direct_is_refused_big_appends_go_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that refuses O_DIRECT at open (EINVAL; tmpfs did before Linux 6.6,
    and no such file system is at hand here, so the refusal is injected)."""
    small_direct_writes(monkeypatch)
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(nvme_log.os, "open", refusing_open)
    log = NvmeLog.open(str(tmp_path))
    assert not log.direct
    location = log.append(BlockKey(4, 0), b"z" * 50_000)
    assert log.direct_bytes == 0
    assert bytes(log.read(location, BlockKey(4, 0))) == b"z" * 50_000
    log.close()


def test_a_direct_write_the_device_refuses_is_written_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device whose blocks are bigger than the alignment refuses the write (EINVAL, here
    injected): that write and every later one go through the page cache, nothing lost."""
    small_direct_writes(monkeypatch)
    log = NvmeLog.open(str(tmp_path))
    if not log.direct:
        log.close()
        pytest.skip("this file system refuses O_DIRECT")

    def refuse(seg: object, data: memoryview, at: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(NvmeLog, "_pwrite_direct", staticmethod(refuse))
    first = log.append(BlockKey(6, 0), b"a" * 20_000)
    second = log.append(BlockKey(6, 1), b"b" * 20_000)
    assert not log.direct
    assert log.direct_bytes == 0
    assert bytes(log.read(first, BlockKey(6, 0))) == b"a" * 20_000
    assert bytes(log.read(second, BlockKey(6, 1))) == b"b" * 20_000
    log.close()


def test_a_direct_write_that_fails_in_the_writer_thread_fails_the_append_and_nothing_is_half_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staging buffers take turns, one written by the log's writer thread while the
    next fills. A write that fails there (a full disk, here on the second of five staged
    writes) fails the whole append once every write in flight has ended: no write lands
    after the append has returned, the log is cut back to where the append began, and
    the next append and a restart see only the records before it."""
    small_direct_writes(monkeypatch)
    log = NvmeLog.open(str(tmp_path))
    if not log.direct:
        log.close()
        pytest.skip("this file system refuses O_DIRECT")
    before = log.append(BlockKey(1, 0), b"before")
    real = NvmeLog._pwrite_direct
    calls: list[int] = []
    late: list[int] = []  # writes that began or ended after their append returned
    returned = False

    def second_fails(seg: object, data: memoryview, at: int) -> None:
        if returned:
            late.append(at)
        calls.append(at)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        time.sleep(0.02)  # long enough for the append to get ahead of its writer thread
        real(seg, data, at)  # type: ignore[arg-type]
        if returned:
            late.append(at)

    monkeypatch.setattr(NvmeLog, "_pwrite_direct", staticmethod(second_fails))
    size_before = log.position()
    with pytest.raises(StoreFull):
        log.append_many([(BlockKey(2, i), bytes([i + 1]) * 20_000) for i in range(4)])  # about 5 stages
    returned = True
    time.sleep(0.1)
    assert not late
    assert len(calls) >= 2
    assert log.position() == size_before
    monkeypatch.setattr(NvmeLog, "_pwrite_direct", staticmethod(real))
    after = log.append_many([(BlockKey(3, i), bytes([i + 7]) * 20_000) for i in range(2)])
    assert bytes(log.read(after[1], BlockKey(3, 1))) == bytes([8]) * 20_000
    killed(log)

    recovered = NvmeLog.open(str(tmp_path))
    assert [r.key for r in recovered.scan()] == [BlockKey(1, 0), BlockKey(3, 0), BlockKey(3, 1)]
    assert bytes(recovered.read(before, BlockKey(1, 0))) == b"before"
    recovered.close()


def small_direct_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct reads of records from 8 KiB to 64 KiB (the mechanism of 256 KiB to 4 MiB)."""
    monkeypatch.setattr(nvme_log, "DIRECT_READ_MIN_BYTES", 8192)
    monkeypatch.setattr(nvme_log, "DIRECT_READ_MAX_BYTES", 65536)


def evicted(log: NvmeLog) -> None:
    """Drop the log's clean pages from the page cache (what a remount after a while, or
    memory pressure, leaves): its big records are then read with O_DIRECT."""
    for seg in log._segments.values():
        os.fsync(seg.fd)
        os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_through_the_page_cache(log: NvmeLog, location: LogLocation, key: BlockKey, payload: bytes) -> None:
    """The record reads back whole, and direct reads are off with none made: what every
    refusal (no cachestat, no O_DIRECT, a device's EINVAL) must leave."""
    assert bytes(log.read(location, key)) == payload
    assert not log.direct_reads
    assert log.direct_read_bytes == 0


def direct_log(directory: Path, monkeypatch: pytest.MonkeyPatch) -> NvmeLog:
    small_direct_reads(monkeypatch)
    log = NvmeLog.open(str(directory))
    if not log.direct_reads or nvme_log.cached_pages(log._segments[log.active_segment].fd, 0, 4096) is None:
        log.close()
        pytest.skip("this file system refuses O_DIRECT, or this kernel has no cachestat")
    return log


def test_big_records_out_of_the_page_cache_are_read_with_o_direct_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = direct_log(tmp_path, monkeypatch)
    payloads = [bytes([i + 1]) * (10_000 + 4099 * i) for i in range(8)]  # unaligned offsets and lengths
    small = log.append(BlockKey(1, 99), b"small")
    locations = log.append_many([(BlockKey(1, i), p) for i, p in enumerate(payloads)])
    for i, payload in enumerate(payloads):  # just written: in the page cache, read through it
        assert bytes(log.read(locations[i], BlockKey(1, i))) == payload
    assert log.direct_read_bytes == 0
    evicted(log)
    spare = bytearray(b"\xee") * 100_000
    for i, payload in enumerate(payloads):
        got = log.read(locations[i], BlockKey(1, i), spare)
        assert got is spare
        assert spare[: len(payload)] == payload
    assert log.direct_read_bytes == sum(len(p) for p in payloads)
    assert log.buffer_bytes == nvme_log.DIRECT_READ_MAX_BYTES + 16 * nvme_log.DIRECT_ALIGN  # one kept: reads in turn
    assert bytes(log.read(small, BlockKey(1, 99))) == b"small"  # under the minimum: the page cache
    assert log.direct_read_bytes == sum(len(p) for p in payloads)
    evicted(log)
    with pytest.raises(Corrupted, match="is not"):
        log.read(locations[3], BlockKey(1, 4))
    log.close()


def test_a_damaged_record_read_with_o_direct_is_read_again_and_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = direct_log(tmp_path, monkeypatch)
    locations = log.append_many([(BlockKey(2, i), bytes([i + 1]) * 30_000) for i in range(3)])
    with open(tmp_path / segment_name(locations[1].segment), "r+b") as f:
        f.seek(locations[1].offset + HEADER.size + 20_000)
        f.write(b"\x00")
    evicted(log)
    with pytest.raises(Corrupted, match="crc32c mismatch"):
        log.read(locations[1], BlockKey(2, 1))
    evicted(log)
    assert bytes(log.read(locations[2], BlockKey(2, 2))) == bytes([3]) * 30_000
    assert log.direct_read_bytes == 30_000  # the damaged one was not counted
    log.close()


def test_big_records_get_no_read_ahead_hint_where_they_are_read_with_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hint would put them in the page cache, and a record with pages there is read
    through it: the prefetcher's hints are for the records read that way."""
    log = direct_log(tmp_path, monkeypatch)
    big = log.append_many([(BlockKey(3, i), b"b" * 20_000) for i in range(4)])
    small = log.append_many([(BlockKey(4, i), b"s" * 100) for i in range(4)])
    evicted(log)
    assert log.will_need(big) == 0
    assert log.will_need(small) == 1
    assert log.will_need([*big, *small]) == 1
    assert bytes(log.read(big[2], BlockKey(3, 2))) == b"b" * 20_000
    assert log.direct_read_bytes == 20_000
    log.close()


def test_without_cachestat_or_o_direct_big_records_are_read_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel before 6.5 (no cachestat) and a file system that refuses O_DIRECT at
    open: both injected here, neither at hand."""
    log = direct_log(tmp_path, monkeypatch)
    location = log.append(BlockKey(5, 0), b"k" * 30_000)
    evicted(log)
    monkeypatch.setattr(nvme_log, "cached_pages", lambda fd, offset, length: None)
    read_through_the_page_cache(log, location, BlockKey(5, 0), b"k" * 30_000)
    assert log.will_need([location]) == 1  # read through the page cache: hinted again
    log.close()
    monkeypatch.undo()
    small_direct_reads(monkeypatch)
    log = NvmeLog.open(str(tmp_path))
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT and not flags & os.O_WRONLY:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(nvme_log.os, "open", refusing_open)
    evicted(log)
    read_through_the_page_cache(log, location, BlockKey(5, 0), b"k" * 30_000)
    log.close()


def test_direct_reads_from_many_threads_while_appends_go_on_and_segments_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight readers of records out of the page cache, beside a writer appending into
    the page the last record ends in and a segment deleted under them: every read
    gives its record's bytes (or Corrupted for the deleted segment's, whose reads may
    have begun before it went), the aligned buffers are shared safely, and closing
    leaves no descriptor open."""
    fds_before = len(os.listdir("/proc/self/fd"))
    log = direct_log(tmp_path, monkeypatch)
    log.segment_bytes = 256 * 1024
    written = {}
    for i in range(40):
        key = BlockKey(6, i)
        written[key] = (log.append(key, bytes([i + 1]) * (9_000 + 997 * i)), bytes([i + 1]) * (9_000 + 997 * i))
    evicted(log)
    doomed = min(loc.segment for loc, _ in written.values())
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        keys = list(written)
        try:
            for _ in range(200):
                key = rng.choice(keys)
                location, payload = written[key]
                try:
                    assert bytes(log.read(location, key)) == payload
                except Corrupted:
                    assert location.segment == doomed
        except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
            errors.append(exc)

    def appender() -> None:
        n = 0
        while not stop.is_set():
            log.append(BlockKey(7, n), b"a" * 50)
            n += 1

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    writer = threading.Thread(target=appender)
    for t in [*threads, writer]:
        t.start()
    log.delete_segment(doomed)
    for t in threads:
        t.join()
    stop.set()
    writer.join()
    assert not errors, errors
    assert log.direct_read_bytes > 0
    log.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_read_many_reads_big_neighbours_and_big_singles_out_of_the_page_cache_with_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's cold blocks (a dataset stream loading whole blocks, a replay draw of big
    items): spans of neighbours in one direct read each, scattered ones each in their
    own, none of them hinted into the page cache first."""
    log = direct_log(tmp_path, monkeypatch)
    near = log.append_many([(BlockKey(8, i), bytes([i + 1]) * 12_000) for i in range(4)])
    log.append(BlockKey(9, 0), b"between" * 20_000)  # 140 KB of something else
    far = log.append(BlockKey(8, 9), b"f" * 20_000)
    evicted(log)
    hinted: list[int] = []
    real_fadvise = os.posix_fadvise

    def counted(fd: int, offset: int, length: int, advice: int) -> None:
        hinted.append(offset)
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(nvme_log.os, "posix_fadvise", counted)
    wanted = [(BlockKey(8, i), near[i]) for i in (2, 0, 1, 3)] + [(BlockKey(8, 9), far)]
    got = log.read_many(wanted)
    assert [bytes(p) for p in got] == [bytes([i + 1]) * 12_000 for i in (2, 0, 1, 3)] + [b"f" * 20_000]
    assert log.direct_read_bytes == 4 * 12_000 + 20_000
    assert not hinted
    with open(tmp_path / segment_name(near[1].segment), "r+b") as f:  # damage one record of the span
        f.seek(near[1].offset + HEADER.size + 5)
        f.write(b"\x00")
    evicted(log)
    with pytest.raises(Corrupted, match="crc32c mismatch"):
        log.read_many(wanted)
    log.close()


def direct_reads_fail(monkeypatch: pytest.MonkeyPatch, log: NvmeLog, segment: int, code: int) -> None:
    """Every read of `segment`'s O_DIRECT descriptor fails with `code` (a device's
    refusal or error, injected); other reads go on."""
    real_preadv = os.preadv

    def failing(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        if fd == log._segments[segment].read_direct_fd:
            raise OSError(code, os.strerror(code))
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(nvme_log.os, "preadv", failing)


def test_a_direct_read_the_device_refuses_is_read_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device whose blocks are bigger than the alignment refuses the read (EINVAL, here
    injected): that read and every later one go through the page cache."""
    log = direct_log(tmp_path, monkeypatch)
    location = log.append(BlockKey(10, 0), b"r" * 30_000)
    evicted(log)
    direct_reads_fail(monkeypatch, log, location.segment, errno.EINVAL)
    read_through_the_page_cache(log, location, BlockKey(10, 0), b"r" * 30_000)
    log.close()


def test_a_direct_read_that_fails_raises_and_the_log_still_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error of the device (EIO, injected) fails the read, not silently served
    through the page cache; the traceback kept by the caller holds a view of the aligned
    buffer, and closing the log still works."""
    log = direct_log(tmp_path, monkeypatch)
    location = log.append(BlockKey(11, 0), b"e" * 30_000)
    evicted(log)
    direct_reads_fail(monkeypatch, log, location.segment, errno.EIO)
    with pytest.raises(OSError, match="Input/output error") as kept:
        log.read(location, BlockKey(11, 0))
    assert log.direct_reads
    log.close()
    del kept


def test_read_many_reads_big_records_with_small_records_between_them_in_one_direct_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset's blocks have its index records between them: a span of big records
    with small gaps goes to the device as one direct read (the gaps read and skipped),
    cut where it would pass the aligned buffer."""
    log = direct_log(tmp_path, monkeypatch)
    blocks: list[tuple[BlockKey, LogLocation, bytes]] = []
    for i in range(8):
        payload = bytes([i + 1]) * 15_000
        blocks.append((BlockKey(12, i), log.append(BlockKey(12, i), payload), payload))
        log.append(BlockKey(13, i), b"index %d" % i)  # a small record between two blocks
    evicted(log)
    reads: list[int] = []
    real_preadv = os.preadv

    def counted(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        reads.append(fd)
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(nvme_log.os, "preadv", counted)
    got = log.read_many([(key, location) for key, location, _payload in blocks])
    assert [bytes(p) for p in got] == [payload for _key, _location, payload in blocks]
    assert log.direct_read_bytes == 8 * 15_000
    assert len(reads) == 2  # six blocks and their gaps reach 90 KB; a seventh would pass 96 KiB
    with open(tmp_path / segment_name(blocks[7][1].segment), "r+b") as f:  # damage a block of the second span
        f.seek(blocks[7][1].offset + HEADER.size + 9)
        f.write(b"\x00")
    evicted(log)
    with pytest.raises(Corrupted, match="crc32c mismatch"):
        log.read_many([(key, location) for key, location, _payload in blocks])
    log.close()


def test_runs_take_big_records_close_together_up_to_what_one_direct_read_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequential reader's next blocks, cut into the runs the prefetcher reads with one
    direct read each: neighbours and small gaps join, a small record, another segment,
    a gap past 64 KiB or a run past the buffer start a new one; with direct reads off,
    every record is a run of its own."""
    log = direct_log(tmp_path, monkeypatch)
    a = log.append_many([(BlockKey(14, i), b"a" * 20_000) for i in range(3)])
    log.append(BlockKey(15, 0), b"note")  # a small record between blocks: a gap
    b = log.append_many([(BlockKey(14, 3 + i), b"b" * 20_000) for i in range(3)])
    log.append(BlockKey(15, 1), b"g" * 70_000)  # a gap past SPAN_GAP_BYTES
    c = log.append(BlockKey(14, 6), b"c" * 20_000)
    small = log.append(BlockKey(14, 7), b"s" * 100)
    keyed = [(BlockKey(14, i), location) for i, location in enumerate([*a, *b, c, small])]
    runs = log.runs(keyed)
    # 96 KiB from the first's start: four blocks and the note fit, the fifth would not
    assert [len(run) for run in runs] == [4, 2, 1, 1]
    assert [key for run in runs for key, _loc in run] == [key for key, _loc in keyed]
    got = log.read_run(runs[0], [None] * 4)
    assert [bytes(p) for p in got] == [b"a" * 20_000] * 3 + [b"b" * 20_000]
    evicted(log)
    got = log.read_run(runs[0], [bytearray(30_000) for _ in range(4)])
    assert [bytes(p[:20_000]) for p in got] == [b"a" * 20_000] * 3 + [b"b" * 20_000]
    assert log.direct_read_bytes == 4 * 20_000
    log.direct_reads = False
    assert [len(run) for run in log.runs(keyed)] == [1] * len(keyed)
    log.close()
