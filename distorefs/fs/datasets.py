"""The `datasets/` kind: record arrays as directories of control files.

Owns the FUSE side of datasets: the nodes (`config`, `append`, `state`, `order`, `len`,
`stats`, `stream`, `stream-RANK-of-WORLD`, `records/<i>`) and what each open's handle does
with reads and writes. The datasets themselves are stores/datasets; nothing here keeps
dataset state.

Record inodes are computed, not stored: RECORD_BASE | dataset number << 36 | index, and
`records/` lists its entries per position on demand, so ten million records cost no
memory here.
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from distorefs import scheduling
from distorefs.errors import DistorefsError, FileTooLarge, InvalidArgument, NotFound, ReadOnly, describe
from distorefs.fs.virtual import (
    READ_PIECES,
    Access,
    AppendStreamHandle,
    ControlFile,
    Entry,
    NamedDir,
    NamedKindDirectory,
    PositionListing,
    ReadReply,
    RenderedHandle,
    VirtualDir,
    VirtualFile,
    VirtualHandle,
    VirtualNode,
    VirtualTree,
    WholeInputHandle,
    json_object,
)
from distorefs.ids import DATASET_OWNER_BASE, INDEX_BITS, OWNERS_PER_DATASET, RECORD_BASE, RECORD_SPAN
from distorefs.stores.datasets.dataset import Dataset
from distorefs.stores.datasets.formats import OrderInput, OrderSpec
from distorefs.stores.datasets.store import DatasetStore
from distorefs.stores.datasets.stream import Stream
from distorefs.stores.replay.formats import BlobStream, RecordStream

RECORD_CACHE_S = 60.0  # records never change; a removed dataset's may stat this long
CONTROL_NAMES = (b"config", b"append", b"state", b"order", b"len", b"stats", b"stream")
STATE_INPUT_BYTES = 4096  # `seal` and a newline, with room for whitespace
MAX_WORLD = 1 << 16


def config_text(ds: Dataset) -> bytes:
    return (json.dumps(asdict(ds.config), indent=2) + "\n").encode()


def state_text(ds: Dataset) -> bytes:
    return b"sealed\n" if ds.sealed else b"open\n"


def record_ino(ds: Dataset, index: int) -> int:
    return RECORD_BASE | ((ds.owner - DATASET_OWNER_BASE) // OWNERS_PER_DATASET << INDEX_BITS) | index


def _label(ds: Dataset, file: str) -> str:
    return f"datasets/{ds.name}/{file}"


def _recorded(ds: Dataset, exc: DistorefsError) -> DistorefsError:
    """Keep the refusal in the dataset's `stats` (errors) on its way to the caller."""
    ds.record_error(exc.message)
    return exc


# --- handles ----------------------------------------------------------------------------


class ConfigHandle(WholeInputHandle):
    """Reads the config as JSON; a write of a complete JSON object applies it (or none)."""

    kind = "datasets"

    incomplete = "config is not valid JSON"

    def __init__(self, ds: Dataset) -> None:
        content = config_text(ds)
        super().__init__(_label(ds, "config"), ds.record_error, content)
        self._ds = ds

    async def _apply_if_complete(self, pending: bytearray) -> bool:
        changes = json_object(self.label, pending)
        if changes is None:
            return False
        self._ds.reconfigure(changes)
        return True

    async def flush(self) -> None:
        await super().flush()
        if self.applied:  # a read of the config commits nothing
            self.applied = False
            await self._ds.persist()


class AppendHandle(AppendStreamHandle):
    """Adds each complete record (or frame) as it arrives; close acknowledges them, fsync
    makes them durable."""

    kind = "datasets"

    def __init__(self, ds: Dataset) -> None:
        if ds.sealed:
            raise ReadOnly(f"datasets/{ds.name} is sealed: no more appends")
        self._ds = ds
        self._stream: RecordStream | BlobStream = RecordStream(ds.dtype) if ds.dtype is not None else BlobStream()

    async def write(self, offset: int, data: bytes) -> int:
        try:
            records = self._stream.feed(offset, data)
            self._follow_stream()
            await self._ds.append(records)
        except InvalidArgument as exc:
            self._stream.reset()  # the bad input is dropped; later writes start afresh
            self._follow_stream()
            raise _recorded(self._ds, exc) from None
        return len(data)

    def input_label(self) -> str:
        return f"{_label(self._ds, 'append')}: a partial record"

    async def flush(self) -> None:
        try:
            tail = self._stream.finish()
            self._follow_stream()
            await self._ds.append(tail)
        except InvalidArgument as exc:
            self._follow_stream()
            raise _recorded(self._ds, exc) from None
        await self._ds.persist()

    async def fsync(self) -> None:
        await self._ds.persist(durable=True)


