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
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio
import zstandard

from distorefs.errors import InvalidArgument, NotFound, TryAgain
from distorefs.news import Outbox
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.formats import ScatteredBytes, encode_blob_batch, encode_npy_batch
from distorefs.stores.replay.rate_limiter import RateLimiter
from distorefs.stores.replay.sumtree import SegmentTree
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from distorefs.types import BlockKey

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 1.0
RECENT_ERRORS = 5


@dataclass
class Batch:
    """One drawn batch: the encoded bytes a `sample` handle reads, and what is in it."""

    data: bytearray | ScatteredBytes
    indices: np.ndarray
    weights: np.ndarray


@dataclass
class Drawn:
    """Items drawn from one buffer (or shard), counted as sampled, not yet encoded."""

    indices: np.ndarray  # int64
    probabilities: np.ndarray | None  # float64 within this buffer; None: not prioritized
    payloads: list[bytes | memoryview]


@dataclass(frozen=True)
class ShardState:
    """One shard's numbers for splitting a batch: `mass` is what sampling is in
    proportion to (total scaled priority, or the size), `min_mass` the smallest item's."""

    size: int
    mass: float
    min_mass: float
    can_sample: bool


def importance_weights(
    probabilities: np.ndarray | None, count: int, size: int, min_probability: float, beta: float
) -> np.ndarray:
    """(N * P)^-beta normalised by the largest possible weight, (N * P_min)^-beta, over a
    buffer of N items; all ones where the draw was not prioritized."""
    if probabilities is None:
        return np.ones(count, dtype=np.float32)
    weights: np.ndarray = np.power(size * probabilities, -beta) / math.pow(size * min_probability, -beta)
    return weights.astype(np.float32)


def check_priorities(name: str, indices: np.ndarray, priorities: np.ndarray) -> None:
    """EINVAL, naming the first bad pair, unless every priority is finite and >= 0 and
    there is one per index."""
    if len(indices) != len(priorities):
        raise InvalidArgument(f"buffers/{name}: {len(indices)} indices but {len(priorities)} priorities")
    bad = ~np.isfinite(priorities) | (priorities < 0)
    if bad.any():
        at = int(np.argmax(bad))
        raise InvalidArgument(
            f"buffers/{name}: priority must be finite and >= 0, got {priorities[at]} for index {indices[at]}"
        )


def encode_batch(
    config: BufferConfig, payloads: list[bytes | memoryview], indices: np.ndarray, weights: np.ndarray
) -> bytearray | ScatteredBytes:
    """A batch in the buffer's format: a .npy with `_index`/`_weight` under a schema,
    the framed blob format without one."""
    if config.dtype is not None:
        return encode_npy_batch(config.dtype, payloads, indices, weights)
    return encode_blob_batch(payloads, indices, weights)


class Router(Protocol):
    """Where a buffer spread over nodes sends appends, samples and priorities
    (stores/replay/sharded.py). A buffer with no router serves them itself."""

    async def sample(self, count: int | None = None, nonblocking: bool = False) -> Batch: ...

    async def append(self, items: Sequence[bytes | bytearray], nonblocking: bool = False) -> list[int]: ...

    async def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None: ...

    def stats_now(self) -> dict[str, Any]: ...


