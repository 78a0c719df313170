"""WriteBack: dirty DRAM blocks to the segment log, and metadata commits.

The role of the block tier that moves bytes down the durability stages (docs/design.md,
"Durability words"): a block written into DRAM is *held*; `flush` and `persist` make it
*logged* (its record is in the log's write path, so a killed daemon keeps it once the
index row commits); `commit(durable=True)` makes it *durable* (the log is fsync'ed, then
the metadata commits with synchronous=FULL). Also the two background tasks that bound
how long data stays held or logged: the flusher and the syncer.

A mixin of BlockStore (tiers/blocks.py). Flushes read frozen block buffers from a worker
thread: a writer that meets a frozen block copies it first (copy on write, in
`BlockStore._writable`). What must stay atomic between awaits is in docs/concurrency.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

import trio

from distorefs import scheduling
from distorefs.errors import Corrupted, DistorefsError, StoreFull
from distorefs.ids import ROW_NOTES_OWNER
from distorefs.tiers.block_base import BlockTierBase
from distorefs.tiers.dram import Block
from distorefs.tiers.metadb import Changes, decode_row_note, encode_row_note
from distorefs.tiers.nvme_log import LOG_START, NOTE_NUMBERS, LogPosition
from distorefs.types import BlockKey, LogLocation

log = logging.getLogger(__name__)

# dirty blocks per trip to a worker thread (a flush, a close's big file, a write-behind pass):
# 64 MiB, four of the log's 16 MiB direct writes per trip. With 16 MiB trips a 1 GiB close
# took 0.45-0.56 s, with 64 MiB 0.34-0.44 s (docs/benchmarks.md, "Thirteenth session"):
# each trip also pays the hop to the thread and back and its bookkeeping on the event loop.
FLUSH_BATCH_BYTES = 64 * 1024 * 1024
CHECKPOINT_S = 5.0  # durable persists fold the WAL into the database at most this often
WRITE_BEHIND_BYTES = 8 * 1024 * 1024  # full dirty blocks that start a write-behind pass
WRITE_BEHIND_RETRY_S = 1.0  # after a pass that failed (a full disk)
INLINE_APPEND_BYTES = 256 * 1024  # log-only persists up to this size write on the event loop
DIRTY_WATCH_S = 0.1  # how often the kernel's dirty page count is read (inline appends)
TAIL_ROWS_SOON = 50_000  # staged rows that wake the flusher before its interval
ROW_NOTE_CHANGES = 1024  # a persist notes at most this many staged changes; more are committed
ROW_NOTE_BYTES = 256 * 1024  # and at most this many bytes of them
LOG_MARK_KEY = "log_mark"  # kv: "segment offset", the log records after it are the tail
NOTES_MARK_KEY = "notes_mark"  # kv: "segment offset", notes after it are replayed at start-up


Tail = dict[int, list[tuple[int, LogLocation]]]  # owner -> (block number, location) after the log mark
RowNotes = list[tuple[int, Changes]]  # (tag, changes) of each row note to replay, in log order


def _mark(position: LogPosition) -> str:
    """A log position as the kv table keeps it (`_position` reads it back)."""
    return f"{position.segment} {position.offset}"


def _position(mark: object) -> LogPosition | None:
    """A "segment offset" mark from the kv table (None when there is none)."""
    if mark is None:
        return None
    segment, offset = (int(part) for part in str(mark).split())
    return LogPosition(segment, offset)


def below_dirty_background() -> bool:
    """Whether the kernel's dirty and writeback pages are below its background threshold
    (vm.dirty_background_bytes, or dirty_background_ratio of the dirtyable memory).
    Below it, a buffered write never sleeps in balance_dirty_pages: the kernel throttles
    writers only past the midpoint between this threshold and vm.dirty_ratio. False when
    /proc cannot tell."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip()}
        with open("/proc/sys/vm/dirty_background_bytes", encoding="ascii") as f:
            limit = int(f.read())
        if not limit:
            with open("/proc/sys/vm/dirty_background_ratio", encoding="ascii") as f:
                ratio = int(f.read())
            dirtyable = kib["MemFree"] + kib["Active(file)"] + kib["Inactive(file)"]
            limit = dirtyable * 1024 * ratio // 100
        return (kib["Dirty"] + kib["Writeback"]) * 1024 < limit
    except (OSError, KeyError, ValueError):
        return False