class StateHandle(RenderedHandle):
    """Reads `open` or `sealed`; a write of `seal` seals (durably, before it returns)."""

    kind = "datasets"

    def __init__(self, ds: Dataset) -> None:
        super().__init__(state_text(ds))
        self._ds = ds
        self._pending = bytearray()

    async def _apply(self, text: bytes) -> None:
        word = text.strip()
        if word == b"seal":
            await self._ds.seal()
        elif word:
            raise _recorded(
                self._ds, InvalidArgument(f"{_label(self._ds, 'state')}: write `seal`, got {describe(word)}")
            )
        else:
            await scheduling.checkpoint()

    async def write(self, offset: int, data: bytes) -> int:
        if len(self._pending) + len(data) > STATE_INPUT_BYTES:  # (it grew without bound)
            self._pending = bytearray()
            raise _recorded(self._ds, FileTooLarge(f"{_label(self._ds, 'state')}: write `seal`, not megabytes"))
        self._pending += data
        if b"\n" in self._pending:
            text, self._pending = bytes(self._pending), bytearray()
            await self._apply(text)
        else:
            await scheduling.checkpoint()
        return len(data)

    async def flush(self) -> None:
        text, self._pending = bytes(self._pending), bytearray()
        await self._apply(text)


class OrderHandle(VirtualHandle):
    """Reads the current order as a `.npy` of int64; takes the next one (OrderInput)."""

    kind = "datasets"

    def __init__(self, ds: Dataset) -> None:
        self._ds = ds
        self._input = OrderInput(ds.name, ds.count)
        self._content: bytes | None = None

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        if self._content is None:
            out = io.BytesIO()
            np.save(out, await self._ds.order_indices())
            self._content = out.getvalue()
        else:
            await scheduling.checkpoint()
        return memoryview(self._content)[offset : offset + size]

    async def _apply(self, take: Callable[[], tuple[OrderSpec, np.ndarray | None] | None]) -> None:
        """Run the parser step `take`; apply the order it completes, if any."""
        try:
            done = take()
        except InvalidArgument as exc:
            raise _recorded(self._ds, exc) from None
        if done is not None:
            await self._ds.set_order(*done)
        else:
            await scheduling.checkpoint()

    async def write(self, offset: int, data: bytes) -> int:
        try:
            await self._apply(lambda: self._input.feed(data))
        finally:
            self._follow_input()
        return len(data)

    def _follow_input(self) -> None:
        """Count what the order's input holds until it applies (ENOMEM, the input dropped,
        when it does not fit)."""
        self.hold_input(self._input.held_bytes, self._input.reset)

    def input_label(self) -> str:
        return f"{_label(self._ds, 'order')}: input"

    async def flush(self) -> None:
        try:
            await self._apply(self._input.finish)
        finally:
            self._follow_input()

    async def release(self) -> None:
        await scheduling.checkpoint()
        self._input.reset()
        self._follow_input()


class StreamHandle(VirtualHandle):
    """One stream: the order as it was at open, this rank's share, read as far as read."""

    kind = "datasets"

    def __init__(self, store: DatasetStore, stream: Stream) -> None:
        self._store = store
        self.stream = stream

    async def read(self, offset: int, size: int) -> ReadReply:
        # Served from DRAM: views of the block cache, replied before anything else runs
        # (no await between here and pyfuse3's writev, so no eviction can reuse a buffer).
        pieces = self.stream.read_pieces(offset, size)
        if pieces is not None:
            return pieces
        return await self.stream.read(offset, size)

    async def release(self) -> None:
        await scheduling.checkpoint()
        self._store.close_stream(self.stream)


class RecordHandle(VirtualHandle):
    kind = "datasets"

    def __init__(self, ds: Dataset, index: int) -> None:
        self._ds = ds
        self._index = index

    async def read(self, offset: int, size: int) -> bytes | bytearray | memoryview:
        return await self._ds.read_record(self._index, offset, size)


# --- nodes ------------------------------------------------------------------------------


class DatasetFile(VirtualFile):
    """A control file of one dataset; `make` builds the handle for an open."""

    def __init__(
        self, ino: int, name: bytes, mode: int, ds: Dataset, make: Callable[[int], VirtualHandle], writable: bool
    ) -> None:
        super().__init__(ino, name, stat.S_IFREG | mode)
        self.ds = ds
        self._make = make
        self.writable = writable

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        await scheduling.checkpoint()
        if self.ds.deleted:
            raise NotFound(f"datasets/{self.ds.name} was removed")
        if not self.writable and flags & os.O_ACCMODE != os.O_RDONLY:
            raise ReadOnly(f"{_label(self.ds, self.name.decode())} is read-only")
        return self._make(flags)


