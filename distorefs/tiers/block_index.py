"""BlockIndex: where each block's newest record lives in the segment log.

Owns the map BlockKey -> LogLocation and the two views derived from it that the block
tier needs fast: the live bytes of each segment (what compaction weighs) and the block
numbers of each owner with their lengths (what a file or a buffer holds). Which keys live
in a segment is not kept: compaction reads them from the segment itself
(`NvmeLog.segment_records`), which spared a million-item start-up a set per segment
(docs/benchmarks.md, "A million items"). It stages its rows in MetaDb's `blocks` table;
committing them is the caller's job.

The map holds plain tuples, (owner, number) -> (segment, offset, length), and hands out
BlockKey and LogLocation: Python's cyclic garbage collector stops tracking a plain tuple
of ints once it has seen it, but tracks a NamedTuple for good, and a full collection
visits every tracked object. A million items held a BlockKey and a LogLocation each: 2
million objects and 0.2 s of a full collection, during which the daemon answers nothing
(docs/design.md, "Pauses of Python's garbage collector"). A BlockKey
finds its plain-tuple entry (same hash, equal).

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


_key = BlockKey._make  # a plain (owner, number) as a BlockKey, no check
_location = LogLocation._make  # a plain (segment, offset, length) as a LogLocation


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
        self._locations: dict[tuple[int, int], tuple[int, int, int]] = {}  # plain tuples: see above
        self._seg_live: dict[int, int] = {}
        self._owned: dict[int, dict[int, int]] = {}  # owner -> block number -> payload length

    @classmethod
    def load(cls, meta: MetaDb) -> BlockIndex:
        """The index as the committed `blocks` rows say (what `_add` does per row, inlined:
        a million rows at start-up)."""
        self = cls(meta)
        locations, seg_live, owned = self._locations, self._seg_live, self._owned
        header = HEADER.size
        for owner, number, segment, offset, length in meta.rows("blocks"):
            locations[(owner, number)] = (segment, offset, length)
            seg_live[segment] = seg_live.get(segment, 0) + header + length
            numbers = owned.get(owner)
            if numbers is None:
                numbers = owned[owner] = {}
            numbers[number] = length
        return self

    # --- reading --------------------------------------------------------------------------

    def get(self, key: BlockKey) -> LogLocation | None:
        location = self._locations.get(key)
        return None if location is None else _location(location)

    def __getitem__(self, key: BlockKey) -> LogLocation:
        return _location(self._locations[key])

    def __contains__(self, key: object) -> bool:
        return key in self._locations

    def __len__(self) -> int:
        return len(self._locations)

    def __iter__(self) -> Iterator[BlockKey]:
        return map(_key, self._locations)

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

    def _add(self, key: tuple[int, int], location: tuple[int, int, int]) -> None:
        self._locations[key] = location
        owner, number = key
        segment, _offset, length = location
        self._seg_live[segment] = self._seg_live.get(segment, 0) + HEADER.size + length
        self._owned.setdefault(owner, {})[number] = length

    def _drop(self, key: BlockKey) -> LogLocation | None:
        old = self._locations.pop(key, None)
        if old is None:
            return None
        segment, _offset, length = old
        self._seg_live[segment] -= HEADER.size + length
        owned = self._owned[key[0]]
        del owned[key[1]]
        if not owned:
            del self._owned[key[0]]
        return _location(old)

    def set(self, key: BlockKey, location: LogLocation, stage: bool = True) -> LogLocation | None:
        """Point `key` at `location` (its old record turns dead); returns the old location.
        `stage` False when the row was committed already (persist writes rows itself)."""
        old = self._drop(key)
        plain_key = (key[0], key[1])  # exact tuples (the module's note)
        plain_location = (location[0], location[1], location[2])
        self._add(plain_key, plain_location)
        if stage:
            self._meta.put("blocks", plain_key, plain_location)
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