@dataclasses.dataclass(eq=False)
class DurableGroup:
    """Durable persists (fsyncs) that share one commit: those asked for while the commit
    before them was in flight (`WriteBack._persist_durable`)."""

    owners: set[int]
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    began: bool = False  # its commit began: membership closed
    failed: bool = False  # its commit raised (the members persist again, each its own way)


class WriteBack(BlockTierBase):
    """Flushing, persisting and committing (mixed into BlockStore)."""

    _dirty: dict[int, set[int]]  # owner -> numbers of its dirty blocks in DRAM
    _full_dirty: dict[BlockKey, None]  # dirty blocks written full, oldest first (write-behind)
    _write_behind_wanted: trio.Event
    written_behind_bytes: int  # full blocks the write-behind put in the log before their close
    _frozen: dict[int, int]  # id(block) -> flushes in flight reading its buffer
    _flush_lock: trio.Lock
    _flush_wanted: trio.Event
    _room_freed: trio.Event
    _flushed_bytes: int
    _dirty_since: float | None  # no DRAM block has been dirty for longer than since this
    _undurable_since: float | None  # no log record written before this is waiting for fsync
    _last_logged: float  # when the log was last appended to
    _rows_unstaged: list[LogPosition]  # where flushes in flight began appending
    _tail: Tail  # owner -> records after the mark (start-up)
    _inline_ok: bool  # the kernel has room for dirty pages: small log-only appends go inline
    _notes_lock: trio.Lock  # notes reach the log in the order they were appended (FIFO)
    _note_count: int  # notes appended since the start (their record numbers)
    _note_positions: collections.deque[LogPosition]  # notes a start-up may replay, in log order
    _notes_marks: list[tuple[LogPosition, int]]  # staged notes marks and their MetaDb marks
    _tail_notes: dict[int, list[bytes]]  # owner -> its notes after the committed mark (start-up)
    inline_appends: int  # log-only persists written on the event loop (the rest went to a thread)
    inline_notes: int  # notes written on the event loop (the rest went to a thread)
    row_notes: int  # persists acknowledged by a row note instead of a commit
    _durable_lock: trio.Lock  # one durable group's commit at a time
    _forming: DurableGroup | None  # the group the next durable persist joins (its commit not begun)
    durable_persists: int  # durable persists asked for (fsyncs and the like)
    durable_commits: int  # commits that made them durable: fewer, where they came together
    _checkpointed_at: float  # when a durable commit last folded the WAL into the database

    def lags(self) -> dict[str, float]:
        """flush_lag_s and durable_lag_s: bounds of how long the oldest write has waited
        for the log, and the oldest log record for fsync (0 when nothing waits)."""
        now = time.monotonic()
        return {
            "flush_lag_s": 0.0 if self._dirty_since is None else round(now - self._dirty_since, 3),
            "durable_lag_s": 0.0 if self._undurable_since is None else round(now - self._undurable_since, 3),
        }

    def _logged(self) -> None:
        self._last_logged = time.monotonic()
        if self._undurable_since is None:
            self._undurable_since = self._last_logged

    def _synced(self, started: float) -> None:
        """An fsync of the log that began at `started` completed."""
        if self._undurable_since is not None:
            self._undurable_since = None if self._last_logged < started else started

    def owner_dirty_bytes(self, owner: int) -> int:
        """Bytes of `owner` in DRAM that the log does not have yet."""
        total = 0
        for number in self._dirty.get(owner, ()):
            block = self._dram.peek(BlockKey(owner, number))
            if block is not None:
                total += block.length
        return total

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
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()
        self._dram.mark_dirty(block)
        self._dirty.setdefault(key.owner, set()).add(key.number)
        if self._dram.dirty_bytes > self._dram.budget_bytes // 4:
            self._flush_wanted.set()
        if block.length == self.block_bytes and key not in self._full_dirty:
            self._full_dirty[key] = None
            if len(self._full_dirty) * self.block_bytes >= WRITE_BEHIND_BYTES:
                self._write_behind_wanted.set()

    def _unmark_dirty(self, key: BlockKey) -> None:
        self._full_dirty.pop(key, None)
        indices = self._dirty.get(key.owner)
        if indices is not None:
            indices.discard(key.number)
            if not indices:
                del self._dirty[key.owner]
                if not self._dirty:
                    self._dirty_since = None

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
            started = time.monotonic()
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
                if owner is None and not full_only and self._dirty_since is not None:
                    # everything dirty when the pass began is in the log now
                    self._dirty_since = max(self._dirty_since, started)
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
        start = self._log.position()
        self._rows_unstaged.append(start)  # the log mark stays before these records ...
        try:
            try:
                locations = await trio.to_thread.run_sync(self._log.append_many, records, limiter=self._io_limiter)
            finally:
                self._thaw(snapshots, records)
            self._logged()
            self._apply_flushed(snapshots, locations, staged=True)
        finally:
            self._rows_unstaged.remove(start)  # ... until their rows are staged
        self._wake_room_waiters()

    async def persist(self, owner: int, durable: bool = False, log_only: bool = False) -> None:
        """Flush `owner`'s dirty blocks and commit all staged metadata, in one trip to a
        worker thread (close and fsync of a small file pay one hop, not two).

        Not durable: survives a killed daemon. Durable: the log is fsync'ed before the
        metadata commits with synchronous=FULL, so it survives a power loss.

        `log_only` (not durable): write the blocks' records to the log and stage their
        rows, without a commit. The records survive a killed daemon, but their rows
        may not: a store that asks for this must adopt its records from the log's tail
        at start-up (`read_tail`, `adopt_tail`), as replay buffers do. Small ones are written on
        the event loop, with no trip to a thread (docs/design.md, "Log-only appends").
        """
        if log_only and not durable:
            await self._log_only(owner)
            return
        if not durable and owner not in self._dirty and not self._meta.pending_changes:
            await scheduling.checkpoint()
            return  # nothing to persist (a read-only close): no trip to a thread
        if not durable and self._persist_noted(owner):
            await scheduling.checkpoint()
            return
        if durable:
            await self._persist_durable(owner)
            return
        await self._commit_owners({owner}, durable=False)

    async def _persist_durable(self, owner: int) -> None:
        """Group commit: `owner`'s blocks and every staged change durable in one commit
        with the other durable persists asked for while the commit before them ran. The
        first of them waits for that commit to end, then commits for all; the others wait
        for its end. A persist that joins a group is in its commit, which freezes the
        blocks only when it begins (docs/design.md, "Durable persists in groups"). Where
        the group's commit failed, each other member commits again by itself and reports
        its own outcome; where the first member was cancelled before the commit began,
        they form a new group."""
        self.durable_persists += 1
        while True:
            group = self._forming
            if group is not None:
                group.owners.add(owner)
                await group.done.wait()
                if not group.began:
                    continue  # its first member was cancelled first: form another
                if group.failed:
                    async with self._durable_lock:
                        with trio.CancelScope(shield=True):
                            await self._commit_owners({owner}, durable=True)
                return
            group = self._forming = DurableGroup({owner})
            try:
                async with self._durable_lock:
                    self._forming = None
                    group.began = True
                    with trio.CancelScope(shield=True):  # the members count on this commit
                        await self._commit_owners(group.owners, durable=True)
            except BaseException:
                group.failed = group.began
                if self._forming is group:
                    self._forming = None
                raise
            finally:
                group.done.set()
            return

    async def _commit_owners(self, owners: set[int], durable: bool) -> None:
        """The owners' dirty blocks to the log and every staged change committed, in one
        trip to a worker thread (`durable`: the log fsync'ed before a FULL commit)."""
        for owner in sorted(owners):
            if len(self._dirty.get(owner, ())) * self.block_bytes > FLUSH_BATCH_BYTES:
                await self.flush(owner)  # big files go in batches first
        async with self._flush_lock:
            keys = [BlockKey(owner, i) for owner in sorted(owners) for i in sorted(self._dirty.get(owner, ()))]
            snapshots, records = self._freeze(keys)
            locations: list[LogLocation] = []

            def append_then_rows() -> Changes:
                locations.extend(self._log.append_many(records) if records else [])
                if durable:
                    self._log.sync()
                return {"blocks": {tuple(r[0]): tuple(loc) for r, loc in zip(records, locations, strict=True)}}

            started = time.monotonic()
            # an fsync's commit folds the WAL into the database only every CHECKPOINT_S:
            # a checkpoint is two more writes and fsyncs, most of a lone fsync's time
            checkpoint = durable and started - self._checkpointed_at >= CHECKPOINT_S
            self._stage_mark()
            try:
                await self._meta.commit(durable=durable, before_commit=append_then_rows, checkpoint=checkpoint)
            finally:
                self._thaw(snapshots, records)
            if durable:
                self._synced(started)
                self.durable_commits += 1
                if checkpoint:
                    self._checkpointed_at = started
            elif records:
                self._logged()
            if locations:
                self._apply_flushed(snapshots, locations, staged=False)
                self._wake_room_waiters()

    async def persist_rows(self) -> None:
        """Make every staged metadata change survive a killed daemon (a namespace change
        such as mkdir, rename or unlink, which writes no block): a row note on the event
        loop where one can go (`_persist_noted` with no blocks), else a commit. Nothing
        staged: nothing to do."""
        await self.persist(ROW_NOTES_OWNER)

    def _persist_noted(self, owner: int) -> bool:
        """Persist `owner` without a commit, on the event loop, when it is small: its dirty
        blocks and then a row note of every change staged since the last take, their own
        rows included, go to the log with one pwritev. A start-up replays the notes after
        the last commit, so the result survives a killed daemon as a commit's would
        (docs/design.md, "Closes acknowledged by row notes"); the flusher commits the rows
        within its interval. False when it cannot (a commit or another append in flight,
        too much staged, the kernel's dirty pages high, a new segment due): then commit."""
        meta = self._meta
        if meta.committing or not meta.delta_fits(ROW_NOTE_CHANGES):
            return False
        blocks = self._inline_blocks(owner)
        if blocks is None:
            return False
        seq, delta = meta.take_delta()

        def note(locations: list[LogLocation]) -> tuple[BlockKey, bytes] | None:
            rows = [("blocks", tuple(key), tuple(at)) for (key, _b, _v), at in zip(blocks, locations, strict=True)]
            payload = encode_row_note(seq, delta, rows)
            if len(payload) > ROW_NOTE_BYTES:
                return None
            return BlockKey(ROW_NOTES_OWNER, NOTE_NUMBERS + self.row_notes), payload

        try:
            appended = self._write_inline(blocks, note)
        except BaseException:
            meta.restore_delta(delta)
            raise
        if appended is None or not appended[1]:
            # nothing written, or the blocks alone (their rows staged): a commit carries it all
            meta.restore_delta(delta)
            return False
        meta.noted("blocks", [tuple(key) for key, _block, _version in blocks])
        self.row_notes += 1
        self._flush_wanted_for_rows()
        return True

    def _inline_room(self, nbytes: int) -> bool:
        """Whether `nbytes` of records may be written on the event loop now: the kernel has
        room for dirty pages, no flush is in flight, and they are at most
        INLINE_APPEND_BYTES (docs/design.md, "Small appends are written on the event
        loop"). The log itself may still refuse (another append, a new segment due)."""
        return self._inline_ok and not self._flush_lock.locked() and nbytes <= INLINE_APPEND_BYTES

    def _inline_blocks(self, owner: int) -> list[tuple[BlockKey, Block, int]] | None:
        """`owner`'s dirty blocks with their versions, in block order, if they may be
        written on the event loop now (`_inline_room`); else None. Such a write runs with
        no await, so nothing can change a block under it: no freeze."""
        blocks: list[tuple[BlockKey, Block, int]] = []
        total = 0
        for number in sorted(self._dirty.get(owner, ())):
            key = BlockKey(owner, number)
            block = self._dram.peek(key)
            if block is not None and block.dirty:
                blocks.append((key, block, block.version))
                total += block.length
        return blocks if self._inline_room(total) else None

    def _append_inline(self, owner: int) -> bool:
        """Write `owner`'s dirty blocks to the log now, on the event loop, and stage their
        rows: only while the kernel has room for dirty pages, no flush is in flight and
        they are at most INLINE_APPEND_BYTES (docs/design.md, "Small appends are written
        on the event loop"). False when it cannot (then nothing was written), or when the
        records do not fit in the active segment."""
        blocks = self._inline_blocks(owner)
        if blocks is None:
            return False
        return not blocks or self._write_inline(blocks) is not None

    def _write_inline(
        self,
        blocks: list[tuple[BlockKey, Block, int]],
        note: Callable[[list[LogLocation]], tuple[BlockKey, bytes] | None] | None = None,
    ) -> tuple[list[LogLocation], bool] | None:
        """Write `blocks` (of `_inline_blocks`) to the log now with one pwritev, `note`'s
        record after them where it makes one (NvmeLog.try_append_noted); they turn clean
        with their rows staged. Their locations and whether the note went with them, or
        None when the log refused (nothing written)."""
        records = [(key, memoryview(block.buf)[: block.length]) for key, block, _version in blocks]
        try:
            appended = self._log.try_append_noted(records, note)
        finally:
            for _key, view in records:
                view.release()
        if appended is not None:
            self._logged()
            self._apply_flushed(blocks, appended[0], staged=True)
        return appended

    async def _log_only(self, owner: int) -> None:
        if not self._dirty.get(owner):
            await scheduling.checkpoint()
            return
        if self._append_inline(owner):
            self.inline_appends += 1
            self._flush_wanted_for_rows()
            await scheduling.checkpoint()
            return
        await self.flush(owner)  # another append is in flight, or a new segment is due
        self._flush_wanted_for_rows()

    def commit_soon(self) -> None:
        """Ask the flusher for a pass now rather than at its interval: a store whose
        cheap path waits for its rows to be committed (a new buffer's appends go log-only
        once its row is in the database)."""
        self._flush_wanted.set()

    def _flush_wanted_for_rows(self) -> None:
        """Rows staged by log-only persists commit with the flusher's next pass; many of
        them make it come sooner (a start-up reads the log's tail back)."""
        if self._meta.pending_changes > TAIL_ROWS_SOON:
            self._flush_wanted.set()

    def _stage_mark(self) -> None:
        """Stage the log's position with the next commit: every record before it has its
        row in that commit (or one before it), or is dead. Records after it are the tail
        that `read_tail` reads back at start-up."""
        position = min([self._log.position(), *self._rows_unstaged])
        self._meta.put("kv", (LOG_MARK_KEY,), (_mark(position),))
        if self.notes_hold() is None and not self._notes_lock.locked() and not self._notes_marks:
            # every note so far is in a committed snapshot: a start-up need not look back
            # further than here (keeps its scan short when no priorities change)
            self._meta.put("kv", (NOTES_MARK_KEY,), (_mark(position),))

    async def read_tail(self) -> int:
        """At start-up, before the stores load: read the records written after the last
        committed log mark (their rows may be missing) and keep them by owner for
        `adopt_tail`. Returns how many there are. A data dir without a mark has none."""
        tail_mark, notes_mark = (_position(self._meta.get_kv(key)) for key in (LOG_MARK_KEY, NOTES_MARK_KEY))
        # Row notes lie after the log mark of the last commit (or anywhere, before the
        # first): the walk starts there, or at the notes mark if that is earlier.
        start = min(mark for mark in (tail_mark or LOG_START, notes_mark) if mark is not None)
        committed_seq = self._meta.committed_seq

        def scan() -> tuple[Tail, dict[int, list[bytes]], list[LogPosition], RowNotes]:
            tail: Tail = {}
            notes: dict[int, list[bytes]] = {}
            positions: list[LogPosition] = []
            row_notes: RowNotes = []
            for location, key, _seq, payload in self._log.walk(start):  # no copy but of the notes
                at = LogPosition(location.segment, location.offset)
                if key.number >= NOTE_NUMBERS:
                    if key.owner == ROW_NOTES_OWNER:
                        seq, changes = decode_row_note(payload)
                        if seq >= committed_seq:  # taken after the last commit that succeeded
                            row_notes.append((seq, changes))
                    elif notes_mark is not None and at >= notes_mark:
                        notes.setdefault(key.owner, []).append(bytes(payload))
                        positions.append(at)
                elif tail_mark is not None and at >= tail_mark:
                    tail.setdefault(key.owner, []).append((key.number, location))
            return tail, notes, positions, row_notes

        self._tail, self._tail_notes, positions, row_notes = await trio.to_thread.run_sync(scan)
        self._note_positions.extend(positions)  # held until a new notes mark commits
        if row_notes:
            await self._replay_row_notes(row_notes)
        count = sum(len(records) for records in self._tail.values())
        if count and tail_mark is not None:
            log.info(
                "log: %d records after the last commit, from segment %d offset %d",
                count, tail_mark.segment, tail_mark.offset,
            )  # fmt: skip
        if positions:
            log.info("log: %d notes after the last notes mark", len(positions))
        return count

    async def _replay_row_notes(self, row_notes: RowNotes) -> None:
        """Apply the row notes after the last commit, in log order, and commit them before
        the stores load their rows (the log mark stays: the tail is still to adopt)."""
        sizes = self._log.segment_sizes()
        applied = 0
        for seq, changes in row_notes:
            self._meta.seen_seq(seq)
            for table, rows in changes.items():
                for key, values in rows.items():
                    if table != "blocks":
                        if values is None:
                            self._meta.delete(table, key)
                        else:
                            self._meta.put(table, key, values)
                    elif values is None:
                        self._index.delete(BlockKey(*key))
                    else:
                        location = LogLocation(*values)
                        if location.offset + location.length > sizes.get(location.segment, -1):
                            raise Corrupted(f"a row note names block {key} at {location}, past the log's end")
                        self._set_location(BlockKey(*key), location)
                    applied += 1
        await self._meta.commit()
        log.info("log: %d row notes after the last commit replayed (%d changes)", len(row_notes), applied)

    def adopt_tail(self, owner: int, accept: Callable[[int], bool]) -> int:
        """Index `owner`'s tail records whose block number `accept` takes (the store that
        persisted them log-only knows which still belong), newest record winning, and
        stage their rows. Returns how many were adopted; the rest stay dead."""
        adopted = 0
        for number, location in self._tail.pop(owner, ()):
            if accept(number):
                self._set_location(BlockKey(owner, number), location)
                adopted += 1
        return adopted

    def forget_tail(self) -> None:
        """The stores have loaded: tail records nobody adopted are dead (and notes of
        owners that are gone)."""
        self._tail = {}
        self._tail_notes = {}

    # --- notes: small records a store replays at start-up ---------------------------------

    async def append_note(self, owner: int, payload: bytes) -> None:
        """Write a note of `owner` to the log: a small record that is never a block and
        never indexed, which a start-up hands back (`take_notes`) if it lies after the
        last committed notes mark. When this returns it survives a killed daemon. Notes
        reach the log in the order of their calls (on the event loop when nothing else
        appends, else from a worker thread). Raises only if the note was not written
        (StoreFull on a full disk, Cancelled while waiting for an earlier note). Replay
        buffers write their priority updates as notes (docs/design.md, "Priorities:
        snapshots and notes")."""
        self._note_count += 1
        records = [(BlockKey(owner, NOTE_NUMBERS + self._note_count), payload)]
        if self._inline_ok and not self._notes_lock.locked():  # no earlier note in flight
            locations = self._log.try_append_now(records)
            if locations is not None:
                self.inline_notes += 1
                self._noted(locations[0])
                await scheduling.cancel_shielded_checkpoint()
                return
        async with self._notes_lock:  # (a thread's append is not cancelled: it completes)
            locations = await trio.to_thread.run_sync(self._log.append_many, records, limiter=self._io_limiter)
            self._noted(locations[0])
        await scheduling.cancel_shielded_checkpoint()  # written: the caller must not see a cancel

    def _noted(self, location: LogLocation) -> None:
        self._logged()
        self._note_positions.append(LogPosition(location.segment, location.offset))

    def stage_notes_mark(self, position: LogPosition) -> None:
        """Stage `position` (the log's `position()` taken when the store's state was
        copied for a snapshot staged with this) as the point a start-up replays notes
        from. The notes before it stay held from compaction until a commit carries it."""
        self._meta.put("kv", (NOTES_MARK_KEY,), (_mark(position),))
        self._notes_marks.append((position, self._meta.mark()))

    def notes_hold(self) -> int | None:
        """The first log segment compaction must keep for notes a start-up would replay
        (None: no such note)."""
        committed = None
        while self._notes_marks and self._meta.carried(self._notes_marks[0][1]):
            committed = self._notes_marks.pop(0)[0]
        if committed is not None:
            while self._note_positions and self._note_positions[0] < committed:
                self._note_positions.popleft()
        return self._note_positions[0].segment if self._note_positions else None

    def notes_waiting(self) -> bool:
        """Whether notes were written that no committed notes mark covers yet."""
        return self.notes_hold() is not None

    def notes_mark_staged(self) -> bool:
        """Whether a notes mark is staged and not yet committed."""
        self.notes_hold()
        return bool(self._notes_marks)

    def take_notes(self, owner: int) -> list[bytes]:
        """At start-up: `owner`'s notes after the committed notes mark, in log order."""
        return self._tail_notes.pop(owner, [])

    def _wake_room_waiters(self) -> None:
        self._room_freed.set()
        self._room_freed = trio.Event()

    async def commit(self, durable: bool = False) -> None:
        """Commit staged metadata; `durable` fsyncs the log first, then commits with FULL."""
        self._stage_mark()
        if durable:
            started = time.monotonic()
            await self._meta.commit(durable=True, before_commit=self._log.sync, checkpoint=True)
            self._synced(started)
            self._checkpointed_at = started
        else:
            await self._meta.commit()

    async def run_flusher(self, interval_s: float = 1.0) -> None:
        """Background task: flush on memory pressure, and at least every `interval_s`."""
        while True:
            with trio.move_on_after(interval_s):
                await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            if self._dirty or self._meta.pending_changes:
                async with survive("flusher"):
                    await self.flush()
                    await self.commit()

    async def run_write_behind(self) -> None:
        """Background task: full blocks to the log while their files are still being
        written (`write_behind`), so that a close finds little left to write."""
        while True:
            await self._write_behind_wanted.wait()
            self._write_behind_wanted = trio.Event()
            try:
                await self.write_behind()
            except (DistorefsError, OSError) as exc:  # a full disk: the flusher and the closes write them
                log.warning("write-behind: pass failed, will retry in %s s: %s", WRITE_BEHIND_RETRY_S, exc)
                await trio.sleep(WRITE_BEHIND_RETRY_S)

    async def write_behind(self) -> None:
        """Write the dirty blocks that were written full to the log, oldest first, one
        batch per trip to a thread, while at least WRITE_BEHIND_BYTES of them wait. A
        sequential writer fills a block and moves on, so the block will not change again:
        written now, on the core the writer's round trips leave idle, it is not written at
        the close, which then waits only for the file's last few blocks (docs/design.md,
        "Write-behind of full blocks"). A block changed again is marked again and goes in
        a later pass; the rows are staged for the flusher's next commit, as its own are."""
        per_batch = max(1, FLUSH_BATCH_BYTES // self.block_bytes)
        while len(self._full_dirty) * self.block_bytes >= WRITE_BEHIND_BYTES:
            async with self._flush_lock:
                keys: list[BlockKey] = []
                while self._full_dirty and len(keys) < per_batch:  # taken out first: every pass ends
                    key = next(iter(self._full_dirty))
                    del self._full_dirty[key]
                    block = self._dram.peek(key)
                    if block is not None and block.dirty and block.length == self.block_bytes:
                        keys.append(key)
                before = self._flushed_bytes
                await self._flush_batch(keys)
                self.written_behind_bytes += self._flushed_bytes - before

    def watch_dirty_pages(self) -> None:
        """Allow inline log-only appends only while the kernel is below its background
        dirty threshold, where a small pwrite copies into the page cache and returns
        (docs/design.md, "Log-only appends"); above it they go to a worker thread."""
        self._inline_ok = below_dirty_background()

    async def run_dirty_watch(self, interval_s: float = DIRTY_WATCH_S) -> None:
        """Background task: `watch_dirty_pages` every `interval_s` (reading /proc/meminfo
        takes tens of microseconds and never waits for a disk)."""
        while True:
            self.watch_dirty_pages()
            await trio.sleep(interval_s)

    async def run_syncer(self, interval_s: float = 5.0) -> None:
        """Background task: bound what a power loss can take to `interval_s` of closed data."""
        while True:
            await trio.sleep(interval_s)
            if self._meta.pending_changes:
                async with survive("syncer"):
                    await self.commit(durable=True)


@contextlib.asynccontextmanager
async def survive(task: str) -> AsyncIterator[None]:
    """A background pass that fails (disk full, a bad record) is logged and tried again
    next time; the daemon goes on serving."""
    try:
        yield
    except (DistorefsError, OSError) as exc:
        log.warning("%s: pass failed, will retry: %s", task, exc)
