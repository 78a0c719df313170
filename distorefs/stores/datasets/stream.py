"""Stream: one open of `stream`: the records of an epoch (or a rank's share) in order.

Owns the stream's layout, its prefetched batches and the task that fetches them ahead of
the reader. No FUSE here.

The order is known when the stream opens, so a prefetch task (started by the store's
`run_streams`) fetches batches of consecutive positions ahead of the reader, each batch
already laid out in the stream's format, up to the window. A batch's records come from
DRAM where cached and otherwise straight from the log (BlockStore.gather: many small reads
in flight, or a whole span of a block many of them share); each record is checked
against its crc32c. Batches count against the DRAM budget (BlockStore.reserve) and are
dropped as soon as the reader has passed them, so prefetched data never pushes out the
block cache for longer than it is needed.

A dataset that fits the window, or what the page cache may be asked to hold
(`--dataset-page-cache`, store.py), is asked of the kernel whole once the first batch is
in: its log records are hinted into the page cache (WILLNEED, in log order, so the
device reads them at its sequential speed in the background) and the batches' records
are then read from there. A bigger one is read record by record, each hinted a few
hundred reads ahead.

The reader never depends on the task: a read whose batch is not fetched or on its way
fetches it itself. A read far from where the stream was (a seek) restarts the prefetch
there.

A stream whose dataset is all in the daemon's DRAM when it opens, for a caller that
takes a read's bytes as pieces (`read_pieces`: the FUSE layer replies with them in one
writev), fetches no batches: each read is the layout's own bytes and views of the
records where they lie in the block cache, with no copy in the daemon. A read that finds
a record gone from DRAM turns the stream back to batches for good.

A dataset within the stream's DRAM share (`dram_bytes`: store.py gives `--dataset-dram`
to datasets of small records) that is not all in DRAM is kept there: as the stream
reads, its blocks are loaded into the block cache in log order, a group at a time behind
the page-cache hints (so they come from the page cache, not from the disk a second
time). Batches copy what is loaded from DRAM; once every block is in, the stream is
served from DRAM, and so are the next epochs' streams. A stream read to its end lets its
load finish after its close.
"""

from __future__ import annotations

import logging

import numpy as np
import trio

from distorefs import scheduling
from distorefs.errors import Corrupted, DistorefsError
from distorefs.stores.datasets.dataset import Dataset
from distorefs.stores.datasets.formats import StreamLayout
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.copy_ranges import first_bad_crc
from distorefs.tiers.dram import Block
from distorefs.types import BlockKey

log = logging.getLogger(__name__)

FIRST_BATCH_BYTES = 1 << 20  # the first batch is small so the first read returns soon
MAX_BATCH_BYTES = 32 << 20
BATCHES_IN_FLIGHT = 2  # batches fetched at once (for a dataset that fits: one more, FITS_IN_FLIGHT)
FITS_IN_FLIGHT = 3  # each of its batches is a few short waits (a worker thread's turn, the reads, the check)
RESERVE_RETRY_S = 0.02
DRAM_REFRESHES = 8  # a stream served from DRAM looks at its blocks again this often for free,
DRAM_REFRESH_READS = 8  # and once more every this many reads; past that it takes batches
HINT_GROUP_BYTES = 64 << 20  # a fitting dataset's records are hinted this much at a time (a close stops it between)
LOAD_GROUP_BYTES = 24 << 20  # a dataset kept in DRAM is loaded this much at a time: three I/O threads


class _Batch:
    __slots__ = ("first", "last", "data", "reserved", "done", "error", "dropped")

    def __init__(self, first: int, last: int) -> None:
        self.first = first
        self.last = last
        self.data: memoryview | None = None
        self.reserved = 0
        self.done = trio.Event()
        self.error: DistorefsError | None = None
        self.dropped = False