class StreamFile(VirtualFile):
    """`stream` (rank 0 of 1) or `stream-RANK-of-WORLD`."""

    acts_on_read = True  # each open streams an epoch (and prefetches for it)

    def __init__(self, ino: int, name: bytes, ds: Dataset, store: DatasetStore, rank: int, world: int) -> None:
        super().__init__(ino, name, stat.S_IFREG | 0o444)
        self.ds = ds
        self._store = store
        self.rank = rank
        self.world = world

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise ReadOnly(f"{_label(self.ds, self.name.decode())} is read-only")
        if self.ds.deleted:
            raise NotFound(f"datasets/{self.ds.name} was removed")
        stream = await self._store.open_stream(self.ds, self.rank, self.world, READ_PIECES)
        return StreamHandle(self._store, stream)


class RecordNode(VirtualFile):
    cache_s = RECORD_CACHE_S

    def __init__(self, ds: Dataset, index: int) -> None:
        super().__init__(record_ino(ds, index), b"%d" % index, stat.S_IFREG | 0o444)
        self.mtime_ns = ds.loaded_ns  # one node per lookup: a stable time, or tar sees a change
        self.ds = ds
        self.index = index

    @property
    def size(self) -> int:
        loaded = self.ds.index_loaded()
        return 0 if loaded is None or self.index >= len(loaded) else int(loaded["length"][self.index])

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        await scheduling.checkpoint()
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise ReadOnly(f"datasets/{self.ds.name}/records/{self.index}: records are written once, via append")
        if self.ds.deleted or self.index >= self.ds.count:
            raise NotFound(f"datasets/{self.ds.name}: no record {self.index}")
        return RecordHandle(self.ds, self.index)


class RecordListing(PositionListing):
    """`records/` for readdir, computed per position: (name, inode, mode, size)."""

    def __init__(self, ds: Dataset, bits: int) -> None:
        super().__init__(ds.count)
        self._mode = stat.S_IFREG | bits
        self._base = record_ino(ds, 0)
        loaded = ds.index_loaded()
        self._lengths = loaded["length"] if loaded is not None else np.zeros(ds.count, np.uint32)

    def _entry(self, position: int) -> Entry:
        return (b"%d" % position, self._base | position, self._mode, int(self._lengths[position]))


class RecordsDir(VirtualDir):
    """`records/`: record i as the file `i` (read-only)."""

    child_cache_s = RECORD_CACHE_S

    def __init__(self, ino: int, ds: Dataset) -> None:
        super().__init__(ino, b"records", stat.S_IFDIR | 0o555)
        self.ds = ds
        self.mtime_ns = ds.loaded_ns  # readdir hands its records this directory's times

    def lookup(self, name: bytes) -> VirtualNode:
        if not name.isdigit() or int(name) >= self.ds.count or (len(name) > 1 and name.startswith(b"0")):
            raise NotFound(f"datasets/{self.ds.name}/records: no record {name.decode(errors='replace')!r}")
        return RecordNode(self.ds, int(name)).govern(self.governor or self, Access.READ)

    def listing(self) -> Sequence[tuple[bytes, int, int, int]]:
        return RecordListing(self.ds, self.child_bits(Access.READ, 0o444))

    async def unlink(self, name: bytes) -> None:
        """Records are not removed one by one: a no-op, so `rm -r` of a dataset works."""
        await scheduling.checkpoint()
        self.lookup(name)


