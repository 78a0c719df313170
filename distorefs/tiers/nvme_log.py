"""NvmeLog: the append-only segment log on local NVMe.

Owns the bytes on disk: segment files, the record format, appends, reads with checks,
fsync, torn-tail recovery and deleting whole segments. It does not know which records
are live; the block tier above it keeps that index and decides what to compact.

All methods are synchronous and may block on the disk: callers on the event loop run
them through `trio.to_thread.run_sync` with the tier's CapacityLimiter. Appends are
serialised by an internal lock; reads run concurrently with appends.

Record layout (little endian, also in docs/formats.md):

    offset  size  field
    0       4     magic    0x44535452 ("DSTR")
    4       4     length   payload length in bytes
    8       8     owner    BlockKey.owner
    16      8     number   BlockKey.number
    24      8     seq      log-wide sequence number, increasing
    32      4     crc      crc32c of bytes 0..31 and of the payload
    36      ...   payload

A segment is a file `seg-<id:010d>.log` in the log directory. Only the newest segment can
hold a torn tail: a segment is fsync'ed before the next one is created.

Appends of DIRECT_MIN_BYTES or more (flushes of file blocks, the write-behind, big
persists) bypass the page cache: they are copied into one reused, aligned staging buffer
and written with O_DIRECT, from the start of the page that holds the log's end (its
bytes read back and written again as they are) to a page boundary (zeros past the last
record, which the next append overwrites and a start-up cuts off without calling them
torn). Through the page cache the same write cost 0.3-1.9 s of CPU per GiB on this VM
(new page cache pages, then the kernel's writeback), with O_DIRECT 0.17-0.19 s
(docs/design.md, "Big log writes bypass the page cache"). Small appends (replay items,
notes, small files) keep the page cache. Where the file system refuses O_DIRECT (tmpfs
before Linux 6.6), or a device refuses a 4 KiB-aligned write, every append goes through
the page cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import crc32c
import numpy as np

from distorefs.errors import Corrupted, StoreFull
from distorefs.memory import unzeroed
from distorefs.tiers.copy_ranges import compiled_crcs, copy_ranges, pread_ranges
from distorefs.types import BlockKey, LogLocation, Writable

log = logging.getLogger(__name__)

MAGIC = 0x44535452
HEADER = struct.Struct("<IIQQQI")
HEADER_CRC_SPAN = HEADER.size - 4
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
RESERVE_NAME = "reserve"  # ballast that keeps room for compaction on a full disk
SCAN_CHUNK_BYTES = 8 * 1024 * 1024
NOTE_NUMBERS = 1 << 62  # records with an index from here on are notes, not blocks (tiers/writeback.py)
# WILLNEED reads at most max(the device's read-ahead, its largest request): 8 MiB here, as
# little as 128 KiB with a default read_ahead_kb; hints go in pieces of that least size
# (a GiB hinted in 128 KiB pieces was submitted as fast as in 1 MiB or 4 MiB ones here)
HINT_BYTES = 128 << 10
READ_AHEAD_PARTS = 128  # read_ranges keeps this many small reads hinted ahead (measured: 64-512 alike)
DIRECT_MIN_BYTES = 4 * 1024 * 1024  # appends of at least this much are written with O_DIRECT
DIRECT_ALIGN = 4096  # offsets, lengths and memory of O_DIRECT writes are multiples of this
STAGE_BYTES = 16 * 1024 * 1024  # each of the two aligned staging buffers: one O_DIRECT write at most this big
DIRECT_READ_MIN_BYTES = 256 * 1024  # records this big that are not in the page cache are read with O_DIRECT
DIRECT_READ_MAX_BYTES = 4 * 1024 * 1024  # ... up to this (the reused aligned buffers' size)
READ_STAGES_KEPT = 8  # aligned read buffers kept for the next direct reads (the block tier's I/O threads)
_SEGMENT_PREFIX = "seg-"
_SEGMENT_SUFFIX = ".log"


def segment_name(segment: int) -> str:
    return f"{_SEGMENT_PREFIX}{segment:010d}{_SEGMENT_SUFFIX}"


def _head(key: BlockKey, seq: int, payload: bytes | bytearray | memoryview) -> bytes:
    """A header's first 32 bytes (its crc, over them and the payload, follows)."""
    return struct.pack("<IIQQQ", MAGIC, len(payload), key.owner, key.number, seq)


def encode_header(key: BlockKey, seq: int, payload: bytes | bytearray | memoryview) -> bytes:
    """Return the 36-byte header for `payload` under `key`, crc included."""
    head = _head(key, seq, payload)
    crc = crc32c.crc32c(payload, crc32c.crc32c(head))
    return head + struct.pack("<I", crc)


def encode_headers(records: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]], first_seq: int) -> list[bytes]:
    """`encode_header` of each record, numbered from `first_seq`. A big batch's payload
    crcs come from one compiled call without the GIL (copy_ranges.compiled_crcs) where the
    kernels are loaded: from a worker thread beside a busy event loop, each crc32c call
    gave the GIL back and waited up to the switch interval (5 ms) to have it again, and a
    write-behind of 64 records spent most of its time waiting (docs/design.md, "Big log
    writes bypass the page cache", "The GIL once a stage")."""
    if len(records) > 1 and sum(len(payload) for _key, payload in records) >= DIRECT_MIN_BYTES:
        heads = [_head(key, first_seq + i, payload) for i, (key, payload) in enumerate(records)]
        crcs = compiled_crcs([payload for _key, payload in records], [crc32c.crc32c(head) for head in heads])
        if crcs is not None:
            return [head + struct.pack("<I", crc) for head, crc in zip(heads, crcs, strict=True)]
    return [encode_header(key, first_seq + i, payload) for i, (key, payload) in enumerate(records)]


IOV_MAX = 1024  # buffers one preadv takes (Linux)
SPAN_BYTES = 8 * 1024 * 1024  # read_many reads neighbouring records with one pread up to this
SPAN_GAP_BYTES = 64 * 1024  # ... when the bytes between them are no more than this