class ReplayBuffer:
    """A replay buffer: FIFO ring of items with priorities, samplers and a rate limiter.

    Examples:
        >>> buf = ReplayBuffer("atari", owner, BufferConfig(capacity=1000), blocks, meta)
        >>> await buf.append([b"item0", b"item1"])
        [0, 1]
        >>> batch = await buf.sample(2)          # waits while it cannot be served
        >>> buf.update_priorities(np.array([0]), np.array([2.5]))
    """

    def __init__(self, name: str, owner: int, config: BufferConfig, blocks: BlockStore, meta: MetaDb) -> None:
        self.name = name
        self.owner = owner
        self._blocks = blocks
        blocks.spill(owner)  # cold items may go to peers' lent memory (cluster mode)
        self._meta = meta
        self._rng = np.random.default_rng()
        self.next_index = 0
        self.inserts = 0
        self.samples = 0
        self.removed = 0
        self.stored_bytes = 0
        self.blocked_readers = 0
        self.blocked_writers = 0
        self.errors: list[str] = []
        self.deleted = False
        self.shard_limit: Callable[[], int] = lambda: 1  # the store sets it: live nodes in a cluster
        self.router: Router | None = None  # set in a cluster when the buffer spans nodes
        self.news: Outbox[tuple[str, str]] = Outbox()  # the store's, where it follows its buffers
        self._changed = trio.Event()
        self._snapshot_dirty = False
        self._snapshot: bytes | None = None  # the last staged snapshot; every row carries it
        self._apply_config(config, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64))

    # --- layout ---------------------------------------------------------------------

    def _apply_config(
        self, config: BufferConfig, indices: np.ndarray, priorities: np.ndarray, times: np.ndarray, sizes: np.ndarray
    ) -> None:
        """(Re)build the ring for `config` holding the given live items."""
        self.config = config
        self.limiter = RateLimiter.from_config(config)
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

    def _scaled(self, priorities: np.ndarray) -> np.ndarray:
        cfg = self.config
        return np.power(priorities + cfg.epsilon, cfg.alpha) if cfg.alpha != 0 else np.ones_like(priorities)

    @property
    def size(self) -> int:
        return round(self._live.total)

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
        self._changed.set()
        self._changed = trio.Event()

    def record_error(self, message: str) -> None:
        """Keep the last few rejected inputs for `stats` (they also go to the daemon log)."""
        log.warning("%s", message)
        self.errors = [*self.errors[-(RECENT_ERRORS - 1) :], f"{time.strftime('%H:%M:%S')} {message}"]

    # --- waiting ----------------------------------------------------------------------

    async def _wait_until(self, ready: Callable[[], bool], nonblocking: bool, what: str, writer: bool) -> None:
        """Return once `ready()`; EAGAIN at once under O_NONBLOCK, or after sample_timeout."""
        if ready():
            await trio.lowlevel.checkpoint()
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
                return
        finally:
            if writer:
                self.blocked_writers -= 1
            else:
                self.blocked_readers -= 1
        raise TryAgain(f"buffers/{self.name}: {what} still blocked after sample_timeout={timeout} s")

    def can_append(self, count: int) -> bool:
        """Whether `count` appends would go through now without waiting."""
        r = self.limiter
        return all(r.can_insert(self.inserts + k, self.samples) for k in range(min(count, 64)))

    def can_sample(self, count: int | None) -> bool:
        count = count or self.config.batch_size
        return self.limiter.can_sample(self.size, self.inserts, self.samples, count)

    # --- appending --------------------------------------------------------------------

    async def append(self, items: Sequence[bytes | bytearray], nonblocking: bool = False) -> list[int]:
        """Add items in order (each waits for the rate limiter); return their indices.

        For schema buffers each item must be exactly one record. The items are in DRAM
        when this returns; `persist` makes them survive a killed daemon.
        """
        itemsize = self.config.itemsize
        for item in items:
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
            for k, data in enumerate(chunk):
                await self._blocks.put(self.key(first + k), data)  # bytes first ...
            sizes = [len(item) for item in items[at : at + count]]
            self._publish(first, sizes)  # ... then samplers may see the indices
            added.extend(range(first, first + count))
            at += count
        self._snapshot_dirty = True
        self.stage_row()
        return added

    def _publish(self, first: int, sizes: list[int]) -> None:
        """Make indices first.. live (their bytes are in the block tier), evicting the
        items whose slots they take (FIFO). One batched tree update for the lot."""
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

    def _raw_priority_for(self, scaled: float) -> float:
        """The raw priority whose scaled value is `scaled` (new items get the current max)."""
        cfg = self.config
        if cfg.alpha == 0:
            return float(np.max(self._priority[self._slot_index >= 0])) if self.size else DEFAULT_PRIORITY
        return max(float(scaled ** (1.0 / cfg.alpha)) - cfg.epsilon, 0.0)

    async def persist(self, durable: bool = False) -> None:
        """Make every append so far survive a killed daemon (durable: a power loss too)."""
        self.stage_row()
        await self._blocks.persist(self.owner, durable=durable or self.config.sync)

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
        for index in np.asarray(indices, dtype=np.int64).tolist():
            self._blocks.delete(self.key(index))
        self.removed += len(indices)

    def delete_item(self, index: int) -> None:
        slot = self._slot_of(index)
        self._remove_slot(slot, index)
        self.stage_row()
        self._notify()

    def delete_all(self) -> None:
        """Remove every item at once (buffer deletion): one pass, no per-item tree updates."""
        self._drop_items(self.live_indices())
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
        """Replace a live item's bytes (schema buffers: same size)."""
        slot = self._slot_of(index)
        itemsize = self.config.itemsize
        if itemsize is not None and len(data) != itemsize:
            raise InvalidArgument(f"buffers/{self.name}: item {index} must stay {itemsize} bytes, got {len(data)}")
        stored = data
        if self._zstd_level is not None:
            stored = await trio.to_thread.run_sync(zstandard.compress, data, self._zstd_level)
        if self._slot_index[slot] != index:
            raise NotFound(f"buffers/{self.name}: item {index} left while it was written")
        self._size[slot] = len(data)
        await self._blocks.put(self.key(index), stored)

    # --- priorities -------------------------------------------------------------------

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Set priorities; all are checked first, so a bad pair applies none of them."""
        check_priorities(self.name, indices, priorities)
        if len(indices) == 0:
            return
        slots = indices % self.config.capacity
        dead = (indices < 0) | (self._slot_index[slots] != indices)
        if dead.any():
            raise InvalidArgument(
                f"buffers/{self.name}: no live item {int(indices[int(np.argmax(dead))])}; none applied"
            )
        self._priority[slots] = priorities
        self._tree.update(slots, self._scaled(priorities))
        self._snapshot_dirty = True
        self._notify()

    # --- sampling ---------------------------------------------------------------------

    async def sample(self, count: int | None = None, nonblocking: bool = False) -> Batch:
        """Draw one batch of `count` items (default batch_size) and encode it.

        Waits while the buffer cannot serve it (min_size_to_sample, the rate limiter), up
        to sample_timeout, then TryAgain; nothing is counted when it fails.
        """
        drawn = await self.draw(count or self.config.batch_size, nonblocking)
        weights = importance_weights(
            drawn.probabilities, len(drawn.indices), self.size, self._tree.min / max(self._tree.total, 1e-300),
            self.config.beta,
        )  # fmt: skip
        return Batch(encode_batch(self.config, drawn.payloads, drawn.indices, weights), drawn.indices, weights)

    async def draw(self, count: int, nonblocking: bool = False) -> Drawn:
        """Draw `count` items and count them as sampled: their indices, their sampling
        probabilities within this buffer (None where the sampler is not prioritized) and
        their bytes. A shard of a sharded buffer answers its share of a batch with this."""
        await self._wait_until(
            lambda: self.limiter.can_sample(self.size, self.inserts, self.samples, count),
            nonblocking,
            f"sample of {count}",
            writer=False,
        )
        slots, probabilities = self._draw(count)
        indices = self._slot_index[slots].copy()
        payloads = await self._payloads(indices)
        self._account_sampled(indices)
        return Drawn(indices, probabilities, payloads)

    def shard_state(self) -> ShardState:
        """What a sharded sample needs to split a batch over shards and weigh it."""
        prioritized = self.config.sampler == "prioritized" and self._tree.total > 0
        return ShardState(
            size=self.size,
            mass=self._tree.total if prioritized else float(self.size),
            min_mass=self._tree.min if prioritized else 1.0,
            can_sample=self.can_sample(1),
        )

    async def _payloads(self, indices: np.ndarray) -> list[bytes | memoryview]:
        """The items' bytes, cold ones read from the log in one trip to a thread.

        Views, not copies: the block tier never changes a buffer item's bytes in place
        (put replaces the whole block), so a view stays valid while the batch lives.
        """
        blocks = await self._blocks.get_many([self.key(int(i)) for i in indices.tolist()])
        out: list[bytes | memoryview] = []
        for index, block in zip(indices.tolist(), blocks, strict=True):
            if block is None:
                raise NotFound(f"buffers/{self.name}: item {index} has no data")
            out.append(memoryview(block.buf)[: block.length])
        if self._zstd_level is not None:  # CPU work: off the event loop, one trip per batch
            return await trio.to_thread.run_sync(lambda: [zstandard.decompress(view) for view in out])
        return out

    def _draw(self, count: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The slots drawn, and their probabilities where the draw is prioritized."""
        sampler = self.config.sampler
        if sampler in ("fifo", "lifo"):
            live = self.live_indices()
            chosen = live[:count] if sampler == "fifo" else live[::-1][:count]
            return chosen % self.config.capacity, None
        total = self._tree.total
        if sampler == "uniform" or total <= 0:  # every live priority zero: uniform too
            size = self._live.total
            prefixes = (np.arange(count) + self._rng.random(count)) * (size / count)
            return self._live.find(prefixes), None
        # Stratified: one draw in each of `count` equal segments of the priority mass.
        prefixes = (np.arange(count) + self._rng.random(count)) * (total / count)
        slots = self._tree.find(prefixes)
        return slots, self._tree.leaves()[slots] / total

    def _account_sampled(self, indices: np.ndarray) -> None:
        self.samples += len(indices)
        slots = indices % self.config.capacity
        still = self._slot_index[slots] == indices  # not left while the batch was read
        np.add.at(self._times, slots[still], 1)  # an item drawn twice counts twice
        limit = self.config.max_times_sampled
        if limit:
            done = np.unique(slots[still][self._times[slots[still]] >= limit])
            if len(done):
                self._remove_slots(done, self._slot_index[done].tolist())
        self._snapshot_dirty = True
        self._notify()

    # --- config -----------------------------------------------------------------------

    def reconfigure(self, changes: dict[str, Any]) -> None:
        """Apply a JSON config update whole or not at all (EINVAL / EBUSY)."""
        new = self.config.updated(f"buffers/{self.name}", changes, has_items=self.size > 0)
        if new.shards > max(1, self.shard_limit()) and new.shards != self.config.shards:
            raise InvalidArgument(
                f"buffers/{self.name}.shards must be <= {max(1, self.shard_limit())} (the live nodes;"
                f" a daemon without --cluster has 1), got {new.shards}"
            )
        live = self.live_indices()
        slots = live % self.config.capacity
        priorities, times, sizes = self._priority[slots], self._times[slots], self._size[slots]
        self._apply_config(new, live, priorities, times, sizes)
        self.stage_row()
        self._notify()
        self.news.post(("configured", self.name))

    # --- persistence ------------------------------------------------------------------

    def stage_row(self) -> None:
        """Stage the buffer's row: config, counters and the last snapshot."""
        self._meta.put("buffers", (self.name,), self._row())

    def _row(self) -> tuple[object, ...]:
        return (
            self.owner, self.config.dumps(), self.next_index, self.inserts, self.samples, self.removed, self._snapshot,
        )  # fmt: skip

    def stage_snapshot(self) -> bool:
        """Stage priorities and sample counts (the snapshot restored after a crash)."""
        if not self._snapshot_dirty:
            return False
        live = self.live_indices()
        slots = live % self.config.capacity
        out = io.BytesIO()
        np.savez(out, indices=live, priorities=self._priority[slots], times=self._times[slots], sizes=self._size[slots])
        self._snapshot = out.getvalue()
        self._snapshot_dirty = False
        self.stage_row()
        return True

    @classmethod
    def restore(
        cls,
        name: str,
        row: tuple[Any, ...],
        blocks: BlockStore,
        meta: MetaDb,
        item_sizes: dict[int, int],
    ) -> ReplayBuffer:
        """Rebuild a buffer from its row and the items the block tier holds.

        Items are exactly the blocks that survived; priorities and counts come from the
        last snapshot, and items newer than it get the current maximum priority.
        """
        owner, config_json, next_index, inserts, samples, removed, snapshot = row
        config = BufferConfig.from_json(f"buffers/{name}", json.loads(config_json))
        buf = cls(name, owner, config, blocks, meta)
        indices = np.fromiter(item_sizes, dtype=np.int64, count=len(item_sizes))
        sizes = np.fromiter(item_sizes.values(), dtype=np.int64, count=len(item_sizes))
        order = np.argsort(indices)
        indices, sizes = indices[order], sizes[order]
        if len(indices) > config.capacity:
            indices, sizes = indices[-config.capacity :], sizes[-config.capacity :]
        priorities = np.full(len(indices), np.nan)
        times = np.zeros(len(indices), dtype=np.int64)
        if snapshot:
            with np.load(io.BytesIO(snapshot)) as npz:  # read each array once
                saved = {name: npz[name] for name in ("indices", "priorities", "times", "sizes")}
            # Both index lists are sorted: match them with one searchsorted.
            at = np.searchsorted(saved["indices"], indices)
            at_clipped = np.minimum(at, max(len(saved["indices"]) - 1, 0))
            found = (
                (at < len(saved["indices"])) & (saved["indices"][at_clipped] == indices)
                if len(saved["indices"])
                else np.zeros(len(indices), bool)
            )
            priorities[found] = saved["priorities"][at[found]]
            times[found] = saved["times"][at[found]]
            sizes[found] = saved["sizes"][at[found]]  # uncompressed sizes
        known = priorities[~np.isnan(priorities)]
        fallback = float(known.max()) if len(known) else DEFAULT_PRIORITY
        priorities = np.where(np.isnan(priorities), fallback, priorities)
        buf._apply_config(config, indices, priorities, times, sizes)
        buf.next_index = max(int(next_index), int(indices[-1]) + 1 if len(indices) else 0)
        buf.inserts, buf.samples, buf.removed = int(inserts), int(samples), int(removed)
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
            "bytes_stored": self.stored_bytes,
            "bytes_dram": self._blocks.dram_bytes(self.owner),
            "bytes_remote_memory": self._blocks.remote_bytes(self.owner),
            "blocked_readers": self.blocked_readers,
            "blocked_writers": self.blocked_writers,
            "rate_limiter": self.limiter.state(self.size, self.inserts, self.samples, self.config.batch_size),
            "total_priority": self._tree.total,
            "errors": self.errors,
            **({"cluster": self.router.stats_now()} if self.router is not None else {}),
        }
