"""ReplayBuffer: one replay buffer or memory bank over the block tier.

Owns the item index of one buffer: which global index lives in which ring slot, each
item's priority and sample count, the sum/min/max trees, the counters, the rate limiter
and the waiting of blocked samplers and writers. Item bytes are blocks of the block tier
keyed (owner, index), so a FIFO buffer's oldest items die in log order and whole
segments are dropped without copying.

Indices are 0, 1, 2, ... in append order and never reused. Index i lives in slot
i % capacity, so appending past capacity evicts the oldest item (FIFO). Deleted items
leave an empty slot. Everything here is synchronous between awaits; waits are
`_wait_until` on one event that every change sets.

Which slots a draw picks is the config's sampler (samplers/), what leaves after a draw
its remover (removers/); both are chosen once when a config is applied. A draw is two
steps: `pick` reads the items and changes nothing, `commit` counts them as sampled (and
lets the remover act) once the whole batch is handed out, so a batch that is thrown
away (another shard said EAGAIN) counts nothing.

A buffer that its store spread over several nodes (stores/replay/sharded.py) answers
`append`, `sample` and `update_priorities` for the whole buffer through its Spread; the
`*_local` methods, `pick` and `commit` always act on this node's shard.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import trio
import zstandard

from distorefs import memory, scheduling
from distorefs.compiled import compiled_array
from distorefs.errors import (
    DistorefsError,
    FileTooLarge,
    InvalidArgument,
    NotFound,
    NotSupported,
    OutOfMemory,
    StoreFull,
    TryAgain,
)
from distorefs.logs import FailureLog
from distorefs.news import Outbox
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.draws import (
    Batch,
    Drawn,
    ShardState,
    Spread,
    check_priorities,
    check_scalable,
    encoded_batch,
    highest_priority,
    importance_weights,
    too_high,
    uniform_weights,
)
from distorefs.stores.replay.formats import MAX_ITEM_BYTES, PAIRS
from distorefs.stores.replay.mirror import (
    COUNTS,
    INLINE_BYTES,
    Mirror,
    add_at,
    batch_repeats,
    stride_for,
)
from distorefs.stores.replay.rate_limiter import RateLimiter
from distorefs.stores.replay.removers import make_remover
from distorefs.stores.replay.rows import RecordRows, rows_bytes_for
from distorefs.stores.replay.samplers import make_sampler
from distorefs.stores.replay.snapshot import encode_state, match_snapshot
from distorefs.stores.replay.sumtree import SegmentTree
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.dram import INDEX_BUDGET_SHARE, Block
from distorefs.tiers.metadb import MetaDb
from distorefs.types import BlockKey

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class MirroredBatch:
    """A batch drawn for a shared-memory sampler: where its items sit in the arena."""

    mirror: Mirror
    indices: np.ndarray  # int64
    weights: np.ndarray  # float32
    arena_slots: np.ndarray  # int64
    lengths: np.ndarray  # int64, each item's bytes
    repeated: bool | None  # whether an item was drawn twice (None: not looked, mirror.batch_repeats)


async def _as_is(batch: Batch) -> Batch:
    await scheduling.checkpoint()
    return batch


DEFAULT_PRIORITY = 1.0
RECENT_ERRORS = 5


HELD_SLOT_BYTES = 8  # a ring slot's entry in the table of drawn blocks (an object reference)
HELD_BUDGET_SHARE = 64  # that table takes at most this share of the DRAM budget
# An item up to this size is drawn as a copy (bytes), not a view of its block: a copy is
# smaller than a view (about 250 bytes with its buffer object) and Python's cyclic
# collector does not track it. The million views made by one sample.1000000 of a blob
# buffer brought six full collections into its 4.4 s (every request of the mount
# waiting throughout); held views also make every later full collection longer.
COPIED_ITEM_BYTES = 128
MIN_DEFAULT_CAPACITY = 1024  # the smallest ring a buffer made without a config gets (default_capacity)
BULK_DRAW_ITEMS = 16_384  # a draw of this many items or more runs with automatic collections paused
HELD_FILL_SLICE = 1_024  # a draw that finds more of its items not held gathers them in slices (_fill_held)
HELD_FILL_ROUNDS = 4  # ... and draws again at most this many times; the last draw looks its items up in one go
PICK_TRIES = 8  # a draw asks the limiter again after its wait; items removed meanwhile make it wait again


def ring_refusal(blocks: BlockStore, capacity: int) -> str:
    """Why a ring of `capacity` slots was refused its DRAM (`_reserve_ring`)."""
    budget = blocks.dram_budget_bytes
    return (
        f"a ring of {capacity} slots takes {ring_index_bytes(capacity)} bytes of the DRAM budget ({budget}"
        f" bytes, of which all buffers' rings may take {budget // INDEX_BUDGET_SHARE};"
        f" {blocks.dram_index_bytes} taken now), and they are not free (a smaller capacity, fewer buffers,"
        " or a bigger --dram-budget)"
    )


def default_capacity(room_bytes: int) -> int | None:
    """The capacity of a buffer made without a config (mkdir): the default 100,000 slots,
    or as many as `room_bytes` of ring have room for where that is less (a small DRAM
    budget, many buffers), but not under MIN_DEFAULT_CAPACITY (None: no room)."""
    high = BufferConfig.capacity
    if ring_index_bytes(high) <= room_bytes:
        return high
    if ring_index_bytes(MIN_DEFAULT_CAPACITY) > room_bytes:
        return None
    low = MIN_DEFAULT_CAPACITY  # fits; high does not
    while high - low > 1:
        middle = (low + high) // 2
        if ring_index_bytes(middle) <= room_bytes:
            low = middle
        else:
            high = middle
    return low


def ring_index_bytes(capacity: int) -> int:
    """The memory of a ring of `capacity` slots: its four per-slot arrays (index,
    priority, times sampled, size) and its trees (the sum tree with its min and max, and
    the live-slot tree: 2 x the next power of two x 8 bytes each). Counted against the
    DRAM budget, so that a config cannot take the daemon's memory (a capacity of 2**26
    was 2 GB and 3.5 s of the event loop for an empty buffer)."""
    size = 1 << max(capacity - 1, 0).bit_length()
    return 4 * 8 * capacity + 4 * 2 * 8 * size


class ReplayBuffer:
    """A replay buffer: FIFO ring of items with priorities, samplers and a rate limiter.

    Examples:
        >>> buf = ReplayBuffer("atari", owner, BufferConfig(capacity=1000), blocks, meta)
        >>> await buf.append([b"item0", b"item1"])
        [0, 1]
        >>> batch = await buf.sample(2)          # waits while it cannot be served
        >>> buf.update_priorities(np.array([0]), np.array([2.5]))
    """

    def __init__(
        self,
        name: str,
        owner: int,
        config: BufferConfig,
        blocks: BlockStore,
        meta: MetaDb,
        news: Outbox[tuple[str, str]] | None = None,
        shard_limit: Callable[[], int] = lambda: 1,
        new: bool = False,
    ) -> None:
        """`news` is the store's outbox (configuration changes are posted there);
        `shard_limit` says how many shards a config may ask for (the live nodes). A `new`
        buffer (not one loaded at start-up, whose memory is held whatever the budget says)
        is StoreFull (ENOSPC), nothing held, when its ring does not fit the DRAM budget."""
        self.name = name
        self.owner = owner
        self._blocks = blocks
        blocks.spill(owner)  # cold items may go to peers' lent memory (cluster mode)
        self._meta = meta
        self._rng = np.random.default_rng()
        self.next_index = 0
        self.priority_updates_skipped = 0  # pairs of items that had left (not persisted: a counter)
        self.inserts = 0
        self.samples = 0
        self.removed = 0
        self.stored_bytes = 0
        self.blocked_readers = 0
        self.blocked_writers = 0
        # every change a draw depends on (items, priorities, counts, config, placement)
        # moves this on: a batch drawn ahead is handed out only while it has not moved
        self.changes = 0
        self.errors: list[str] = []
        self._refusals = FailureLog(log)
        self.loaded_ns = time.time_ns()  # when this daemon made or restored it: its items' mtime
        self.deleted = False
        self._shard_limit = shard_limit
        self._spread: Spread | None = None  # set by the store when it spreads the buffer over nodes
        self._news: Outbox[tuple[str, str]] = news if news is not None else Outbox()
        self._changed = trio.Event()
        self._snapshot_dirty = False
        self._snapshot: bytes | None = None  # the last staged snapshot (its own row, see stage_snapshot)
        self.mirror: Mirror | None = None  # the items in shared memory, once a sampler asked (mirror.py)
        self._rows: RecordRows | None = None  # small records by ring slot, for draws (rows.py)
        # Without rows: a view of each ring slot's item's bytes while DRAM holds its block
        # (None: unknown), so a draw finds its items without a lookup in the block tier per
        # item (`_payloads`). DRAM tells `_block_left` of every block of this owner that leaves it.
        self._held: np.ndarray | None = None
        blocks.watch(owner, self._block_left)
        self._row_mark: int | None = None  # MetaDb mark of the row's first staging (0: read from it)
        self._ring_reserved = 0  # ring_index_bytes of the ring laid out, reserved in the DRAM budget
        self.config: BufferConfig = config  # (set again, with everything it implies, by _apply_config)
        if new and not self._reserve_ring(ring_index_bytes(config.capacity), force=False):
            blocks.watch(owner, None)
            raise StoreFull(f"buffers/{name}: {ring_refusal(self._blocks, config.capacity)}")
        self._apply_config(config, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64))

    # --- layout ---------------------------------------------------------------------

    def _apply_config(
        self, config: BufferConfig, indices: np.ndarray, priorities: np.ndarray, times: np.ndarray, sizes: np.ndarray
    ) -> None:
        """(Re)build the ring for `config` holding the given live items (its memory counted
        in the DRAM budget whether it fits or not: `reconfigure` refuses one that does not
        before it gets here)."""
        self._reserve_ring(0 if self.deleted else ring_index_bytes(config.capacity), force=True)
        mirror = self.mirror
        if mirror is not None:
            same_items = config.zstd_level is None and config.itemsize == self.config.itemsize
            if config.capacity != mirror.capacity or not same_items:
                self.close_mirror()  # laid out for the old ring or items: the next draw makes a new one
        self.config = config
        self._highest_priority = highest_priority(config.alpha, config.epsilon)  # (draws.py)
        self._config_json = config.dumps()  # the row carries it on every append: once here
        self.limiter = RateLimiter.from_config(config)
        self._sampler = make_sampler(config.sampler)
        self._remover = make_remover(config.max_times_sampled)
        self._zstd_level = config.zstd_level
        cap = config.capacity
        self._slot_index = np.full(cap, -1, dtype=np.int64)
        self._priority = np.zeros(cap, dtype=np.float64)
        self._times = np.zeros(cap, dtype=np.int64)
        self._size = np.zeros(cap, dtype=np.int64)
        self._tree = SegmentTree(cap, with_min_max=True)
        self._live = SegmentTree(cap)
        slots = indices % cap
        self._slot_index[slots] = indices
        self._priority[slots] = priorities
        self._times[slots] = times
        self._size[slots] = sizes
        self._tree.update(slots, self._scaled(priorities))
        self._live.update(slots, np.ones(len(slots)))
        self._make_rows()
        keep_blocks = self._rows is None and not self.deleted and cap * HELD_SLOT_BYTES <= self._held_limit()
        self._held = np.full(cap, None, dtype=object) if keep_blocks else None

    def _reserve_ring(self, nbytes: int, force: bool) -> bool:
        """Make the ring's reservation `nbytes`; False (nothing changed) when more does not
        fit in the DRAM budget, unless `force`."""
        more = nbytes - self._ring_reserved
        if more > 0 and not self._blocks.reserve(more, force, index=True):
            return False
        if more < 0:
            self._blocks.unreserve(-more, index=True)
        self._ring_reserved = nbytes
        return True

    def _make_rows(self) -> None:
        """Rows for this config's ring where its records are small and it fits their
        share of the budget (rows.py); none otherwise. They fill as items come and go."""
        if self._rows is not None:
            self._rows.close()
            self._rows = None
        if self.deleted:
            return  # a deleted buffer holds no share of the budget
        config, blocks = self.config, self._blocks
        compressed = config.zstd_level is not None
        if config.itemsize is not None and rows_bytes_for(
            config.capacity, config.itemsize, compressed, blocks.dram_budget_bytes, blocks.dram_reserved_bytes
        ):
            self._rows = RecordRows.make(config.capacity, config.itemsize, self._blocks.reserve, self._blocks.unreserve)

    def _scaled(self, priorities: np.ndarray) -> np.ndarray:
        cfg = self.config
        return np.power(priorities + cfg.epsilon, cfg.alpha) if cfg.alpha != 0 else np.ones_like(priorities)

    @property
    def size(self) -> int:
        return round(self._live.total)

    # the Ring a sampler looks at (samplers/base.py)
    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def priority_tree(self) -> SegmentTree:
        return self._tree

    @property
    def live_tree(self) -> SegmentTree:
        return self._live

    def spread_over(self, spread: Spread | None) -> None:
        """The store places the buffer: over nodes (`spread`), or all on this node (None)."""
        self._spread = spread
        self._notify()

    def _slot_of(self, index: int) -> int:
        """The slot of a live item; NotFound otherwise."""
        if index < 0:
            raise NotFound(f"buffers/{self.name}: no item {index}")
        slot = index % self.config.capacity
        if self._slot_index[slot] != index:
            raise NotFound(f"buffers/{self.name}: no item {index}")
        return slot

    def live_indices(self) -> np.ndarray:
        """Live indices in append order."""
        live = self._slot_index[self._slot_index >= 0]
        return np.sort(live)

    def live_items(self) -> tuple[np.ndarray, np.ndarray]:
        """Live indices in append order and their item sizes."""
        live = self.live_indices()
        return live, self._size[live % self.config.capacity]

    def key(self, index: int) -> BlockKey:
        return BlockKey(self.owner, index)

    def _notify(self) -> None:
        self.changes += 1
        self._changed.set()
        self._changed = trio.Event()

    def record_error(self, message: str) -> None:
        """Keep the last few rejected inputs for `stats`; they also go to the daemon log,
        at most 20 lines per 10 s for this buffer (a client can send the same bad input
        as fast as it likes: a session's refused draws came at thousands a second)."""
        self._refusals.refused(f"buffers/{self.name}", message)
        self.errors = [*self.errors[-(RECENT_ERRORS - 1) :], f"{time.strftime('%H:%M:%S')} {message}"]

    # --- waiting ----------------------------------------------------------------------

    async def _wait_until(self, ready: Callable[[], bool], nonblocking: bool, what: str, writer: bool) -> None:
        """Return once `ready()`; EAGAIN at once under O_NONBLOCK, or after sample_timeout;
        ENOENT once the buffer is deleted (at once for a waiter: nothing it waits for can
        come, and what it would add would stay behind in the block tier)."""
        self.check_live()
        if ready():
            await scheduling.checkpoint()
            return
        if nonblocking:
            raise TryAgain(f"buffers/{self.name}: {what} would block")
        timeout = self.config.sample_timeout
        if writer:
            self.blocked_writers += 1
        else:
            self.blocked_readers += 1
        try:
            with trio.move_on_after(timeout):
                while not ready():
                    changed = self._changed
                    await changed.wait()
                    self.check_live()
                return
        finally:
            if writer:
                self.blocked_writers -= 1
            else:
                self.blocked_readers -= 1
        raise TryAgain(f"buffers/{self.name}: {what} still blocked after sample_timeout={timeout} s")

    def can_append(self, count: int) -> bool:
        """Whether `count` appends would go through now without waiting (a spread
        buffer cannot tell without asking other nodes: False)."""
        if self._spread is not None:
            return False
        r = self.limiter
        return all(r.can_insert(self.inserts + k, self.samples) for k in range(min(count, 64)))

    def can_sample(self, count: int | None) -> bool:
        """Whether a sample of the whole buffer would be served now without waiting (a
        spread buffer cannot tell without asking other nodes: False)."""
        return self._spread is None and self.can_sample_local(count)

    def can_sample_local(self, count: int | None) -> bool:
        """Whether this node's shard can serve a pick of `count` now."""
        count = count or self.config.batch_size
        return self.limiter.can_sample(self.size, self.inserts, self.samples, count)

    # --- appending --------------------------------------------------------------------

    async def append(self, items: Sequence[bytes | bytearray], nonblocking: bool = False) -> list[int]:
        """Add items to the buffer, wherever it lives; return their (global) indices."""
        if self._spread is not None:
            return await self._spread.append(items, nonblocking)
        return await self.append_local(items, nonblocking)

    async def append_local(self, items: Sequence[bytes | bytearray], nonblocking: bool = False) -> list[int]:
        """Add items to this node's shard in order (each waits for the rate limiter);
        return their indices.

        For schema buffers each item must be exactly one record. The items are in DRAM
        when this returns; `persist` makes them survive a killed daemon.
        """
        itemsize = self.config.itemsize
        for item in items:
            if len(item) > MAX_ITEM_BYTES:
                raise FileTooLarge(f"buffers/{self.name}: an item of {len(item)} bytes, at most {MAX_ITEM_BYTES}")
            if itemsize is not None and len(item) != itemsize:
                raise InvalidArgument(f"buffers/{self.name}: record of {len(item)} bytes, schema needs {itemsize}")
        stored: Sequence[bytes | bytearray] = items
        if self._zstd_level is not None and items:
            level = self._zstd_level
            stored = await trio.to_thread.run_sync(lambda: [zstandard.compress(i, level) for i in items])
        added: list[int] = []
        at = 0
        while at < len(stored):
            await self._wait_until(
                lambda: self.limiter.can_insert(self.inserts, self.samples), nonblocking, "append", writer=True
            )
            # Reserve as many indices as the limiter lets through now (at most a ring's worth),
            # so the counts stay honest while the bytes go into DRAM.
            count = 1
            limit = min(len(stored) - at, self.config.capacity)
            while count < limit and self.limiter.can_insert(self.inserts + count, self.samples):
                count += 1
            first = self.next_index
            self.next_index += count
            self.inserts += count
            chunk = stored[at : at + count]
            keys = [self.key(first + k) for k in range(count)]
            # bytes first: logged at once where they may be (small items of a buffer whose
            # row is committed: `persist_appends` then finds nothing left to write) ...
            if self.config.sync or not self.row_committed or not self._blocks.put_logged(keys, chunk):
                for key, data in zip(keys, chunk, strict=True):
                    await self._blocks.put(key, data)
                if self.deleted:  # deleted while the bytes went in: they go too
                    for key in keys:
                        self._blocks.delete(key)
                    self.check_live()
            sizes = [len(item) for item in items[at : at + count]]
            self._publish(first, sizes)  # ... then samplers may see the indices
            self._mirror_place(np.arange(first, first + count, dtype=np.int64), chunk)
            self._rows_place(np.arange(first, first + count, dtype=np.int64), items[at : at + count])
            added.extend(range(first, first + count))
            at += count
        self._snapshot_dirty = True
        self.stage_row()
        return added

    def _publish(self, first: int, sizes: list[int]) -> None:
        """Make indices first.. live (their bytes are in the block tier), evicting the
        items whose slots they take (FIFO). One batched tree update for the lot."""
        if len(sizes) == 1:
            self._publish_one(first, sizes[0])
            return
        indices = np.arange(first, first + len(sizes), dtype=np.int64)
        size_array = np.asarray(sizes, dtype=np.int64)
        slots = indices % self.config.capacity
        old = self._slot_index[slots]
        # A concurrent appender may already have put newer items in these slots: then the
        # older new items are evicted at once, as FIFO order says.
        stale = old > indices
        self._drop_items(indices[stale])
        indices, slots, old, size_array = indices[~stale], slots[~stale], old[~stale], size_array[~stale]
        count = len(indices)
        evicted = old >= 0
        self._drop_items(old[evicted])
        self.stored_bytes -= int(self._size[slots[evicted]].sum())
        priority = self._tree.max if self.size else DEFAULT_PRIORITY
        raw = self._raw_priority_for(priority if priority > 0 else DEFAULT_PRIORITY)
        raws = np.full(count, raw)
        self._slot_index[slots] = indices
        self._priority[slots] = raws
        self._times[slots] = 0
        self._size[slots] = size_array
        self._tree.update(slots, self._scaled(raws))
        self._live.update(slots, np.ones(count))
        self.stored_bytes += int(size_array.sum())
        self._notify()

    def _publish_one(self, index: int, size: int) -> None:
        """`_publish` of one item (an RL loop's append per step) in Python numbers: the
        batched path's two dozen numpy calls on one-element arrays cost ~40 µs."""
        slot = index % self.config.capacity
        old = int(self._slot_index[slot])
        if old > index:  # a newer item holds the slot already: this one is evicted at once
            self._drop_items([index])
            self._notify()
            return
        if old >= 0:
            self._drop_items([old])
            self.stored_bytes -= int(self._size[slot])
        priority = self._tree.max if self.size else DEFAULT_PRIORITY
        raw = self._raw_priority_for(priority if priority > 0 else DEFAULT_PRIORITY)
        self._slot_index[slot] = index
        self._priority[slot] = raw
        self._times[slot] = 0
        self._size[slot] = size
        self._tree.update_one(slot, float(self._scaled(np.array([raw]))[0]))
        self._live.update_one(slot, 1.0)
        self.stored_bytes += size
        self._notify()

    def _raw_priority_for(self, scaled: float) -> float:
        """The raw priority whose scaled value is `scaled` (new items get the current max)."""
        cfg = self.config
        if cfg.alpha == 0:
            return float(np.max(self._priority[self._slot_index >= 0])) if self.size else DEFAULT_PRIORITY
        return max(float(scaled ** (1.0 / cfg.alpha)) - cfg.epsilon, 0.0)

    async def persist(self, durable: bool = False) -> None:
        """Make every change so far survive a killed daemon (durable: a power loss too)."""
        self.stage_row()
        await self._blocks.persist(self.owner, durable=durable or self.config.sync)

    async def persist_appends(self) -> None:
        """Make every append so far survive a killed daemon, log-only: the items' records
        go to the log (small ones without leaving the event loop) and their rows commit
        with the flusher's next pass; a start-up adopts the records after the last commit
        (BufferStore.load, docs/design.md "Log-only appends"). A `sync` buffer commits
        durably instead; a buffer whose row no commit has carried yet (made since the
        last one: a peer's shard, a store's caller that did not persist it) persists
        with its row (a commit, or a row note that a start-up replays before it loads
        the buffers)."""
        self.stage_row()
        if self.config.sync:
            await self._blocks.persist(self.owner, durable=True)
        elif not self.row_committed:
            await self._blocks.persist(self.owner)
            self._blocks.commit_soon()  # once the row is committed, appends go log-only
        else:
            await self._blocks.persist(self.owner, log_only=True)

    # --- removing ---------------------------------------------------------------------

    def _remove_slot(self, slot: int, index: int) -> None:
        self._remove_slots(np.array([slot]), [index])

    def _remove_slots(self, slots: np.ndarray, indices: list[int]) -> None:
        """Remove these live items: one batched tree update for all of them."""
        self._slot_index[slots] = -1
        self._priority[slots] = 0.0
        self._times[slots] = 0
        self.stored_bytes -= int(self._size[slots].sum())
        self._size[slots] = 0
        self._tree.update(slots, np.zeros(len(slots)))
        self._live.update(slots, np.zeros(len(slots)))
        self._drop_items(indices)
        self._snapshot_dirty = True

    def _drop_items(self, indices: np.ndarray | list[int]) -> None:
        """Delete these items' bytes from the block tier and count them removed."""
        as_array = np.asarray(indices, dtype=np.int64)
        for index in as_array.tolist():
            self._blocks.delete(self.key(index))
        if self.mirror is not None:
            self.mirror.forget(as_array)
        self.removed += len(indices)

    def delete_item(self, index: int) -> None:
        self.check_live()
        slot = self._slot_of(index)
        self._remove_slot(slot, index)
        self.stage_row()
        self._notify()

    def check_live(self) -> None:
        """NotFound once the buffer is deleted."""
        if self.deleted:
            raise NotFound(f"buffers/{self.name} was deleted")

    def delete_all(self) -> None:
        """Remove every item at once, for good (buffer deletion): one pass, no per-item
        tree updates; the buffer is `deleted` from here on."""
        self.deleted = True  # (before the empty ring is laid out: a deleted buffer gets no rows)
        self.close_mirror()
        self._drop_items(self.live_indices())
        self._blocks.watch(self.owner, None)  # (DRAM holds none of its blocks now)
        self.stored_bytes = 0
        self._apply_config(self.config, *(np.zeros(0, dtype) for dtype in (np.int64, np.float64, np.int64, np.int64)))
        self._snapshot_dirty = True
        self._notify()

    # --- items ------------------------------------------------------------------------

    def item_size(self, index: int) -> int:
        return int(self._size[self._slot_of(index)])

    async def read_item(self, index: int) -> bytes | memoryview:
        """The item's bytes (decompressed). Raises NotFound for a dead index."""
        self._slot_of(index)
        block = await self._blocks.get(self.key(index))
        if block is None:
            raise NotFound(f"buffers/{self.name}: item {index} has no data")
        view = memoryview(block.buf)[: block.length]
        if self._zstd_level is not None:
            return await trio.to_thread.run_sync(zstandard.decompress, bytes(view))
        return view

    async def write_item(self, index: int, data: bytes) -> None:
        """Replace a live item's bytes (schema buffers: same size); EFBIG past MAX_ITEM_BYTES."""
        slot = self._slot_of(index)
        if len(data) > MAX_ITEM_BYTES:
            raise FileTooLarge(f"buffers/{self.name}: item {index} of {len(data)} bytes, at most {MAX_ITEM_BYTES}")
        itemsize = self.config.itemsize
        if itemsize is not None and len(data) != itemsize:
            raise InvalidArgument(f"buffers/{self.name}: item {index} must stay {itemsize} bytes, got {len(data)}")
        stored = data
        if self._zstd_level is not None:
            stored = await trio.to_thread.run_sync(zstandard.compress, data, self._zstd_level)
        self.check_live()
        if self._slot_index[slot] != index:
            raise NotFound(f"buffers/{self.name}: item {index} left while it was written")
        self._size[slot] = len(data)
        self.changes += 1  # (a batch drawn ahead may hold its old bytes)
        await self._blocks.put(self.key(index), stored)
        self._mirror_place(np.array([index], dtype=np.int64), [data])
        self._rows_place(np.array([index], dtype=np.int64), [data])

    # --- priorities -------------------------------------------------------------------

    async def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Set priorities of the buffer's items, wherever they live (EINVAL applies none)."""
        if self._spread is not None:
            await self._spread.update_priorities(indices, priorities)
            return
        await self.apply_priorities(indices, priorities)

    async def apply_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """`set_priorities`, then the update as a note in the log before this returns, so
        a start-up after kill -9 has it exactly (the snapshot, then the notes after it:
        `replay_priorities`)."""
        self.check_live()
        applied, before = self.set_priorities(indices, priorities)
        if not len(indices):
            await scheduling.checkpoint()
            return
        try:
            await self._blocks.append_note(self.owner, encode_priority_note(indices, priorities))
        except BaseException:  # not in the log (a full disk): not applied either
            self.set_priorities(applied, before)
            raise

    def replay_priorities(self, note: bytes) -> int:
        """Apply a priority note at start-up (after the snapshot restore); pairs of items
        no longer here are skipped, as they were when the update came. Returns how many
        pairs it held (0 for a note it cannot read, which is logged)."""
        decoded = decode_priority_note(note)
        if decoded is None:
            log.warning("buffers/%s: an unreadable priority note of %d bytes skipped", self.name, len(note))
            return 0
        indices, priorities = decoded
        known = (indices >= 0) & (indices < self.next_index)
        try:
            self.set_priorities(indices[known], priorities[known])
        except DistorefsError as exc:  # checked when written; a start-up never stops on one
            log.warning("buffers/%s: a priority note not replayed: %s", self.name, exc)
            return 0
        return len(indices)

    def set_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Set priorities of this shard's items; all are checked first, so a bad pair
        applies none of them. A pair of an item that was appended and has left since (FIFO
        past the capacity, max_times_sampled: the learner sampled it just before) is
        skipped and counted in `priority_updates_skipped`, as Reverb does; an index never
        appended is a bad pair. Returns the indices it set and their priorities before."""
        jit = PAIRS.module
        if jit is not None and len(indices) and indices.dtype == np.int64 and priorities.dtype == np.float64:
            return self._set_compiled(jit, indices, priorities)
        check_priorities(self.name, indices, priorities)
        cfg = self.config
        check_scalable(f"buffers/{self.name}", priorities, self._highest_priority, cfg.alpha, cfg.epsilon)
        if len(indices) == 0:
            return indices, priorities
        slots = indices % self.config.capacity
        never = (indices < 0) | (indices >= self.next_index)
        if never.any():
            raise InvalidArgument(
                f"buffers/{self.name}: no live item {int(indices[int(np.argmax(never))])}; none applied"
            )
        live = self._slot_index[slots] == indices
        if not live.all():
            self.priority_updates_skipped += int((~live).sum())
            indices, priorities, slots = indices[live], priorities[live], slots[live]
        before = self._priority[slots]  # (a copy: fancy indexing)
        self._priority[slots] = priorities
        self._tree.update(slots, self._scaled(priorities))
        self._snapshot_dirty = True
        self._notify()
        return indices, before

    def _set_compiled(self, jit: Any, indices: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`set_priorities` in one compiled call (pairs_jit.set_pairs): the same checks in
        the same order, the same errors, the same result."""
        if len(indices) != len(priorities):
            check_priorities(self.name, indices, priorities)  # (raises: the count's message)
        count = len(indices)
        applied, slots = np.empty(count, np.int64), np.empty(count, np.int64)
        values, before = np.empty(count), np.empty(count)
        indices, priorities = compiled_array(indices, np.int64), compiled_array(priorities, np.float64)
        cfg = self.config
        code, at, count = jit.set_pairs(
            indices, priorities, self._highest_priority, self.next_index, cfg.capacity, self._slot_index,
            self._priority, applied, slots, values, before,
        )  # fmt: skip
        if code == jit.BAD_PRIORITY:
            check_priorities(self.name, indices[at : at + 1], priorities[at : at + 1])  # (raises: its message)
        if code == jit.TOO_HIGH:
            raise too_high(f"buffers/{self.name}", float(priorities[at]), cfg.alpha, cfg.epsilon, "none applied")
        if code == jit.NEVER_APPENDED:
            raise InvalidArgument(f"buffers/{self.name}: no live item {int(indices[at])}; none applied")
        assert code == jit.GOOD, f"set_pairs answered {code}"
        self.priority_updates_skipped += len(indices) - count
        self._tree.update(slots[:count], self._scaled(values[:count]))
        self._snapshot_dirty = True
        self._notify()
        return applied[:count], before[:count]

    # --- sampling ---------------------------------------------------------------------

    async def sample(self, count: int | None = None, nonblocking: bool = False) -> Batch:
        """Draw one batch of `count` items (default batch_size) from the whole buffer and
        encode it; the items count as sampled once the batch is built.

        Waits while the buffer cannot serve it (min_size_to_sample, the rate limiter), up
        to sample_timeout, then TryAgain; nothing is counted when it fails.
        """
        return await self.sample_into(count, nonblocking, _as_is)

    async def sample_into(self, count: int | None, nonblocking: bool, place: Callable[[Batch], Awaitable[T]]) -> T:
        """`sample`, handing the batch to `place` (a shared-memory slot) before the items
        count as sampled: a batch `place` refuses (raises) counts nothing. A buffer spread
        over nodes counts at the draw, as its shards commit their own picks."""
        count = count or self.config.batch_size
        if self._spread is not None:  # this node joins the shards' parts: the whole batch is checked
            if self.config.itemsize is not None:  # before any shard draws
                self._check_batch_bytes(count, count * self.config.itemsize)
                return await place(await self._spread.sample(count, nonblocking))
            return await place(await self._spread.sample(count, nonblocking, self._check_batch_bytes))
        batch = await self.draw_uncounted(count, nonblocking)
        placed = await place(batch)
        self.commit(batch.indices)
        return placed

    async def draw_uncounted(self, count: int | None, nonblocking: bool) -> Batch:
        """A batch of this node's items as `sample` would hand it out, with nothing
        counted: `commit(batch.indices)` counts it once it is handed out. Handed out while
        `changes` has not moved since, it is a draw from the buffer as it is then (the
        fs layer draws a sample file's next batch ahead this way)."""
        assert self._spread is None, "a spread buffer's shards count their own picks"
        count = count or self.config.batch_size
        indices, probabilities, items = await self._draw(count, nonblocking)
        weights = self._weights(probabilities, len(indices))
        return await encoded_batch(self.config, items, indices, weights)

    def _weights(self, probabilities: np.ndarray | None, count: int) -> np.ndarray:
        if probabilities is None:  # (the tree's min and total are not needed)
            return uniform_weights(count)
        return importance_weights(
            probabilities, count, self.size, self._tree.min / max(self._tree.total, 1e-300), self.config.beta
        )

    async def _pick_slots(self, count: int, nonblocking: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Wait for the rate limiter, then pick `count` ring slots (and their
        probabilities: None where the sampler is not prioritized). Nothing is counted.

        The limiter is asked again after the wait's last await, with no await between
        that answer and the pick: other requests run at that await, and one that removed
        the last items (an item's unlink, the buffer's rmdir) left a sampler walking an
        empty tree to a slot past the ring (IndexError, an internal error; found by a
        two-node fuzz). A few tries, then EAGAIN: the loop is bounded."""
        for _ in range(PICK_TRIES):
            if self.limiter.can_sample(self.size, self.inserts, self.samples, count):
                await scheduling.checkpoint()  # (the usual case, without the wait's closure)
            else:
                await self._wait_until(
                    lambda: self.limiter.can_sample(self.size, self.inserts, self.samples, count),
                    nonblocking,
                    f"sample of {count}",
                    writer=False,
                )
            self.check_live()
            if self.limiter.can_sample(self.size, self.inserts, self.samples, count):
                return self._sampler.pick(self, count, self._rng)
        raise TryAgain(f"buffers/{self.name}: a sample of {count} found the buffer changed under it {PICK_TRIES} times")

    async def pick(self, count: int, nonblocking: bool = False) -> Drawn:
        """Pick `count` items of this shard: their indices, their sampling probabilities
        within it (None where the sampler is not prioritized) and their bytes. Nothing is
        counted: `commit` does that once the batch is handed out. A buffer with rows gives
        its records as one (count, itemsize) uint8 array (a view per record cost 2 µs each:
        0.2 s for a shard's part of 100,000)."""
        indices, probabilities, items = await self._draw(count, nonblocking)
        return Drawn(indices, probabilities, items)

    async def _draw(
        self, count: int, nonblocking: bool
    ) -> tuple[np.ndarray, np.ndarray | None, list[bytes | memoryview] | np.ndarray]:
        """`pick`'s indices and probabilities, and the items: their bytes (views), or for
        a buffer with rows (rows.py) its records as one (count, itemsize) uint8 array."""
        itemsize = self.config.itemsize
        if itemsize is not None:  # known before the draw
            self._check_batch_bytes(count, count * itemsize)
        for attempt in range(HELD_FILL_ROUNDS + 1):
            slots, probabilities = await self._pick_slots(count, nonblocking)
            if itemsize is None:
                self._check_batch_bytes(count, int(self._size[slots].sum()))
            indices = self._slot_index[slots].copy()
            if (
                count < HELD_FILL_SLICE  # (the usual batch: nothing more to do)
                or self._rows is not None
                or attempt == HELD_FILL_ROUNDS
                or not await self._fill_held(indices)
            ):
                break
            # Other requests ran while views of the batch's items were gathered, and may
            # have removed some of them: draw again, from the buffer as it is now, whose
            # items are now held (or few of them are not).
        rows = self._rows
        if rows is None:
            return indices, probabilities, await self._payloads(indices)
        records, missing = rows.gather(slots, indices)
        if missing is not None:  # rows that do not hold their item yet: read those items, and keep them
            wanted = indices[missing]
            payloads = await self._payloads(wanted)
            records[missing] = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(wanted), rows.itemsize)
            if rows is self._rows:
                rows.put_missing(wanted, payloads)
        return indices, probabilities, records

    def _batch_limit(self) -> int:
        """The most bytes one batch may have: half the DRAM budget (a batch is built in
        the daemon's memory, beside the cache)."""
        return self._blocks.dram_budget_bytes // 2

    def _check_batch_bytes(self, count: int, nbytes: int) -> None:
        """EFBIG, before anything is read or counted, for a batch past `_batch_limit`:
        `batch_size` is checked against it at configuration, but `sample.N` (N up to
        2**20, drawn with replacement) of 1 MB items asked for a terabyte, and a blob
        buffer's batch has no size to check until its items are drawn."""
        if nbytes > self._batch_limit():
            message = (
                f"buffers/{self.name}: a batch of {count} items is {nbytes} bytes, more than half the daemon's"
                f" DRAM budget ({self._batch_limit()}); sample fewer items"
            )
            self.record_error(message)
            raise FileTooLarge(message)

    # --- the shared-memory mirror (mirror.py) -------------------------------------------

    def open_mirror(self, reserve: Callable[[int], bool], unreserve: Callable[[int], None]) -> Mirror:
        """The buffer's items in a shared-memory arena (made on the first call; items
        come in as appended and, older ones, at their first draw). ENOTSUP for buffers
        whose items are not kept as they are (compression) or live on several nodes."""
        self.check_live()
        if self.mirror is not None and not self.mirror.outgrown:
            return self.mirror
        outgrown = self.mirror.outgrown if self.mirror is not None else 0
        self.close_mirror()  # blobs outgrew its slots: a new arena with bigger ones (held batches stay readable)
        if self._zstd_level is not None:
            raise NotSupported(f"buffers/{self.name}: compressed items have no shared-memory copy")
        if self._spread is not None:
            raise NotSupported(f"buffers/{self.name}: a buffer spread over nodes has no shared-memory copy")
        item_bytes = self.config.itemsize
        if item_bytes is None:  # blobs: slots as big as the biggest item now (a bigger one: a new arena)
            item_bytes = max(outgrown, int(self._size.max()) if self.size else 0)
        if item_bytes == 0:
            raise TryAgain(f"buffers/{self.name}: no items yet to size the shared-memory copy for")
        self.mirror = Mirror(self.config.capacity, stride_for(item_bytes), reserve, unreserve)
        return self.mirror

    def close_mirror(self) -> None:
        """Drop the arena (a reconfiguration, a deletion, the daemon stopping); samplers
        holding views of it keep them readable, and open a new one if they go on."""
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None

    def _mirror_place(self, indices: np.ndarray, items: Sequence[bytes | bytearray]) -> None:
        """Copy items that are live now into the arena (not ones a newer append replaced)."""
        if self.mirror is None:
            return
        live = self._slot_index[indices % self.config.capacity] == indices
        if not live.all():
            indices, items = indices[live], [item for item, ok in zip(items, live.tolist(), strict=True) if ok]
        self.mirror.place(indices, items)

    def _rows_place(self, indices: np.ndarray, records: Sequence[bytes | bytearray | memoryview]) -> None:
        """Copy these items' records into the rows. No check that they are live: a row
        holding an item that left never matches a live index (indices are not reused),
        so it only costs a later draw a read from the block tier."""
        if self._rows is not None:
            self._rows.put(indices, records)

    async def _fill_mirror(self, mirror: Mirror, indices: np.ndarray) -> None:
        """Bring drawn items that are not in the arena in (read from the block tier; big
        ones copied from a thread). Items that cannot come in stay out."""
        blocks = await self._blocks.get_many([self.key(i) for i in indices.tolist()])
        for index, block in zip(indices.tolist(), blocks, strict=True):
            if block is None or mirror.closed:
                continue
            arena_slot = mirror.reserve_slot(block.length)
            if arena_slot is None:
                continue
            view = memoryview(block.buf)[: block.length]
            if block.length > INLINE_BYTES:
                await trio.to_thread.run_sync(mirror.copy_into, arena_slot, view)
            else:
                mirror.copy_into(arena_slot, view)
            if self._slot_index[index % self.config.capacity] == index and not mirror.closed:
                mirror.commit_slot(index, arena_slot)
            else:
                mirror.abandon_slot(arena_slot)  # it left meanwhile

    async def fill_mirror(self, mirror: Mirror, step_bytes: int = 1 << 20) -> int:
        """Bring every live item that is not in the arena yet in, about `step_bytes` per
        trip through the event loop (a session starts this once, beside its draws); stops
        when the arena is full or replaced. Returns how many came in."""
        missing = self.live_indices()
        missing = missing[mirror.ring[missing % self.config.capacity] < 0]
        # the sums once: a sum of the rest at every step took up to 0.4-0.8 ms of the event
        # loop (200,000 sizes), some 22,000 steps for a ring of 200,000 items of 110 KB
        ends = np.cumsum(self._size[missing % self.config.capacity])
        placed, at = 0, 0
        while at < len(missing) and not mirror.closed:
            done = int(ends[at - 1]) if at else 0
            end = at + 1 + int(np.searchsorted(ends[at:], done + step_bytes))
            before = mirror.free_slots()
            await self._fill_mirror(mirror, missing[at:end])
            placed += max(0, before - mirror.free_slots())
            at = end
            if mirror.full():
                break
        return placed

    async def draw_mirrored(
        self, mirror: Mirror, count: int | None, nonblocking: bool, place: Callable[[MirroredBatch], Awaitable[T]]
    ) -> T:
        """Draw a batch as `sample` does, but hand `place` where its items sit in the
        arena instead of their bytes; the items count as sampled once `place` returns
        (which leases the arena slots, so they stay unchanged until released). ENOMEM
        when a drawn item cannot be brought into the arena."""
        count = count or self.config.batch_size
        if self._spread is not None:
            raise NotSupported(f"buffers/{self.name}: a buffer spread over nodes has no shared-memory copy")
        for _attempt in range(3):
            slots, probabilities = await self._pick_slots(count, nonblocking)
            indices = self._slot_index[slots]  # (fancy indexing copies)
            arena_slots = mirror.ring[slots]
            if (arena_slots < 0).any():
                await self._fill_mirror(mirror, np.unique(indices[arena_slots < 0]))
                if mirror.closed:
                    raise TryAgain(f"buffers/{self.name}: the shared-memory copy was replaced")
                if not (self._slot_index[slots] == indices).all():
                    continue  # an item left during the fill: draw again (nothing was counted)
                arena_slots = mirror.ring[slots]
                if (arena_slots < 0).any():
                    raise OutOfMemory(
                        f"buffers/{self.name}: a drawn item does not fit the shared-memory copy (its slots are"
                        f" {mirror.stride} bytes, its share of the DRAM budget is used)"
                    )
            repeated = batch_repeats(slots)  # one look for the batch's lease, count and release
            batch = MirroredBatch(
                mirror,
                indices,
                self._weights(probabilities, len(indices)),
                arena_slots,
                self._size[slots],
                repeated,
            )
            layout = self._slot_index  # (a reconfigure while `place` waits makes a new ring)
            placed = await place(batch)
            self.commit(indices, repeated, slots if self._slot_index is layout else None)
            return placed
        raise TryAgain(f"buffers/{self.name}: items kept leaving while a batch was drawn; try again")

    def shard_state(self) -> ShardState:
        """What a sharded sample needs to split a batch over shards and weigh it."""
        prioritized = self._sampler.prioritized and self._tree.total > 0
        return ShardState(
            size=self.size,
            mass=self._tree.total if prioritized else float(self.size),
            min_mass=self._tree.min if prioritized else 1.0,
            can_sample=self.can_sample_local(1),
        )

    def _held_limit(self) -> int:
        """The most the table of blocks by ring slot may take: a small share of the DRAM
        budget (8 bytes a slot: 8 MB for a million slots; a 6 GiB budget allows 96 MiB,
        12 million slots). A bigger ring draws through the block tier's lookups."""
        return self._blocks.dram_budget_bytes // HELD_BUDGET_SHARE

    def _block_left(self, number: int) -> None:
        """DRAM let go of item `number`'s block (DramCache.watch): forget it, so that a
        draw looks it up again (and the cache may reuse its buffer)."""
        held = self._held
        if held is not None:
            held[number % len(held)] = None

    async def _payloads(self, indices: np.ndarray) -> list[bytes | memoryview]:
        """The items' bytes, cold ones read from the log in one trip to a thread.

        Views, not copies: the block tier never changes a buffer item's bytes in place
        (put replaces the whole block), so a view stays valid while the batch lives.

        Views come from `_held` where it has them (one object index for the batch); the
        rest from the block tier, which looks each up in DRAM's LRU (0.4-1 µs a key when
        the daemon's other work has left the CPU caches cold: 280 of 760 µs of a SAC
        batch of 256, docs/design.md "A draw's blocks by ring slot"), and their views go
        into `_held` while DRAM keeps the blocks and their slots still hold their items
        (a view holds its block's buffer: DRAM's watch drops it before the buffer could be
        reused). A draw served from `_held` does not touch the LRU order of its items.
        """
        if len(indices) < BULK_DRAW_ITEMS:
            return await self._payloads_of(indices)
        with memory.automatic_collections_paused():
            return await self._payloads_of(indices)

    async def _fill_held(self, indices: np.ndarray) -> bool:
        """Put views of those of these items that `_held` lacks into it, HELD_FILL_SLICE
        at a time with other requests served between slices; False, at once, where it
        lacks fewer than that (the draw then looks them up itself, in one go).

        A draw's items are looked up and viewed at about 2 µs each: the first
        sample.1000000 of a blob buffer, whose items had never been drawn, held every
        request of the mount for 1.5-3 s. Items that leave meanwhile are skipped; the
        caller draws again, since its picks may be among them."""
        held = self._held
        if held is None:
            return False
        slots = indices % len(held)
        slots = slots[held[slots] == None]  # noqa: E711 (elementwise)
        if len(slots) < HELD_FILL_SLICE:
            return False
        lacking = np.zeros(len(held), dtype=bool)  # each once (np.unique of a million sorts: 0.28 s)
        lacking[slots] = True
        missing = np.flatnonzero(lacking)
        owner = self.owner
        with memory.automatic_collections_paused():  # (young ones run between slices)
            for part in np.array_split(missing, -(-len(missing) // HELD_FILL_SLICE)):
                numbers = self._slot_index[part]  # what the slots hold now
                keys = [BlockKey(owner, i) for i in numbers[numbers >= 0].tolist()]
                found = await self._blocks.get_many(keys)  # (a schedule point: other requests run)
                if self._held is not held:
                    break  # the ring was laid out again
                self._hold_found(held, keys, found)
                memory.collect_young()
        return True

    def _hold_found(self, held: np.ndarray, keys: list[BlockKey], found: list[Block | None]) -> None:
        """`_hold` of each item just read from the block tier (as a draw would serve it: a
        copy of a small one, COPIED_ITEM_BYTES); items it did not find are skipped."""
        for key, block in zip(keys, found, strict=True):
            if block is not None:
                self._hold(held, key, block, self._item_view(key, block))

    async def _payloads_of(self, indices: np.ndarray) -> list[bytes | memoryview]:
        owner = self.owner
        held = self._held
        if held is None:
            keys = [BlockKey(owner, i) for i in indices.tolist()]
            found = await self._blocks.get_many(keys)
            out: list[bytes | memoryview] = [self._item_view(k, b) for k, b in zip(keys, found, strict=True)]
        else:
            slots = indices % len(held)
            out = held[slots].tolist()
            missing = [k for k, view in enumerate(out) if view is None]
            if not missing:
                await scheduling.checkpoint()
            else:
                keys = [BlockKey(owner, int(indices[k])) for k in missing]
                for k, key, block in zip(missing, keys, await self._blocks.get_many(keys), strict=True):
                    view = out[k] = self._item_view(key, block)
                    self._hold(held, key, block, view)
        if self._zstd_level is not None:  # CPU work: off the event loop, one trip per batch
            return await trio.to_thread.run_sync(lambda: [zstandard.decompress(view) for view in out])
        return out

    def _hold(self, held: np.ndarray, key: BlockKey, block: Block | None, view: bytes | memoryview) -> None:
        """Keep `view` of `key`'s `block`, just read from the block tier, in `held`, where
        the ring was not laid out again meanwhile (`held` is still the table), the item's
        slot still holds it, and DRAM holds the block (a read that found no room is not)."""
        slot = key.number % len(held)
        if (
            self._held is held
            and self._slot_index[slot] == key.number
            and block is not None
            and self._blocks.resident(key, block)
        ):
            held[slot] = view

    def _item_view(self, key: BlockKey, block: Block | None) -> bytes | memoryview:
        """The item's bytes: a view of its block, or a copy for a small one (COPIED_ITEM_BYTES;
        the same for as long as it is held: a change of the item replaces its block, and
        DRAM's watch then drops what is held of it)."""
        if block is None:
            raise NotFound(f"buffers/{self.name}: item {key.number} has no data")
        if block.length <= COPIED_ITEM_BYTES:
            return bytes(memoryview(block.buf)[: block.length])
        return memoryview(block.buf)[: block.length]

    async def warm(self, indices: np.ndarray) -> None:
        """Read these items into DRAM (cold ones from the log in one trip to a thread);
        items that left meanwhile are skipped. A buffer with record rows gets the records
        into its rows too, so that its draws after a restart are served from the rows
        from the start instead of reading the block tier until each item was drawn once
        (a million-item buffer sampled at 0.71x of a 20,000-item one that way); one
        without rows gets their views into its table by ring slot, for the same reason."""
        owner = self.owner
        keys = [BlockKey(owner, i) for i in indices.tolist()]
        found = await self._blocks.get_many(keys)
        held, rows = self._held, self._rows
        if held is not None:
            self._hold_found(held, keys, found)
        if rows is None:
            return
        fits = [
            (key.number, memoryview(block.buf)[: block.length])
            for key, block in zip(keys, found, strict=True)
            if block is not None and block.length == rows.itemsize
        ]
        if fits:
            warmed = np.fromiter((index for index, _ in fits), np.int64, len(fits))
            live = self._slot_index[warmed % self.config.capacity] == warmed  # not a newer item's slot
            rows.put_missing(warmed, [view for _, view in fits], live)

    def commit(self, indices: np.ndarray, repeated: bool | None = None, slots: np.ndarray | None = None) -> None:
        """Count these picked items of this shard as sampled (they were handed out); the
        remover then takes what must leave. Items that left since the pick are skipped.
        `repeated`: whether an item was picked twice, and `slots`: the ring slots they
        were picked from in the ring as it is now, where the caller knows (each saves a
        pass over the batch)."""
        self.samples += len(indices)
        if slots is None:
            slots = indices % self.config.capacity
        counts = COUNTS.module
        if counts is not None and not self._remover.removes and slots.dtype == indices.dtype == np.int64:
            # one compiled pass: count each item still here (counts_jit.py)
            counts.count_live(
                self._times, self._slot_index, compiled_array(slots, np.int64), compiled_array(indices, np.int64)
            )
        else:
            still = self._slot_index[slots] == indices  # not left while the batch was read
            if not still.all():
                slots = slots[still]
                repeated = None if repeated else False  # (fewer of a batch without repeats have none)
            add_at(self._times, slots, 1, repeated)  # an item drawn twice counts twice
            if self._remover.removes:
                done = self._remover.after_sampled(slots, self._times[slots])
                if len(done):
                    self._remove_slots(done, self._slot_index[done].tolist())
        self._snapshot_dirty = True
        self._notify()

    # --- config -----------------------------------------------------------------------

    def reconfigure(self, changes: dict[str, Any]) -> None:
        """Apply a JSON config update whole or not at all (EINVAL / EBUSY; ENOENT once
        deleted: a deleted buffer reserves no ring)."""
        self.check_live()
        new = self.config.updated(f"buffers/{self.name}", changes, has_items=self.size > 0)
        if new.itemsize is not None and new.batch_size * new.itemsize > self._batch_limit():
            raise InvalidArgument(
                f"buffers/{self.name}.batch_size: a batch of {new.batch_size} records of {new.itemsize} bytes"
                f" must fit in half the DRAM budget ({self._batch_limit()} bytes)"
            )
        if new.shards > max(1, self._shard_limit()) and new.shards != self.config.shards:
            raise InvalidArgument(
                f"buffers/{self.name}.shards must be <= {max(1, self._shard_limit())} (the live nodes;"
                f" a daemon without --cluster has 1), got {new.shards}"
            )
        live = self.live_indices()
        slots = live % self.config.capacity
        priorities, times, sizes = self._priority[slots], self._times[slots], self._size[slots]
        if new.alpha != self.config.alpha or new.epsilon != self.config.epsilon:
            what, highest = f"buffers/{self.name}.alpha, epsilon", highest_priority(new.alpha, new.epsilon)
            check_scalable(what, priorities, highest, new.alpha, new.epsilon, outcome="the config stays as it was")
        if not self._reserve_ring(ring_index_bytes(new.capacity), force=False):  # (the last check: it reserves)
            raise InvalidArgument(f"buffers/{self.name}.capacity: {ring_refusal(self._blocks, new.capacity)}")
        self._apply_config(new, live, priorities, times, sizes)
        self.stage_row()
        self._notify()
        self._news.post(("configured", self.name))

    # --- persistence ------------------------------------------------------------------

    def stage_row(self) -> None:
        """Stage the buffer's row: config and counters (small: staged on every append).
        Never once deleted: a call that began before the delete and ends after it (a
        config write, a sample, an append's close) would bring the row back, and with it
        the buffer at the next start."""
        if self.deleted:
            return
        self._meta.put("buffers", (self.name,), self._row())
        if self._row_mark is None:
            self._row_mark = self._meta.mark()

    @property
    def row_committed(self) -> bool:
        """Whether the buffer's row is in the metadata database: a start-up adopts logged
        items only into buffers whose row it finds."""
        return self._row_mark is not None and self._meta.carried(self._row_mark)

    def _row(self) -> tuple[object, ...]:
        return (
            self.owner, self._config_json, self.next_index, self.inserts, self.samples, self.removed, None,
        )  # fmt: skip

    def stage_snapshot(self) -> bool:
        """Stage priorities and sample counts (the snapshot restored after a crash), all
        here (the shutdown's last snapshot); False when nothing changed since the last."""
        state = self.snapshot_state()
        if state is None:
            return False
        self.stage_encoded(encode_state(*state))
        return True

    def snapshot_state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Copies of the ring's arrays for a snapshot, or None when nothing changed since
        the last. The copies (memcpy) are taken between awaits, so a worker thread can
        sort and encode them (`encode_state`) while the buffer goes on changing."""
        if not self._snapshot_dirty:
            return None
        self._snapshot_dirty = False
        return self._slot_index.copy(), self._priority.copy(), self._times.copy(), self._size.copy()

    def snapshot_failed(self) -> None:
        self._snapshot_dirty = True

    def stage_encoded(self, snapshot: bytes) -> None:
        if self.deleted:  # (as stage_row)
            return
        self._snapshot = snapshot
        self._meta.put("buffer_snapshots", (self.name,), (snapshot,))
        self.stage_row()

    @classmethod
    def restore(
        cls,
        name: str,
        row: tuple[Any, ...],
        blocks: BlockStore,
        meta: MetaDb,
        item_sizes: dict[int, int],
        news: Outbox[tuple[str, str]] | None = None,
        shard_limit: Callable[[], int] = lambda: 1,
    ) -> ReplayBuffer:
        """Rebuild a buffer from its row and the items the block tier holds.

        Items are exactly the blocks that survived; priorities and counts come from the
        last snapshot, and items newer than it get the current maximum priority.
        """
        owner, config_json, next_index, inserts, samples, removed, snapshot = row
        config, dropped = BufferConfig.restored(f"buffers/{name}", json.loads(config_json))
        if dropped:
            log.error("buffers/%s: saved config fields no longer valid, defaults used: %s", name, "; ".join(dropped))
        buf = cls(name, owner, config, blocks, meta, news, shard_limit)
        buf._row_mark = 0  # the row came from the database
        indices = np.fromiter(item_sizes, dtype=np.int64, count=len(item_sizes))
        sizes = np.fromiter(item_sizes.values(), dtype=np.int64, count=len(item_sizes))
        order = np.argsort(indices)
        indices, sizes = indices[order], sizes[order]
        if len(indices) > config.capacity:
            # FIFO evictions that did not commit before a crash: they leave again now
            for index in indices[: -config.capacity].tolist():
                blocks.delete(BlockKey(owner, index))
            removed += len(indices) - config.capacity
            indices, sizes = indices[-config.capacity :], sizes[-config.capacity :]
        priorities, times, sizes = match_snapshot(snapshot, indices, sizes)
        known = priorities[~np.isnan(priorities)]
        fallback = float(known.max()) if len(known) else DEFAULT_PRIORITY
        priorities = np.where(np.isnan(priorities), fallback, priorities)
        buf._apply_config(config, indices, priorities, times, sizes)
        buf.next_index = max(int(next_index), int(indices[-1]) + 1 if len(indices) else 0)
        # appends adopted from the log's tail count as inserts (the row was older than them)
        buf.inserts = int(inserts) + buf.next_index - int(next_index)
        buf.samples, buf.removed = int(samples), int(removed)
        buf._snapshot = snapshot
        buf.stored_bytes = int(sizes.sum())
        return buf

    # --- numbers ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size": self.size,
            "capacity": self.config.capacity,
            "next_index": self.next_index,
            "inserts": self.inserts,
            "samples": self.samples,
            "removed": self.removed,
            "priority_updates_skipped": self.priority_updates_skipped,
            "bytes_stored": self.stored_bytes,
            "bytes_dram": self._blocks.dram_bytes(self.owner),
            "bytes_remote_memory": self._blocks.remote_bytes(self.owner),
            "blocked_readers": self.blocked_readers,
            "blocked_writers": self.blocked_writers,
            "rate_limiter": self.limiter.state(self.size, self.inserts, self.samples, self.config.batch_size),
            "total_priority": self._tree.total,
            "errors": self.errors,
            **({"shared_memory": self.mirror.statistics()} if self.mirror is not None else {}),
            **({"record_rows": self._rows.statistics()} if self._rows is not None else {}),
            **({"cluster": self._spread.stats_now()} if self._spread is not None else {}),
        }


PRIORITY_NOTE = struct.Struct("<4sI")  # magic, pairs; then int64 indices and float64 priorities
PRIORITY_NOTE_MAGIC = b"DSP1"


def encode_priority_note(indices: np.ndarray, priorities: np.ndarray) -> bytes:
    return (
        PRIORITY_NOTE.pack(PRIORITY_NOTE_MAGIC, len(indices))
        + np.asarray(indices, dtype="<i8").tobytes()
        + np.asarray(priorities, dtype="<f8").tobytes()
    )


def decode_priority_note(note: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    if len(note) < PRIORITY_NOTE.size:
        return None
    magic, count = PRIORITY_NOTE.unpack_from(note)
    if magic != PRIORITY_NOTE_MAGIC or len(note) != PRIORITY_NOTE.size + 16 * count:
        return None
    indices = np.frombuffer(note, "<i8", count, PRIORITY_NOTE.size).astype(np.int64)
    priorities = np.frombuffer(note, "<f8", count, PRIORITY_NOTE.size + 8 * count).astype(np.float64)
    return indices, priorities
