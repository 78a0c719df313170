"""BlockStore: blocks named by BlockKey, held in DRAM over the segment log.

Owns the blocks themselves: the DRAM cache of them, the index of their newest log
records (tiers/block_index.py), reading a block (DRAM, then the remote memory tier,
then the log, filling DRAM on the way back), writing one into DRAM, deleting one, and
the prefetcher. Its other roles have a module each, mixed in here:

    tiers/byte_ranges.py   byte ranges of an owner's content, and gather
    tiers/writeback.py     flush, persist, commit, the flusher and the syncer
    tiers/compaction.py    reclaiming dead log space, the compactor (built on write-back)

In cluster mode it also consults the remote memory tier (tiers/remote_memory.py, given
at construction): clean blocks of the owners a store marked with `spill` are offered to
it when DRAM evicts them, and looked for there before the log when a read misses DRAM.

It knows nothing about files: a store above gives each block a key and reads or writes
byte ranges inside it. What must stay atomic between awaits is listed in
docs/concurrency.md.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import trio

from distorefs import scheduling
from distorefs.errors import OutOfMemory
from distorefs.tiers.block_index import BlockIndex
from distorefs.tiers.byte_ranges import ByteRanges
from distorefs.tiers.compaction import Compaction
from distorefs.tiers.dram import Block, DramCache, capacity_for
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import LogPosition, NvmeLog
from distorefs.tiers.remote_memory import RemoteMemory
from distorefs.types import BlockKey, LogLocation

log = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 1024 * 1024
PREFETCH_QUEUE = 256
PREFETCH_CONCURRENCY = 8
READ_PIECE_BYTES = 8 * 1024 * 1024  # what one I/O thread reads of a big get_many


@dataclass(frozen=True)
class BlockStatistics:
    dram_budget_bytes: int
    dram_used_bytes: int
    dram_dirty_bytes: int
    dram_blocks: int
    dram_hits: int
    dram_misses: int
    dram_evictions: int
    dram_transient_bytes: int  # blocks one-pass readers had loaded, kept briefly (tiers/dram.py)
    dram_reused_buffers: int  # new blocks and loads given a reused buffer instead of fresh memory
    dram_spare_bytes: int  # of dram_used_bytes: block buffers kept for reuse (tiers/dram.py)
    log_bytes: int
    log_live_bytes: int
    log_segments: int
    log_live_ratio: float
    flushed_bytes: int
    log_direct_write_bytes: int  # appended with O_DIRECT (docs/design.md, "Big log writes bypass the page cache")
    log_direct_read_bytes: int  # read with O_DIRECT (docs/design.md, "Big log reads bypass the page cache")
    log_buffer_bytes: int  # the log's aligned buffers for those, kept for reuse (outside the DRAM budget)
    prefetched_blocks: int
    compacted_segments: int
    reclaimed_bytes: int
    moved_bytes: int
    blocks: int
    dram_reserved_bytes: int
    dram_index_bytes: int  # of dram_used_bytes: replay buffers' rings (their per-slot arrays and trees)
    dram_borrowed_bytes: int  # of dram_used_bytes: staged files' memory taken over (BlockStore.adopt)
    gathered_dram_bytes: int
    gathered_log_parts: int
    gathered_log_spans: int
    remote_loaded_blocks: int
    inline_appends: int  # log-only persists written on the event loop (docs/design.md, "Log-only appends")
    notes: int  # notes written since the start (priority updates of replay buffers)
    inline_notes: int  # of them, written on the event loop (the rest went to a thread)
    row_notes: int  # persists (closes) acknowledged by a row note in the log instead of a commit
    written_behind_bytes: int  # full blocks written to the log by the write-behind before their close
    durable_persists: int  # durable persists asked for (fsync, a sync close ...)
    durable_commits: int  # commits that made them durable (fewer where they came together: group commit)
    flush_lag_s: float  # age bound of the oldest write still only in DRAM (0: none)
    durable_lag_s: float  # age bound of the oldest log record not yet fsync'ed (0: none)


class BlockStore(ByteRanges, Compaction):
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
        remote: RemoteMemory | None = None,
    ) -> None:
        if dram.budget_bytes < 4 * block_bytes:
            raise ValueError(f"DRAM budget {dram.budget_bytes} must hold at least 4 blocks of {block_bytes}")
        self._log = log_
        self._dram = dram
        self._meta = meta
        self.block_bytes = block_bytes
        self._io_limiter = trio.CapacityLimiter(io_threads)
        dram.spare_size = block_bytes  # one-pass readers' loads reuse buffers of this size
        self._index = BlockIndex.load(meta)
        self._loading: dict[BlockKey, trio.Event] = {}
        self._prefetch_send, self._prefetch_recv = trio.open_memory_channel[BlockKey](PREFETCH_QUEUE)
        self._prefetch_wanted: set[BlockKey] = set()  # queued for the prefetcher, or loading for it
        self._prefetched = 0
        # write-back (tiers/writeback.py)
        self._dirty = {}
        self._full_dirty = {}
        self._write_behind_wanted = trio.Event()
        self.written_behind_bytes = 0
        self._frozen = {}
        self._flush_lock = trio.Lock()
        self._durable_lock = trio.Lock()
        self._forming = None
        self.durable_persists = 0
        self.durable_commits = 0
        self._checkpointed_at = 0.0  # (the first durable persist checkpoints)
        self._flush_wanted = trio.Event()
        self._room_freed = trio.Event()
        self._flushed_bytes = 0
        self._dirty_since: float | None = None
        self._undurable_since: float | None = None
        self._last_logged = 0.0
        self._rows_unstaged = []
        self._inline_ok = False  # until the dirty watch has looked (run_dirty_watch)
        self.inline_appends = 0
        self.inline_notes = 0
        self.row_notes = 0
        self._tail = {}
        self._notes_lock = trio.Lock()
        self._note_count = 0
        self._note_positions = collections.deque()
        self._notes_marks = []
        self._tail_notes = {}
        # compaction (tiers/compaction.py)
        self._compacted_segments = 0
        self._reclaimed_bytes = 0
        self._moved_bytes = 0
        self._seg_live_seen = {}
        # byte ranges (tiers/byte_ranges.py)
        self._read_end = {}
        self._gathered_dram_bytes = 0
        self._gathered_parts = 0
        self._gathered_spans = 0
        # The remote memory tier (cluster mode with lenders), given at construction: clean
        # blocks of `_spillable` owners evicted from DRAM are copied to peers, and looked
        # for there before the log.
        self._remote = remote
        self._spillable: set[int] = set()
        self._remote_loads = 0
        if remote is not None:
            dram.evicted = self._evicted

    @property
    def dram_budget_bytes(self) -> int:
        return self._dram.budget_bytes

    @property
    def dram_index_bytes(self) -> int:
        """Bytes the replay buffers' rings hold (`reserve(index=True)`)."""
        return self._dram.index_bytes

    @property
    def ring_room_bytes(self) -> int:
        """How many more bytes of ring the buffers may reserve (DramCache.index_room_bytes)."""
        return self._dram.index_room_bytes

    @property
    def dram_reserved_bytes(self) -> int:
        """Bytes that stores hold outside the block cache now (`reserve`)."""
        return self._dram.reserved_bytes

    def watch(self, owner: int, left: Callable[[int], None] | None) -> None:
        """DramCache.watch: `left(number)` for each of `owner`'s blocks that leaves DRAM."""
        self._dram.watch(owner, left)

    def resident(self, key: BlockKey, block: Block) -> bool:
        """Whether `block` is the one DRAM holds for `key` (a block that `get_many` read
        but found no room to keep is not)."""
        return self._dram.peek(key) is block

    def spill(self, owner: int) -> None:
        """Let `owner`'s blocks go to the remote memory tier (buffer items: small and read
        at random; files stay local, their sequential reads prefetch from the log)."""
        self._spillable.add(owner)

    def _evicted(self, key: BlockKey, block: Block) -> None:
        if self._remote is None or key.owner not in self._spillable:
            return
        location = self._index.get(key)
        if location is not None and location.length == block.length and isinstance(block.buf, bytearray):
            self._remote.offer(key, location, block.buf)  # (a borrowed block is a file's: never spilled)

    def remote_bytes(self, owner: int) -> int:
        """Bytes of `owner`'s blocks kept by peers (statistics only)."""
        return 0 if self._remote is None else self._remote.owner_bytes(owner)

    def _set_location(self, key: BlockKey, location: LogLocation, stage: bool = True) -> None:
        self._index.set(key, location, stage)
        self._forget_remote(key)

    def _forget_remote(self, key: BlockKey) -> None:
        """A block's record changed or died: a peer's copy of the old one is useless."""
        if self._remote is not None and key.owner in self._spillable:
            self._remote.forget(key)

    def owner_keys(self, owner: int) -> list[BlockKey]:
        """Keys of `owner` that hold data, in DRAM or in the log (unordered)."""
        indices = self._index.numbers(owner) | self._dirty.get(owner, set())
        return [BlockKey(owner, i) for i in indices]

    def owner_block_count(self, owner: int) -> int:
        """How many of `owner`'s blocks hold data, in the log or dirty in DRAM (no copy)."""
        logged, dirty = self._index.count(owner), self._dirty.get(owner, ())
        return logged + sum(1 for number in dirty if BlockKey(owner, number) not in self._index)

    def owner_lengths(self, owner: int) -> dict[int, int]:
        """Block number -> stored length for `owner`'s blocks in the index (start-up)."""
        return self._index.lengths(owner)

    def log_position(self) -> LogPosition:
        """Where the log's next record goes (every record before it is complete)."""
        return self._log.position()

    def has_block(self, key: BlockKey) -> bool:
        return key in self._index or self._dram.peek(key) is not None

    def owners(self) -> set[int]:
        """Every owner with a block in the index or dirty in DRAM."""
        return self._index.owners() | set(self._dirty)

    def delete_owner(self, owner: int) -> None:
        """Delete all of `owner`'s blocks (a file or a version that is gone)."""
        for key in self.owner_keys(owner):
            self.delete(key)
        self._read_end.pop(owner, None)
        self._spillable.discard(owner)

    def reserve(self, nbytes: int, force: bool = False, index: bool = False) -> bool:
        """Count `nbytes` that a store holds outside the block cache (prefetched records;
        `index`: a replay buffer's ring) against the DRAM budget, evicting clean blocks for
        them; False when they do not fit (unless `force`: DramCache.reserve)."""
        return self._dram.reserve(nbytes, force, index)

    def unreserve(self, nbytes: int, index: bool = False) -> None:
        self._dram.unreserve(nbytes, index)

    def shed_spares(self) -> int:
        """Let idle reusable buffers go (see DramCache.shed_spares); the bytes let go."""
        return self._dram.shed_spares()

    async def get(self, key: BlockKey, transient: bool = False) -> Block | None:
        """Return the block (from DRAM, else loaded from the log), or None for a hole.
        `transient`: a one-pass sequential reader asks, so a block loaded for it is kept
        only briefly, in a reused buffer (tiers/dram.py).

        Raises Corrupted when the log record fails its checks.
        """
        while True:
            block = self._dram.get(key)
            if block is not None:
                return block
            location = self._index.get(key)
            if location is None:
                return None
            loaded = await self._load(key, location, transient)
            if loaded is not None:
                return loaded

    async def get_many(self, keys: list[BlockKey]) -> list[Block | None]:
        """`get` for many keys; the cold ones are read from the log in one thread call.

        Duplicated keys are fine (batches drawn with replacement).
        """
        out = self._dram.get_many(keys)
        if all(block is not None for block in out):  # all in DRAM: the common case of a batch
            await scheduling.checkpoint()
            return out
        cold: dict[BlockKey, LogLocation] = {}
        for key, block in zip(keys, out, strict=True):
            if block is None and key in self._index and key not in self._loading:
                cold[key] = self._index[key]
        if cold:
            with self._loading_keys(cold):
                loaded = await self._read_remote(cold)
                from_log = [(k, loc) for k, loc in cold.items() if k not in loaded]
                if from_log:
                    payloads = await self._read_many(from_log)
                    loaded.update(zip((k for k, _loc in from_log), payloads, strict=True))
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

    async def _read_many(self, records: list[tuple[BlockKey, LogLocation]]) -> list[bytearray]:
        """`NvmeLog.read_many` of `records`, in pieces of about READ_PIECE_BYTES of
        neighbouring records read by several I/O threads at once when there are many (a
        dataset stream loading its blocks whole), else in one trip to a thread."""
        if sum(loc.length for _k, loc in records) <= 2 * READ_PIECE_BYTES:
            return await trio.to_thread.run_sync(self._log.read_many, records, limiter=self._io_limiter)
        order = sorted(range(len(records)), key=lambda i: records[i][1])
        pieces: list[list[int]] = [[]]
        size = 0
        for i in order:
            if size >= READ_PIECE_BYTES:
                pieces.append([])
                size = 0
            pieces[-1].append(i)
            size += records[i][1].length
        out: list[bytearray] = [bytearray()] * len(records)

        async def read(piece: list[int]) -> None:
            got = await trio.to_thread.run_sync(
                self._log.read_many, [records[i] for i in piece], limiter=self._io_limiter
            )
            for i, payload in zip(piece, got, strict=True):
                out[i] = payload

        async with trio.open_nursery() as nursery:
            for piece in pieces:
                nursery.start_soon(read, piece)
        return out

    async def _load(
        self, key: BlockKey, location: LogLocation, transient: bool = False, prefetched: bool = False
    ) -> Block | None:
        """Read a block from the log into DRAM; None when the caller must look again.
        `prefetched`: loaded ahead of its reader (a transient block's read is still to come)."""
        pending = self._loading.get(key)
        if pending is not None:
            await pending.wait()
            return None
        with self._loading_keys([key]):
            payload = (await self._read_remote({key: location})).get(key)
            if payload is None:
                spare = self._dram.take_spare(location.length)
                payload = await trio.to_thread.run_sync(self._log.read, location, key, spare, limiter=self._io_limiter)
        return self._cache_loaded(key, location, payload, transient, reads=0 if prefetched else 1)

    @contextlib.contextmanager
    def _loading_keys(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        """While the body reads `keys` from the log (or a peer), a `get` of any of them
        waits for it instead of reading it again; all are released together, also when
        the read fails."""
        keys = list(keys)
        done = trio.Event()
        for key in keys:
            self._loading[key] = done
        try:
            yield
        finally:
            for key in keys:
                del self._loading[key]
            done.set()

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

    def _cache_loaded(
        self, key: BlockKey, location: LogLocation, payload: bytearray, transient: bool = False, reads: int = 1
    ) -> Block | None:
        """A payload read from `location` came back (into a buffer of at least its length):
        the clean block for it (kept in DRAM when there is room), or None when the key
        changed meanwhile and must be looked up again (written, deleted, moved)."""
        if self._dram.peek(key) is not None or self._index.get(key) != location:
            return None
        block = Block(payload, location.length, dirty=False)
        if self._dram.make_room(block.capacity_bytes):
            self._dram.insert(key, block, transient, reads)
        return block

    def prefetch(self, keys: Iterable[BlockKey]) -> None:
        """Ask the prefetcher to load these blocks from the log; never waits. Keys that are
        cached, holes, already loading, or that do not fit in the queue are skipped."""
        for key in keys:
            if (
                key not in self._prefetch_wanted
                and key in self._index
                and key not in self._loading
                and self._dram.peek(key) is None
            ):
                try:
                    self._prefetch_send.send_nowait(key)
                except trio.WouldBlock:
                    return
                # Queued until its load is done: a sequential reader asks for its next 32
                # blocks at every read, and each key asked for again was hinted and queued
                # again (a tenth of both cores in WILLNEED calls over cached pages).
                self._prefetch_wanted.add(key)

    async def run_prefetcher(self) -> None:
        """Background task: load queued blocks, a few at a time, so sequential readers of
        cold data find the next blocks in DRAM."""
        slots = trio.Semaphore(PREFETCH_CONCURRENCY)

        async def load(run: list[tuple[BlockKey, LogLocation]]) -> None:
            try:
                wanted = [
                    (key, location)
                    for key, location in run
                    if self._index.get(key) == location and self._dram.peek(key) is None and key not in self._loading
                ]
                for _ in wanted:  # (only sequential readers prefetch: the block is theirs, not read yet)
                    self._dram.missed()
                await self._load_run(wanted)
                self._prefetched += len(wanted)
            except Exception as exc:  # best effort: the reader gets the error when it gets there
                log.warning("prefetch of %s failed: %s", [key for key, _loc in run], exc)
            finally:
                for key, _loc in run:
                    self._prefetch_wanted.discard(key)
                slots.release()

        async with trio.open_nursery() as nursery:
            async for key in self._prefetch_recv:
                keys = [key]
                while len(keys) < PREFETCH_QUEUE:
                    try:
                        keys.append(self._prefetch_recv.receive_nowait())
                    except trio.WouldBlock:
                        break
                # One hint for the whole run ahead: the kernel reads it in large requests
                # while the loads below copy block by block out of its page cache (not
                # for the blocks the log reads with O_DIRECT: they go in runs below).
                located = [(k, loc) for k in keys if (loc := self._index.get(k)) is not None]
                hinted = [loc for _k, loc in located if not self._log.reads_directly(loc)]
                if len(hinted) > 1:
                    nursery.start_soon(self._hint, hinted)
                for k in keys:
                    if self._index.get(k) is None:
                        self._prefetch_wanted.discard(k)  # a hole now, or gone: nothing to load
                for run in self._log.runs(located):
                    await slots.acquire()
                    nursery.start_soon(load, run)

    async def _load_run(self, records: list[tuple[BlockKey, LogLocation]]) -> None:
        """Prefetch the blocks of a run of neighbouring log records (`NvmeLog.runs`) into
        DRAM with one read (`NvmeLog.read_run`), as transient blocks not read yet."""
        if not records:
            return
        if len(records) == 1 or self._remote is not None:
            for key, location in records:
                await self._load(key, location, transient=True, prefetched=True)
            return
        with self._loading_keys([key for key, _location in records]):
            spares = [self._dram.take_spare(location.length) for _key, location in records]
            payloads = await trio.to_thread.run_sync(self._log.read_run, records, spares, limiter=self._io_limiter)
        for (key, location), payload in zip(records, payloads, strict=True):
            self._cache_loaded(key, location, payload, transient=True, reads=0)

    async def _hint(self, locations: list[LogLocation]) -> None:
        try:
            await trio.to_thread.run_sync(self._log.will_need, locations)
        except OSError as exc:  # a hint: the loads read the blocks anyway
            log.debug("read-ahead hint failed: %s", exc)

    async def write(self, key: BlockKey, offset: int, data: bytes | memoryview) -> None:
        """Copy `data` into the block at `offset` (zero-filling any gap); the block turns dirty.

        Waits while DRAM is full of dirty blocks until the flusher has made room.
        """
        end = offset + len(data)
        if end > self.block_bytes:
            raise ValueError(f"write to {key} ends at {end}, past the block size {self.block_bytes}")
        block = await self._writable(key, end)
        buf = block.buf
        assert isinstance(buf, bytearray)  # _writable gave it a buffer of its own
        if offset > block.length:
            buf[block.length : offset] = bytes(offset - block.length)
        buf[offset:end] = data
        if end > block.length:
            block.length = end
        self._mark_dirty(key, block)

    async def write_whole(self, key: BlockKey, data: bytes) -> None:
        """A write that replaces the whole block with `data` (a 1 MiB write at a block's
        start, as FUSE hands it over): `data` itself becomes the block's buffer, with no
        copy and nothing read from the log first; the block turns dirty. Its first
        partial change copies it (`bytes` cannot change)."""
        if len(data) != self.block_bytes:
            raise ValueError(f"write_whole of {len(data)} bytes to {key}: a block is {self.block_bytes}")
        await self._replace(key, Block(data, len(data), dirty=False))

    async def put(self, key: BlockKey, data: bytes | bytearray | memoryview) -> None:
        """Replace the block's whole content with `data` (any size up to the log's record
        limit: buffer items, not file blocks). The block turns dirty. A bytearray is taken
        over as the block's buffer (the caller must not change it afterwards); anything
        else is copied."""
        buf = data if isinstance(data, bytearray) else bytearray(data)
        await self._replace(key, Block(buf, len(buf), dirty=False))

    def put_logged(self, keys: Sequence[BlockKey], datas: Sequence[bytes | bytearray | memoryview]) -> bool:
        """`put` each of `datas` under its key and write their records to the log now, on
        the event loop, with one pwritev: the blocks arrive clean with their rows staged,
        *logged* when this returns (the log-only contract: a start-up adopts the records
        a commit did not carry, docs/design.md "Log-only appends"). For small appends
        only, under the conditions of `_inline_room` (the kernel's dirty pages low, no
        flush in flight, at most INLINE_APPEND_BYTES), with room in DRAM without waiting
        and the log free, its active segment not full. False, with nothing put and
        nothing written, when they do not hold: then `put` them and persist as usual.
        Skips the dirty-block bookkeeping that an append written right after its put
        would undo at once."""
        total = sum(data.nbytes if isinstance(data, memoryview) else len(data) for data in datas)
        if not self._inline_room(total) or not self._dram.make_room(total):
            return False
        buffers = [data if isinstance(data, bytearray) else bytearray(data) for data in datas]
        views = [memoryview(buf) for buf in buffers]
        try:
            locations = self._log.try_append_now(list(zip(keys, views, strict=True)))
        finally:
            for view in views:
                view.release()
        if locations is None:
            return False
        for key, buf, location in zip(keys, buffers, locations, strict=True):
            self._uncache(key)
            self._dram.insert(key, Block(buf, len(buf), dirty=False))
            self._set_location(key, location)
            self._flushed_bytes += location.length
        self._logged()
        self.inline_appends += 1
        self._flush_wanted_for_rows()
        return True

    async def _replace(self, key: BlockKey, block: Block) -> None:
        """`block` (new, clean) becomes `key`'s block in DRAM, dirty, whatever was there."""
        while not self._dram.make_room(block.capacity_bytes):
            await self._wait_for_room()
        self._uncache(key)
        self._dram.insert(key, block)
        self._mark_dirty(key, block)

    async def adopt(self, owner: int, view: memoryview) -> None:
        """Make `view` the whole content of `owner` (which has no blocks) without copying
        it: each block's buffer is a read-only slice of `view` (a *borrowed* block),
        dirty until the log has it. The caller must never change the memory behind
        `view` (a sealed memfd). OutOfMemory when it does not fit in the DRAM budget
        (after one wait for the flusher to make room)."""
        size = len(view)
        if self.owner_keys(owner):
            raise ValueError(f"adopt: owner {owner} still has blocks")
        await self.make_room_for(size)
        bb = self.block_bytes
        for number, start in enumerate(range(0, size, bb)):
            part = view[start : start + bb]
            key = BlockKey(owner, number)
            block = Block(part, len(part), dirty=False)
            self._dram.insert(key, block)
            self._mark_dirty(key, block)

    async def make_room_for(self, size: int) -> None:
        """Evict clean blocks until `size` more bytes fit in the DRAM budget, after one
        wait for the flusher when dirty blocks are in the way; OutOfMemory, with nothing
        held for the caller, when they still do not fit."""
        self.check_room(size)
        for attempt in range(2):
            if self._dram.make_room(size):
                return
            if attempt or not self._dram.dirty_bytes:
                break
            await self._wait_for_room()
        raise self._no_room(size)

    def check_room(self, size: int) -> None:
        """OutOfMemory when `size` bytes could not fit in the DRAM budget even with every
        block that can go gone (what is reserved outside the LRU stays)."""
        if size > self._dram.budget_bytes - self._dram.reserved_bytes - self._dram.index_bytes:
            raise self._no_room(size)

    def _no_room(self, size: int) -> OutOfMemory:
        return OutOfMemory(
            f"{size} bytes do not fit in the DRAM budget of {self._dram.budget_bytes} bytes "
            f"({self._dram.used_bytes} in use, {self._dram.dirty_bytes} of it not yet in the log)"
        )

    def drop_borrowed(self, owner: int) -> list[Block]:
        """Drop `owner`'s clean borrowed blocks from DRAM (the log has them) and return
        them: the memory they borrow goes back to the system when the last reference to
        it goes, which unmaps it (0.2 s per GiB here), so let them go in a worker thread."""
        dropped = []
        for key in self.owner_keys(owner):
            block = self._dram.peek(key)
            if block is not None and block.borrowed and not block.dirty and id(block) not in self._frozen:
                self._dram.remove(key)
                dropped.append(block)
        return dropped

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
        if self._index.delete(key) is not None:
            self._forget_remote(key)

    def _uncache(self, key: BlockKey) -> None:
        """Drop the block from DRAM, dirty or not (its index entry stays)."""
        block = self._dram.remove(key)
        if block is not None:
            if block.dirty:
                self._unmark_dirty(key)
            self._dram.recycle(block)

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
            # A flush writing the old buffer from a thread, or a borrowed (read-only) buffer:
            # the change goes to a copy.
            frozen = block is not None and (id(block) in self._frozen or not block.writable)
            need = want if frozen else max(0, want - have)
            capacity = max(want, have)  # of a new buffer, when one is needed
            if need and not self._dram.room_for_buffer(capacity, need):
                await self._wait_for_room()
                continue
            break
        if block is None:
            block = Block(self._new_buffer(want), 0, dirty=False)
            self._dram.insert(key, block)
        elif frozen or want > have:
            # A flush is writing the old buffer from a thread (or it is too small): copy.
            buf = self._new_buffer(capacity)
            buf[: block.length] = memoryview(block.buf)[: block.length]
            self._dram.replace_buffer(key, block, buf)
        return block

    def _new_buffer(self, capacity: int) -> bytearray:
        """A buffer for a new or copied block, room made for it: a spare when one of that
        size is kept (its bytes past the block's length are another block's, and nothing
        reads there), else new zeroed memory."""
        spare = self._dram.take_spare(capacity)
        return bytearray(capacity) if spare is None else spare

    async def close(self) -> None:
        """Flush everything, commit durably and close the log (clean unmount)."""
        await self.flush()
        await self.commit(durable=True)
        await trio.to_thread.run_sync(self._log.close)

    def disk_stats(self) -> os.statvfs_result:
        """The statvfs of the log's disk (one syscall on a held descriptor)."""
        return self._log.disk_stats()

    def disk_free_bytes(self) -> int:
        """Bytes the log's disk has free (a statvfs: call it from a thread)."""
        return self._log.free_bytes()

    @property
    def logged_directly(self) -> bool:
        """Whether big appends have gone to the log with O_DIRECT (their crcs and staging
        copies run compiled once the kernels are loaded: daemon.load_kernels_when_idle)."""
        return self._log.direct_bytes > 0

    def statistics(self) -> BlockStatistics:
        dram = self._dram.statistics()
        log_bytes = sum(self._log.segment_sizes().values())
        live = self._index.live_total()
        return BlockStatistics(
            dram_budget_bytes=dram.budget_bytes,
            dram_used_bytes=dram.used_bytes,
            dram_dirty_bytes=dram.dirty_bytes,
            dram_blocks=dram.blocks,
            dram_hits=dram.hits,
            dram_misses=dram.misses,
            dram_evictions=dram.evictions,
            dram_transient_bytes=dram.transient_bytes,
            dram_reused_buffers=dram.reused_buffers,
            dram_spare_bytes=dram.spare_bytes,
            log_bytes=log_bytes,
            log_live_bytes=live,
            log_segments=len(self._log.segment_sizes()),
            log_live_ratio=(live / log_bytes) if log_bytes else 1.0,
            flushed_bytes=self._flushed_bytes,
            log_direct_write_bytes=self._log.direct_bytes,
            log_direct_read_bytes=self._log.direct_read_bytes,
            log_buffer_bytes=self._log.buffer_bytes,
            prefetched_blocks=self._prefetched,
            compacted_segments=self._compacted_segments,
            reclaimed_bytes=self._reclaimed_bytes,
            moved_bytes=self._moved_bytes,
            blocks=len(self._index),
            dram_reserved_bytes=dram.reserved_bytes,
            dram_index_bytes=dram.index_bytes,
            dram_borrowed_bytes=dram.borrowed_bytes,
            gathered_dram_bytes=self._gathered_dram_bytes,
            gathered_log_parts=self._gathered_parts,
            gathered_log_spans=self._gathered_spans,
            remote_loaded_blocks=self._remote_loads,
            inline_appends=self.inline_appends,
            notes=self._note_count,
            inline_notes=self.inline_notes,
            row_notes=self.row_notes,
            written_behind_bytes=self.written_behind_bytes,
            durable_persists=self.durable_persists,
            durable_commits=self.durable_commits,
            **self.lags(),
        )