def _check(
    header: bytes | bytearray | memoryview, payload: bytearray | memoryview, location: LogLocation, key: BlockKey
) -> None:
    """Corrupted unless the record read at `location` is `key`'s, of its length and crc."""
    magic, length, owner, index, _seq, crc = HEADER.unpack(header)
    if magic != MAGIC or length != location.length or (owner, index) != key:
        raise Corrupted(f"log: record at {location} is not {key}")
    if crc32c.crc32c(payload, crc32c.crc32c(header[:HEADER_CRC_SPAN])) != crc:
        raise Corrupted(f"log: crc32c mismatch for {key} at {location}")


class LogPosition(NamedTuple):
    """A point in the log: a segment and a byte offset in it (where a record starts)."""

    segment: int
    offset: int


LOG_START = LogPosition(0, 0)


def _close_direct(seg: _Segment) -> None:
    if seg.direct_fd >= 0:
        os.close(seg.direct_fd)
        seg.direct_fd = -1


def _fill_stage(staged: np.ndarray, pending: list[memoryview], parts: list[tuple[int, int, int, int]]) -> None:
    """Copy `parts` ((buffer of `pending`, at, length, to), for one staging buffer) into
    `staged`, and clear them: in one compiled call without the GIL where the kernels are
    loaded, else a numpy copy each (each gives the GIL back for its copy, and waits to
    have it again)."""
    if not parts:
        return
    columns = np.array(parts, dtype=np.int64).T
    if not copy_ranges(pending, columns[0], columns[1], columns[2], staged.data, columns[3], compiled_only=True):
        for i, a, n, t in parts:
            staged[t : t + n] = np.frombuffer(pending[i], dtype=np.uint8, count=n, offset=a)
    parts.clear()


def _close_files(seg: _Segment) -> None:
    """Close every descriptor of a segment (its last reader is done with it)."""
    _close_direct(seg)
    if seg.read_direct_fd >= 0:
        os.close(seg.read_direct_fd)
        seg.read_direct_fd = -1
    os.close(seg.fd)


def _direct_span_bytes() -> int:
    """How far one direct read may reach from its first record's start to its last's end:
    what the aligned buffers hold, less the pages around it."""
    return DIRECT_READ_MAX_BYTES + 8 * DIRECT_ALIGN


def _joins(first: LogLocation, prev: LogLocation, loc: LogLocation, limit: int) -> bool:
    """Whether the record at `loc` joins a span of records from `first` to `prev`, to be
    read with them in one read: in the same segment, at most SPAN_GAP_BYTES after the
    end of `prev`, and the span then no longer than `limit` bytes from `first`'s start."""
    return (
        loc.segment == first.segment
        and 0 <= loc.offset - (prev.offset + HEADER.size + prev.length) <= SPAN_GAP_BYTES
        and loc.offset + HEADER.size + loc.length - first.offset <= limit
    )


def _pread_each(
    fds: np.ndarray,
    at: np.ndarray,
    lengths: np.ndarray,
    out: Writable,
    out_at: np.ndarray,
    segments: np.ndarray,
    ahead: int,
) -> None:
    """NvmeLog.read_ranges' reads as a Python loop, as the compiled one makes them (range
    by range, fd -1 skipped, a WILLNEED hint `ahead` ranges on), raising what a read
    meets: an OSError, or Corrupted when one comes back short."""
    view = memoryview(out)
    rows = list(zip(fds.tolist(), at.tolist(), lengths.tolist(), out_at.tolist(), strict=True))
    count = len(rows)
    for k in range(min(ahead, count)):
        if rows[k][0] >= 0:
            os.posix_fadvise(rows[k][0], rows[k][1], rows[k][2], os.POSIX_FADV_WILLNEED)
    for i, (fd, position, n, to) in enumerate(rows):
        k = i + ahead
        if ahead and k < count and rows[k][0] >= 0:
            os.posix_fadvise(rows[k][0], rows[k][1], rows[k][2], os.POSIX_FADV_WILLNEED)
        if fd >= 0 and os.preadv(fd, [view[to : to + n]], position) != n:
            raise Corrupted(f"log: short read of {n} bytes at {position} of segment {int(segments[i])}")


def _close_stage(stage: mmap.mmap) -> None:
    """Unmap an aligned buffer; one still viewed (by a failed read's traceback that
    something keeps) is left to go with its last view instead of failing the close."""
    with contextlib.suppress(BufferError):
        stage.close()


class _CacheStat(ctypes.Structure):  # struct cachestat (linux/mman.h)
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


class _CacheStatRange(ctypes.Structure):  # struct cachestat_range
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


_SYS_CACHESTAT = 451  # the same number on every architecture (Linux 6.5)
_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of the `length` bytes at `offset` of `fd` are in the page cache
    (the cachestat system call: no side effect, a microsecond); None where the kernel
    has no cachestat (before 6.5) or refuses it."""
    stat = _CacheStat()
    span = _CacheStatRange(offset, length)
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        return None
    return int(stat.cache)


def _drop_written(pending: list[memoryview], written: int) -> None:
    """Take the first `written` bytes off `pending` (after a pwritev that may be short)."""
    while pending and written >= len(pending[0]):
        written -= len(pending.pop(0))
    if written:
        pending[0] = pending[0][written:]


def _is_padding(fd: int, offset: int, length: int) -> bool:
    """Whether the `length` bytes at `offset` are what a direct write leaves past the
    log's end: fewer than a page, all zeros."""
    if length >= DIRECT_ALIGN:
        return False
    return not any(os.pread(fd, length, offset))


@dataclass(frozen=True)
class LogRecord:
    """One record as found by a scan."""

    location: LogLocation
    key: BlockKey
    seq: int
    payload: bytes


class _Segment:
    """An open segment file. `readers` counts preads in flight so delete can wait to close."""

    def __init__(self, segment: int, path: str, fd: int, size_bytes: int) -> None:
        self.segment = segment
        self.path = path
        self.fd = fd
        self.size_bytes = size_bytes
        self.synced_bytes = size_bytes
        self.readers = 0
        self.deleted = False
        self.direct_fd = -1  # the active segment's O_DIRECT descriptor (-1: none)
        self.read_direct_fd = -1  # an O_DIRECT descriptor for big reads, opened at the first (-1: none yet)


