"""Compaction: reclaim log space that overwrites and deletes left dead.

The role of the block tier that keeps the log from growing without bound: sealed segments
whose live share fell far enough have their live records copied to the end of the log,
then are deleted. A FIFO buffer's oldest items die in log order, so most segments die
whole and are dropped without a copy. A mixin of BlockStore (tiers/blocks.py).
"""

from __future__ import annotations

import logging

import trio

from distorefs.errors import StoreFull
from distorefs.tiers.writeback import WriteBack, survive
from distorefs.types import BlockKey, LogLocation

log = logging.getLogger(__name__)


class Compaction(WriteBack):
    """Choosing, copying and dropping sparse segments (mixed into BlockStore)."""

    _compacted_segments: int
    _reclaimed_bytes: int
    _moved_bytes: int  # live bytes compaction had to copy
    _seg_live_seen: dict[int, int]  # live bytes per segment at the last pass

    async def run_compactor(self, interval_s: float = 5.0, min_dead_ratio: float = 0.5) -> None:
        """Background task: compact sealed segments whose dead share reached `min_dead_ratio`,
        then hold the compaction reserve again where there is room for it."""
        while True:
            await trio.sleep(interval_s)
            async with survive("compactor"):
                await self.compact(min_dead_ratio)
            async with survive("compaction reserve"):
                await trio.to_thread.run_sync(self._log.hold_reserve, limiter=self._io_limiter)

    async def _use_reserve(self, why: str) -> None:
        released = await trio.to_thread.run_sync(self._log.release_reserve, limiter=self._io_limiter)
        if released:
            log.warning("compaction: %s; using the %d-byte reserve", why, released)

    def _compaction_victims(self, min_dead_ratio: float) -> list[int]:
        """Sealed segments to compact: fully dead ones at once; sparse ones only once their
        live bytes stopped shrinking since the last pass. A segment still dying (a FIFO
        buffer evicting in log order) is left to die whole, so it is dropped, not copied."""
        active = self._log.active_segment
        held = self.notes_hold()  # notes a start-up would replay lie from this segment on
        victims = []
        seen = self._seg_live_seen
        self._seg_live_seen = {}
        for segment, size in self._log.segment_sizes().items():
            if segment == active or (held is not None and segment >= held):
                continue
            live = self._index.live_bytes(segment)
            self._seg_live_seen[segment] = live
            if size == 0 or live == 0:
                victims.append(segment)
            elif live <= size * (1.0 - min_dead_ratio) and seen.get(segment) == live:
                victims.append(segment)
        return sorted(victims)

    def _move_record(self, key: BlockKey, location: LogLocation) -> LogLocation:
        """Copy one record to the end of the log (in a worker thread: one trip per record)."""
        return self._log.append(key, self._log.read(location, key))

    async def compact(self, min_dead_ratio: float = 0.5) -> int:
        """Move the live records out of sparse sealed segments and delete those segments.

        Returns the bytes of log reclaimed. Reads and writes go on meanwhile: each record
        moves with one read and one append, and its index entry moves only if nobody
        changed the block in between.
        """
        victims = self._compaction_victims(min_dead_ratio)
        if not victims:
            return 0
        copying = sum(self._index.live_bytes(segment) for segment in victims)
        if copying and await trio.to_thread.run_sync(self._log.free_bytes) < copying + (1 << 20):
            await self._use_reserve(f"the disk has no room to copy {copying} live bytes")
        for segment in victims:
            if not self._index.live_bytes(segment):
                continue  # nothing to move: the segment goes below
            records = await trio.to_thread.run_sync(self._log.segment_records, segment, limiter=self._io_limiter)
            for key, found in records:
                location = self._index.get(key)
                if location != found:
                    continue  # dead: the block has a newer record, or none
                cached = self._dram.peek(key)
                if cached is not None and cached.dirty:
                    continue  # the flusher will write it elsewhere anyway
                moved = await trio.to_thread.run_sync(self._move_record, key, location, limiter=self._io_limiter)
                if self._index.get(key) == location:
                    self._set_location(key, moved)
                    self._moved_bytes += moved.length
        try:
            await self.flush()  # dirty blocks skipped above move out of the victims
        except StoreFull:
            log.info("compaction: the disk is full for dirty blocks; dropping what is dead")
        try:
            await self.commit(durable=True)  # nothing durable may point into a segment deleted below
        except StoreFull:
            await self._use_reserve("the metadata commit found the disk full")
            await self.commit(durable=True)
        reclaimed = 0
        sizes = self._log.segment_sizes()
        for segment in victims:
            if self._index.live_bytes(segment) == 0 and segment in sizes:
                await trio.to_thread.run_sync(self._log.delete_segment, segment, limiter=self._io_limiter)
                self._index.forget_segment(segment)
                reclaimed += sizes[segment]
                self._compacted_segments += 1
        self._reclaimed_bytes += reclaimed
        if reclaimed:
            log.info("compaction: reclaimed %d bytes from %d segments", reclaimed, len(victims))
        return reclaimed
