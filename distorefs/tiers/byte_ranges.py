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
from distorefs.types import BlockKey, LogLocation

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
        self, owner: int, starts: np.ndarray, lengths: np.ndarray, out: bytearray, out_starts: np.ndarray
    ) -> None:
        """Copy the ranges `[starts[i], starts[i] + lengths[i])` of `owner`'s content into
        `out` at `out_starts[i]`, without caching what comes from the log (a stream's
        prefetch reads a range once, then drops it).

        Ranges in blocks cached in DRAM are copied from there. In a block that many ranges
        touch, one span covering them is read; other ranges are read one by one, straight
        into `out`, with many in flight. Log reads skip the record checks (parts of a record
        are read): the caller checks its ranges. Holes stay as they are in `out` (zeros).
        One worker-thread trip for the whole gather.
        """
        bb = self.block_bytes
        pieces: list[tuple[int, int, int, int]] = []  # block number, inner offset, length, out position
        first = starts // bb
        whole = (first == (starts + lengths - 1) // bb) | (lengths == 0)
        for number, inner, length, at in zip(
            first[whole].tolist(),
            (starts[whole] - first[whole] * bb).tolist(),
            lengths[whole].tolist(),
            out_starts[whole].tolist(),
            strict=True,
        ):
            if length:
                pieces.append((number, inner, length, at))
        for start, length, at in zip(
            starts[~whole].tolist(), lengths[~whole].tolist(), out_starts[~whole].tolist(), strict=True
        ):
            while length:  # a range across block boundaries: one piece per block
                take = min(length, bb - start % bb)
                pieces.append((start // bb, start % bb, take, at))
                start, length, at = start + take, length - take, at + take
        by_block: dict[int, list[tuple[int, int, int, int]]] = {}
        for piece in pieces:
            by_block.setdefault(piece[0], []).append(piece)
        view = memoryview(out)
        copies: list[tuple[bytearray | memoryview | bytes, int, int, int]] = []
        parts: list[tuple[LogLocation, int, memoryview]] = []
        spans: list[tuple[int, bytearray, list[tuple[int, int, int, int]]]] = []  # span start, buffer, pieces
        part_pieces: list[list[tuple[int, int, int, int]]] = []  # what each part serves, for retries
        for number, wanted in by_block.items():
            key = BlockKey(owner, number)
            block = self._dram.peek(key)
            if block is not None:
                copies.extend((block.buf, inner, length, at) for _n, inner, length, at in wanted)
                self._gathered_dram_bytes += sum(p[2] for p in wanted)
                continue
            location = self._index.get(key)
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
                    _n, inner, length, at = piece
                    parts.append((location, inner, view[at : at + length]))
                    part_pieces.append([piece])
                self._gathered_parts += len(wanted)
        order = sorted(range(len(parts)), key=lambda i: (parts[i][0].segment, parts[i][0].offset + parts[i][1]))

        def work() -> list[int]:
            for buf, inner, length, at in copies:
                view[at : at + length] = memoryview(buf)[inner : inner + length]
            gone = [order[i] for i in self._log.read_parts([parts[i] for i in order])]
            for low, buf, wanted in spans:
                for _n, inner, length, at in wanted:
                    view[at : at + length] = memoryview(buf)[inner - low : inner - low + length]
            return gone

        gone = await trio.to_thread.run_sync(work, limiter=self._io_limiter)
        for i in gone:  # moved by compaction meanwhile: through the index, as any read
            for number, inner, length, at in part_pieces[i]:
                block = await self.get(BlockKey(owner, number))
                if block is not None:
                    view[at : at + length] = memoryview(block.buf)[inner : inner + length]