class Stream:
    """Positions [0, len(layout)) of one shard of the order, read as one batch."""

    def __init__(
        self,
        dataset: Dataset,
        layout: StreamLayout,
        index: np.ndarray,
        blocks: BlockStore,
        window_bytes: int,
        whole_bytes: int = 0,
        pieces: int = 0,
        dram_bytes: int = 0,
    ) -> None:
        self.dataset = dataset
        self.layout = layout
        self._index = index
        self._blocks = blocks
        self.window_bytes = window_bytes
        # A dataset that fits the window, or `whole_bytes` (what the kernel's page cache
        # may be asked to hold: store.py), is hinted whole into the page cache at the
        # start; a bigger one is read record by record.
        self.fits = dataset.data_bytes <= max(window_bytes, whole_bytes)
        # Laid-out batches held ahead of the reader: the window, except when the dataset
        # fits (then the page cache holds the prefetched data, and a batch is a quick copy
        # out of it: more than a few of them would only take DRAM).
        self.max_in_flight = FITS_IN_FLIGHT if self.fits else BATCHES_IN_FLIGHT
        self.ahead_bytes = min(window_bytes, self.max_in_flight * MAX_BATCH_BYTES) if self.fits else window_bytes
        self._batches: dict[int, _Batch] = {}  # by first position, in position order
        self._cursor = 0  # the next position to fetch
        self._batch_bytes = FIRST_BATCH_BYTES
        self._in_flight = 0
        self._held_bytes = 0  # bytes of batches fetched or on their way, not yet passed
        self._wake = trio.Event()
        self.closed = False
        self.fetched_batches = 0
        self._first_done = trio.Event()  # a batch has been fetched (or failed)
        self.reader_waits = 0  # reads that found their batch not fetched yet
        self.restarts = 0
        # Served from DRAM in pieces (see the module's doc): the caller takes up to `pieces`
        # pieces a read, every block of the dataset is cached now, and a read of 1 MiB
        # (FUSE's largest) stays within `pieces` (tiny records make too many).
        self.max_pieces = pieces
        width = layout.prefix + layout.suffix
        mean = dataset.data_bytes // max(1, dataset.count) + width
        self._dram: list[tuple[bytearray | memoryview | bytes, int]] | None = None
        self._dram_seen = blocks.dram_departures
        # a read of 1 MiB (FUSE's largest): two pieces a position, one more a block crossed
        most = 2 * ((1 << 20) // max(1, mean) + 2) + (1 << 20) // blocks.block_bytes + 2
        self._block_count = -(-dataset.data_bytes // blocks.block_bytes)
        cached = blocks.dram_blocks(dataset.data_owner, self._block_count)
        self._in_pieces = pieces > 0 and most <= pieces
        if self._in_pieces:
            self._dram = cached
        self.dram_reads = 0
        self._dram_refreshes = 0
        # Kept in DRAM (see the module's doc): a dataset within `dram_bytes` that is not
        # all there yet is loaded as the stream reads; one that is all there needs no hint.
        self.in_dram = cached is not None
        self.keeps_dram = not self.in_dram and 0 < dataset.data_bytes <= dram_bytes
        self.loaded_blocks = 0
        self.read_through = False  # its last byte has been read: an epoch's end
        self._hinted_blocks = 0  # blocks of a fitting dataset hinted so far, in log order
        self._hint_moved = trio.Event()

    @property
    def from_dram(self) -> bool:
        """Whether the stream is served from DRAM (`read_pieces`), not in batches."""
        return self._dram is not None

    @property
    def size(self) -> int:
        return self.layout.total

    # --- planning (synchronous: no await between looking and planning) --------------------

    def _find(self, position: int) -> _Batch | None:
        for batch in self._batches.values():
            if batch.first <= position < batch.last:
                return batch
        return None

    def _plan(self) -> _Batch:
        """The next batch from the cursor: consecutive positions of about `_batch_bytes`."""
        layout = self.layout
        first = self._cursor
        last = max(first + 1, min(len(layout), layout.position_at(layout.start(first) + self._batch_bytes)))
        self._batch_bytes = min(2 * self._batch_bytes, MAX_BATCH_BYTES, max(FIRST_BATCH_BYTES, self.ahead_bytes // 4))
        batch = _Batch(first, last)
        self._batches[first] = batch
        self._cursor = last
        self._held_bytes += self._batch_size(batch)
        # In flight from here: counted before the task that fetches it first runs, or
        # the prefetch loop (which does not await between plans) planned the whole
        # window at once, and the first batch's loads queued behind all of it.
        self._in_flight += 1
        return batch

    def _batch_size(self, batch: _Batch) -> int:
        return self.layout.start(batch.last) - self.layout.start(batch.first)

    def _drop(self, batch: _Batch) -> None:
        if batch.dropped:
            return
        batch.dropped = True
        self._batches.pop(batch.first, None)
        self._held_bytes -= self._batch_size(batch)
        batch.data = None
        if batch.done.is_set():
            self._release(batch)
        self._wake.set()

    def _release(self, batch: _Batch) -> None:
        if batch.reserved:
            self._blocks.unreserve(batch.reserved)
            batch.reserved = 0

    def _passed(self, position: int) -> None:
        """The reader is at `position`: batches before it go; a jump restarts the cursor."""
        for batch in list(self._batches.values()):
            if batch.last <= position:
                self._drop(batch)
        if self._find(position) is None and position != self._cursor:
            for batch in list(self._batches.values()):
                self._drop(batch)
            self._cursor = position
            self._batch_bytes = FIRST_BATCH_BYTES
            self.restarts += 1

    # --- fetching ---------------------------------------------------------------------------

    async def _fetch(self, batch: _Batch) -> None:
        """Fill `batch` (planned by `_plan`, which counted it in flight)."""
        try:
            layout = self.layout
            # A batch is up to 32 MiB, left uninitialised: every byte of it is written below
            # (the layout's prefixes or suffixes, then the records; a record the gather
            # could not fill fails its crc check). A bytearray was zeroed by memset holding
            # the GIL, 10-20 ms of the event loop's time a batch even from a worker thread.
            # The layout's writes are the first touch of most of its pages (page faults):
            # in a worker thread too.
            out = np.empty(self._batch_size(batch), dtype=np.uint8).data
            at = await trio.to_thread.run_sync(layout.frame, out, batch.first, batch.last)
            records = layout.indices[batch.first : batch.last]
            entries = self._index[records]
            starts = entries["offset"].astype(np.int64)
            lengths = layout.lengths(batch.first, batch.last)
            owner = self.dataset.data_owner
            # the first batch (before the dataset is hinted) hints its own records
            read_ahead = not self.fits or not self._first_done.is_set()
            unchecked = await self._blocks.gather(owner, starts, lengths, out, at, read_ahead=read_ahead)
            if unchecked.any():
                await trio.to_thread.run_sync(
                    _check_crcs, out, at[unchecked], entries[unchecked], records[unchecked], self.dataset.name
                )
            batch.data = out
            self.fetched_batches += 1
        except DistorefsError as exc:
            batch.error = exc
        except OSError as exc:
            batch.error = Corrupted(f"datasets/{self.dataset.name}: reading records failed: {exc}")
        finally:
            self._in_flight -= 1
            self._first_done.set()
            batch.done.set()
            if batch.dropped:
                self._release(batch)
                batch.data = None
            self._wake.set()

    async def _hint_records(self) -> None:
        """Ask the kernel to read a fitting dataset's log records into its page cache, in
        log order, a group at a time until done or the stream closes. Not before the
        first batch is in: its own few reads would queue behind the whole dataset's, and
        the first byte came after 0.5 s (a cold GiB) instead of 0.05."""
        await self._first_done.wait()
        # a sealed dataset's records fill blocks 0, 1, ... in order, appended in that order:
        # block order is log order but for blocks compaction moved (each group is sorted),
        # and a group's lookups are all the event loop does between two hints
        blocks = self._block_count
        per_group = max(1, HINT_GROUP_BYTES // self._blocks.block_bytes)
        try:
            for first in range(0, blocks, per_group):
                if self.closed:
                    return
                last = min(first + per_group, blocks)
                group = self._blocks.log_locations(self.dataset.data_owner, range(first, last))
                if group:
                    try:
                        await self._blocks.will_need(group)
                    except OSError as exc:  # a hint: the reads read the records anyway
                        log.debug("datasets/%s: read-ahead hint failed: %s", self.dataset.name, exc)
                        return
                self._hinted_blocks = last
                self._hint_moved.set()
        finally:
            self._hinted_blocks = blocks  # done or given up: the load waits for it no more
            self._hint_moved.set()

    async def _keep_in_dram(self) -> None:
        """Load the dataset's blocks into the block cache (see the module's doc), a group
        at a time in log order, each once its hint has been given; then serve the stream
        from DRAM where its reads may be pieces. Stops at the close, unless the stream was
        read to its end (an epoch done: the next one is likely to follow, and finds the
        rest loaded); at a failed read (a batch that needs the block says why); or when
        the cache keeps no more of them (dirty blocks fill the budget, or other reads
        evict them)."""
        await self._first_done.wait()
        owner = self.dataset.data_owner
        blocks = self._block_count
        per_group = max(1, LOAD_GROUP_BYTES // self._blocks.block_bytes)
        oldest: list[tuple[BlockKey, Block | None]] = []  # block 0 as loaded: LRU takes it first
        for first in range(0, blocks, per_group):
            last = min(first + per_group, blocks)
            while self.fits and self._hinted_blocks < last and not self.closed:
                await self._hint_moved.wait()
                self._hint_moved = trio.Event()
            if self._load_stops():
                return
            keys = [BlockKey(owner, number) for number in range(first, last)]
            try:
                got = list(zip(keys, await self._blocks.get_many(keys), strict=True))
            except (DistorefsError, OSError) as exc:
                log.debug("datasets/%s: loading blocks %d-%d failed: %s", self.dataset.name, first, last, exc)
                return
            if self._load_stops():
                return
            oldest = oldest or got[:1]
            if not all(block is not None and self._blocks.resident(key, block) for key, block in oldest + got):
                log.info("datasets/%s: the DRAM cache keeps no more of it: batches from here", self.dataset.name)
                return
            self.loaded_blocks = last
        buffers = self._blocks.dram_blocks(owner, blocks)
        if buffers is None or self.closed:
            return
        self.in_dram = True
        if self._in_pieces:
            self._dram = buffers
            self._dram_seen = self._blocks.dram_departures
            self._dram_refreshes = 0
            for batch in list(self._batches.values()):
                self._drop(batch)

    def _load_stops(self) -> bool:
        return self.dataset.deleted or (self.closed and not self.read_through)

    async def run_prefetch(self) -> None:
        """Fetch batches ahead of the reader while they fit in the window (none while the
        stream is served from DRAM); ends at close."""
        async with trio.open_nursery() as nursery:
            started = False
            while not self.closed:
                if self.from_dram:
                    await self._wait_wake()
                    continue
                if not started:
                    if self.fits and not self.in_dram:
                        nursery.start_soon(self._hint_records)
                    if self.keeps_dram:
                        nursery.start_soon(self._keep_in_dram)
                    started = True
                if (
                    self._cursor < len(self.layout)
                    and self._in_flight < self.max_in_flight
                    and self._held_bytes + self._batch_bytes <= self.ahead_bytes
                ):
                    need = min(self._batch_bytes, self.layout.start(len(self.layout)) - self.layout.start(self._cursor))
                    if not self._blocks.reserve(need):
                        with trio.move_on_after(RESERVE_RETRY_S):
                            await self._wait_wake()
                        continue
                    batch = self._plan()
                    batch.reserved = need
                    nursery.start_soon(self._fetch, batch)
                else:
                    await self._wait_wake()

    async def _wait_wake(self) -> None:
        await self._wake.wait()
        self._wake = trio.Event()

    # --- reading ----------------------------------------------------------------------------

    async def read(self, offset: int, size: int) -> bytes | bytearray | memoryview:
        self.dataset.check_live()
        layout = self.layout
        end = min(offset + size, layout.total)
        if offset >= end:
            await scheduling.checkpoint()
            return b""
        pieces, at = self._head(offset, end)
        if at < end:
            self._passed(layout.position_at(at))
        while at < end:
            position = layout.position_at(at)
            batch = self._find(position)
            if batch is None:
                if position != self._cursor:
                    self._passed(position)
                batch = self._plan()
                self.reader_waits += 1
                await self._fetch(batch)
            elif not batch.done.is_set():
                self.reader_waits += 1
                await batch.done.wait()
            self.dataset.check_live()  # removed while this read waited: not a failed crc
            if batch.error is not None:
                raise batch.error
            if batch.data is None:
                continue  # dropped meanwhile by a concurrent read of this open: look again
            base = layout.start(batch.first)
            stop = min(end, layout.start(batch.last))
            pieces.append(memoryview(batch.data)[at - base : stop - base])
            at = stop
        self._wake.set()
        self.dataset.streamed_bytes += end - offset
        self.read_through |= end == layout.total
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def read_pieces(self, offset: int, size: int) -> list[bytes | memoryview] | None:
        """What `read(offset, size)` returns, as pieces, while the stream is served from
        DRAM: the layout's own bytes (the header, each record's prefix or suffix) and each
        record's bytes as views of the block cache's buffers, used before the caller's
        next await. None when the stream is not served from DRAM, or when a record is no
        longer there (the stream then goes back to batches for good), or when the pieces
        would be more than the stream's `max_pieces`: then `read`."""
        buffers = self._dram_buffers()
        if buffers is None or self.dataset.deleted:  # removed: `read` says so
            return None
        layout = self.layout
        end = min(offset + size, layout.total)
        pieces, at = self._head(offset, end)
        if at < end:
            first = layout.position_at(at)
            last = min(len(layout), layout.position_at(end - 1) + 1)
            if not self._pieces_of(pieces, buffers, first, last, at, end):
                self._leave_dram()
                return None
            if len(pieces) > self.max_pieces:
                return None
        self.dram_reads += 1
        self.dataset.streamed_bytes += max(0, end - offset)
        self.read_through |= end == layout.total
        return pieces

    def _head(self, offset: int, end: int) -> tuple[list[bytes | memoryview], int]:
        """A read of [offset, end): the stream header's bytes in it as its first piece (if
        any), and where its positions' bytes begin."""
        header = self.layout.header
        pieces: list[bytes | memoryview] = []
        if offset < len(header):
            pieces.append(header[offset : min(end, len(header))])
        return pieces, max(offset, len(header))

    def _dram_buffers(self) -> list[tuple[bytearray | memoryview | bytes, int]] | None:
        """The dataset's block buffers while the stream is served from DRAM, taken again if
        any block left DRAM since; None when it is not (or has just gone back to batches,
        one of its own blocks gone or the churn too much)."""
        if self._dram is None:
            return None
        now = self._blocks.dram_departures
        if now != self._dram_seen:
            # Each look is a lookup per block of the dataset: where other blocks keep
            # leaving DRAM (another reader's churn), batches cost less than looking again
            # for every read, so after a few the stream goes back to them.
            self._dram_refreshes += 1
            if self._dram_refreshes > DRAM_REFRESHES + self.dram_reads // DRAM_REFRESH_READS:
                self._leave_dram()
                return None
            self._dram = self._blocks.dram_blocks(self.dataset.data_owner, len(self._dram))
            self._dram_seen = now
            if self._dram is None:
                self._leave_dram()
        return self._dram

    def _leave_dram(self) -> None:
        self._dram = None
        self._wake.set()  # the prefetch takes over

    def _pieces_of(
        self,
        pieces: list[bytes | memoryview],
        buffers: list[tuple[bytearray | memoryview | bytes, int]],
        first: int,
        last: int,
        at: int,
        end: int,
    ) -> bool:
        """Append to `pieces` the bytes of positions [first, last) that lie in [at, end):
        each position's prefix or suffix (`layout.affixes`) and its record's bytes as views
        of `buffers` (one, or two for a record that crosses into the next block). False
        when a record's bytes are past what its block holds. Only the first and the last
        position can be cut by the range; the ones between are whole (the fast loop)."""
        layout = self.layout
        prefix, suffix = layout.prefix, layout.suffix
        width = prefix + suffix
        bb = self._blocks.block_bytes
        affixes = layout.affixes(first, last).reshape(-1).data
        ends = layout.ends[first:last].tolist()
        lengths = layout.lengths(first, last).tolist()
        addresses = self._index["offset"][layout.indices[first:last]].tolist()  # where each record starts
        count = last - first

        def record(k: int, skip: int, take: int) -> bool:
            """Views of `take` bytes of position k's record from `skip` bytes into it."""
            number, inner = divmod(addresses[k] + skip, bb)
            reach = inner + take
            buf, valid = buffers[number]
            if reach <= bb:
                if reach > valid:
                    return False
                pieces.append(memoryview(buf)[inner:reach])
                return True
            after, after_valid = buffers[number + 1] if number + 1 < len(buffers) else (b"", 0)
            if valid < bb or reach - bb > after_valid:
                return False
            pieces.append(memoryview(buf)[inner:bb])
            pieces.append(memoryview(after)[: reach - bb])
            return True

        def cut(k: int) -> bool:
            """Position k, cut to [at, end): a prefix lies at [record_start - prefix,
            record_start), a suffix at [record_end, stop)."""
            stop = ends[k]
            record_end = stop - suffix
            record_start = record_end - lengths[k]
            region = record_start - prefix if prefix else record_end
            lo, hi = max(region, at), min(region + width, end)
            if prefix and lo < hi:
                pieces.append(affixes[k * width + lo - region : k * width + hi - region])
            rlo, rhi = max(record_start, at), min(record_end, end)
            if rlo < rhi and not record(k, rlo - record_start, rhi - rlo):
                return False
            if suffix and lo < hi:
                pieces.append(affixes[k * width + lo - region : k * width + hi - region])
            return True

        if not cut(0):
            return False
        for k in range(1, count - 1):  # whole positions
            if prefix:
                pieces.append(affixes[k * width : k * width + width])
            if not record(k, 0, lengths[k]):
                return False
            if suffix:
                pieces.append(affixes[k * width : k * width + width])
        return count < 2 or cut(count - 1)

    def close(self) -> None:
        self.closed = True
        self._first_done.set()  # the hint task waits for nothing more
        self._hint_moved.set()  # nor the load
        for batch in list(self._batches.values()):
            self._drop(batch)
        self._wake.set()

    def statistics(self) -> dict[str, int]:
        return {
            "whole": int(self.fits),
            "positions": len(self.layout),
            "bytes": self.layout.total,
            "held_bytes": self._held_bytes,
            "fetched_batches": self.fetched_batches,
            "reader_waits": self.reader_waits,
            "restarts": self.restarts,
            "from_dram": int(self.from_dram),
            "dram_reads": self.dram_reads,
            "keeps_dram": int(self.keeps_dram),
            "in_dram": int(self.in_dram),
            "loaded_blocks": self.loaded_blocks,
        }


def _check_crcs(out: memoryview, at: np.ndarray, entries: np.ndarray, records: np.ndarray, name: str) -> None:
    bad = first_bad_crc(out, at, entries["length"], entries["crc"])
    if bad >= 0:
        raise Corrupted(f"datasets/{name}: record {int(records[bad])} fails its crc32c check")
