"""MetaDb: the embedded metadata database (SQLite in WAL mode) under the data dir.

Owns the tables and their commits. Callers keep their own in-memory state and stage
changes here with `put`/`delete`; staged changes coalesce per primary key and go to disk
in one transaction per `commit`. Commits are serialised by one trio.Lock and run in a
worker thread.

Durability: a plain commit reaches the OS (survives a killed daemon); a durable commit
first runs the caller's `before_commit` (the log's fsync) and then commits with
synchronous=FULL, so metadata never becomes durable ahead of the log records it names.
Automatic WAL checkpoints are off; a durable commit can ask for one.

Row notes: besides the staged changes, MetaDb keeps the *delta*, what was staged since
the last commit took its changes or the last `take_delta`. The block tier writes a delta
to its log as a row note, so that a close is acknowledged without a commit (tiers/
writeback.py). Every commit takes a number (`take_seq`) and writes it into its own
transaction (kv `commit_seq`); a delta is tagged with the number of the last take before
it. A start-up replays, in log order, the row notes tagged at or after the committed
number: their changes were not in any committed transaction, and applying them gives
the state a commit at the last note would have written (docs/design.md, "Closes
acknowledged by row notes").
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgpack
import trio

from distorefs.errors import Corrupted, StoreFull

log = logging.getLogger(__name__)

SQLITE_FULL = 13  # "database or disk is full"

# 2: the buffers table; 3: the weights and ckpt_pending tables; 4: datasets; 5: buffer snapshots
SCHEMA_VERSION = 5

PROGRESS_ROWS = 8192
TABLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # table: (primary key columns, value columns)
    "inodes": (
        ("ino",),
        ("mode", "nlink", "uid", "gid", "rdev", "size", "atime_ns", "mtime_ns", "ctime_ns", "target"),
    ),
    "dentries": (("parent", "name"), ("ino",)),
    "blocks": (("owner", "idx"), ("segment", "offset", "length")),
    "xattrs": (("ino", "name"), ("value",)),
    "kv": (("key",), ("value",)),
    # `snapshot` is no longer written (version 5 keeps it in `buffer_snapshots`): a row staged
    # on every append must not carry a blob that grows with the buffer
    "buffers": (("name",), ("owner", "config", "next_index", "inserts", "samples", "removed", "snapshot")),
    "buffer_snapshots": (("name",), ("data",)),
    "weights": (("model",), ("version", "published_ns", "files")),
    "ckpt_pending": (("ino",), ("since_ns",)),
    "datasets": (("name",), ("owner", "config", "count", "data_bytes", "sealed", "order_spec", "created_ns")),
}

Row = tuple[Any, ...]
Changes = dict[str, dict[tuple[Any, ...], Row | None]]
COMMIT_SEQ_KEY = "commit_seq"  # kv: the number of the last take whose commit succeeded
UNNOTED_TABLES = ("buffer_snapshots",)  # blobs of megabytes: a delta with them is committed, not noted


ROW_NOTE_MAGIC = b"DSR1"


def no_changes() -> Changes:
    return {t: {} for t in TABLES}


_packers = threading.local()  # a msgpack.Packer per thread for row notes (a Packer is not thread-safe)


def encode_row_note(seq: int, delta: Changes, more: Iterable[tuple[str, Any, Any]] = ()) -> bytes:
    """A row note's payload: "DSR1", then msgpack [seq, [[table, key, values or nil], ...]]
    in staging order per table (docs/formats.md, "Row notes"), then the rows of `more`
    (table, key, values) staged after them."""
    rows = [(table, key, values) for table, changes in delta.items() for key, values in changes.items()]
    rows.extend(more)
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    packed: bytes = packer.pack((seq, rows))  # tuples pack as msgpack arrays, as lists do
    return ROW_NOTE_MAGIC + packed


def decode_row_note(payload: bytes | memoryview) -> tuple[int, Changes]:
    """The tag and the changes of a row note; Corrupted when it is not one (the record's
    crc32c held, so that is a bug or a foreign record, never a torn write)."""
    if bytes(payload[:4]) != ROW_NOTE_MAGIC:
        raise Corrupted("a row note without its magic")
    try:
        seq, rows = msgpack.unpackb(payload[4:], raw=False, use_list=True)
        changes = no_changes()
        for table, key, values in rows:
            changes[table][tuple(key)] = None if values is None else tuple(values)
        return int(seq), changes
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise Corrupted(f"a row note that does not decode: {exc}") from None


class MetaDb:
    """SQLite tables with staged, coalescing changes.

    Examples:
        >>> db = MetaDb.open("/data/meta.sqlite")
        >>> db.put("kv", ("next_ino",), (42,))
        >>> await db.commit()                     # survives kill -9
        >>> await db.commit(durable=True, before_commit=log.sync)   # survives power loss
    """

    def __init__(self, path: str, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        self.progress: Callable[[int], None] | None = None  # told of rows read at start-up (rows())
        self._pending: Changes = no_changes()
        self._delta: Changes = no_changes()  # staged since the last take (see the module's doc)
        self._lock = trio.Lock()
        self._thread_lock = threading.Lock()
        self.commits = 0
        self._staged = 0  # changes staged so far, counted (a mark: see `mark`)
        self._committed = 0  # the count a successful commit had taken when it began
        row = conn.execute("SELECT value FROM kv WHERE key = ?", (COMMIT_SEQ_KEY,)).fetchone()
        self.committed_seq: int = 0 if row is None else int(row[0])  # as committed when opened
        self.take_seq = self.committed_seq  # the number of the last take

    @classmethod
    def open(cls, path: str) -> MetaDb:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        for table, (keys, values) in TABLES.items():
            columns = ", ".join(keys + values)
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {table} ({columns}, PRIMARY KEY ({', '.join(keys)})) WITHOUT ROWID"
            )
        found = conn.execute("SELECT value FROM kv WHERE key = 'schema_version'").fetchone()
        if found is None or found[0] in (1, 2, 3, 4):  # older versions lacked only tables now created
            conn.execute("INSERT OR REPLACE INTO kv VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
        elif found[0] != SCHEMA_VERSION:
            raise RuntimeError(f"{path}: metadata schema {found[0]}, this distorefs reads {SCHEMA_VERSION}")
        return cls(path, conn)

    def rows(self, table: str) -> Iterator[Row]:
        """Yield the committed rows of `table` (startup only: it reads on the caller's thread).
        `progress`, when set, is told how many rows were read, every PROGRESS_ROWS rows."""
        keys, values = TABLES[table]
        cursor = self._conn.execute(f"SELECT {', '.join(keys + values)} FROM {table}")
        while batch := cursor.fetchmany(PROGRESS_ROWS):
            yield from batch
            if self.progress is not None:
                self.progress(len(batch))

    def count_rows(self) -> int:
        """Committed rows in all tables (what a start-up will read)."""
        return sum(self._conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in TABLES)

    def get_kv(self, key: str, default: Any = None) -> Any:
        staged = self._pending["kv"].get((key,), ...)
        if staged is not ...:
            return default if staged is None else staged[0]
        row = self._conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return default if row is None else row[0]

    def put(self, table: str, key: tuple[Any, ...], values: Row) -> None:
        self._pending[table][key] = values
        self._delta[table][key] = values
        self._staged += 1

    def delete(self, table: str, key: tuple[Any, ...]) -> None:
        self._pending[table][key] = None
        self._delta[table][key] = None
        self._staged += 1

    @property
    def committing(self) -> bool:
        """Whether a commit is in flight (or waiting for one)."""
        return self._lock.locked()

    def delta_fits(self, max_changes: int) -> bool:
        """Whether the delta is small enough to note: at most `max_changes` changes and
        none of UNNOTED_TABLES."""
        delta = self._delta
        return not any(delta[t] for t in UNNOTED_TABLES) and sum(len(c) for c in delta.values()) <= max_changes

    def take_delta(self) -> tuple[int, Changes]:
        """The delta, tagged with the number of the last take, and a fresh one begun.
        The caller writes it as a row note at once, or gives it back (`restore_delta`)."""
        delta, self._delta = self._delta, no_changes()
        return self.take_seq, delta

    def noted(self, table: str, keys: Iterable[tuple[Any, ...]]) -> None:
        """Changes of `table` staged since the last take are in a row note already (it
        carried them with the take's delta): the next take leaves them out."""
        changes = self._delta[table]
        for key in keys:
            changes.pop(key, None)

    def restore_delta(self, delta: Changes) -> None:
        """`delta` was not written: merge it back under anything staged since."""
        for table, changes in delta.items():
            if changes:
                self._delta[table] = {**changes, **self._delta[table]}

    def seen_seq(self, seq: int) -> None:
        """At start-up: a row note tagged `seq` is in the log, so the next take numbers
        past it (a later start-up must not take notes older than that commit as newer)."""
        self.take_seq = max(self.take_seq, seq)

    def mark(self) -> int:
        """A mark for every change staged so far: `carried(mark)` is True once a commit
        has written them (whoever started that commit)."""
        return self._staged

    def carried(self, mark: int) -> bool:
        return self._committed >= mark

    @property
    def pending_changes(self) -> int:
        return sum(len(p) for p in self._pending.values())

    async def commit(
        self,
        durable: bool = False,
        *,
        before_commit: Callable[[], Changes | None] | None = None,
        checkpoint: bool = False,
    ) -> None:
        """Write every staged change in one transaction.

        `before_commit` runs in the worker thread after the changes were taken and before
        the transaction: the log's appends and fsync, so that metadata never names a
        record written after it, all in one trip to the thread. The changes it returns
        join the transaction and win over staged ones for the same key. `checkpoint`
        (with `durable`) then folds the WAL into the database file in the same step.
        """
        async with self._lock:
            pending = self._pending
            if not any(pending.values()) and not durable and before_commit is None:
                return
            self._pending = no_changes()
            delta, self._delta = self._delta, no_changes()  # the take carries the delta's changes
            taken = self._staged
            self.take_seq += 1
            seq = self.take_seq
            pending = {**pending, "kv": {**pending["kv"], (COMMIT_SEQ_KEY,): (seq,)}}
            try:
                await trio.to_thread.run_sync(self._commit_sync, pending, durable, before_commit, checkpoint)
                self._committed = taken
                self.committed_seq = seq
            except BaseException:
                # Put the changes back, newer staged values winning, so nothing is lost;
                # the next row note carries them again (what was noted before the take
                # stays replayable: the committed number did not move).
                del pending["kv"][(COMMIT_SEQ_KEY,)]
                for table, changes in pending.items():
                    changes.update(self._pending[table])
                    self._pending[table] = changes
                self.restore_delta(delta)
                raise

    def _commit_sync(
        self,
        pending: Changes,
        durable: bool,
        before_commit: Callable[[], Changes | None] | None,
        checkpoint: bool,
    ) -> None:
        """Write the changes in one transaction (a worker thread). SQLite's errors come out
        as the daemon's: a full disk is ENOSPC (StoreFull), anything else EIO; the
        transaction is rolled back either way."""
        try:
            with self._thread_lock:
                if before_commit is not None:
                    extra = before_commit()
                    if extra:
                        pending = {t: {**pending[t], **extra.get(t, {})} for t in pending}
                conn = self._conn
                if durable:
                    conn.execute("PRAGMA synchronous=FULL")
                try:
                    conn.execute("BEGIN")
                    for table, changes in pending.items():
                        if not changes:
                            continue
                        keys, values = TABLES[table]
                        where = " AND ".join(f"{k} = ?" for k in keys)
                        deletes = [k for k, v in changes.items() if v is None]
                        upserts = [k + v for k, v in changes.items() if v is not None]
                        if deletes:
                            conn.executemany(f"DELETE FROM {table} WHERE {where}", deletes)
                        if upserts:
                            marks = ", ".join("?" * (len(keys) + len(values)))
                            conn.executemany(f"INSERT OR REPLACE INTO {table} VALUES ({marks})", upserts)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                finally:
                    if durable:
                        conn.execute("PRAGMA synchronous=NORMAL")
                self.commits += 1
                if durable and checkpoint:
                    try:
                        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    except sqlite3.Error as exc:  # committed already: the WAL folds in later
                        log.warning("metadata: WAL checkpoint failed (%s); it is retried at the next one", exc)
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL:
                raise StoreFull(f"the metadata database's disk is full ({self.path}): {exc}") from None
            raise Corrupted(f"metadata database {self.path}: {exc}") from None

    def close(self) -> None:
        with self._thread_lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:  # a full disk: the WAL stays and is folded in at the next open
                log.warning("metadata: final WAL checkpoint failed: %s", exc)
            self._conn.close()
