"""ByteRanges: byte ranges of an owner's content laid out in fixed-size blocks.

The role of the block tier that files, weight versions and datasets use: read, write,
truncate and copy a range of an owner's bytes (block `i` holds bytes
[i * block_bytes, (i + 1) * block_bytes), short at the end, holes read as zeros), and
gather many small ranges into one buffer in one trip to a worker thread (a dataset
stream's batch). A mixin of BlockStore (tiers/blocks.py), which owns the blocks, the DRAM
cache and the index these methods go through.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import trio

from distorefs.errors import InvalidArgument
from distorefs.memory import unzeroed
from distorefs.tiers.block_base import BlockTierBase
from distorefs.tiers.copy_ranges import check_inside, copy_ranges
from distorefs.types import BlockKey, LogLocation, Writable

PREFETCH_BLOCKS = 32  # how far a sequential reader's next blocks are loaded ahead
# ... and, where the log reads big records with O_DIRECT, asked for this many at a time:
# neighbours in the log then go to the device as one read (NvmeLog.runs)
PREFETCH_GROUP = 4
# gather reads a block whole when this many of its ranges are wanted (or half its bytes):
# on this disk one random 1 MiB read costs about as much as 32 random 10 KB reads. Only
# where the ranges fill at least half of the stretch of the block that they lie in: 32
# or 300 small records of a shuffle scattered over a block are a thirtieth of it, and
# such a block is wanted again by nearly every batch of the epoch, so reading it whole
# read the dataset again for every batch (1 KB records: 0.13 GB/s warm, 13 s of system
# time a GiB; docs/benchmarks.md, "Thirty-second session").
DENSE_PARTS = 32


class ByteRanges(BlockTierBase):
    """Byte ranges over an owner's fixed-size blocks (mixed into BlockStore)."""

    _read_end: dict[int, int]  # owner -> where its last read_range ended
    _gathered_dram_bytes: int
    _gathered_parts: int
    _gathered_spans: int

    async def read_range(self, owner: int, offset: int, size: int, length: int) -> bytes | bytearray | memoryview:
        """Up to `size` bytes at `offset` of `owner`'s content of `length` bytes, laid out in
        blocks of `block_bytes` (short at the end; holes read as zeros).

        A read inside one cached block returns a memoryview of it without copying; the
        caller must use it before its next await. A read that continues where the last
        one of this owner ended has the next blocks loaded from the log meanwhile.
        """
        if offset < 0:
            raise InvalidArgument(f"negative offset {offset}")
        if offset >= length or size <= 0:
            return b""
        size = min(size, length - offset)
        bb = self.block_bytes
        first, last = offset // bb, (offset + size - 1) // bb
        sequential = self._read_end.get(owner) == offset
        if sequential:  # a one-pass reader: what it has loaded is kept only briefly (tiers/dram.py)
            group = PREFETCH_GROUP if self._log.direct_reads else 1
            ahead = min(-(-(last + 1 + PREFETCH_BLOCKS) // group) * group, -(-length // bb))
            self.prefetch(BlockKey(owner, i) for i in range(last + 1, ahead))
        self._read_end[owner] = offset + size
        if first == last:
            block = await self.get(BlockKey(owner, first), sequential)
            inner = offset - first * bb
            if block is not None and inner + size <= block.length:
                return memoryview(block.buf)[inner : inner + size]
        out = bytearray(size)
        for index in range(first, last + 1):
            block = await self.get(BlockKey(owner, index), sequential)
            if block is None:
                continue
            start = max(offset, index * bb)
            end = min(offset + size, index * bb + block.length)
            if end > start:
                out[start - offset : end - offset] = memoryview(block.buf)[start - index * bb : end - index * bb]
        return out

    async def write_range(self, owner: int, offset: int, data: bytes | memoryview) -> None:
        """Write `data` at `offset` of `owner`'s content, block by block, into DRAM."""
        if offset < 0:
            raise InvalidArgument(f"negative offset {offset}")
        bb = self.block_bytes
        if type(data) is bytes and len(data) == bb and offset % bb == 0:
            await self.write_whole(BlockKey(owner, offset // bb), data)  # the request's bytes, kept
            return
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            at = offset + pos
            inner = at % bb
            count = min(bb - inner, len(view) - pos)
            await self.write(BlockKey(owner, at // bb), inner, view[pos : pos + count])
            pos += count

    async def zero_range(self, owner: int, start: int, end: int) -> None:
        """Make bytes [start, end) of `owner`'s content read as zeros: the blocks wholly
        inside become holes (deleted: nothing written), the bytes of the edge blocks that
        hold data are overwritten with zeros, holes stay holes. So punching a hole across
        a sparse file costs what its blocks with data cost, not its length (zeros written
        over 15 TiB of holes filled the disk)."""
        if end <= start:
            return
        bb = self.block_bytes
        held = {key.number for key in self.owner_keys(owner)}
        inner_first, inner_end = -(-start // bb), end // bb  # the blocks wholly inside
        for number in held:
            if inner_first <= number < inner_end:
                self.delete(BlockKey(owner, number))
        for number in sorted({start // bb, (end - 1) // bb}):
            if number in held and not inner_first <= number < inner_end:
                lo, hi = max(start, number * bb), min(end, (number + 1) * bb)
                await self.write(BlockKey(owner, number), lo - number * bb, bytes(hi - lo))

    async def truncate_range(self, owner: int, old_length: int, new_length: int) -> None:
        """Cut `owner`'s content from `old_length` down to `new_length` bytes."""
        if new_length >= old_length:
            return
        bb = self.block_bytes
        keep = -(-new_length // bb)  # blocks that keep some bytes
        for key in self.owner_keys(owner):
            if key.number >= keep:
                self.delete(key)
        if new_length % bb:
            await self.truncate(BlockKey(owner, new_length // bb), new_length % bb)

    async def copy_owner(self, source: int, target: int) -> None:
        """Copy every block of `source` to `target` (copy-on-write of a whole file)."""
        for key in sorted(self.owner_keys(source)):
            block = await self.get(key)
            if block is not None:
                await self.put(BlockKey(target, key.number), memoryview(block.buf)[: block.length])

    def log_locations(self, owner: int, numbers: Iterable[int]) -> list[LogLocation]:
        """Where these blocks of `owner` lie in the log, in log order (holes and blocks
        cached in DRAM left out): for `will_need`."""
        index, dram = self._index, self._dram
        return sorted(
            location
            for number in numbers
            if (location := index.get(BlockKey(owner, number))) is not None
            and dram.peek(BlockKey(owner, number)) is None
        )

    @property
    def dram_departures(self) -> int:
        """Blocks that left DRAM (or changed buffer) so far: views of cached blocks taken
        when this was n are still what the cache holds while it is n."""
        return self._dram.departures

    def dram_blocks(self, owner: int, count: int) -> list[tuple[bytearray | memoryview | bytes, int]] | None:
        """The buffers of blocks 0 .. `count` - 1 of `owner` as cached in DRAM, each with
        its valid bytes; None when one is not cached. Not copies: they hold the blocks'
        bytes while `dram_departures` has not moved (an eviction may give a buffer to
        another block), so a caller checks that before each use, and uses what it takes
        from them before its next await. Bytes in DRAM were checked when they were loaded,
        or are as written."""
        peek = self._dram.peek
        found: list[tuple[bytearray | memoryview | bytes, int]] = []
        for number in range(count):
            block = peek(BlockKey(owner, number))
            if block is None:
                return None
            found.append((block.buf, min(block.length, len(block.buf))))
        return found

    async def will_need(self, locations: list[LogLocation]) -> None:
        """Have the kernel read these log records into its page cache, in the background
        (NvmeLog.will_need, from a worker thread: the hints queue the reads and return)."""
        await trio.to_thread.run_sync(self._log.will_need, locations, True)

    async def gather(
        self,
        owner: int,
        starts: np.ndarray,
        lengths: np.ndarray,
        out: Writable,
        out_starts: np.ndarray,
        read_ahead: bool = True,
    ) -> np.ndarray:
        """Copy the ranges `[starts[i], starts[i] + lengths[i])` of `owner`'s content into
        `out` at `out_starts[i]`, without caching what comes from the log (a stream's
        prefetch reads a range once, then drops it). Returns a mask of the ranges not wholly
        copied from cached blocks: those the caller must check.

        Ranges in blocks cached in DRAM are copied from there (checked when they were
        loaded, or the bytes as written), in one compiled copy (copy_ranges.py). In a block
        that many ranges touch, one span covering them is read; other ranges are read one
        by one, straight into `out`, with many in flight (`read_ahead`: hinted ahead of
        the reads; not when the caller has had the records hinted). Log reads skip the
        record checks (parts of a record are read): the caller checks those ranges. Holes
        leave `out` as it was there, and count as unchecked. One worker-thread trip for
        the whole gather.
        """
        bb = self.block_bytes
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        out_starts = np.asarray(out_starts, dtype=np.int64)
        rng, number, inner, length, at = _pieces(starts, lengths, out_starts, bb)
        numbers, which = np.unique(number, return_inverse=True)
        sources: list[bytearray | memoryview | bytes] = []
        valid: list[int] = []  # the valid bytes of each source
        source_of = np.full(len(numbers), -1, dtype=np.int64)
        for j, n in enumerate(numbers.tolist()):
            block = self._dram.peek(BlockKey(owner, n))
            if block is not None:
                source_of[j] = len(sources)
                sources.append(block.buf)
                valid.append(min(block.length, len(block.buf)))
        source = source_of[which]
        cached = source >= 0
        missed = ~cached
        # The compiled copy checks no bounds: a piece past its block's valid bytes (the
        # block shorter than the index says) is not copied, and its range stays unchecked,
        # so the caller's check fails it instead of serving what lies beyond.
        copied = cached & (inner + length <= np.asarray(valid + [0], dtype=np.int64)[source])  # [-1]: not cached
        check_inside(out, at, length, "gather")
        view = memoryview(out)
        unchecked = np.ones(len(starts), dtype=bool)  # empty ranges included: nothing vouches for them
        unchecked[rng[copied]] = False
        unchecked[rng[~copied]] = True  # a range with any piece from the log, or not copied
        self._gathered_dram_bytes += int(length[copied].sum())
        # Pieces in blocks not cached, planned in numpy: a dense block (many pieces, or half
        # its bytes) is read as one span; the others' pieces straight into `out`, sorted
        # by where they lie in the log. Only blocks are looked up one by one.
        m_block = which[missed]
        m_inner, m_length, m_at = inner[missed], length[missed], at[missed]
        count = np.bincount(m_block, minlength=len(numbers))
        size = np.bincount(m_block, weights=m_length, minlength=len(numbers))
        segment = np.full(len(numbers), -1, dtype=np.int64)
        record_at = np.zeros(len(numbers), dtype=np.int64)
        spans: list[tuple[LogLocation, int, int, np.ndarray]] = []  # location, span start and length, pieces
        grouped = np.argsort(m_block, kind="stable")  # pieces by block: block j's are grouped[bounds[j]:bounds[j + 1]]
        bounds = np.concatenate([[0], np.cumsum(count)])
        wanted = np.flatnonzero(count)
        low = np.zeros(len(numbers), dtype=np.int64)  # where each block's pieces start and end
        high = np.zeros(len(numbers), dtype=np.int64)
        if len(wanted):
            low[wanted] = np.minimum.reduceat(m_inner[grouped], bounds[wanted])
            high[wanted] = np.maximum.reduceat((m_inner + m_length)[grouped], bounds[wanted])
        dense = ((count >= DENSE_PARTS) | (size * 2 >= bb)) & (size * 2 >= high - low)
        for j in wanted.tolist():
            location = self._index.get(BlockKey(owner, int(numbers[j])))
            if location is None:
                continue  # a hole: zeros
            if dense[j]:
                spans.append((location, int(low[j]), int(high[j] - low[j]), grouped[bounds[j] : bounds[j + 1]]))
                self._gathered_spans += 1
            else:
                segment[j], record_at[j] = location.segment, location.offset
        direct = np.flatnonzero(segment[m_block] >= 0)
        p_segment = segment[m_block[direct]]
        p_offset = record_at[m_block[direct]] + m_inner[direct]
        order = np.lexsort((p_offset, p_segment))
        direct, p_segment, p_offset = direct[order], p_segment[order], p_offset[order]
        self._gathered_parts += len(direct)
        # spans, in log order, are read into one scratch buffer, then their pieces copied out
        spans.sort(key=lambda span: (span[0].segment, span[0].offset))
        s_segment = np.array([location.segment for location, *_ in spans], dtype=np.int64)
        s_offset = np.array([location.offset + low for location, low, *_ in spans], dtype=np.int64)
        s_length = np.array([size for _location, _low, size, _mine in spans], dtype=np.int64)
        s_at = np.cumsum(s_length) - s_length
        scratch = unzeroed(int(s_length.sum()))  # only what the reads filled is copied out
        # each span's pieces, copied out of the scratch in one compiled copy: with a Python
        # step a piece, an in-order stream of 10 KB records spent about 0.4 s more of the
        # daemon's user time a GiB than one read without spans (the step and the copy)
        span_of = np.repeat(np.arange(len(spans), dtype=np.int64), [len(mine) for *_, mine in spans])
        s_piece = np.concatenate([mine for *_, mine in spans]) if spans else np.zeros(0, dtype=np.int64)
        s_low = np.array([low for _location, low, _size, _mine in spans], dtype=np.int64)
        s_from = s_at[span_of] - s_low[span_of] + m_inner[s_piece]
        c_source, c_inner, c_length, c_at = source[copied], inner[copied], length[copied], at[copied]

        def work() -> list[int]:
            copy_ranges(sources, c_source, c_inner, c_length, out, c_at)
            gone = self._log.read_ranges(p_segment, p_offset, m_length[direct], out, m_at[direct], read_ahead)
            gone = [int(direct[i]) for i in gone]
            gone_spans = self._log.read_ranges(s_segment, s_offset, s_length, scratch, s_at, read_ahead)
            read = ~np.isin(span_of, gone_spans)
            gone += s_piece[~read].tolist()
            pieces = s_piece[read]
            copy_ranges(
                [scratch], np.zeros(len(pieces), dtype=np.int64), s_from[read], m_length[pieces], out, m_at[pieces]
            )
            return gone

        # Only a gather that reads the log queues for an I/O thread: one that copies from
        # DRAM alone must not wait behind other streams' block loads (a first batch waited
        # 0.8 s there behind the loads of the batches after it).
        limiter = self._io_limiter if len(direct) or spans else None
        gone = await trio.to_thread.run_sync(work, limiter=limiter)
        for i in gone:  # moved by compaction meanwhile: through the index, as any read
            block = await self.get(BlockKey(owner, int(numbers[m_block[i]])))
            if block is not None:
                offset, n, to = int(m_inner[i]), int(m_length[i]), int(m_at[i])
                view[to : to + n] = memoryview(block.buf)[offset : offset + n]
        return unchecked


def _pieces(
    starts: np.ndarray, lengths: np.ndarray, out_starts: np.ndarray, bb: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ranges cut at block boundaries, empty ones left out: (range, block number,
    offset in the block, length, position in out) per piece, as arrays."""
    keep = lengths > 0
    first = starts // bb
    last = (starts + lengths - 1) // bb
    count = np.where(keep, last - first + 1, 0)
    rng = np.repeat(np.arange(len(starts), dtype=np.int64), count)
    k = np.arange(len(rng), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)  # piece k of its range
    number = first[rng] + k
    begin = np.maximum(starts[rng], number * bb)
    end = np.minimum(starts[rng] + lengths[rng], (number + 1) * bb)
    return rng, number, begin - number * bb, end - begin, out_starts[rng] + (begin - starts[rng])
