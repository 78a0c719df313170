"""BlockIndex: where each block's newest record lives in the segment log.

Owns the map BlockKey -> LogLocation and the two views derived from it that the block
tier needs fast: the live bytes of each segment (what compaction weighs) and the block
numbers of each owner with their lengths (what a file or a buffer holds). Which keys live
in a segment is not kept: compaction reads them from the segment itself
(`NvmeLog.segment_records`), which spared a million-item start-up a set per segment
(docs/benchmarks.md, "A million items"). It stages its rows in MetaDb's `blocks` table;
committing them is the caller's job.

Invariants, for every state reachable through the methods below:
    live_bytes(s) == sum(HEADER.size + loc.length for loc in locations in segment s)
    lengths(o) == {key.number: loc.length for key, loc in the map if key.owner == o},
        and no owner maps to an empty dict

Plain, synchronous Python: nothing here awaits or does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator

from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import HEADER
from distorefs.types import BlockKey, LogLocation


def record_bytes(location: LogLocation) -> int:
    """Bytes a record takes in its segment: header and payload."""
    return HEADER.size + location.length


class BlockIndex:
    """The block index, its per-segment and per-owner views, and its staged rows.

    Examples:
        >>> index = BlockIndex.load(meta)
        >>> index.set(BlockKey(7, 0), LogLocation(1, 0, 4096))   # staged in MetaDb
        >>> index.live_bytes(1)
        4120
        >>> index.delete(BlockKey(7, 0))                          # the record is dead
    """

    def __init__(self, meta: MetaDb) -> None:
        self._meta = meta
        self._locations: dict[BlockKey, LogLocation] = {}
        self._seg_live: dict[int, int] = {}
        self._owned: dict[int, dict[int, int]] = {}  # owner -> block number -> payload length

    @classmethod
    def load(cls, meta: MetaDb) -> BlockIndex:
        """The index as the committed `blocks` rows say (what `_add` does per row, inlined:
        a million rows at start-up)."""
        self = cls(meta)
        locations, seg_live, owned = self._locations, self._seg_live, self._owned
        header = HEADER.size
        new_key, new_location = BlockKey._make, LogLocation._make
        for owner, number, segment, offset, length in meta.rows("blocks"):
            locations[new_key((owner, number))] = new_location((segment, offset, length))
            seg_live[segment] = seg_live.get(segment, 0) + header + length
            numbers = owned.get(owner)
            if numbers is None:
                numbers = owned[owner] = {}
            numbers[number] = length
        return self

    # --- reading --------------------------------------------------------------------------

    def get(self, key: BlockKey) -> LogLocation | None:
        return self._locations.get(key)

    def __getitem__(self, key: BlockKey) -> LogLocation:
        return self._locations[key]

    def __contains__(self, key: object) -> bool:
        return key in self._locations

    def __len__(self) -> int:
        return len(self._locations)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._locations)

    def numbers(self, owner: int) -> set[int]:
        """Block numbers of `owner` with a record (a copy: safe to keep)."""
        return set(self._owned.get(owner, ()))

    def lengths(self, owner: int) -> dict[int, int]:
        """Block number -> record payload length of each of `owner`'s blocks (a copy)."""
        return dict(self._owned.get(owner, {}))

    def count(self, owner: int) -> int:
        """How many blocks of `owner` have a record (no copy: for stat)."""
        return len(self._owned.get(owner, ()))

    def owners(self) -> set[int]:
        return set(self._owned)

    def live_bytes(self, segment: int) -> int:
        return self._seg_live.get(segment, 0)

    def live_total(self) -> int:
        return sum(self._seg_live.values())

    # --- changing ---------------------------------------------------------------------------

    def _add(self, key: BlockKey, location: LogLocation) -> None:
        self._locations[key] = location
        self._seg_live[location.segment] = self._seg_live.get(location.segment, 0) + record_bytes(location)
        self._owned.setdefault(key.owner, {})[key.number] = location.length

    def _drop(self, key: BlockKey) -> LogLocation | None:
        old = self._locations.pop(key, None)
        if old is not None:
            self._seg_live[old.segment] -= record_bytes(old)
            owned = self._owned[key.owner]
            del owned[key.number]
            if not owned:
                del self._owned[key.owner]
        return old

    def set(self, key: BlockKey, location: LogLocation, stage: bool = True) -> LogLocation | None:
        """Point `key` at `location` (its old record turns dead); returns the old location.
        `stage` False when the row was committed already (persist writes rows itself)."""
        old = self._drop(key)
        self._add(key, location)
        if stage:
            self._meta.put("blocks", tuple(key), tuple(location))
        return old

    def delete(self, key: BlockKey) -> LogLocation | None:
        """Forget `key` and stage its row's deletion; returns the old location, if any."""
        old = self._drop(key)
        if old is not None:
            self._meta.delete("blocks", tuple(key))
        return old

    def forget_segment(self, segment: int) -> None:
        """A segment with no live record was deleted from the log."""
        assert not self._seg_live.get(segment), f"segment {segment} still holds live records"
        self._seg_live.pop(segment, None)
