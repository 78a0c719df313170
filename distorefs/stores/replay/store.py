"""BufferStore: the set of replay buffers under `buffers/`, by name.

Owns buffer creation and deletion, the owner ids their items use in the block tier
(from BUFFER_OWNER_BASE up, far above any inode), restoring buffers at start-up, and the
periodic snapshot of priorities. No FUSE here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from distorefs.errors import Exists, NotFound
from distorefs.news import Outbox
from distorefs.stores.files import check_name
from distorefs.stores.replay.buffer import ReplayBuffer
from distorefs.stores.replay.config import BufferConfig
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb

log = logging.getLogger(__name__)

BUFFER_OWNER_BASE = 1 << 48


class BufferStore:
    """Named replay buffers.

    Examples:
        >>> buffers = BufferStore.load(blocks, meta)
        >>> buf = buffers.create("atari")
        >>> buffers.names()
        ['atari']
    """

    def __init__(self, blocks: BlockStore, meta: MetaDb) -> None:
        self._blocks = blocks
        self._meta = meta
        self._buffers: dict[str, ReplayBuffer] = {}
        self._by_owner: dict[int, ReplayBuffer] = {}  # item inodes resolve through this
        self._next_owner = int(meta.get_kv("next_buffer_owner", BUFFER_OWNER_BASE))
        self.shard_limit: Callable[[], int] = lambda: 1  # how many shards a buffer may have
        self.news = Outbox[tuple[str, str]]()  # ("created" | "configured" | "deleted", name)

    @classmethod
    def load(cls, blocks: BlockStore, meta: MetaDb) -> BufferStore:
        self = cls(blocks, meta)
        for name, *row in meta.rows("buffers"):
            owner = row[0]
            buf = ReplayBuffer.restore(name, tuple(row), blocks, meta, blocks.owner_lengths(owner))
            self._buffers[name] = self._by_owner[owner] = buf
            buf.shard_limit, buf.news = (lambda: self.shard_limit()), self.news
            log.info("buffer %s: %d items restored (next index %d)", name, buf.size, buf.next_index)
        return self

    def names(self) -> list[str]:
        return list(self._buffers)

    def get(self, name: str) -> ReplayBuffer:
        buf = self._buffers.get(name)
        if buf is None:
            raise NotFound(f"no buffer {name!r}")
        return buf

    def by_owner(self, owner: int) -> ReplayBuffer:
        buf = self._by_owner.get(owner)
        if buf is None:
            raise NotFound(f"no buffer with owner {owner}")
        return buf

    def create(self, name: str, config: BufferConfig | None = None) -> ReplayBuffer:
        check_name(name.encode())
        if name in self._buffers:
            raise Exists(f"buffer {name!r} exists")
        owner = self._next_owner
        self._next_owner += 1
        self._meta.put("kv", ("next_buffer_owner",), (self._next_owner,))
        buf = ReplayBuffer(name, owner, config or BufferConfig(), self._blocks, self._meta)
        self._buffers[name] = self._by_owner[owner] = buf
        buf.shard_limit, buf.news = (lambda: self.shard_limit()), self.news
        buf.stage_row()
        self.news.post(("created", name))
        return buf

    def delete(self, name: str) -> None:
        """Remove the buffer and all its items (their log space is reclaimed by compaction)."""
        buf = self.get(name)
        buf.delete_all()
        buf.deleted = True
        del self._buffers[name]
        del self._by_owner[buf.owner]
        self._meta.delete("buffers", (name,))
        self.news.post(("deleted", name))

    def snapshot(self) -> int:
        """Stage the priorities of every buffer that changed; returns how many."""
        return sum(buf.stage_snapshot() for buf in self._buffers.values())

    async def run_snapshots(self, interval_s: float) -> None:
        """Background task: priorities and sample counts persist every `interval_s`."""
        while True:
            await trio.sleep(interval_s)
            if self.snapshot():
                await self._blocks.commit()
