"""DramCache: blocks held in the daemon's memory under a byte budget.

Owns the block buffers, their LRU order and the byte accounting (used, dirty). It never
evicts a dirty block: the block tier above persists dirty blocks to the log, marks them
clean, and only then can they go. Synchronous and atomic between awaits.

A block's buffer is a bytearray sized by `capacity_for`; `length` says how many bytes
are valid. Buffers are replaced when they grow, never resized
in place, so a memoryview handed to the kernel reply never sees a resize. A *borrowed*
block's buffer is a read-only memoryview of memory the daemon took over whole (a staged
checkpoint's sealed memfd, see BlockStore.adopt): it is never written in place; the
first change copies it into a bytearray of its own. So is a block whose buffer is the
`bytes` of a write that covered it whole (BlockStore.write_whole).

*Transient* blocks are those a one-pass sequential reader had loaded (BlockStore.get
with `transient`): they stay in a FIFO of at most `transient_budget` bytes, and the
oldest leaves the cache when the FIFO is full, unless it was read a second time (then
it is an ordinary block). The kernel's page cache keeps what such a reader read, so a
cold scan of a big file does not push the working set out of DRAM.

*Spares*: the block-size buffer of a block that leaves (a transient one, a deleted or
replaced one, see `recycle`) is kept, when nothing else holds it, for the next new
block or load of that size, still counted in `used_bytes` (so within the budget). A
reused buffer skips the page faults of fresh memory: a third of a cold read's time, and
on this VM (free pages are handed back to the host) up to 13 µs per 4 KiB page for a
write into new blocks, four times what the copy itself costs (docs/design.md, "Block
buffers are reused"). `make_room` drops spares before it evicts anything, and
`shed_spares` lets idle ones go.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from distorefs.types import BlockKey

MIN_CAPACITY_BYTES = 4096
TRANSIENT_MAX_BYTES = 128 * 1024 * 1024  # four sequential readers' prefetch windows of 32 MiB
# shed_spares calls (the memory trim's, 5 s apart) without a spare taken before half of
# them go: 10 minutes, longer than the interval of most training jobs' checkpoints,
# whose next save reuses the buffers the last one's deleted files left
SPARE_IDLE_CHECKS = 120


def add_owned(bytes_by_owner: dict[int, int], owner: int, delta: int) -> None:
    """Add `delta` to `owner`'s bytes, dropping an owner at 0 (statistics kept as things
    come and go, where a walk of a million entries would hold the event loop)."""
    left = bytes_by_owner.pop(owner, 0) + delta
    if left:
        bytes_by_owner[owner] = left


class Block:
    """One cached block. `version` increases on every change, so a flush can tell whether
    the block changed while its snapshot was being written."""

    __slots__ = ("buf", "length", "dirty", "version", "transient")

    def __init__(self, buf: bytearray | memoryview | bytes, length: int, dirty: bool) -> None:
        self.buf = buf
        self.length = length
        self.dirty = dirty
        self.version = 0
        self.transient = False  # in DramCache's FIFO of a one-pass reader's blocks

    @property
    def capacity_bytes(self) -> int:
        return len(self.buf)

    @property
    def borrowed(self) -> bool:
        """Memory the daemon took over whole (a staged file's memfd): let go once logged."""
        return isinstance(self.buf, memoryview)

    @property
    def writable(self) -> bool:
        """Whether the buffer may be changed in place (not borrowed, not a whole-block
        write's own `bytes`, see BlockStore.write_whole)."""
        return isinstance(self.buf, bytearray)


SMALL_BLOCK_BYTES = 64 * 1024


def capacity_for(length: int, block_bytes: int) -> int:
    """The buffer capacity for `length` valid bytes.

    Small contents (up to 64 KiB: small files, file tails) get the next power of two from
    4 KiB, so 100k small files do not cost 100k full blocks. Anything larger gets the whole
    block at once: growing by doubling costs a copy per step, which halves write speed.
    """
    if length > SMALL_BLOCK_BYTES:
        return max(block_bytes, length)
    capacity = MIN_CAPACITY_BYTES
    while capacity < length:
        capacity *= 2
    return min(capacity, block_bytes)


@dataclass(frozen=True)
class DramStatistics:
    budget_bytes: int
    used_bytes: int
    dirty_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    reserved_bytes: int
    index_bytes: int
    borrowed_bytes: int
    transient_bytes: int
    spare_bytes: int
    reused_buffers: int


# The replay buffers' rings together may take at most this share of the budget: the rest
# stays for cached blocks and for writes. Without a bound, 600 empty buffers (mkdir each:
# a ring of the default 100,000 slots is 11.6 MB) reserved 7 GB of a 4 GiB budget, and
# every file write on the mount failed with ENOSPC.
INDEX_BUDGET_SHARE = 2


class DramCache:
    """LRU of blocks under `budget_bytes`, counted by buffer capacity."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        # Keyed by plain (owner, number) tuples, which a BlockKey finds: the garbage
        # collector stops tracking those once seen (tiers/block_index.py says why it matters).
        self._blocks: OrderedDict[tuple[int, int], Block] = OrderedDict()
        self._owner_bytes: dict[int, int] = {}  # capacity of the cached blocks, by owner
        self.used_bytes = 0
        self.dirty_bytes = 0
        self.reserved_bytes = 0  # held outside the LRU (a stream's prefetched records)
        self.index_bytes = 0  # held outside the LRU for good: replay buffers' rings (arrays and trees)
        self.borrowed_bytes = 0  # of used_bytes: borrowed blocks (staged files' memory)
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._transient: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> hits since its load
        self.transient_bytes = 0
        self.transient_budget = min(TRANSIENT_MAX_BYTES, budget_bytes // 2)
        self.spare_size = 0  # the capacity of a reusable buffer (the block tier's block size)
        self._spares: list[bytearray] = []  # counted in used_bytes
        self._reused = 0
        self._idle_checks = 0  # shed_spares calls since a spare was last taken
        # Told of each clean block that make_room evicts (the remote memory tier's chance
        # to keep a copy); it must not touch the cache.
        self.evicted: Callable[[BlockKey, Block], None] | None = None
        self._watchers: dict[int, Callable[[int], None]] = {}  # owner -> told of each block that leaves
        # Blocks that left the cache or changed buffer so far: a reader that keeps views of
        # cached blocks (a dataset stream served from DRAM) looks again when it moved.
        self.departures = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockKey) -> Block | None:
        """Return the block and make it most recently used, or None on a miss."""
        block = self._blocks.get(key)
        if block is None:
            self._misses += 1
            return None
        self._hits += 1
        self._blocks.move_to_end(key)
        if block.transient:
            self._touch_transient(key, block)
        return block

    def _touch_transient(self, key: BlockKey, block: Block) -> None:
        """The reader that had it loaded reads it once; a second read makes it ordinary."""
        hits = self._transient[key] + 1
        if hits < 2:
            self._transient[key] = hits
        else:
            del self._transient[key]
            self.transient_bytes -= block.capacity_bytes
            block.transient = False

    def get_many(self, keys: list[BlockKey]) -> list[Block | None]:
        """`get` for many keys in one call (a sampled batch: tens of keys)."""
        blocks = self._blocks
        used = blocks.move_to_end
        out = [blocks.get(key) for key in keys]
        misses = 0
        for key, block in zip(keys, out, strict=True):
            if block is None:
                misses += 1
            else:
                used(key)
        self._misses += misses
        self._hits += len(keys) - misses
        return out

    def missed(self) -> None:
        """Count a miss of a lookup made without `get` (the prefetcher's, which must not
        count as a read of a block it finds)."""
        self._misses += 1

    def peek(self, key: BlockKey) -> Block | None:
        """Return the block without touching LRU order or counters."""
        return self._blocks.get(key)

    def insert(self, key: BlockKey, block: Block, transient: bool = False, reads: int = 1) -> None:
        """Add a block that is not cached yet; the caller made room with `make_room`.
        `transient`: a one-pass reader's (see the module's doc), which has read it
        `reads` times (0: loaded ahead of it; 1: loaded for the read that asked)."""
        assert key not in self._blocks
        plain = (key[0], key[1])
        self._blocks[plain] = block
        self.used_bytes += block.capacity_bytes
        add_owned(self._owner_bytes, key[0], block.capacity_bytes)
        if block.borrowed:
            self.borrowed_bytes += block.capacity_bytes
        if block.dirty:
            self.dirty_bytes += block.capacity_bytes
        if transient and not block.dirty:
            block.transient = True
            self._transient[plain] = reads
            self.transient_bytes += block.capacity_bytes
            self._trim_transient()

    def _trim_transient(self) -> None:
        """The oldest transient blocks leave while there are too many; their buffers are
        kept as spares when nothing else holds them."""
        while self.transient_bytes > self.transient_budget and self._transient:
            key, _hits = self._transient.popitem(last=False)
            block = self._blocks[key]
            self.transient_bytes -= block.capacity_bytes
            block.transient = False
            if block.dirty:
                continue  # written meanwhile: an ordinary block now
            del block  # (recycle must find the cache's reference alone)
            self._evict_one(key, reuse=True)

    def recycle(self, block: Block) -> None:
        """`block` left the cache (`remove`d): keep its buffer as a spare when it is a
        block-size bytearray that nothing else holds. The caller's one reference to
        `block` must be its last (a flush's snapshot, a write-behind pass or a reply's
        memoryview still holding it or its buffer keeps the buffer out of the spares).
        Its bytes stay counted in `used_bytes`; the cache had counted them already."""
        if (
            isinstance(block.buf, bytearray)
            and len(block.buf) == self.spare_size
            and sys.getrefcount(block) <= 3  # the caller's, this call's, getrefcount's own
            and sys.getrefcount(block.buf) <= 2  # the block's, getrefcount's own
        ):
            self._spares.append(block.buf)
            self.used_bytes += self.spare_size
            block.buf = bytearray()

    def has_spare(self, capacity: int) -> bool:
        return capacity == self.spare_size and bool(self._spares)

    def take_spare(self, capacity: int) -> bytearray | None:
        """A reused buffer of `capacity` bytes for a new block, or None (only block-size
        ones are kept). Its old bytes are another block's: the caller fills what the new
        block's length covers; nothing reads past a block's length. No longer counted
        in `used_bytes` (the block it goes to is, when inserted)."""
        if not self.has_spare(capacity):
            return None
        self.used_bytes -= self.spare_size
        self._reused += 1
        self._idle_checks = 0
        return self._spares.pop()

    def _drop_spares(self, need_bytes: int) -> None:
        """Let spares go (the newest last) until `need_bytes` more fit in the budget."""
        spares = self._spares
        while spares and self.used_bytes + need_bytes > self.budget_bytes:
            spares.pop()
            self.used_bytes -= self.spare_size

    def shed_spares(self) -> int:
        """Called every few seconds (the daemon's memory trim): once SPARE_IDLE_CHECKS
        calls in a row have found no spare taken, half of the spares go (the memory trim
        then gives them back to the system). Returns the bytes let go."""
        if not self._spares:
            return 0
        self._idle_checks += 1
        if self._idle_checks < SPARE_IDLE_CHECKS:
            return 0
        keep = len(self._spares) // 2
        dropped = len(self._spares) - keep
        del self._spares[keep:]
        self.used_bytes -= dropped * self.spare_size
        return dropped * self.spare_size

    def watch(self, owner: int, left: Callable[[int], None] | None) -> None:
        """Tell `left(number)` of every block of `owner` that leaves the cache, however it
        goes (evicted, deleted, dropped), before anything reuses its buffer: for an owner
        that keeps references to its cached blocks (a replay buffer's table of them by
        ring slot) and must let go of one as soon as the cache does. None stops it. It
        must not touch the cache."""
        if left is None:
            self._watchers.pop(owner, None)
        else:
            self._watchers[owner] = left

    def remove(self, key: tuple[int, int]) -> Block | None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.departures += 1
            watcher = self._watchers.get(key[0])
            if watcher is not None:
                watcher(key[1])
            if block.transient:
                del self._transient[key]
                self.transient_bytes -= block.capacity_bytes
                block.transient = False
            self.used_bytes -= block.capacity_bytes
            add_owned(self._owner_bytes, key[0], -block.capacity_bytes)
            if block.borrowed:
                self.borrowed_bytes -= block.capacity_bytes
            if block.dirty:
                self.dirty_bytes -= block.capacity_bytes
        return block

    def replace_buffer(self, key: BlockKey, block: Block, buf: bytearray) -> None:
        """Swap the buffer of the cached block of `key` for a bigger (or smaller) one,
        keeping the accounting."""
        self.departures += 1
        delta = len(buf) - block.capacity_bytes
        add_owned(self._owner_bytes, key[0], delta)
        if block.transient:
            self.transient_bytes += delta
        if block.borrowed:
            self.borrowed_bytes -= block.capacity_bytes  # a copy of its own from now on
        block.buf = buf
        self.used_bytes += delta
        if block.dirty:
            self.dirty_bytes += delta

    def mark_dirty(self, block: Block) -> None:
        block.version += 1
        if not block.dirty:
            block.dirty = True
            self.dirty_bytes += block.capacity_bytes

    def mark_clean(self, block: Block) -> None:
        if block.dirty:
            block.dirty = False
            self.dirty_bytes -= block.capacity_bytes

    def make_room(self, need_bytes: int) -> bool:
        """Evict clean blocks, least recently used first, until `need_bytes` more fit.

        Returns False when only dirty blocks are left and they do not fit.
        """
        if self.used_bytes + need_bytes <= self.budget_bytes:
            return True
        self._drop_spares(need_bytes)
        if self.used_bytes + need_bytes <= self.budget_bytes:
            return True
        self._evict(need_bytes, reuse=False)
        return self.used_bytes + need_bytes <= self.budget_bytes

    def room_for_buffer(self, capacity: int, need_bytes: int) -> bool:
        """Room for a block's new buffer of `capacity` bytes (`need_bytes` more than the
        cache counts now, when it is new memory), which the caller then takes with
        `take_spare`, or allocates when that gives None. A block-size buffer comes from a
        spare when one is kept, else from a block evicted for it (its buffer kept as a
        spare, when nothing else holds it, instead of freed and then allocated again as
        new memory). False as for `make_room`."""
        if self.has_spare(capacity) or self.used_bytes + need_bytes <= self.budget_bytes:
            return True
        if capacity == self.spare_size:
            self._evict(need_bytes, reuse=True)
            if self.has_spare(capacity):
                return True
        return self.make_room(need_bytes)

    def _evict(self, need_bytes: int, reuse: bool) -> None:
        """Evict clean blocks, least recently used first, until `need_bytes` more fit or,
        with `reuse`, until a block-size one was evicted (its buffer kept as a spare)."""
        for key in self._victims(need_bytes, reuse):
            self._evict_one(key, reuse)

    def _evict_one(self, key: tuple[int, int], reuse: bool) -> None:
        """Evict the clean block at `key`: counted, told to `evicted`, and with `reuse`
        its buffer kept as a spare when nothing else holds it."""
        victim = self.remove(key)
        assert victim is not None
        self._evictions += 1
        if self.evicted is not None:
            self.evicted(BlockKey._make(key), victim)
        if reuse:
            self.recycle(victim)

    def _victims(self, need_bytes: int, reuse: bool) -> list[tuple[int, int]]:
        """The keys `_evict` evicts. Walks from the least recently used end and stops as
        soon as there is room: a full cache of a million items costs a few steps per
        call, not a copy of its keys. Dirty blocks met on the way cannot go; they move to
        the other end, so the next walk does not step over them again (they are in use
        anyway). (Keys only: a victim's reference count must be the cache's alone when
        `recycle` looks at it.)"""
        victims: list[tuple[int, int]] = []
        passed: list[tuple[int, int]] = []
        freed = 0
        for key, block in self._blocks.items():
            if block.dirty:
                passed.append(key)
                continue
            victims.append(key)
            freed += block.capacity_bytes
            if self.used_bytes - freed + need_bytes <= self.budget_bytes:
                break
            if reuse and block.capacity_bytes == self.spare_size:
                break
        for key in passed:
            self._blocks.move_to_end(key)
        return victims

    @property
    def index_room_bytes(self) -> int:
        """How many more bytes of ring the buffers may reserve (INDEX_BUDGET_SHARE)."""
        return max(0, self.budget_bytes // INDEX_BUDGET_SHARE - self.index_bytes)

    def reserve(self, nbytes: int, force: bool = False, index: bool = False) -> bool:
        """Count `nbytes` held outside the LRU against the budget, evicting clean blocks
        to make room; False (nothing reserved) when they do not fit, unless `force`:
        memory a store holds already (a buffer's ring at start-up) counts whatever room
        there is, and the cache then keeps fewer blocks. `index`: a replay buffer's ring,
        counted apart (`index_bytes`) from what `reserved_bytes` shares out, and all
        rings together at most 1/INDEX_BUDGET_SHARE of the budget (unless `force`)."""
        if not force and index and nbytes > self.index_room_bytes:
            return False
        if not self.make_room(nbytes) and not force:
            return False
        self.used_bytes += nbytes
        if index:
            self.index_bytes += nbytes
        else:
            self.reserved_bytes += nbytes
        return True

    def unreserve(self, nbytes: int, index: bool = False) -> None:
        assert 0 <= nbytes <= (self.index_bytes if index else self.reserved_bytes)
        self.used_bytes -= nbytes
        if index:
            self.index_bytes -= nbytes
        else:
            self.reserved_bytes -= nbytes

    def owner_bytes(self, owner: int) -> int:
        """Bytes of `owner`'s cached blocks: kept as blocks come, go and grow (a walk of
        the cache took 0.7 s of the event loop for a million items, at every read of a
        buffer's `stats` and every scrape of the metrics)."""
        return self._owner_bytes.get(owner, 0)

    def statistics(self) -> DramStatistics:
        return DramStatistics(
            budget_bytes=self.budget_bytes,
            used_bytes=self.used_bytes,
            dirty_bytes=self.dirty_bytes,
            blocks=len(self._blocks),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            reserved_bytes=self.reserved_bytes,
            index_bytes=self.index_bytes,
            borrowed_bytes=self.borrowed_bytes,
            transient_bytes=self.transient_bytes,
            spare_bytes=len(self._spares) * self.spare_size,
            reused_buffers=self._reused,
        )
