"""Dataset: one record array under `datasets/<name>/`: appends, seal, records, the order.

Owns a dataset's records and their index, its config (an optional schema of fixed-size
records; the prefetch window), its sealed state and the order of the next epoch. Streams
(stream.py) read through it. No FUSE here.

Storage: three byte contents in the block tier, each under an owner of its own:
`owner` holds the records back to back, `owner + 1` their index (INDEX_DTYPE, 16 bytes a
record), `owner + 2` and `owner + 3` the two slots an explicit order alternates between
(a new order is written to the free slot, then the row that names it commits, so a crash
leaves the old order or the new one). The `datasets` row (count, bytes, sealed, order)
commits after the bytes it counts are in the log: after a crash the dataset is what the
last commit says, and bytes past it are ignored and overwritten by the next append.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import crc32c
import numpy as np
import trio

from distorefs import progress, scheduling
from distorefs.errors import Busy, Corrupted, InvalidArgument, NotFound, ReadOnly, describe
from distorefs.news import Outbox
from distorefs.stores.datasets.formats import INDEX_DTYPE, MAX_RECORD_BYTES, OrderSpec, shuffled
from distorefs.stores.replay.config import parse_schema, schema_to_json
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb

log = logging.getLogger(__name__)

MIN_WINDOW_BYTES = 4 << 20
# An append applies this many records at a time, other requests served between: a WRITE
# of 1 MiB of 8-byte records is 65,536 of them (their crcs, index entries and join: some
# 60 ms of the event loop in one go on this VM).
APPEND_SLICE = 8192


@dataclass(frozen=True)
class DatasetConfig:
    """`config` of a dataset: `schema` (field -> dtype, as buffers; None: variable-size
    blobs) and `prefetch_window_bytes` (None: the mount's --prefetch-window)."""

    schema: dict[str, Any] | None = None
    prefetch_window_bytes: int | None = None

    @property
    def dtype(self) -> np.dtype[Any] | None:
        return parse_schema("config", self.schema)

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    def updated(self, name: str, changes: Any, has_records: bool) -> DatasetConfig:
        """A new config with `changes` (a JSON object) applied; raises before any change."""
        if not isinstance(changes, dict):
            raise InvalidArgument(f"datasets/{name}/config: expected a JSON object, got {describe(changes)}")
        unknown = set(changes) - {"schema", "prefetch_window_bytes"}
        if unknown:
            raise InvalidArgument(f"datasets/{name}/config: unknown keys {sorted(unknown)}")
        new = replace(self, **changes)
        dtype = parse_schema(f"datasets/{name}/config", new.schema)
        if "schema" in changes and new.schema != self.schema and has_records:
            raise Busy(f"datasets/{name}/config: the schema cannot change once records exist")
        if dtype is not None and dtype.itemsize > MAX_RECORD_BYTES:
            raise InvalidArgument(
                f"datasets/{name}/config: records of {dtype.itemsize} bytes exceed {MAX_RECORD_BYTES}"
            )
        window = new.prefetch_window_bytes
        if window is not None and (type(window) is not int or window < MIN_WINDOW_BYTES):
            raise InvalidArgument(
                f"datasets/{name}/config: prefetch_window_bytes must be an integer >= {MIN_WINDOW_BYTES}, "
                f"got {describe(window)}"
            )
        return replace(new, schema=schema_to_json(dtype))


class Dataset:
    """One dataset: records appended until sealed, then read by index or streamed."""

    def __init__(
        self,
        name: str,
        owner: int,
        blocks: BlockStore,
        meta: MetaDb,
        config: DatasetConfig | None = None,
        count: int = 0,
        data_bytes: int = 0,
        sealed: bool = False,
        order: OrderSpec | None = None,
        created_ns: int = 0,
    ) -> None:
        self.name = name
        self.owner = owner
        self._blocks = blocks
        self._meta = meta
        self.config = config or DatasetConfig()
        self.dtype = self.config.dtype
        self.count = count
        self.data_bytes = data_bytes
        self.sealed = sealed
        self.order = order or OrderSpec()
        # One more at every order set: two explicit orders can have equal specs (the same
        # slot and length, alternate writes), so a stream's layout is keyed by this.
        self.order_serial = 0
        self.created_ns = created_ns or time.time_ns()
        self.deleted = False
        self._index: np.ndarray | None = np.empty(0, INDEX_DTYPE) if count == 0 else None
        self._index_lock = trio.Lock()
        self._append_lock = trio.Lock()
        self._order_cache: tuple[OrderSpec, np.ndarray] | None = None
        self._changed = False
        self.errors: list[str] = []
        self.loaded_ns = time.time_ns()  # when this daemon made or restored it: its records' mtime
        # Cluster mode: news for the other nodes, and the node that writes this dataset
        # when it is a copy of another node's (None: written here).
        self.news: Outbox[tuple[str, str]] = Outbox()
        self.writer: str | None = None
        self.streams_opened = 0
        self.streamed_bytes = 0
        self.records_read = 0

    # --- owners and the metadata row ----------------------------------------------------

    @property
    def data_owner(self) -> int:
        return self.owner

    @property
    def index_owner(self) -> int:
        return self.owner + 1

    def order_owner(self, slot: int) -> int:
        return self.owner + 2 + slot

    def owners(self) -> list[int]:
        return [self.owner + i for i in range(4)]

    def stage_row(self) -> None:
        if self.deleted:  # a call begun before the delete must not bring the row back
            return
        self._meta.put(
            "datasets",
            (self.name.encode(errors="surrogateescape"),),
            (
                self.owner,
                self.config.dumps(),
                self.count,
                self.data_bytes,
                int(self.sealed),
                json.dumps(self.order.to_json()),
                self.created_ns,
            ),
        )

    @classmethod
    def restore(cls, name: str, row: tuple[Any, ...], blocks: BlockStore, meta: MetaDb) -> Dataset:
        owner, config, count, data_bytes, sealed, order, created_ns = row
        return cls(
            name,
            owner,
            blocks,
            meta,
            DatasetConfig(**json.loads(config)),
            count,
            data_bytes,
            bool(sealed),
            OrderSpec.from_json(json.loads(order)),
            created_ns,
        )

    def record_error(self, message: str) -> None:
        self.errors = [*self.errors[-9:], message]

    def check_live(self) -> None:
        """NotFound once removed: its records' blocks went with it (a read would find
        holes, not the records; an open `records/<i>` or stream reads ENOENT from then)."""
        if self.deleted:
            raise NotFound(f"datasets/{self.name} was removed")

    def _check_not_removed_meanwhile(self) -> None:
        """After writing bytes under the dataset's owners: NotFound if it was removed
        while they went in, and they go too (the delete dropped the owners' blocks
        before; these would stay behind until the next start)."""
        if self.deleted:
            for owner in self.owners():
                self._blocks.delete_owner(owner)
            self.check_live()

    def _check_writer(self, from_writer: bool) -> None:
        """A copy of another node's dataset changes only as its writer says."""
        if self.writer is not None and not from_writer:
            raise ReadOnly(f"datasets/{self.name} is written on node {self.writer}: write it there")

    # --- config -------------------------------------------------------------------------

    def reconfigure(self, changes: Any, from_writer: bool = False) -> None:
        self.check_live()
        self._check_writer(from_writer)
        if self.sealed and "schema" in changes:
            raise ReadOnly(f"datasets/{self.name} is sealed: its schema cannot change")
        self.config = self.config.updated(self.name, changes, has_records=self.count > 0)
        self.dtype = self.config.dtype
        self.stage_row()
        self.news.post(("configured", self.name))

    # --- the record index -----------------------------------------------------------------

    async def index(self) -> np.ndarray:
        """The index of all `count` records (loaded from the log at first use)."""
        if self._index is None:
            async with self._index_lock:
                if self._index is None:
                    size = self.count * INDEX_DTYPE.itemsize
                    raw = await self._blocks.read_range(self.index_owner, 0, size, size)
                    if len(raw) != size:
                        raise InvalidArgument(f"datasets/{self.name}: index is {len(raw)} bytes, expected {size}")
                    self._index = np.frombuffer(bytes(raw), INDEX_DTYPE).copy()
        return self._index[: self.count]

    def index_loaded(self) -> np.ndarray | None:
        return None if self._index is None else self._index[: self.count]

    # --- appends --------------------------------------------------------------------------

    async def append(
        self, records: list[bytes] | list[bytearray] | list[memoryview], from_writer: bool = False
    ) -> None:
        """Add records after the last one; visible at once, acknowledged by `persist`.
        Applied APPEND_SLICE at a time, other requests served between (other appends
        wait for the whole call: the records stay in order); a failure part way (the
        dataset removed meanwhile) leaves the slices before it in place, unacknowledged.

        Raises ReadOnly once sealed or on a copy of another node's dataset (unless
        `from_writer`), InvalidArgument for a record of the wrong size (before any is
        added).
        """
        self.check_live()
        self._check_writer(from_writer)
        if not records:
            await scheduling.checkpoint()
            return
        lengths = np.fromiter((len(r) for r in records), dtype=np.int64, count=len(records))
        if self.dtype is not None and (lengths != self.dtype.itemsize).any():
            raise InvalidArgument(f"datasets/{self.name}: records must be {self.dtype.itemsize} bytes (the schema)")
        if lengths.max() > MAX_RECORD_BYTES:
            raise InvalidArgument(f"datasets/{self.name}: a record of {lengths.max()} bytes exceeds {MAX_RECORD_BYTES}")
        await self.index()
        async with self._append_lock:
            for at in range(0, len(records), APPEND_SLICE):
                if at:
                    await scheduling.checkpoint()
                await self._append_locked(records[at : at + APPEND_SLICE], lengths[at : at + APPEND_SLICE])

    async def _append_locked(
        self, records: list[bytes] | list[bytearray] | list[memoryview], lengths: np.ndarray
    ) -> None:
        """`append`'s one slice, under the append lock."""
        if self.sealed:
            raise ReadOnly(f"datasets/{self.name} is sealed: no more appends")
        self.check_live()
        entries = np.empty(len(records), INDEX_DTYPE)
        entries["length"] = lengths
        entries["offset"] = self.data_bytes + np.concatenate(([0], np.cumsum(lengths[:-1])))
        entries["crc"] = [crc32c.crc32c(r) for r in records]
        payload = b"".join(records)
        await self._blocks.write_range(self.data_owner, self.data_bytes, payload)
        await self._blocks.write_range(self.index_owner, self.count * INDEX_DTYPE.itemsize, entries.tobytes())
        self._check_not_removed_meanwhile()
        assert self._index is not None
        if len(self._index) < self.count + len(records):
            grown = np.empty(max(2 * len(self._index), self.count + len(records), 1024), INDEX_DTYPE)
            grown[: self.count] = self._index[: self.count]
            self._index = grown
        self._index[self.count : self.count + len(records)] = entries
        self.count += len(records)
        self.data_bytes += len(payload)
        self._changed = True

    async def persist(self, durable: bool = False) -> None:
        """Acknowledge what was appended: records and index in the log, then the row."""
        if self._changed:
            self._changed = False
            await self._blocks.flush(self.data_owner)
            await self._blocks.flush(self.index_owner)
            self.stage_row()
        await self._blocks.commit(durable=durable)

    async def seal(self, from_writer: bool = False) -> None:
        """No more appends; the dataset is made durable. Sealing twice is a no-op."""
        self.check_live()
        self._check_writer(from_writer)
        async with self._append_lock:
            if not self.sealed:
                self.sealed = True
                self._changed = True

            def left() -> int:
                blocks = self._blocks
                return blocks.owner_dirty_bytes(self.data_owner) + blocks.owner_dirty_bytes(self.index_owner)

            await progress.watch(f"sealing datasets/{self.name}", left, lambda: self.persist(durable=True), log)
        self.news.post(("sealed", self.name))

    async def read_run(self, start: int, max_bytes: int) -> tuple[np.ndarray, bytes | bytearray | memoryview]:
        """Records from `start` on, back to back, as many as fit in `max_bytes` (at least
        one): their index entries and their bytes, in one read of the data."""
        self.check_live()
        index = await self.index()
        if not 0 <= start < self.count:
            raise NotFound(f"datasets/{self.name}: no record {start} (it has {self.count})")
        ends = index["offset"][start:] + index["length"][start:] - int(index["offset"][start])
        stop = start + max(1, int(np.searchsorted(ends, max_bytes, side="right")))
        entries = index[start:stop].copy()
        first = int(entries["offset"][0])
        size = int(entries["offset"][-1] + entries["length"][-1]) - first
        data = await self._blocks.read_range(self.data_owner, first, size, self.data_bytes)
        self.check_live()
        return entries, bytes(data) if isinstance(data, memoryview) else data

    # --- records --------------------------------------------------------------------------

    async def record_length(self, i: int) -> int:
        self.check_live()
        index = await self.index()
        if not 0 <= i < self.count:
            raise NotFound(f"datasets/{self.name}: no record {i} (it has {self.count})")
        return int(index["length"][i])

    async def read_record(self, i: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        """Bytes of record `i` (whole records are checked against their crc32c)."""
        length = await self.record_length(i)
        entry = (await self.index())[i]
        start = int(entry["offset"])
        size = max(0, min(size, length - offset))
        data = await self._blocks.read_range(self.data_owner, start + offset, size, self.data_bytes)
        self.check_live()  # removed during the read: its blocks went with it
        if offset == 0 and size == length and crc32c.crc32c(data) != int(entry["crc"]):
            raise Corrupted(f"datasets/{self.name}: record {i} fails its crc32c check")
        self.records_read += 1
        return data

    # --- the order ------------------------------------------------------------------------

    async def set_order(self, spec: OrderSpec, indices: np.ndarray | None) -> None:
        """Make `spec` the order of the next streams opened; durable before it returns.

        The caller checked the indices against the count (OrderInput).
        """
        self.check_live()
        if spec.kind == "explicit":
            assert indices is not None
            slot = 1 - self.order.slot if self.order.kind == "explicit" else 0
            owner = self.order_owner(slot)
            data = indices.astype("<i8").tobytes()
            old = self._blocks.owner_keys(owner)
            for key in old:
                self._blocks.delete(key)
            await self._blocks.write_range(owner, 0, data)
            await self._blocks.flush(owner)
            self._check_not_removed_meanwhile()
            spec = replace(spec, slot=slot)
            self._order_cache = (spec, indices.astype(np.int64))
        self.order = spec
        self.order_serial += 1
        self.stage_row()
        await self._blocks.commit(durable=True)

    async def order_indices(self) -> np.ndarray:
        """The record indices of the current order, in order."""
        spec = self.order
        if self._order_cache is not None and self._order_cache[0] == spec:
            return self._order_cache[1]
        if spec.kind == "shuffle":
            indices = shuffled(spec.seed, spec.count)
        elif spec.kind == "explicit":
            size = spec.length * 8
            raw = await self._blocks.read_range(self.order_owner(spec.slot), 0, size, size)
            indices = np.frombuffer(bytes(raw), "<i8").astype(np.int64)
        else:
            indices = np.arange(self.count, dtype=np.int64)
        self._order_cache = (spec, indices)
        return indices

    async def shard(self, rank: int, world: int) -> np.ndarray:
        """Rank `rank`'s share of the order: positions rank, rank + world, ... (as
        torch's DistributedSampler, without padding)."""
        if not 0 <= rank < world:
            raise InvalidArgument(f"datasets/{self.name}: rank {rank} is not in [0, {world})")
        if not self.sealed:
            raise Busy(f"datasets/{self.name} is not sealed: write `seal` to state before streaming")
        return (await self.order_indices())[rank::world]

    def statistics(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "records": self.count,
            "bytes": self.data_bytes,
            "sealed": self.sealed,
            "schema": self.config.schema,
            "record_bytes": None if self.dtype is None else self.dtype.itemsize,
            "order": self.order.describe(),
            "prefetch_window_bytes": self.config.prefetch_window_bytes,
            "streams_opened": self.streams_opened,
            "streamed_bytes": self.streamed_bytes,
            "records_read": self.records_read,
            "errors": self.errors,
        }
