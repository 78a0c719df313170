"""ByteRanges: byte ranges of an owner's content laid out in fixed-size blocks.

The role of the block tier that files, weight versions and datasets use: read, write,
truncate and copy a range of an owner's bytes (block `i` holds bytes
[i * block_bytes, (i + 1) * block_bytes), short at the end, holes read as zeros), and
gather many small ranges into one buffer in one trip to a worker thread (a dataset
stream's batch). A mixin of BlockStore (tiers/blocks.py), which owns the blocks, the DRAM
cache and the index these methods go through.
"""

from __future__ import annotations

import numpy as np
import trio

from distorefs.errors import InvalidArgument
from distorefs.tiers.block_base import BlockTierBase
from distorefs.tiers.copy_ranges import copy_ranges
from distorefs.types import BlockKey, LogLocation, Writable

PREFETCH_BLOCKS = 32  # how far a sequential reader's next blocks are loaded ahead
# gather reads a block whole when this many of its ranges are wanted (or half its bytes):
# on this disk one random 1 MiB read costs about as much as 32 random 10 KB reads.
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
            ahead = min(last + 1 + PREFETCH_BLOCKS, -(-length // bb))
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

    async def gather(
        self, owner: int, starts: np.ndarray, lengths: np.ndarray, out: Writable, out_starts: np.ndarray
    ) -> np.ndarray:
        """Copy the ranges `[starts[i], starts[i] + lengths[i])` of `owner`'s content into
        `out` at `out_starts[i]`, without caching what comes from the log (a stream's
        prefetch reads a range once, then drops it). Returns a mask of the ranges not wholly
        copied from cached blocks: those the caller must check.

        Ranges in blocks cached in DRAM are copied from there (checked when they were
        loaded, or the bytes as written), in one compiled copy (copy_ranges.py). In a block
        that many ranges touch, one span covering them is read; other ranges are read one
        by one, straight into `out`, with many in flight. Log reads skip the record checks
        (parts of a record are read): the caller checks those ranges. Holes stay as they
        are in `out` (zeros), and count as unchecked. One worker-thread trip for the whole
        gather.
        """
        bb = self.block_bytes
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        out_starts = np.asarray(out_starts, dtype=np.int64)
        rng, number, inner, length, at = _pieces(starts, lengths, out_starts, bb)
        numbers, which = np.unique(number, return_inverse=True)
        sources: list[bytearray | memoryview | bytes] = []
        source_of = np.full(len(numbers), -1, dtype=np.int64)
        for j, n in enumerate(numbers.tolist()):
            block = self._dram.peek(BlockKey(owner, n))
            if block is not None:
                source_of[j] = len(sources)
                sources.append(block.buf)
        source = source_of[which]
        cached = source >= 0
        missed = ~cached
        unchecked = np.ones(len(starts), dtype=bool)  # empty ranges included: nothing vouches for them
        unchecked[rng[cached]] = False
        unchecked[rng[missed]] = True  # a range with any piece from the log
        self._gathered_dram_bytes += int(length[cached].sum())
        by_block: dict[int, list[tuple[int, int, int, int]]] = {}
        for piece in zip(
            number[missed].tolist(), inner[missed].tolist(), length[missed].tolist(), at[missed].tolist(), strict=True
        ):
            by_block.setdefault(piece[0], []).append(piece)
        view = memoryview(out)
        parts: list[tuple[LogLocation, int, memoryview]] = []
        spans: list[tuple[int, bytearray, list[tuple[int, int, int, int]]]] = []  # span start, buffer, pieces
        part_pieces: list[list[tuple[int, int, int, int]]] = []  # what each part serves, for retries
        for n, wanted in by_block.items():
            location = self._index.get(BlockKey(owner, n))
            if location is None:
                continue  # a hole: zeros
            if len(wanted) >= DENSE_PARTS or sum(p[2] for p in wanted) * 2 >= bb:
                low = min(p[1] for p in wanted)
                high = max(p[1] + p[2] for p in wanted)
                buf = bytearray(high - low)
                spans.append((low, buf, wanted))
                parts.append((location, low, memoryview(buf)))
                part_pieces.append(wanted)
                self._gathered_spans += 1
            else:
                for piece in wanted:
                    _n, offset, size, to = piece
                    parts.append((location, offset, view[to : to + size]))
                    part_pieces.append([piece])
                self._gathered_parts += len(wanted)
        order = sorted(range(len(parts)), key=lambda i: (parts[i][0].segment, parts[i][0].offset + parts[i][1]))
        copies = (source[cached], inner[cached], length[cached], at[cached])

        def work() -> list[int]:
            copy_ranges(sources, *copies[:3], out, copies[3])
            gone = [order[i] for i in self._log.read_parts([parts[i] for i in order])]
            for low, buf, wanted in spans:
                for _n, offset, size, to in wanted:
                    view[to : to + size] = memoryview(buf)[offset - low : offset - low + size]
            return gone

        # Only a gather that reads the log queues for an I/O thread: one that copies from
        # DRAM alone must not wait behind other streams' block loads (a first batch waited
        # 0.8 s there behind the loads of the batches after it).
        limiter = self._io_limiter if parts else None
        gone = await trio.to_thread.run_sync(work, limiter=limiter)
        for i in gone:  # moved by compaction meanwhile: through the index, as any read
            for n, offset, size, to in part_pieces[i]:
                block = await self.get(BlockKey(owner, n))
                if block is not None:
                    view[to : to + size] = memoryview(block.buf)[offset : offset + size]
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