class DatasetDir(NamedDir):
    """`datasets/<name>/`: the control files and `records/`."""

    aliases = {b"append.npy": b"append", b"order.npy": b"order"}  # as `np.save(f"{d}/append", records)` names them

    def __init__(self, tree: VirtualTree, store: DatasetStore, ds: Dataset) -> None:
        super().__init__(tree.new_ino(), ds.name.encode(errors="surrogateescape"), stat.S_IFDIR | 0o755)
        self.own(tree.owners, b"datasets", tree.default_owner())
        self._tree = tree
        self._store = store
        self.ds = ds
        files: list[tuple[bytes, int, Callable[[int], VirtualHandle], bool, Access]] = [
            (b"config", 0o664, lambda flags: ConfigHandle(ds), True, Access.READ_WRITE),
            (b"append", 0o664, lambda flags: AppendHandle(ds), True, Access.WRITE),
            (b"state", 0o664, lambda flags: StateHandle(ds), True, Access.READ_WRITE),
            (b"order", 0o664, lambda flags: OrderHandle(ds), True, Access.READ_WRITE),
        ]
        snapshots = {b"config": lambda: config_text(ds), b"state": lambda: state_text(ds)}
        for name, mode, make, writable, access in files:
            node = DatasetFile(tree.new_ino(), name, mode, ds, make, writable).govern(self, access)
            node.snapshot = snapshots.get(name)  # sizes for copy tools (the order is not rendered to stat)
            self._add(node)
        self._add(ControlFile(tree.new_ino(), b"len", lambda: b"%d\n" % ds.count).govern(self, Access.READ))
        self._add(ControlFile(tree.new_ino(), b"stats", self._render_stats).govern(self, Access.READ))
        self._add(StreamFile(tree.new_ino(), b"stream", ds, store, 0, 1).govern(self, Access.READ))
        self._add(RecordsDir(tree.new_ino(), ds).govern(self, Access.DIRECTORY))
        self._shards: dict[tuple[int, int], StreamFile] = {}

    def _add(self, node: VirtualNode) -> None:
        self.children[node.name] = node
        self._tree.register(node)

    def _render_stats(self) -> bytes:
        streams = [s.statistics() for s in self._store.streams if s.dataset is self.ds]
        return (json.dumps({**self.ds.statistics(), "streams": streams}, indent=2) + "\n").encode()

    def lookup(self, name: bytes) -> VirtualNode:
        if name.startswith(b"stream-"):
            return self._shard(name)
        return super().lookup(name)

    def _shard(self, name: bytes) -> StreamFile:
        """`stream-RANK-of-WORLD` (not listed by readdir)."""
        parts = name[len(b"stream-") :].split(b"-of-")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise NotFound(f"datasets/{self.ds.name}: {name.decode(errors='replace')!r} is not stream-RANK-of-WORLD")
        rank, world = int(parts[0]), int(parts[1])
        if not 0 <= rank < world <= MAX_WORLD:
            raise NotFound(f"datasets/{self.ds.name}/{name.decode()}: need 0 <= RANK < WORLD <= {MAX_WORLD}")
        node = self._shards.get((rank, world))
        if node is None:
            node = StreamFile(self._tree.new_ino(), name, self.ds, self._store, rank, world).govern(self, Access.READ)
            if len(self._shards) < 1024:
                self._shards[(rank, world)] = node
            self._tree.register(node)
        return node

    async def unlink(self, name: bytes) -> None:
        """Control files come back: unlinking one is a no-op, so `rm -r` works."""
        await scheduling.checkpoint()
        if name not in CONTROL_NAMES:
            raise NotFound(f"datasets/{self.ds.name}: no file {name.decode(errors='replace')!r}")

    async def rmdir(self, name: bytes) -> None:
        """`records/` stays (a no-op, for `rm -r`)."""
        await scheduling.checkpoint()
        if name != b"records":
            raise NotFound(f"datasets/{self.ds.name}: no directory {name.decode(errors='replace')!r}")

    def forget_nodes(self) -> None:
        for node in [*self.children.values(), *self._shards.values(), self]:
            self._tree.unregister(node.ino)


class DatasetsDir(NamedKindDirectory):
    """`datasets/`: mkdir creates a dataset, rmdir (or `rm -r`) deletes it with its records."""

    def __init__(self, tree: VirtualTree, store: DatasetStore) -> None:
        super().__init__(tree, b"datasets")
        self._store = store
        tree.add_resolver(RECORD_BASE, RECORD_BASE + RECORD_SPAN, self._resolve_record)
        tree.add_status(store.statistics)

    def _names(self) -> list[str]:
        return self._store.names()

    def _object(self, name: str) -> Dataset:
        return self._store.get(name)

    def _make_dir(self, obj: Any) -> DatasetDir:
        return DatasetDir(self._tree, self._store, obj)

    async def mkdir(self, name: bytes, mode: int) -> VirtualNode:
        key = name.decode(errors="surrogateescape")
        self._store.create(key)
        await self._store.get(key).persist()
        return self._dir(key)

    async def rmdir(self, name: bytes) -> None:
        key = name.decode(errors="surrogateescape")
        await self._store.delete(key)
        self._forget(key)
        self._tree.owners.delete(self.name, name)

    def _resolve_record(self, ino: int) -> VirtualNode:
        number = (ino - RECORD_BASE) >> INDEX_BITS
        index = ino & ((1 << INDEX_BITS) - 1)
        ds = self._store.by_owner(DATASET_OWNER_BASE + number * OWNERS_PER_DATASET)
        if index >= ds.count:
            raise NotFound(f"datasets/{ds.name}: no record {index}")
        return RecordNode(ds, index).govern(self._dir(ds.name), Access.READ)