class NvmeLog:
    """A directory of segment files holding crc32c-checked records.

    Examples:
        >>> log = NvmeLog.open("/data/log")          # recovers a torn tail if any
        >>> loc = log.append(BlockKey(7, 0), b"hello")
        >>> log.sync()                                 # durable from here on
        >>> bytes(log.read(loc, BlockKey(7, 0)))
        b'hello'
    """

    def __init__(self, directory: str, segment_bytes: int, reserve_bytes: int = 0) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        # Disk held back from appends (the daemon holds two segments' worth): compaction
        # copies a victim's live records before it can delete it, so on a full disk it
        # releases this ballast, compacts, and holds it again once there is room.
        self.reserve_bytes = reserve_bytes
        self.reserve_path = os.path.join(directory, RESERVE_NAME)
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._seq = 0
        self._append_lock = threading.Lock()
        self._fd_lock = threading.Lock()
        # Where the append in progress began (None between appends): `position` never
        # names a point past a record that is still being written.
        self._appending_from: LogPosition | None = None
        self._position_lock = threading.Lock()
        self.dropped_tail_bytes = 0
        self.direct = hasattr(os, "O_DIRECT")  # False once the file system refuses it
        self.direct_reads = self.direct  # False once the file system or the kernel refuses what they need
        self.direct_read_bytes = 0  # payload bytes read with O_DIRECT
        self._read_stages: list[mmap.mmap] = []  # aligned buffers of DIRECT_READ_MAX_BYTES + 16 pages, reused
        self.direct_bytes = 0  # bytes appended with O_DIRECT
        self._stages: list[mmap.mmap] = []  # two, made at the first direct write
        self._direct_writer: ThreadPoolExecutor | None = None  # writes one staged buffer while the next fills
        # ((segment, end offset), the bytes of the last page up to the end) after a direct write
        self._direct_tail: tuple[tuple[int, int], bytes] | None = None
        self._dir_fd = -1  # the directory, open (`open`)

    # --- opening and recovery -------------------------------------------------------

    @classmethod
    def open(cls, directory: str, segment_bytes: int = DEFAULT_SEGMENT_BYTES, reserve_bytes: int = 0) -> NvmeLog:
        """Open (creating if needed) the log in `directory` and recover it.

        Recovery scans the newest segment, keeps its longest valid prefix of records and
        truncates the rest (a torn tail), then starts a fresh segment for new appends.
        Older segments were fsync'ed whole before their successor was created.
        """
        os.makedirs(directory, exist_ok=True)
        self = cls(directory, segment_bytes, reserve_bytes)
        # Held for the log's life: the disk's numbers still come if the directory's
        # path goes (a cleaner that removed the data dir), so `df` and status answer.
        self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        ids = sorted(
            int(name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)])
            for name in os.listdir(directory)
            if name.startswith(_SEGMENT_PREFIX) and name.endswith(_SEGMENT_SUFFIX)
        )
        for segment in ids:
            path = os.path.join(directory, segment_name(segment))
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            self._segments[segment] = _Segment(segment, path, fd, os.fstat(fd).st_size)
        if ids:
            self._seq = self._recover_tail(self._segments[ids[-1]]) + 1
        self._start_segment((ids[-1] + 1) if ids else 1)
        if not self.hold_reserve():
            log.warning(
                "log %s: the disk has no room for the %d-byte compaction reserve", directory, self.reserve_bytes
            )
        return self

    def _recover_tail(self, seg: _Segment) -> int:
        """Cut the segment after its last valid record; return that record's seq (-1 if none)."""
        valid_end = 0
        last_seq = -1
        for offset, length, _owner, _index, seq, _payload in self._walk_segment(seg):
            valid_end, last_seq = offset + HEADER.size + length, seq
        if valid_end < seg.size_bytes:
            dropped = seg.size_bytes - valid_end
            if not _is_padding(seg.fd, valid_end, dropped):
                log.warning("log %s: dropped a torn tail of %d bytes at offset %d", seg.path, dropped, valid_end)
                self.dropped_tail_bytes += dropped
            os.ftruncate(seg.fd, valid_end)
            os.fsync(seg.fd)
            seg.size_bytes = seg.synced_bytes = valid_end
        return last_seq

    def _start_segment(self, segment: int) -> None:
        path = os.path.join(self.directory, segment_name(segment))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._fsync_directory()
        seg = _Segment(segment, path, fd, 0)
        if self.direct:
            try:
                seg.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:  # EINVAL: a file system without O_DIRECT (tmpfs before 6.6)
                log.info("log %s: no O_DIRECT here (%s): every append goes through the page cache", path, exc)
                self.direct = False
        previous, self._active = self._active, seg
        self._segments[segment] = seg
        if previous is not None:
            _close_direct(previous)

    def _fsync_directory(self) -> None:
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # --- appending ------------------------------------------------------------------

    def append(self, key: BlockKey, payload: bytes | bytearray | memoryview) -> LogLocation:
        """Append one record and return its location. Blocks on the disk write.

        The record is in the OS page cache when this returns (it survives a killed
        daemon); call `sync()` to make it survive a power loss.
        """
        return self.append_many([(key, payload)])[0]

    def append_many(self, records: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]]) -> list[LogLocation]:
        """Append records in order with as few writes as possible; return their locations."""
        self._check_sizes(records)
        with self._append_lock:
            return self._append_locked(records)

    def try_append_now(
        self, records: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]]
    ) -> list[LogLocation] | None:
        """Append records now if no other append is in progress and they fit in the
        active segment; None otherwise (then call `append_many` from a worker thread).

        What this does is one pwritev into the page cache, with no fsync and no new
        segment: a few microseconds for a small record, which is why the block tier may
        call it on the event loop (docs/design.md, "Log-only appends").
        """
        appended = self.try_append_noted(records)
        return None if appended is None else appended[0]

    def try_append_noted(
        self,
        records: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]],
        note: Callable[[list[LogLocation]], tuple[BlockKey, bytes] | None] | None = None,
    ) -> tuple[list[LogLocation], bool] | None:
        """`try_append_now` of `records` followed by a note made from where they land, in
        the same pwritev: `note(locations)` runs under the append lock, before anything is
        written, and returns the note's record, or None for none. Returns the records'
        locations and whether the note went with them (not without `note`, when it gave
        None or when it did not fit in the segment); None when nothing was written (another
        append in progress, or the records do not fit)."""
        self._check_sizes(records)
        if not self._append_lock.acquire(blocking=False):
            return None
        try:
            seg = self._active
            assert seg is not None
            at = seg.size_bytes
            locations: list[LogLocation] = []
            for _key, payload in records:
                locations.append(LogLocation(seg.segment, at, len(payload)))
                at += HEADER.size + len(payload)
            if at > self.segment_bytes:
                return None
            made = None if note is None else note(locations)
            if made is not None and (
                len(made[1]) > MAX_PAYLOAD_BYTES or at + HEADER.size + len(made[1]) > self.segment_bytes
            ):
                made = None
            written = self._append_locked([*records, made] if made is not None else records)
            assert written[: len(locations)] == locations, "the records landed where the note says"
            return locations, made is not None
        finally:
            self._append_lock.release()

    @staticmethod
    def _check_sizes(records: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]]) -> None:
        for _key, payload in records:
            if len(payload) > MAX_PAYLOAD_BYTES:
                raise ValueError(f"record payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")

    def _append_locked(self, records: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]]) -> list[LogLocation]:
        locations: list[LogLocation] = []
        assert self._active is not None
        with self._position_lock:
            self._appending_from = LogPosition(self._active.segment, self._active.size_bytes)
        try:
            buffers: list[bytes | bytearray | memoryview] = []
            start = self._active.size_bytes
            headers = encode_headers(records, self._seq)
            for (_key, payload), header in zip(records, headers, strict=True):
                size = HEADER.size + len(payload)
                seg = self._active
                if seg.size_bytes > 0 and seg.size_bytes + size > self.segment_bytes:
                    self._write_or_roll_back(seg, start, buffers)
                    buffers = []
                    self._seal_active()
                    seg = self._active
                    start = 0
                buffers.append(header)
                buffers.append(payload)
                locations.append(LogLocation(seg.segment, seg.size_bytes, len(payload)))
                seg.size_bytes += size
                self._seq += 1
            self._write_or_roll_back(self._active, start, buffers)
        finally:
            with self._position_lock:
                self._appending_from = None
        return locations

    def position(self) -> LogPosition:
        """A point with every record before it written completely: where the next record
        goes, or where the append in progress began. Safe to call from any thread."""
        with self._position_lock:
            if self._appending_from is not None:
                return self._appending_from
            seg = self._active
            assert seg is not None
            return LogPosition(seg.segment, seg.size_bytes)

    def _write_or_roll_back(self, seg: _Segment, offset: int, buffers: list[bytes | bytearray | memoryview]) -> None:
        """Write at `offset`; on failure cut the segment back to `offset`, so no later
        append follows a torn record, and raise (StoreFull when the disk is full)."""
        try:
            self._write(seg, offset, buffers)
        except OSError as exc:
            seg.size_bytes = offset
            with contextlib.suppress(OSError):
                os.ftruncate(seg.fd, offset)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"the log's disk is full ({self.directory}): {exc.strerror}") from None
            raise

    def _write(self, seg: _Segment, offset: int, buffers: list[bytes | bytearray | memoryview]) -> None:
        total = sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers)
        written = 0
        if total < DIRECT_MIN_BYTES and len(buffers) <= IOV_MAX:  # small: one pwritev, nearly always whole
            written = os.pwritev(seg.fd, buffers, offset)
            if written == total:
                return
            offset += written  # the rest below, from where it stopped
        pending = [memoryview(b).cast("B") for b in buffers]
        _drop_written(pending, written)
        if seg.direct_fd >= 0 and total >= DIRECT_MIN_BYTES:
            try:
                self._write_direct(seg, offset, pending)
                self.direct_bytes += total
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # a device whose blocks are bigger than DIRECT_ALIGN: the page cache from now
                # on, this write again from its start (what reached the file is the same bytes)
                log.warning("log %s: O_DIRECT write refused (%s): appends go through the page cache", seg.path, exc)
                self.direct = False
                _close_direct(seg)
        # pwritev takes at most IOV_MAX (1024) buffers and may write short.
        while pending:
            written = os.pwritev(seg.fd, pending[:IOV_MAX], offset)
            offset += written
            _drop_written(pending, written)

    def _write_direct(self, seg: _Segment, offset: int, pending: list[memoryview]) -> None:
        """Write `pending` at `offset` with O_DIRECT through the staging buffers: from the
        page boundary at or before `offset` (the bytes between it and `offset`, written
        before, are read back and written again unchanged) to the page boundary after the
        end (zeros past the end). Writes of a page either old or new leave those earlier
        bytes as they were, so a torn write can only lose the new records.

        Two staging buffers take turns: while one is written (by the log's writer thread),
        the next STAGE_BYTES are copied into the other, so the disk is not idle during the
        copies (docs/design.md, "Big log writes bypass the page cache"). Writes go out in
        order, and this returns, or raises, only once none is in flight."""
        if not self._stages:
            self._stages = [mmap.mmap(-1, STAGE_BYTES) for _ in range(2)]  # page-aligned, reused
            self._direct_writer = ThreadPoolExecutor(1, thread_name_prefix="log direct writes")
        writer = self._direct_writer
        assert writer is not None
        views = [memoryview(stage) for stage in self._stages]
        arrays = [np.frombuffer(stage, dtype=np.uint8) for stage in self._stages]  # numpy copies without the GIL
        in_flight: list[Future[None] | None] = [None, None]

        def wait_for(buffer: int) -> None:  # that buffer's write, if one is in flight, has ended
            future, in_flight[buffer] = in_flight[buffer], None
            if future is not None:
                future.result()

        turn = 0
        file_at = offset - offset % DIRECT_ALIGN
        filled = offset - file_at
        tail, self._direct_tail = self._direct_tail, None
        try:
            stage, staged = views[0], arrays[0]
            if tail is not None and tail[0] == (seg.segment, offset):  # nothing appended since the last one
                stage[:filled] = tail[1]
            elif filled and os.preadv(seg.fd, [stage[:filled]], file_at) != filled:
                raise OSError(errno.EIO, f"log {seg.path}: short read of the page before offset {offset}")
            parts: list[tuple[int, int, int, int]] = []  # what the stage takes: (buffer, at, length, to)
            for index, buf in enumerate(pending):
                at, left = 0, len(buf)
                while left:
                    step = min(left, STAGE_BYTES - filled)
                    parts.append((index, at, step, filled))
                    filled, at, left = filled + step, at + step, left - step
                    if filled == STAGE_BYTES:
                        _fill_stage(staged, pending, parts)
                        in_flight[turn] = writer.submit(self._pwrite_staged, seg, stage, STAGE_BYTES, file_at)
                        file_at, filled, turn = file_at + STAGE_BYTES, 0, 1 - turn
                        wait_for(turn)  # before it refills
                        stage, staged = views[turn], arrays[turn]
            if filled:
                _fill_stage(staged, pending, parts)
                padded = -(-filled // DIRECT_ALIGN) * DIRECT_ALIGN
                staged[filled:padded] = 0
                self._pwrite_staged(seg, stage, padded, file_at)  # while the one in flight ends
            wait_for(1 - turn)
            # The page at the end, which the next direct write starts with: kept, so that
            # write need not read it back from the disk (it is not in the page cache)
            last = filled - filled % DIRECT_ALIGN
            self._direct_tail = ((seg.segment, file_at + filled), bytes(stage[last:filled]))
        finally:
            for buffer in (0, 1):  # failing: nothing may still write when the caller rolls back
                with contextlib.suppress(BaseException):
                    wait_for(buffer)
            del staged, arrays
            for view in views:
                view.release()

    @classmethod
    def _pwrite_staged(cls, seg: _Segment, stage: memoryview, length: int, at: int) -> None:
        """`_pwrite_direct` of the first `length` bytes of a staging buffer, through a view
        released afterwards, also when the write fails: a failed write's traceback (kept by
        a log record, say) must not keep the staging buffer exported."""
        part = stage[:length]
        try:
            cls._pwrite_direct(seg, part, at)
        finally:
            part.release()

    @staticmethod
    def _pwrite_direct(seg: _Segment, data: memoryview, at: int) -> None:
        written = 0
        while written < len(data):
            part = data[written:]
            if (at + written) % DIRECT_ALIGN or len(part) % DIRECT_ALIGN:  # after an unaligned short write
                written += os.pwritev(seg.fd, [part], at + written)
            else:
                written += os.pwritev(seg.direct_fd, [part], at + written)

    def _seal_active(self) -> None:
        seg = self._active
        assert seg is not None
        os.fsync(seg.fd)
        seg.synced_bytes = seg.size_bytes
        self._start_segment(seg.segment + 1)

    def sync(self) -> None:
        """Make every record appended so far durable on the device."""
        with self._append_lock:
            seg = self._active
            assert seg is not None
            target = seg.size_bytes
        if seg.synced_bytes < target:
            os.fdatasync(seg.fd)
            seg.synced_bytes = max(seg.synced_bytes, target)

    # --- reading --------------------------------------------------------------------

    def read(self, location: LogLocation, key: BlockKey, into: bytearray | None = None) -> bytearray:
        """Return the payload at `location`, checked against `key`, its length and crc32c:
        a new bytearray, or `into` (at least the payload's length) with the payload at its
        start.

        Raises Corrupted when anything does not match (a torn or overwritten record).
        """
        seg = self._acquire(location.segment)
        if seg is None:
            raise Corrupted(f"log: segment {location.segment} of {key} is gone")
        try:
            out = unzeroed(location.length) if into is None else into  # filled whole, or Corrupted
            if self._read_direct(seg, [(key, location)], [out]):
                return out
            header = bytearray(HEADER.size)
            payload = memoryview(out)[: location.length]
            got = os.preadv(seg.fd, [header, payload], location.offset)
        finally:
            self._release(seg)
        with payload:
            if got != HEADER.size + location.length:
                raise Corrupted(f"log: short record for {key} at {location}")
            _check(header, payload, location, key)
        return out

    def reads_directly(self, location: LogLocation) -> bool:
        """Whether the record at `location` is read with O_DIRECT when it is not in the
        page cache (so a WILLNEED hint for it would only fill the page cache)."""
        return self.direct_reads and DIRECT_READ_MIN_BYTES <= location.length <= DIRECT_READ_MAX_BYTES

    def runs(self, records: Sequence[tuple[BlockKey, LogLocation]]) -> list[list[tuple[BlockKey, LogLocation]]]:
        """`records` cut, in their order, into runs that `read_run` reads with one read:
        big records in one segment, each after the one before with at most SPAN_GAP_BYTES
        between them (other records written in between), all within `_direct_span_bytes`
        of the first's start; every other record a run of its own (all of them where
        direct reads are off)."""
        out: list[list[tuple[BlockKey, LogLocation]]] = []
        for key, loc in records:
            if out and self.reads_directly(loc):
                first, prev = out[-1][0][1], out[-1][-1][1]
                if self.reads_directly(first) and _joins(first, prev, loc, _direct_span_bytes()):
                    out[-1].append((key, loc))
                    continue
            out.append([(key, loc)])
        return out

    def read_run(
        self, records: Sequence[tuple[BlockKey, LogLocation]], into: Sequence[bytearray | None]
    ) -> list[bytearray]:
        """`read` of each record, into `into[i]` where given (else a new buffer); with one
        O_DIRECT read when they make a run (`runs`: the blocks of one big append lie one
        after the other) out of the page cache: a sequential reader's prefetch asks the
        device for a few MiB at once instead of one block at a time."""
        out = [unzeroed(loc.length) if buf is None else buf for (_key, loc), buf in zip(records, into, strict=True)]
        seg = self._acquire(records[0][1].segment) if records else None
        if seg is not None:
            try:
                if self._read_direct(seg, records, out):
                    return out
            finally:
                self._release(seg)
        for i, (key, location) in enumerate(records):
            self.read(location, key, out[i])
        return out

    def _read_direct(
        self, seg: _Segment, records: Sequence[tuple[BlockKey, LogLocation]], out: list[bytearray]
    ) -> bool:
        """Read big neighbouring records that are not in the page cache with one O_DIRECT
        read: the pages they lie in, into a reused aligned buffer, each checked there and
        its payload copied to the start of its `out` buffer. False (nothing done) where
        that does not apply: small records or too many bytes, records that are not
        neighbours in `seg`, pages in the page cache (written through it and not evicted
        yet, or hinted), a kernel without cachestat, a file system without O_DIRECT, or
        bytes that do not check (then the caller reads through the page cache, and raises
        if they still do not). See docs/design.md, "Big log reads bypass the page cache"."""
        if not self._direct_shape(records):
            return False
        first, last = records[0][1], records[-1][1]
        end = last.offset + HEADER.size + last.length
        cached = cached_pages(seg.fd, first.offset, end - first.offset)
        if cached is None:
            self.direct_reads = False
            log.info("log %s: no cachestat here: big reads go through the page cache", self.directory)
            return False
        if cached:
            return False
        fd = self._direct_read_fd(seg)
        if fd < 0:
            return False
        start = first.offset - first.offset % DIRECT_ALIGN
        size = -(-(end - start) // DIRECT_ALIGN) * DIRECT_ALIGN
        stage = self._take_read_stage()
        view = memoryview(stage)
        try:
            try:
                got = os.preadv(fd, [view[:size]], start) if size <= len(stage) else 0
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # a device whose blocks are bigger than DIRECT_ALIGN: the page cache from now on
                log.warning("log %s: O_DIRECT read refused (%s): reads go through the page cache", seg.path, str(exc))
                self.direct_reads = False
                return False
            if got < end - start:
                return False  # short: the page cache path says what is wrong
            for (key, location), buf in zip(records, out, strict=True):
                at = location.offset - start
                header, payload = (
                    view[at : at + HEADER.size],
                    view[at + HEADER.size : at + HEADER.size + location.length],
                )
                try:
                    _check(header, payload, location, key)
                except Corrupted as exc:
                    # (the message as a string: a kept log record must not hold the buffer's views)
                    log.warning(
                        "log %s: direct read of %s did not check (%s): reading it again", seg.path, key, str(exc)
                    )
                    return False
                target = np.frombuffer(buf, dtype=np.uint8, count=location.length)
                target[:] = np.frombuffer(payload, dtype=np.uint8)  # numpy copies without the GIL
                del target, header, payload
            self.direct_read_bytes += sum(loc.length for _key, loc in records)
            return True
        finally:
            view.release()
            self._give_read_stage(stage)

    def _direct_shape(self, records: Sequence[tuple[BlockKey, LogLocation]]) -> bool:
        """Whether `_read_direct` may read these records, by their places alone:
        the first read directly (`reads_directly`), each joining the span before it as
        `runs` and `read_many` join them (neighbours, or a small gap: a dataset's index
        records lie between its blocks), all within `_direct_span_bytes` of the first's
        start."""
        first = records[0][1]
        limit = _direct_span_bytes()
        return self.reads_directly(first) and all(
            _joins(first, prev, loc, limit) for (_k, prev), (_key, loc) in itertools.pairwise(records)
        )

    def _direct_read_fd(self, seg: _Segment) -> int:
        """The segment's O_DIRECT read descriptor, opened at the first use; -1 where the
        file system refuses O_DIRECT."""
        if seg.read_direct_fd >= 0:
            return seg.read_direct_fd
        with self._fd_lock:
            if seg.read_direct_fd < 0 and self.direct_reads and not seg.deleted:
                try:
                    seg.read_direct_fd = os.open(seg.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
                except OSError as exc:
                    log.info("log %s: no O_DIRECT reads here (%s)", seg.path, exc)
                    self.direct_reads = False
            return seg.read_direct_fd

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the aligned buffers the log keeps for its O_DIRECT writes and reads
        (memory outside the DRAM budget)."""
        with self._fd_lock:
            return sum(len(stage) for stage in self._stages + self._read_stages)

    def _take_read_stage(self) -> mmap.mmap:
        with self._fd_lock:
            if self._read_stages:
                return self._read_stages.pop()
        return mmap.mmap(-1, DIRECT_READ_MAX_BYTES + 16 * DIRECT_ALIGN)  # page-aligned; headers and the edges' pages

    def _give_read_stage(self, stage: mmap.mmap) -> None:
        with self._fd_lock:
            if len(self._read_stages) < READ_STAGES_KEPT:
                self._read_stages.append(stage)
                return
        _close_stage(stage)

    def read_many(self, records: Sequence[tuple[BlockKey, LogLocation]]) -> list[bytearray]:
        """`read` of many records. Records that lie close together in one segment (a
        restored buffer's items, in append order) are read with one pread per span of
        up to SPAN_BYTES; scattered ones each with their own, after a WILLNEED hint for
        all of them, so the device sees them at once instead of one at a time."""
        out = [bytearray()] * len(records)  # every slot is filled below, or Corrupted is raised
        order = sorted(range(len(records)), key=lambda i: records[i][1])
        held = {loc.segment: self._acquire(loc.segment) for _key, loc in records}
        try:
            spans: list[list[int]] = []
            for i in order:
                loc = records[i][1]
                if spans:
                    first = records[spans[-1][0]][1]
                    limit = _direct_span_bytes() if self.reads_directly(first) else SPAN_BYTES
                    if _joins(first, records[spans[-1][-1]][1], loc, limit):
                        spans[-1].append(i)
                        continue
                spans.append([i])
            for span in spans:
                seg = held[records[span[0]][1].segment]
                loc = records[span[0]][1]
                if seg is not None and len(span) == 1 and not self.reads_directly(loc):
                    # (big ones out of the page cache are read with O_DIRECT: no hint for them)
                    os.posix_fadvise(seg.fd, loc.offset, HEADER.size + loc.length, os.POSIX_FADV_WILLNEED)
            for span in spans:
                if len(span) == 1:
                    key, loc = records[span[0]]
                    out[span[0]] = self.read(loc, key)
                else:
                    self._read_span(held[records[span[0]][1].segment], [records[i] for i in span], span, out)
        finally:
            for seg in held.values():
                if seg is not None:
                    self._release(seg)
        return out

    @staticmethod
    def _read_span_direct(
        seg: _Segment, span: list[tuple[BlockKey, LogLocation]], positions: list[int], out: list[bytearray]
    ) -> None:
        """`_read_span` with one preadv straight into each record's own payload buffer (and
        scratch for its header and any gap before the next): no second copy of the bytes."""
        iov: list[bytearray] = []
        headers: list[bytearray] = []
        payloads: list[bytearray] = []
        at = span[0][1].offset
        for _key, loc in span:
            if loc.offset > at:
                iov.append(bytearray(loc.offset - at))  # a dead record between two live ones
            header = bytearray(HEADER.size)
            payload = unzeroed(loc.length)  # filled whole by the preadv below, or Corrupted
            iov += (header, payload)
            headers.append(header)
            payloads.append(payload)
            at = loc.offset + HEADER.size + loc.length
        size = at - span[0][1].offset
        if os.preadv(seg.fd, iov, span[0][1].offset) != size:
            raise Corrupted(f"log: short read of {len(span)} records at {span[0][1]}")
        for (key, loc), position, header, payload in zip(span, positions, headers, payloads, strict=True):
            _check(header, payload, loc, key)
            out[position] = payload

    def will_need(self, locations: Sequence[LogLocation], direct_too: bool = False) -> int:
        """Ask the kernel to read these records into its page cache now, in the
        background (posix_fadvise WILLNEED), one hint per run of neighbouring records:
        the reads that follow find them there. Records that would be read with O_DIRECT
        are left out unless `direct_too` (a dataset stream that reads them from the page
        cache). A run is hinted in pieces of HINT_BYTES: one WILLNEED reads at most the
        device's read-ahead, and the rest of a longer run stayed cold. Returns the number
        of runs hinted."""
        runs: list[tuple[int, int, int]] = []  # segment, start, end
        for loc in sorted(locations):
            if not direct_too and self.reads_directly(loc):
                continue  # read with O_DIRECT at its turn: a hint would only fill the page cache
            end = loc.offset + HEADER.size + loc.length
            if runs and runs[-1][0] == loc.segment and 0 <= loc.offset - runs[-1][2] <= SPAN_GAP_BYTES:
                runs[-1] = (loc.segment, runs[-1][1], end)
            else:
                runs.append((loc.segment, loc.offset, end))
        hints = 0
        for segment, start, end in runs:
            seg = self._acquire(segment)
            if seg is None:
                continue  # deleted meanwhile (compaction): nothing to read ahead
            try:
                for at in range(start, end, HINT_BYTES):
                    os.posix_fadvise(seg.fd, at, min(HINT_BYTES, end - at), os.POSIX_FADV_WILLNEED)
                hints += 1
            finally:
                self._release(seg)
        return hints

    def _read_span(
        self,
        seg: _Segment | None,
        span: list[tuple[BlockKey, LogLocation]],
        positions: list[int],
        out: list[bytearray],
    ) -> None:
        """One pread for records in log order within one segment; each is checked as
        `read` checks it and copied out of the span."""
        first, last = span[0][1], span[-1][1]
        if seg is None:
            raise Corrupted(f"log: segment {first.segment} of {span[0][0]} is gone")
        if self._direct_shape(span):
            payloads = [unzeroed(loc.length) for _key, loc in span]  # filled whole if it reads directly
            if self._read_direct(seg, span, payloads):
                for position, payload in zip(positions, payloads, strict=True):
                    out[position] = payload
                return
        start = first.offset
        size = last.offset + HEADER.size + last.length - start
        if 3 * len(span) <= IOV_MAX:
            self._read_span_direct(seg, span, positions, out)
            return
        chunk = unzeroed(size)  # filled whole, or Corrupted
        if os.preadv(seg.fd, [chunk], start) != size:
            raise Corrupted(f"log: short read of {len(span)} records at {first}")
        view = memoryview(chunk)
        for (key, loc), position in zip(span, positions, strict=True):
            at = loc.offset - start
            header = view[at : at + HEADER.size]
            payload = bytearray(view[at + HEADER.size : at + HEADER.size + loc.length])
            _check(header, payload, loc, key)
            out[position] = payload

    def read_ranges(
        self,
        segments: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        out: Writable,
        out_at: np.ndarray,
        read_ahead: bool = True,
    ) -> list[int]:
        """Read byte ranges of record payloads straight into `out`: range i is `lengths[i]`
        bytes of segment `segments[i]` at `offsets[i]` bytes into the payload of the record
        there (the record's offset + the start in its payload), read to `out_at[i]`. Give
        them in log order (by segment, then offset).

        The records' own checks are skipped (only parts of them are read): the caller
        checks what it reads (dataset records carry their own crc32c). With `read_ahead`,
        the kernel gets a WILLNEED hint READ_AHEAD_PARTS ranges ahead of each read, so many
        small random reads are in flight on the device at once (without it: the caller
        has had the records hinted, `will_need`). The reads are compiled where the
        kernels are loaded (copy_ranges.pread_ranges), else a Python loop. Returns the
        positions of the ranges whose segment was gone (compacted meanwhile): the caller
        reads those another way.
        """
        count = len(segments)
        wanted = np.unique(segments)
        held = {segment: self._acquire(segment) for segment in wanted.tolist()}
        try:
            fd_of = np.array([-1 if seg is None else seg.fd for seg in held.values()], dtype=np.int32)
            fds = fd_of[np.searchsorted(wanted, segments)] if count else fd_of
            at = offsets + HEADER.size
            ahead = READ_AHEAD_PARTS if read_ahead else 0
            first = pread_ranges(fds, at, lengths, out, out_at, ahead)  # checks the ranges fit `out` first
            if first < count:  # not compiled, or the compiled reads stopped at a range that failed
                rest = slice(first, count)
                _pread_each(fds[rest], at[rest], lengths[rest], out, out_at[rest], segments[rest], ahead)
        finally:
            for seg in held.values():
                if seg is not None:
                    self._release(seg)
        return np.flatnonzero(fds < 0).tolist()

    def _acquire(self, segment: int) -> _Segment | None:
        with self._fd_lock:
            seg = self._segments.get(segment)
            if seg is None or seg.deleted:
                return None
            seg.readers += 1
            return seg

    def _release(self, seg: _Segment) -> None:
        with self._fd_lock:
            seg.readers -= 1
            if seg.deleted and seg.readers == 0:
                _close_files(seg)

    def scan(self, start: LogPosition = LOG_START) -> Iterator[LogRecord]:
        """Yield every valid record from `start` on (default: of every segment) in log
        order, its payload copied (tests, tools; a start-up uses `walk`). A segment
        deleted since `start` was taken is skipped."""
        for location, key, seq, payload in self.walk(start):
            yield LogRecord(location, key, seq, bytes(payload))

    def walk(self, start: LogPosition = LOG_START) -> Iterator[tuple[LogLocation, BlockKey, int, memoryview]]:
        """`scan` without copies: (location, key, seq, payload view valid until the next
        step) of every valid record from `start` on, in log order."""
        for segment in sorted(self._segments):
            seg = self._segments.get(segment)
            if segment >= start.segment and seg is not None and not seg.deleted:
                offset = start.offset if segment == start.segment else 0
                for at, length, owner, index, seq, payload in self._walk_segment(seg, offset):
                    yield LogLocation(segment, at, length), BlockKey(owner, index), seq, payload

    def segment_records(self, segment: int) -> list[tuple[BlockKey, LogLocation]]:
        """The key and location of each valid block record in `segment` (notes left out),
        in order: what compaction checks against the index to find the live ones. A
        worker thread's call (it reads the whole segment); [] for a deleted segment."""
        seg = self._acquire(segment)
        if seg is None:
            return []
        try:
            return [
                (BlockKey(owner, index), LogLocation(segment, offset, length))
                for offset, length, owner, index, _seq, _payload in self._walk_segment(seg)
                if index < NOTE_NUMBERS
            ]
        finally:
            self._release(seg)

    def _walk_segment(self, seg: _Segment, offset: int = 0) -> Iterator[tuple[int, int, int, int, int, memoryview]]:
        """(offset, length, owner, index, seq, payload) of each valid record in order,
        stopping at the first bad one; the payload is a view valid until the next step.

        Reads in large chunks and parses from memory: a segment of a million tiny records
        costs a few large reads, not two syscalls per record, and nothing is copied.
        """
        size = os.fstat(seg.fd).st_size
        chunk = bytearray()
        view = memoryview(chunk)
        chunk_start = 0  # file offset of chunk[0]
        unpack, crc32 = HEADER.unpack_from, crc32c.crc32c
        while offset + HEADER.size <= size:
            if offset + HEADER.size > chunk_start + len(chunk):
                view.release()
                chunk, chunk_start = self._read_chunk(seg.fd, offset, max(SCAN_CHUNK_BYTES, HEADER.size)), offset
                view = memoryview(chunk)
            at = offset - chunk_start
            magic, length, owner, index, seq, crc = unpack(chunk, at)
            if magic != MAGIC or length > MAX_PAYLOAD_BYTES or offset + HEADER.size + length > size:
                return
            end = at + HEADER.size + length
            if end > len(chunk):  # the record runs past this chunk: read from its start
                view.release()
                chunk, chunk_start = (
                    self._read_chunk(seg.fd, offset, max(SCAN_CHUNK_BYTES, HEADER.size + length)),
                    offset,
                )
                view = memoryview(chunk)
                at, end = 0, HEADER.size + length
                if end > len(chunk):
                    return
            payload = view[at + HEADER.size : end]
            if crc32(payload, crc32(view[at : at + HEADER_CRC_SPAN])) != crc:
                return
            yield offset, length, owner, index, seq, payload
            offset += HEADER.size + length

    @staticmethod
    def _read_chunk(fd: int, offset: int, size: int) -> bytearray:
        buf = bytearray(size)
        got = os.preadv(fd, [buf], offset)
        del buf[got:]
        return buf

    # --- the compaction reserve ---------------------------------------------------------

    @property
    def reserve_held_bytes(self) -> int:
        try:
            return os.stat(self.reserve_path).st_blocks * 512
        except FileNotFoundError:
            return 0

    def hold_reserve(self) -> bool:
        """Allocate the reserve file (best effort); True when all of it is held."""
        if self.reserve_bytes == 0 or self.reserve_held_bytes >= self.reserve_bytes:
            return True
        fd = os.open(self.reserve_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.reserve_bytes)
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EOPNOTSUPP):
                raise
            return False
        finally:
            os.close(fd)

    def release_reserve(self) -> int:
        """Give the reserve's space back to the disk (for compaction); returns its bytes."""
        held = self.reserve_held_bytes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.reserve_path)
        return held

    def disk_stats(self) -> os.statvfs_result:
        """The statvfs of the disk under the log (through the directory's descriptor)."""
        return os.fstatvfs(self._dir_fd)

    def free_bytes(self) -> int:
        """Bytes the disk under the log has free for appends."""
        st = self.disk_stats()
        return st.f_bavail * st.f_frsize

    # --- segments -------------------------------------------------------------------

    def segment_sizes(self) -> dict[int, int]:
        """Bytes written per live segment, the active one included."""
        return {s: seg.size_bytes for s, seg in self._segments.items() if not seg.deleted}

    @property
    def active_segment(self) -> int:
        assert self._active is not None
        return self._active.segment

    def delete_segment(self, segment: int) -> None:
        """Remove a sealed segment. The caller guarantees nothing durable points into it."""
        if self._active is not None and segment == self._active.segment:
            raise ValueError(f"log: cannot delete the active segment {segment}")
        with self._fd_lock:
            seg = self._segments.pop(segment)
            seg.deleted = True
            os.unlink(seg.path)
            if seg.readers == 0:
                _close_files(seg)

    def close(self) -> None:
        """fsync the active segment and close every file."""
        with self._fd_lock:
            for seg in self._segments.values():
                if seg is self._active:
                    os.fsync(seg.fd)
                _close_files(seg)
            self._segments.clear()
            self._active = None
            for stage in self._stages + self._read_stages:
                _close_stage(stage)
            self._stages = []
            self._read_stages = []
            if self._direct_writer is not None:
                self._direct_writer.shutdown()
                self._direct_writer = None
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1
