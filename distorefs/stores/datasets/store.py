"""DatasetStore: the datasets under `datasets/`, by name.

Owns creating and deleting datasets, the block owners they use (four each, from
DATASET_OWNER_BASE up), restoring them at start-up, and the task that runs each open
stream's prefetch. No FUSE here.
"""

from __future__ import annotations

import logging

import numpy as np
import trio

from distorefs.errors import DistorefsError, Exists, NotFound, OutOfMemory
from distorefs.ids import DATASET_OWNER_BASE, OWNERS_PER_DATASET, is_dataset_owner
from distorefs.logs import at_doubling
from distorefs.memory import available_bytes
from distorefs.news import Outbox
from distorefs.stores.datasets.dataset import Dataset, DatasetConfig
from distorefs.stores.datasets.formats import StreamLayout
from distorefs.stores.datasets.stream import Stream
from distorefs.stores.files import check_name
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb

log = logging.getLogger(__name__)

STREAM_QUEUE = 64
PAGE_CACHE_SHARE = 2  # by default a dataset up to half of the memory available is read whole via the page cache
DRAM_SHARE = 2  # by default a dataset up to half of the DRAM budget is kept in the block cache by its streams,
KEPT_RECORD_BYTES = 4096  # where its records are smaller than this on average


class DatasetStore:
    """Named datasets.

    Examples:
        >>> datasets = DatasetStore.load(blocks, meta, window_bytes=256 << 20)
        >>> ds = datasets.create("imagenet-meta")
        >>> await ds.append([b"a", b"bc"]); await ds.seal()
        >>> stream = await datasets.open_stream(ds, rank=0, world=1)
    """

    def __init__(
        self,
        blocks: BlockStore,
        meta: MetaDb,
        window_bytes: int,
        page_cache_bytes: int | None = 0,
        dram_bytes: int | None = 0,
    ) -> None:
        self._blocks = blocks
        self._meta = meta
        self.window_bytes = window_bytes
        # the largest dataset a stream reads whole through the kernel's page cache beyond
        # its window; None: half of what the kernel calls available at the stream's open
        self.page_cache_bytes = page_cache_bytes
        # the largest dataset a stream loads into the block cache as it reads (Stream,
        # "kept in DRAM"); None: half of the DRAM budget
        self.dram_bytes = blocks.dram_budget_bytes // DRAM_SHARE if dram_bytes is None else dram_bytes
        self._datasets: dict[str, Dataset] = {}
        self._by_owner: dict[int, Dataset] = {}
        self._next_owner = int(meta.get_kv("next_dataset_owner", DATASET_OWNER_BASE))
        self._stream_send, self._stream_recv = trio.open_memory_channel[Stream](STREAM_QUEUE)
        self.streams: set[Stream] = set()
        self.streams_unprefetched = 0  # opens that found the prefetcher's queue full
        # Layouts (8 bytes a position) shared by the open streams of the same dataset,
        # order, rank and world, each counted once, all together at most the DRAM budget
        # (as the fs layer bounds open listings and batches; apart from the block cache's
        # reservations, which prefetched batches fill): without it,
        # each open of a stream of 2,000,000 records held 30 MB, and 200 of them 7.5 GB of
        # a daemon with a 1 GiB budget.
        self._layouts: dict[_LayoutKey, _SharedLayout] = {}
        self._stream_layouts: dict[Stream, _LayoutKey] = {}
        self.layout_bytes = 0
        self.layout_limit = blocks.dram_budget_bytes
        self.news = Outbox[tuple[str, str]]()  # ("created" | "configured" | "sealed" | "deleted", name)

    @classmethod
    def load(
        cls,
        blocks: BlockStore,
        meta: MetaDb,
        window_bytes: int,
        page_cache_bytes: int | None = 0,
        dram_bytes: int | None = 0,
    ) -> DatasetStore:
        """Restore every dataset as its last commit left it; drop the blocks of datasets
        deleted before a crash and of writes past the last commit."""
        self = cls(blocks, meta, window_bytes, page_cache_bytes, dram_bytes)
        for name, *row in meta.rows("datasets"):
            ds = Dataset.restore(name.decode(errors="surrogateescape"), tuple(row), blocks, meta)
            ds.news = self.news
            ds.writer = meta.get_kv(_writer_key(ds.name))
            self._datasets[ds.name] = self._by_owner[ds.owner] = ds
        live = {o for ds in self._datasets.values() for o in ds.owners()}
        orphans = [o for o in blocks.owners() if is_dataset_owner(o) and o not in live]
        for owner in orphans:
            blocks.delete_owner(owner)
        if self._datasets:
            log.info("datasets: %d restored", len(self._datasets))
        return self

    async def load_indexes(self) -> None:
        """Read every dataset's record index (16 bytes a record) at start-up, so that
        `records/` can list and stat without waiting. A dataset whose index cannot be read
        is logged; its reads fail with EIO."""
        for ds in self._datasets.values():
            try:
                await ds.index()
            except DistorefsError as exc:
                log.error("datasets/%s: cannot read the record index: %s", ds.name, exc)

    def names(self) -> list[str]:
        return list(self._datasets)

    def get(self, name: str) -> Dataset:
        ds = self._datasets.get(name)
        if ds is None:
            raise NotFound(f"no dataset {name!r}")
        return ds

    def by_owner(self, owner: int) -> Dataset:
        ds = self._by_owner.get(owner)
        if ds is None:
            raise NotFound(f"no dataset with owner {owner}")
        return ds

    def create(self, name: str, config: DatasetConfig | None = None) -> Dataset:
        check_name(name.encode(errors="surrogateescape"))
        if name in self._datasets:
            raise Exists(f"dataset {name!r} exists")
        owner = self._next_owner
        self._next_owner += OWNERS_PER_DATASET
        self._meta.put("kv", ("next_dataset_owner",), (self._next_owner,))
        ds = Dataset(name, owner, self._blocks, self._meta, config)
        ds.news = self.news
        self._datasets[name] = self._by_owner[owner] = ds
        ds.stage_row()
        self.news.post(("created", name))
        return ds

    def make_copy(self, ds: Dataset, writer: str) -> None:
        """Cluster mode: `ds` is another node's dataset, written only as `writer` says
        (`Dataset.writer`); kept across restarts with the dataset's row."""
        ds.writer = writer
        self._meta.put("kv", (_writer_key(ds.name),), (writer,))

    async def delete(self, name: str) -> None:
        """Remove the dataset and its records (their log space goes at compaction)."""
        ds = self.get(name)
        ds.deleted = True
        del self._datasets[name]
        del self._by_owner[ds.owner]
        for stream in [s for s in self.streams if s.dataset is ds]:
            self.close_stream(stream)
        for owner in ds.owners():
            self._blocks.delete_owner(owner)
        self._meta.delete("datasets", (name.encode(errors="surrogateescape"),))
        if ds.writer is not None:
            self._meta.delete("kv", (_writer_key(name),))
        self.news.post(("deleted", name))
        await self._blocks.commit()

    # --- streams ----------------------------------------------------------------------------

    async def open_stream(self, ds: Dataset, rank: int, world: int, pieces: int = 0) -> Stream:
        """A stream of rank `rank`'s share of the current order (Busy until sealed;
        OutOfMemory where its layout does not fit the DRAM budget). `pieces`: the most
        pieces the caller takes a read as (Stream.read_pieces); 0: none."""
        positions = await ds.shard(rank, world)
        index = await ds.index()
        ds.check_live()
        key, layout = self._share_layout(ds, rank, world, positions, index)  # (no await from here on)
        window = ds.config.prefetch_window_bytes or self.window_bytes
        # Kept in DRAM (Stream; design.md, "A dataset kept in DRAM") where its records are
        # small: there the load costs less CPU than the reads of a record each it saves.
        # Bigger records stream through the page cache about as fast as from DRAM here.
        dram = self.dram_bytes if ds.data_bytes < KEPT_RECORD_BYTES * ds.count else 0
        stream = Stream(ds, layout, index, self._blocks, window, self._page_cache_limit(), pieces, dram)
        ds.streams_opened += 1
        self.streams.add(stream)
        self._stream_layouts[stream] = key
        try:
            self._stream_send.send_nowait(stream)
        except trio.WouldBlock:  # a client can open streams as fast as it likes: a line per doubling
            self.streams_unprefetched += 1
            if at_doubling(self.streams_unprefetched):
                log.warning(
                    "datasets/%s: too many streams opening at once; this one reads without prefetch (%d so far)",
                    ds.name, self.streams_unprefetched,
                )  # fmt: skip
        return stream

    def _page_cache_limit(self) -> int:
        if self.page_cache_bytes is not None:
            return self.page_cache_bytes
        return (available_bytes() or 0) // PAGE_CACHE_SHARE

    def _share_layout(
        self, ds: Dataset, rank: int, world: int, positions: np.ndarray, index: np.ndarray
    ) -> tuple[_LayoutKey, StreamLayout]:
        """The layout of rank `rank`'s share of `ds`'s current order (its `positions`):
        the one open streams of the same share hold, or a new one, counted."""
        key = (ds.owner, ds.order_serial, ds.count, rank, world)
        shared = self._layouts.get(key)
        if shared is None:
            layout = StreamLayout(ds.dtype, positions, index["length"][positions])
            held = self.layout_bytes
            if held + layout.nbytes > self.layout_limit:
                raise OutOfMemory(
                    f"datasets/{ds.name}: a stream of {len(layout)} records needs {layout.nbytes} bytes for its"
                    f" layout; open streams hold {held} in theirs, and together they may hold"
                    f" {self.layout_limit} (the DRAM budget); close some"
                )
            shared = self._layouts[key] = _SharedLayout(layout)
            self.layout_bytes += layout.nbytes
        shared.users += 1
        return key, shared.layout

    def _let_layout_go(self, key: _LayoutKey) -> None:
        shared = self._layouts[key]
        shared.users -= 1
        if not shared.users:
            del self._layouts[key]
            self.layout_bytes -= shared.layout.nbytes

    def close_stream(self, stream: Stream) -> None:
        """The stream's end (its handle's release, or its dataset's removal): its
        prefetch stops and its share of the layout goes. A second call does nothing."""
        stream.close()
        self.streams.discard(stream)
        key = self._stream_layouts.pop(stream, None)
        if key is not None:
            self._let_layout_go(key)

    async def run_streams(self) -> None:
        """Background task: runs the prefetch of each stream from its open to its close."""
        async with trio.open_nursery() as nursery:
            async for stream in self._stream_recv:
                if not stream.closed:
                    nursery.start_soon(stream.run_prefetch)

    def statistics(self) -> dict[str, int]:
        return {
            "datasets": len(self._datasets),
            "dataset_streams_open": len(self.streams),
            "dataset_records": sum(ds.count for ds in self._datasets.values()),
            "dataset_bytes": sum(ds.data_bytes for ds in self._datasets.values()),
            "dataset_stream_layout_bytes": self.layout_bytes,
        }


_LayoutKey = tuple[int, int, int, int, int]  # (dataset owner, order serial, count, rank, world)


class _SharedLayout:
    """A stream layout and how many open streams use it."""

    __slots__ = ("layout", "users")

    def __init__(self, layout: StreamLayout) -> None:
        self.layout = layout
        self.users = 0


def _writer_key(name: str) -> str:
    return f"dataset_writer/{name}"
