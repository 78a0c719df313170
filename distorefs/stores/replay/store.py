"""BufferStore: the set of replay buffers under `buffers/`, by name.

Owns buffer creation and deletion, the owner ids their items use in the block tier
(from BUFFER_OWNER_BASE up, far above any inode), restoring buffers at start-up, and the
periodic snapshot of priorities, and where each buffer lives: all on this node, or
spread over nodes (`set_layout`, with the ShardPeer given at construction in a
cluster). No FUSE here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from distorefs import memory
from distorefs.errors import Exists, NotFound, StoreFull
from distorefs.ids import BUFFER_OWNER_BASE
from distorefs.news import Outbox
from distorefs.stores.files import check_name
from distorefs.stores.replay.buffer import MIN_DEFAULT_CAPACITY, ReplayBuffer, default_capacity, ring_refusal
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.sharded import ShardedBuffer, ShardLayout, ShardPeer
from distorefs.stores.replay.snapshot import encode_state
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from distorefs.types import BlockKey

log = logging.getLogger(__name__)

WARM_CHUNK = 8192  # items per trip to a worker thread when a restored buffer is read into DRAM


def _still_belongs(blocks: BlockStore, owner: int, committed_next: int) -> Callable[[int], bool]:
    """Which of a buffer's tail records to adopt: items past the committed next_index are
    appends the commit did not see; below it, only items whose row committed (a newer
    record of theirs: a rewrite, a compaction move). The rest left before the crash."""
    return lambda number: number >= committed_next or blocks.has_block(BlockKey(owner, number))


class BufferStore:
    """Named replay buffers.

    Examples:
        >>> buffers = BufferStore.load(blocks, meta)
        >>> buf = buffers.create("atari")
        >>> buffers.names()
        ['atari']
    """

    def __init__(self, blocks: BlockStore, meta: MetaDb, peer: ShardPeer | None = None) -> None:
        """`peer` reaches the other nodes of a cluster; None on a single node."""
        self._blocks = blocks
        self._peer = peer
        self._meta = meta
        self._buffers: dict[str, ReplayBuffer] = {}
        self._by_owner: dict[int, ReplayBuffer] = {}  # item inodes resolve through this
        self._next_owner = int(meta.get_kv("next_buffer_owner", BUFFER_OWNER_BASE))
        self.news = Outbox[tuple[str, str]]()  # ("created" | "configured" | "deleted", name)

    @classmethod
    def load(cls, blocks: BlockStore, meta: MetaDb, peer: ShardPeer | None = None) -> BufferStore:
        self = cls(blocks, meta, peer)
        snapshots: dict[str, bytes] = {str(name): bytes(data) for name, data in meta.rows("buffer_snapshots")}
        for name, *row in meta.rows("buffers"):
            owner, committed_next = row[0], int(row[2])
            # appends persist log-only (ReplayBuffer.persist_appends): adopt them from the tail
            blocks.adopt_tail(owner, _still_belongs(blocks, owner, committed_next))
            if name in snapshots:  # schema 5 keeps it apart; older rows carry it themselves
                row[-1] = snapshots[name]
            buf = ReplayBuffer.restore(
                name, tuple(row), blocks, meta, blocks.owner_lengths(owner), self.news, self.shard_limit
            )
            notes = blocks.take_notes(owner)  # priority updates after the snapshot, in order
            if notes:
                pairs = sum(buf.replay_priorities(note) for note in notes)
                log.info("buffer %s: %d priority updates replayed (%d pairs)", name, len(notes), pairs)
            self._buffers[name] = self._by_owner[owner] = buf
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
        if config is None:  # (mkdir) the default capacity, or what the rings' share has room for
            capacity = default_capacity(self._blocks.ring_room_bytes)
            if capacity is None:
                raise StoreFull(f"buffers/{name}: {ring_refusal(self._blocks, MIN_DEFAULT_CAPACITY)}")
            config = BufferConfig(capacity=capacity)
        owner = self._next_owner
        buf = ReplayBuffer(
            name, owner, config, self._blocks, self._meta, self.news, self.shard_limit, new=True
        )  # (StoreFull where its ring does not fit: nothing changed)
        self._next_owner += 1
        self._meta.put("kv", ("next_buffer_owner",), (self._next_owner,))
        self._buffers[name] = self._by_owner[owner] = buf
        buf.stage_row()
        self.news.post(("created", name))
        return buf

    def delete(self, name: str) -> None:
        """Remove the buffer and all its items (their log space is reclaimed by compaction)."""
        buf = self.get(name)
        buf.delete_all()
        del self._buffers[name]
        del self._by_owner[buf.owner]
        self._meta.delete("buffers", (name,))
        self._meta.delete("buffer_snapshots", (name,))
        self.news.post(("deleted", name))

    def shard_limit(self) -> int:
        """How many shards a buffer may have: the live nodes (1 without a cluster)."""
        return 1 if self._peer is None else self._peer.shard_limit()

    def set_layout(self, name: str, nodes: list[str]) -> None:
        """Place buffer `name` on `nodes` (shard i on nodes[i]): all on this node when
        that is the only one, else spread (this node's shard, if any, is the local one)."""
        buffer = self.get(name)
        if self._peer is None or nodes == [self._peer.me]:
            buffer.spread_over(None)
            return
        local = buffer if self._peer.me in nodes else None
        buffer.spread_over(ShardedBuffer(name, buffer.config, ShardLayout(list(nodes)), local, self._peer))

    def snapshot(self) -> int:
        """Stage the priorities of every buffer that changed, and the notes mark with them
        (the notes before it are in these snapshots); returns how many."""
        position = self._blocks.log_position()
        staged = sum(buf.stage_snapshot() for buf in self._buffers.values())
        self._blocks.stage_notes_mark(position)
        return staged

    async def warm_up(self, dram_budget_bytes: int) -> int:
        """Start-up task: read the restored buffers' items from the log into DRAM while
        they fit in half the budget, smallest buffers first, in chunks of WARM_CHUNK
        (each one trip to a worker thread). A draw from a buffer restored after a restart
        then finds its items in DRAM, as it does before the restart, instead of reading
        each cold item from the log. Returns how many items it read."""
        room = dram_budget_bytes // 2
        warmed = 0
        with memory.full_collections_held():  # a block object per item (memory.py says why)
            for buf in sorted(self._buffers.values(), key=lambda b: b.stored_bytes):
                if buf.stored_bytes > room:
                    break
                room -= buf.stored_bytes
                live = buf.live_indices()
                for start in range(0, len(live), WARM_CHUNK):
                    if buf.deleted:
                        break
                    await buf.warm(live[start : start + WARM_CHUNK])
                    warmed += min(WARM_CHUNK, len(live) - start)
                    memory.collect_young()
        if warmed:
            log.info("buffers: %d items read into DRAM after the start", warmed)
        return warmed

    async def snapshot_in_thread(self) -> int:
        """`snapshot`, with each buffer's sorting and encoding in a worker thread (0.2 s
        for a million items, which would stall every request on the event loop)."""
        # Every buffer's arrays are copied at one instant, with the log's position then:
        # each priority note before it is in these copies, each one after it is replayed
        # at a start-up on top of them (an update is applied before its note is written).
        position = self._blocks.log_position()
        states = [(buf, buf.snapshot_state()) for buf in list(self._buffers.values())]
        staged = 0
        for number, (buf, state) in enumerate(states):
            if state is None:
                continue
            try:
                encoded = await trio.to_thread.run_sync(encode_state, *state)
            except BaseException:
                for later, later_state in states[number:]:
                    if later_state is not None:
                        later.snapshot_failed()
                raise
            if not buf.deleted:
                buf.stage_encoded(encoded)
                staged += 1
        if staged or self._blocks.notes_waiting():  # (notes of a buffer deleted since, say)
            self._blocks.stage_notes_mark(position)
        return staged

    async def run_snapshots(self, interval_s: float) -> None:
        """Background task: priorities and sample counts persist every `interval_s`."""
        while True:
            await trio.sleep(interval_s)
            if await self.snapshot_in_thread() or self._blocks.notes_mark_staged():
                await self._blocks.commit()
