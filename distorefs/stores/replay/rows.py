"""RecordRows: a schema buffer's small records in one array by ring slot, for draws.

Owns a second copy of the records of a buffer whose records are small (under
SCATTER_RECORD_BYTES) and whose whole ring fits in a small share of the DRAM budget
(`rows_bytes_for`): row `slot` holds the record of the item in ring slot `slot`, and
`held[slot]` says which item's record that is (-1: none yet). A draw of 64 records is
then one fancy-indexed copy out of the array, where looking up 64 blocks in the block
tier one by one (a key, a dict lookup, an LRU touch, a view each) cost 60-70 us of the
event loop per batch.

The block tier stays the source of truth and the path to the log: records come in as
they are appended or replaced, and records that are not here (after a start-up, or
after a draw fell back to the block tier) come in from the draws that read them. The
buffer calls this between awaits, so a row is never half-written when read. Its bytes
are reserved against the DRAM budget for as long as the array lives (the pages of slots
never written are never touched, so they cost address space only).

Examples:
    >>> rows = RecordRows.make(capacity=50_000, itemsize=48, reserve=blocks.reserve, unreserve=blocks.unreserve)
    >>> rows.put(np.array([7]), [record_bytes])          # item 7, in slot 7 % 50_000
    >>> records, missing = rows.gather(np.array([7]), np.array([7]))  # (1, 48) uint8, [False]
    >>> rows.close()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from distorefs.stores.replay.formats import SCATTER_RECORD_BYTES

BUDGET_SHARE = 8  # one buffer's rows may take at most 1/8 of the DRAM budget ...
MAX_ROWS_BYTES = 256 << 20  # ... and at most this much
RESERVED_SHARE = 4  # and none are made once reservations (all rows, arenas, streams) pass 1/4
HELD_BYTES = 8  # each slot's `held` index (int64), reserved with its row


def ring_bytes(capacity: int, itemsize: int) -> int:
    """What a ring's rows hold in DRAM: the records and each slot's `held` index."""
    return capacity * (itemsize + HELD_BYTES)


def rows_bytes_for(
    capacity: int, itemsize: int | None, compressed: bool, budget_bytes: int, reserved_bytes: int
) -> int:
    """How many bytes a buffer's rows would take, or 0 where it gets none: blob buffers
    (items of any size), compressed ones, records served as views (big), rings larger
    than their share of the budget, and any ring once what is reserved against the budget
    now (`reserved_bytes`) and the rows would pass a quarter of it, so that many small
    buffers never leave the block cache without room."""
    if itemsize is None or compressed or itemsize >= SCATTER_RECORD_BYTES:
        return 0
    size = ring_bytes(capacity, itemsize)
    if (
        size > min(budget_bytes // BUDGET_SHARE, MAX_ROWS_BYTES)
        or reserved_bytes + size > budget_bytes // RESERVED_SHARE
    ):
        return 0
    return size


class RecordRows:
    """The rows of one buffer's ring (see the module's doc)."""

    def __init__(self, capacity: int, itemsize: int, unreserve: Callable[[int], None]) -> None:
        self.capacity = capacity
        self.itemsize = itemsize
        self._unreserve = unreserve
        self.rows = np.empty((capacity, itemsize), dtype=np.uint8)  # pages touched as rows are written
        self.held = np.full(capacity, -1, dtype=np.int64)  # slot -> the item whose record the row holds
        self.closed = False
        self.hits = 0  # draws served here whole
        self.misses = 0  # draws that read some record from the block tier

    @classmethod
    def make(
        cls, capacity: int, itemsize: int, reserve: Callable[[int], bool], unreserve: Callable[[int], None]
    ) -> RecordRows | None:
        """Rows for a ring of `capacity` records of `itemsize` bytes, reserved against the
        DRAM budget first; None when the budget refuses them (draws then read the block
        tier, as without rows)."""
        if not reserve(ring_bytes(capacity, itemsize)):
            return None
        return cls(capacity, itemsize, unreserve)

    def put(self, indices: np.ndarray, records: Sequence[bytes | bytearray | memoryview]) -> None:
        """These items' records (appended, replaced, or just read for a draw). An item
        that is not live any more costs nothing but a later miss: its index never
        matches a live one."""
        if self.closed or not len(indices):
            return
        slots = indices % self.capacity
        if len(records) == 1:
            self.rows[int(slots[0])] = np.frombuffer(records[0], dtype=np.uint8)
        else:
            self.rows[slots] = np.frombuffer(b"".join(records), dtype=np.uint8).reshape(len(records), self.itemsize)
        self.held[slots] = indices

    def put_missing(
        self,
        indices: np.ndarray,
        records: Sequence[bytes | bytearray | memoryview],
        wanted: np.ndarray | None = None,
    ) -> None:
        """`put` of those of these items (read from the block tier) whose rows do not hold
        them yet, and only where `wanted` (a mask) says so: a row that a replacement
        through items/N filled while the records were read keeps the new record."""
        fill = self.held[indices % self.capacity] != indices
        if wanted is not None:
            fill &= wanted
        self.put(indices[fill], [record for record, ok in zip(records, fill.tolist(), strict=True) if ok])

    def gather(self, slots: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The records of the drawn items (in `slots`, with `indices`), copied out as a
        (len(slots), itemsize) uint8 array, and a mask of those whose rows do not hold
        them (their records are garbage: the caller reads them from the block tier), or
        None when every row holds its item."""
        records: np.ndarray = self.rows[slots]
        missing: np.ndarray = self.held[slots] != indices
        if missing.any():
            self.misses += 1
            return records, missing
        self.hits += 1
        return records, None

    def close(self) -> None:
        """Give the bytes back to the DRAM budget (a reconfiguration, a deletion)."""
        if not self.closed:
            self.closed = True
            self._unreserve(ring_bytes(self.capacity, self.itemsize))
            self.rows = np.empty((0, self.itemsize), dtype=np.uint8)
            self.held = np.empty(0, dtype=np.int64)

    def statistics(self) -> dict[str, int]:
        """`record_rows` in the buffer's stats: the bytes reserved, and draws served whole
        from the rows (`hits`) or with some records read from the block tier (`misses`)."""
        return {"bytes": ring_bytes(self.capacity, self.itemsize), "hits": self.hits, "misses": self.misses}
