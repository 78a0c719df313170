"""BlockStore: blocks named by BlockKey, written back from DRAM to the segment log.

Owns the block index (key -> LogLocation), its persistence in MetaDb's `blocks` table,
per-segment live-byte accounting, and the three background tasks that `daemon.py` starts:
the flusher (dirty DRAM blocks -> log), the syncer (periodic durable commit) and the
compactor (rewrite live records of sparse segments, then drop those segments).

In cluster mode it also consults the remote memory tier (tiers/remote_memory.py): clean
blocks of the owners a store marked with `spill` are offered to it when DRAM evicts them,
and looked for there before the log when a read misses DRAM.

It knows nothing about files: a store above gives each block a key and reads or writes
byte ranges inside it. What must stay atomic between awaits is listed in
docs/concurrency.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import numpy as np
import trio

from distorefs.errors import DistorefsError, InvalidArgument, StoreFull
from distorefs.tiers.dram import Block, DramCache, capacity_for
from distorefs.tiers.metadb import Changes, MetaDb
from distorefs.tiers.nvme_log import HEADER, NvmeLog
from distorefs.tiers.remote_memory import RemoteMemory
from distorefs.types import BlockKey, LogLocation

log = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 1024 * 1024
FLUSH_BATCH_BYTES = 16 * 1024 * 1024
PREFETCH_QUEUE = 256
PREFETCH_CONCURRENCY = 8
PREFETCH_BLOCKS = 32  # how far a sequential reader's next blocks are loaded ahead
# gather reads a block whole when this many of its ranges are wanted (or half its bytes):
# on this disk one random 1 MiB read costs about as much as 32 random 10 KB reads.
DENSE_PARTS = 32


def _record_bytes(location: LogLocation) -> int:
    return HEADER.size + location.length


@dataclass(frozen=True)
class BlockStatistics:
    dram_budget_bytes: int
    dram_used_bytes: int
    dram_dirty_bytes: int
    dram_blocks: int
    dram_hits: int
    dram_misses: int
    dram_evictions: int
    log_bytes: int
    log_live_bytes: int
    log_segments: int
    log_live_ratio: float
    flushed_bytes: int
    prefetched_blocks: int
    compacted_segments: int
    reclaimed_bytes: int
    moved_bytes: int
    blocks: int
    dram_reserved_bytes: int
    gathered_dram_bytes: int
    gathered_log_parts: int
    gathered_log_spans: int
    remote_loaded_blocks: int


class BlockStore:
    """Blocks in DRAM over the segment log, with write-back.

    Examples:
        >>> blocks = BlockStore(NvmeLog.open(d), DramCache(512 << 20), MetaDb.open(db))
        >>> await blocks.write(BlockKey(7, 0), 0, b"abc")   # in DRAM, dirty
        >>> await blocks.flush(owner=7)                      # in the log (OS page cache)
        >>> await blocks.commit(durable=True)                # on the device
    """

    def __init__(
        self,
        log_: NvmeLog,
        dram: DramCache,
        meta: MetaDb,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        io_threads: int = 8,
    ) -> None:
        if dram.budget_bytes < 4 * block_bytes:
            raise ValueError(f"DRAM budget {dram.budget_bytes} must hold at least 4 blocks of {block_bytes}")
        self._log = log_
        self._dram = dram
        self._meta = meta
        self.block_bytes = block_bytes
        self._io_limiter = trio.CapacityLimiter(io_threads)
        self._index: dict[BlockKey, LogLocation] = {}
        self._seg_live: dict[int, int] = {}
        self._seg_keys: dict[int, set[BlockKey]] = {}
        self._owned: dict[int, set[int]] = {}  # owner -> indices present in the index
        self._dirty: dict[int, set[int]] = {}
        self._loading: dict[BlockKey, trio.Event] = {}
        self._frozen: dict[int, int] = {}  # id(block) -> flushes in flight reading its buffer
        self._flush_lock = trio.Lock()
        self._flush_wanted = trio.Event()
        self._room_freed = trio.Event()
        self._flushed_bytes = 0
        self._prefetch_send, self._prefetch_recv = trio.open_memory_channel[BlockKey](PREFETCH_QUEUE)
        self._prefetched = 0
        self._compacted_segments = 0
        self._reclaimed_bytes = 0
        self._moved_bytes = 0  # live bytes compaction had to copy
        self._seg_live_seen: dict[int, int] = {}  # live bytes per segment at the last pass
        self._read_end: dict[int, int] = {}  # owner -> where its last read_range ended
        self._gathered_dram_bytes = 0
        self._gathered_parts = 0
        self._gathered_spans = 0
        # The remote memory tier (cluster mode with lenders): clean blocks of `_spillable`
        # owners evicted from DRAM are copied to peers, and looked for there before the log.
        self._remote: RemoteMemory | None = None
        self._spillable: set[int] = set()
        self._remote_loads = 0
        for owner, index, segment, offset, length in meta.rows("blocks"):
            self._add_location(BlockKey(owner, index), LogLocation(segment, offset, length))

    # --- the remote memory tier ---------------------------------------------------------

    def attach_remote(self, remote: RemoteMemory) -> None:
        """Spill evicted clean blocks of spillable owners to `remote`, and read them back."""
        self._remote = remote
        self._dram.evicted = self._evicted

    def spill(self, owner: int) -> None:
        """Let `owner`'s blocks go to the remote memory tier (buffer items: small and read
        at random; files stay local, their sequential reads prefetch from the log)."""
        self._spillable.add(owner)

    def _evicted(self, key: BlockKey, block: Block) -> None:
        if self._remote is None or key.owner not in self._spillable:
            return
        location = self._index.get(key)
        if location is not None and location.length == block.length:
            self._remote.offer(key, location, block.buf)

    def remote_bytes(self, owner: int) -> int:
        """Bytes of `owner`'s blocks kept by peers (statistics only)."""
        return 0 if self._remote is None else self._remote.owner_bytes(owner)

    # --- index bookkeeping (sync) -----------------------------------------------------

    def _add_location(self, key: BlockKey, location: LogLocation) -> None:
        self._index[key] = location
        self._seg_live[location.segment] = self._seg_live.get(location.segment, 0) + _record_bytes(location)
        self._seg_keys.setdefault(location.segment, set()).add(key)
        self._owned.setdefault(key.owner, set()).add(key.number)

    def _drop_location(self, key: BlockKey) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            if self._remote is not None and key.owner in self._spillable:
                self._remote.forget(key)
            self._seg_live[old.segment] -= _record_bytes(old)
            self._seg_keys[old.segment].discard(key)
            owned = self._owned[key.owner]
            owned.discard(key.number)
            if not owned:
                del self._owned[key.owner]

    def _set_location(self, key: BlockKey, location: LogLocation, stage: bool = True) -> None:
        self._drop_location(key)
        self._add_location(key, location)
        if stage:
            self._meta.put("blocks", tuple(key), tuple(location))

    def owner_keys(self, owner: int) -> list[BlockKey]:
        """Keys of `owner` that hold data, in DRAM or in the log (unordered)."""
        indices = self._owned.get(owner, set()) | self._dirty.get(owner, set())
        return [BlockKey(owner, i) for i in indices]

    def owner_lengths(self, owner: int) -> dict[int, int]:
        """Block number -> stored length for `owner`'s blocks in the index (start-up)."""
        return {n: self._index[BlockKey(owner, n)].length for n in self._owned.get(owner, ())}

    def has_block(self, key: BlockKey) -> bool:
        return key in self._index or self._dram.peek(key) is not None

    def owners(self) -> set[int]:
        """Every owner with a block in the index or dirty in DRAM."""
        return set(self._owned) | set(self._dirty)

    def delete_owner(self, owner: int) -> None:
        """Delete all of `owner`'s blocks (a file or a version that is gone)."""
        for key in self.owner_keys(owner):
            self.delete(key)
        self._read_end.pop(owner, None)
        self._spillable.discard(owner)

    def owner_dirty_bytes(self, owner: int) -> int:
        """Bytes of `owner` in DRAM that the log does not have yet."""
        total = 0
        for number in self._dirty.get(owner, ()):
            block = self._dram.peek(BlockKey(owner, number))
            if block is not None:
                total += block.length
        return total

    # --- byte ranges over an owner's fixed-size blocks ---------------------------------

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
        if self._read_end.get(owner) == offset:
            ahead = min(last + 1 + PREFETCH_BLOCKS, -(-length // bb))
            self.prefetch(BlockKey(owner, i) for i in range(last + 1, ahead))
        self._read_end[owner] = offset + size
        if first == last:
            block = await self.get(BlockKey(owner, first))
            inner = offset - first * bb
            if block is not None and inner + size <= block.length:
                return memoryview(block.buf)[inner : inner + size]
        out = bytearray(size)
        for index in range(first, last + 1):
            block = await self.get(BlockKey(owner, index))
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
        view = memoryview(data)
        bb = self.block_bytes
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
        copies: list[tuple[bytearray, int, int, int]] = []
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

    def reserve(self, nbytes: int) -> bool:
        """Count `nbytes` that a store holds outside the block cache (prefetched records)
        against the DRAM budget, evicting clean blocks for them; False when they do not fit."""
        return self._dram.reserve(nbytes)

    def unreserve(self, nbytes: int) -> None:
        self._dram.unreserve(nbytes)

    # --- reading ----------------------------------------------------------------------

    async def get(self, key: BlockKey) -> Block | None:
        """Return the block (from DRAM, else loaded from the log), or None for a hole.

        Raises Corrupted when the log record fails its checks.
        """
        while True:
            block = self._dram.get(key)
            if block is not None:
                return block
            location = self._index.get(key)
            if location is None:
                return None
            loaded = await self._load(key, location)
            if loaded is not None:
                return loaded

    async def get_many(self, keys: list[BlockKey]) -> list[Block | None]:
        """`get` for many keys; the cold ones are read from the log in one thread call.

        Duplicated keys are fine (batches drawn with replacement).
        """
        out: list[Block | None] = [self._dram.get(k) for k in keys]
        cold: dict[BlockKey, LogLocation] = {}
        for key, block in zip(keys, out, strict=True):
            if block is None and key in self._index and key not in self._loading:
                cold[key] = self._index[key]
        if cold:
            done = trio.Event()
            for key in cold:
                self._loading[key] = done
            try:
                loaded = await self._read_remote(cold)
                from_log = [(k, loc) for k, loc in cold.items() if k not in loaded]
                if from_log:
                    payloads = await trio.to_thread.run_sync(self._log.read_many, from_log, limiter=self._io_limiter)
                    loaded.update(zip((k for k, _loc in from_log), payloads, strict=True))
            finally:
                for key in cold:
                    del self._loading[key]
                done.set()
            positions: dict[BlockKey, list[int]] = {}
            for i, key in enumerate(keys):
                positions.setdefault(key, []).append(i)
            for key, location in cold.items():
                block = self._cache_loaded(key, location, loaded[key])
                if block is not None:
                    for i in positions[key]:
                        out[i] = block
        for i, key in enumerate(keys):
            if out[i] is None and key in self._index:
                out[i] = await self.get(key)  # was loading elsewhere, or changed meanwhile
        return out

    async def _load(self, key: BlockKey, location: LogLocation) -> Block | None:
        """Read a block from the log into DRAM; None when the caller must look again."""
        pending = self._loading.get(key)
        if pending is not None:
            await pending.wait()
            return None
        done = self._loading[key] = trio.Event()
        try:
            payload = (await self._read_remote({key: location})).get(key)
            if payload is None:
                payload = await trio.to_thread.run_sync(self._log.read, location, key, limiter=self._io_limiter)
        finally:
            del self._loading[key]
            done.set()
        return self._cache_loaded(key, location, payload)

    async def _read_remote(self, cold: dict[BlockKey, LogLocation]) -> dict[BlockKey, bytearray]:
        """The blocks of `cold` that the remote memory tier has as those records."""
        remote = self._remote
        if remote is None:
            return {}
        wanted = {k: loc for k, loc in cold.items() if remote.has(k, loc)}
        if not wanted:
            return {}
        got = await remote.fetch(wanted)
        self._remote_loads += len(got)
        return got

    def _cache_loaded(self, key: BlockKey, location: LogLocation, payload: bytearray) -> Block | None:
        """A payload read from `location` came back: the clean block for it (kept in DRAM
        when there is room), or None when the key changed meanwhile and must be looked
        up again (written, deleted, moved by compaction)."""
        if self._dram.peek(key) is not None or self._index.get(key) != location:
            return None
        block = Block(payload, len(payload), dirty=False)
        if self._dram.make_room(block.capacity_bytes):
            self._dram.insert(key, block)
        return block

    def prefetch(self, keys: Iterable[BlockKey]) -> None:
        """Ask the prefetcher to load these blocks from the log; never waits. Keys that are
        cached, holes, already loading, or that do not fit in the queue are skipped."""
        for key in keys:
            if key in self._index and key not in self._loading and self._dram.peek(key) is None:
                try:
                    self._prefetch_send.send_nowait(key)
                except trio.WouldBlock:
                    return

    async def run_prefetcher(self) -> None:
        """Background task: load queued blocks, a few at a time, so sequential readers of
        cold data find the next blocks in DRAM."""
        slots = trio.Semaphore(PREFETCH_CONCURRENCY)

        async def load(key: BlockKey) -> None:
            try:
                if self._dram.peek(key) is None and key not in self._loading:
                    await self.get(key)
                    self._prefetched += 1
            except Exception as exc:  # best effort: the reader gets the error when it gets there
                log.warning("prefetch of %s failed: %s", key, exc)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            async for key in self._prefetch_recv:
                await slots.acquire()
                nursery.start_soon(load, key)

    # --- writing ----------------------------------------------------------------------

    async def write(self, key: BlockKey, offset: int, data: bytes | memoryview) -> None:
        """Copy `data` into the block at `offset` (zero-filling any gap); the block turns dirty.

        Waits while DRAM is full of dirty blocks until the flusher has made room.
        """
        end = offset + len(data)
        if end > self.block_bytes:
            raise ValueError(f"write to {key} ends at {end}, past the block size {self.block_bytes}")
        block = await self._writable(key, end)
        if offset > block.length:
            block.buf[block.length : offset] = bytes(offset - block.length)
        block.buf[offset:end] = data
        if end > block.length:
            block.length = end
        self._mark_dirty(key, block)

    async def put(self, key: BlockKey, data: bytes | bytearray | memoryview) -> None:
        """Replace the block's whole content with `data` (any size up to the log's record
        limit: buffer items, not file blocks). The block turns dirty. A bytearray is taken
        over as the block's buffer (the caller must not change it afterwards); anything
        else is copied."""
        size = len(data)
        while not self._dram.make_room(size):
            await self._wait_for_room()
        self._uncache(key)
        block = Block(data if isinstance(data, bytearray) else bytearray(data), size, dirty=False)
        self._dram.insert(key, block)
        self._mark_dirty(key, block)

    def dram_bytes(self, owner: int) -> int:
        """Bytes of `owner`'s blocks in DRAM (walks the cache: for statistics only)."""
        return self._dram.owner_bytes(owner)

    async def truncate(self, key: BlockKey, length: int) -> None:
        """Cut the block to `length` bytes (0 deletes it). Extending is the caller's job."""
        if length == 0:
            self.delete(key)
            return
        if not self.has_block(key):
            return
        block = await self._writable(key, 0)
        if length < block.length:
            block.length = length
            self._mark_dirty(key, block)

    def delete(self, key: BlockKey) -> None:
        """Forget the block in DRAM and in the index; its log record becomes dead."""
        self._uncache(key)
        if key in self._index:
            self._drop_location(key)
            self._meta.delete("blocks", tuple(key))

    def _uncache(self, key: BlockKey) -> None:
        """Drop the block from DRAM, dirty or not (its index entry stays)."""
        block = self._dram.remove(key)
        if block is not None and block.dirty:
            self._unmark_dirty(key)

    async def _writable(self, key: BlockKey, end: int) -> Block:
        """Return the cached block with capacity for `end` bytes and no flush reading it.

        All awaits happen here, before the caller mutates the block.
        """
        block: Block | None = None
        while True:
            block = self._dram.get(key)
            if block is None and key in self._index:
                loaded = await self._load(key, self._index[key])
                if loaded is not None and self._dram.peek(key) is not loaded:
                    await self._wait_for_room()  # read, but DRAM had no room to keep it
                continue
            have = block.capacity_bytes if block is not None else 0
            length = block.length if block is not None else 0
            want = capacity_for(max(end, length), self.block_bytes)
            frozen = block is not None and id(block) in self._frozen
            need = want if frozen else max(0, want - have)
            if need and not self._dram.make_room(need):
                await self._wait_for_room()
                continue
            break
        if block is None:
            block = Block(bytearray(want), 0, dirty=False)
            self._dram.insert(key, block)
        elif frozen or want > have:
            # A flush is writing the old buffer from a thread (or it is too small): copy.
            buf = bytearray(max(want, have))
            buf[: block.length] = memoryview(block.buf)[: block.length]
            self._dram.replace_buffer(block, buf)
        return block

    async def _wait_for_room(self) -> None:
        """DRAM is full of dirty blocks: write them back here (the flusher may be busy or
        absent), so a writer waits at most for one flush, never for a task to wake."""
        if self._dram.dirty_bytes == 0 and not self._frozen:
            raise StoreFull(f"DRAM budget of {self._dram.budget_bytes} bytes cannot hold one more block")
        if self._flush_lock.locked():
            room = self._room_freed
            await room.wait()
        else:
            await self.flush()

    def _mark_dirty(self, key: BlockKey, block: Block) -> None:
        self._dram.mark_dirty(block)
        self._dirty.setdefault(key.owner, set()).add(key.number)
        if self._dram.dirty_bytes > self._dram.budget_bytes // 4:
            self._flush_wanted.set()

    def _unmark_dirty(self, key: BlockKey) -> None:
        indices = self._dirty.get(key.owner)
        if indices is not None:
            indices.discard(key.number)
            if not indices:
                del self._dirty[key.owner]

    # --- flushing and committing --------------------------------------------------------

    @property
    def dirty_bytes(self) -> int:
        return self._dram.dirty_bytes

    async def flush(self, owner: int | None = None, full_only: bool = False) -> None:
        """Write dirty blocks (of `owner`, or all) to the log; they turn clean. `full_only`
        leaves out blocks shorter than `block_bytes` (the tail of a file being written).

        When this returns the data is in the log's write path (it survives a killed daemon);
        `commit` makes the index say where it is.
        """
        async with self._flush_lock:
            if owner is None:
                keys = [BlockKey(o, i) for o, idx in self._dirty.items() for i in sorted(idx)]
            else:
                keys = [BlockKey(owner, i) for i in sorted(self._dirty.get(owner, ()))]
            if full_only:
                keys = [k for k in keys if (b := self._dram.peek(k)) is not None and b.length == self.block_bytes]
            per_batch = max(1, FLUSH_BATCH_BYTES // self.block_bytes)
            try:
                for start in range(0, len(keys), per_batch):
                    await self._flush_batch(keys[start : start + per_batch])
            finally:
                self._wake_room_waiters()

    def _freeze(
        self, keys: Iterable[BlockKey]
    ) -> tuple[list[tuple[BlockKey, Block, int]], list[tuple[BlockKey, memoryview]]]:
        """Take snapshots of the dirty blocks among `keys` for a write from a thread.

        The buffers are not copied: a frozen block is copied by the next writer instead
        (copy on write, in `_writable`), so the thread reads a stable buffer.
        """
        snapshots: list[tuple[BlockKey, Block, int]] = []
        records: list[tuple[BlockKey, memoryview]] = []
        for key in keys:
            block = self._dram.peek(key)
            if block is None or not block.dirty:
                continue
            snapshots.append((key, block, block.version))
            records.append((key, memoryview(block.buf)[: block.length]))
            self._frozen[id(block)] = self._frozen.get(id(block), 0) + 1
        return snapshots, records

    def _thaw(self, snapshots: list[tuple[BlockKey, Block, int]], records: list[tuple[BlockKey, memoryview]]) -> None:
        for _key, block, _version in snapshots:
            left = self._frozen[id(block)] - 1
            if left:
                self._frozen[id(block)] = left
            else:
                del self._frozen[id(block)]
        for record in records:
            record[1].release()

    def _apply_flushed(
        self, snapshots: list[tuple[BlockKey, Block, int]], locations: list[LogLocation], staged: bool
    ) -> None:
        """Point the index at the new records; blocks unchanged since the snapshot turn clean.

        `staged` False means the rows were committed with the records already.
        """
        for (key, block, version), location in zip(snapshots, locations, strict=True):
            self._flushed_bytes += location.length
            if self._dram.peek(key) is not block:
                # Deleted while in flight: the record is dead. If its row went to the
                # database with it, stage the delete.
                if not staged and key not in self._index:
                    self._meta.delete("blocks", tuple(key))
                continue
            self._set_location(key, location, stage=staged)
            if block.version == version:
                self._dram.mark_clean(block)
                self._unmark_dirty(key)

    async def _flush_batch(self, keys: Iterable[BlockKey]) -> None:
        snapshots, records = self._freeze(keys)
        if not records:
            return
        try:
            locations = await trio.to_thread.run_sync(self._log.append_many, records, limiter=self._io_limiter)
        finally:
            self._thaw(snapshots, records)
        self._apply_flushed(snapshots, locations, staged=True)
        self._wake_room_waiters()

    async def persist(self, owner: int, durable: bool = False) -> None:
        """Flush `owner`'s dirty blocks and commit all staged metadata, in one trip to a
        worker thread (close and fsync of a small file pay one hop, not two).

        Not durable: survives a killed daemon. Durable: the log is fsync'ed before the
        metadata commits with synchronous=FULL, so it survives a power loss.
        """
        if not durable and owner not in self._dirty and not self._meta.pending_changes:
            await trio.lowlevel.checkpoint()
            return  # nothing to persist (a read-only close): no trip to a thread
        if len(self._dirty.get(owner, ())) * self.block_bytes > FLUSH_BATCH_BYTES:
            await self.flush(owner)  # big files go in batches first
        async with self._flush_lock:
            snapshots, records = self._freeze(BlockKey(owner, i) for i in sorted(self._dirty.get(owner, ())))
            locations: list[LogLocation] = []

            def append_then_rows() -> Changes:
                locations.extend(self._log.append_many(records) if records else [])
                if durable:
                    self._log.sync()
                return {"blocks": {tuple(r[0]): tuple(loc) for r, loc in zip(records, locations, strict=True)}}

            try:
                await self._meta.commit(durable=durable, before_commit=append_then_rows, checkpoint=durable)
            finally:
                self._thaw(snapshots, records)
            if locations:
                self._apply_flushed(snapshots, locations, staged=False)
                self._wake_room_waiters()

    def _wake_room_waiters(self) -> None:
        self._room_freed.set()
        self._room_freed = trio.Event()

    async def commit(self, durable: bool = False) -> None:
        """Commit staged metadata; `durable` fsyncs the log first, then commits with FULL."""
        if durable:
            await self._meta.commit(durable=True, before_commit=self._log.sync, checkpoint=True)
        else:
            await self._meta.commit()

    async def run_flusher(self, interval_s: float = 1.0) -> None:
        """Background task: flush on memory pressure, and at least every `interval_s`."""
        while True:
            with trio.move_on_after(interval_s):
                await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            if self._dirty:
                async with _survive("flusher"):
                    await self.flush()
                    await self.commit()

    async def run_syncer(self, interval_s: float = 5.0) -> None:
        """Background task: bound what a power loss can take to `interval_s` of closed data."""
        while True:
            await trio.sleep(interval_s)
            if self._meta.pending_changes:
                async with _survive("syncer"):
                    await self.commit(durable=True)

    async def run_compactor(self, interval_s: float = 5.0, min_dead_ratio: float = 0.5) -> None:
        """Background task: compact sealed segments whose dead share reached `min_dead_ratio`."""
        while True:
            await trio.sleep(interval_s)
            async with _survive("compactor"):
                await self.compact(min_dead_ratio)

    # --- compaction ---------------------------------------------------------------------

    def _compaction_victims(self, min_dead_ratio: float) -> list[int]:
        """Sealed segments to compact: fully dead ones at once; sparse ones only once their
        live bytes stopped shrinking since the last pass. A segment still dying (a FIFO
        buffer evicting in log order) is left to die whole, so it is dropped, not copied."""
        active = self._log.active_segment
        victims = []
        seen = self._seg_live_seen
        self._seg_live_seen = {}
        for segment, size in self._log.segment_sizes().items():
            if segment == active:
                continue
            live = self._seg_live.get(segment, 0)
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
        for segment in victims:
            for key in list(self._seg_keys.get(segment, ())):
                location = self._index.get(key)
                if location is None or location.segment != segment:
                    continue
                cached = self._dram.peek(key)
                if cached is not None and cached.dirty:
                    continue  # the flusher will write it elsewhere anyway
                moved = await trio.to_thread.run_sync(self._move_record, key, location, limiter=self._io_limiter)
                if self._index.get(key) == location:
                    self._set_location(key, moved)
                    self._moved_bytes += moved.length
        await self.flush()
        await self.commit(durable=True)
        reclaimed = 0
        sizes = self._log.segment_sizes()
        for segment in victims:
            if self._seg_live.get(segment, 0) == 0 and segment in sizes:
                await trio.to_thread.run_sync(self._log.delete_segment, segment, limiter=self._io_limiter)
                self._seg_live.pop(segment, None)
                self._seg_keys.pop(segment, None)
                reclaimed += sizes[segment]
                self._compacted_segments += 1
        self._reclaimed_bytes += reclaimed
        if reclaimed:
            log.info("compaction: reclaimed %d bytes from %d segments", reclaimed, len(victims))
        return reclaimed

    # --- lifetime and numbers -------------------------------------------------------------

    async def close(self) -> None:
        """Flush everything, commit durably and close the log (clean unmount)."""
        await self.flush()
        await self.commit(durable=True)
        await trio.to_thread.run_sync(self._log.close)

    def statistics(self) -> BlockStatistics:
        dram = self._dram.statistics()
        log_bytes = sum(self._log.segment_sizes().values())
        live = sum(self._seg_live.values())
        return BlockStatistics(
            dram_budget_bytes=dram.budget_bytes,
            dram_used_bytes=dram.used_bytes,
            dram_dirty_bytes=dram.dirty_bytes,
            dram_blocks=dram.blocks,
            dram_hits=dram.hits,
            dram_misses=dram.misses,
            dram_evictions=dram.evictions,
            log_bytes=log_bytes,
            log_live_bytes=live,
            log_segments=len(self._log.segment_sizes()),
            log_live_ratio=(live / log_bytes) if log_bytes else 1.0,
            flushed_bytes=self._flushed_bytes,
            prefetched_blocks=self._prefetched,
            compacted_segments=self._compacted_segments,
            reclaimed_bytes=self._reclaimed_bytes,
            moved_bytes=self._moved_bytes,
            blocks=len(self._index),
            dram_reserved_bytes=dram.reserved_bytes,
            gathered_dram_bytes=self._gathered_dram_bytes,
            gathered_log_parts=self._gathered_parts,
            gathered_log_spans=self._gathered_spans,
            remote_loaded_blocks=self._remote_loads,
        )


@contextlib.asynccontextmanager
async def _survive(task: str) -> AsyncIterator[None]:
    """A background pass that fails (disk full, a bad record) is logged and tried again
    next time; the daemon goes on serving."""
    try:
        yield
    except (DistorefsError, OSError) as exc:
        log.warning("%s: pass failed, will retry: %s", task, exc)


def blocks_for_range(offset: int, size: int, block_bytes: int) -> range:
    """Indices of the blocks that bytes [offset, offset + size) touch."""
    if size <= 0:
        return range(0)
    return range(offset // block_bytes, math.ceil((offset + size) / block_bytes))
