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
cold scan of a big file does not push the working set out of DRAM, and the buffer of
a block that leaves is kept as a *spare* for the next load when nothing else holds it:
a load into a reused buffer skips the page faults of fresh memory, which were a third
of a cold read's time (docs/design.md, "Cold sequential reads reuse their buffers").
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from distorefs.types import BlockKey

MIN_CAPACITY_BYTES = 4096
TRANSIENT_MAX_BYTES = 128 * 1024 * 1024  # four sequential readers' prefetch windows of 32 MiB
MAX_SPARES = 16  # buffers kept for the next transient loads


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
    borrowed_bytes: int
    transient_bytes: int
    spare_bytes: int
    reused_buffers: int


def unshared(block: Block) -> bool:
    """Whether nothing but the caller's one reference holds `block`, and nothing but
    `block` its buffer (no memoryview of it handed out and still alive): CPython's
    reference counts, each plus the one of getrefcount's own argument."""
    return sys.getrefcount(block) <= 3 and sys.getrefcount(block.buf) <= 2


class DramCache:
    """LRU of blocks under `budget_bytes`, counted by buffer capacity."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[BlockKey, Block] = OrderedDict()
        self.used_bytes = 0
        self.dirty_bytes = 0
        self.reserved_bytes = 0  # held outside the LRU (a stream's prefetched records)
        self.borrowed_bytes = 0  # of used_bytes: borrowed blocks (staged files' memory)
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._transient: OrderedDict[BlockKey, int] = OrderedDict()  # key -> hits since its load
        self.transient_bytes = 0
        self.transient_budget = min(TRANSIENT_MAX_BYTES, budget_bytes // 2)
        self.spare_size = 0  # the capacity of a reusable buffer (the block tier's block size)
        self._spares: list[bytearray] = []  # counted in used_bytes
        self._reused = 0
        # Told of each clean block that make_room evicts (the remote memory tier's chance
        # to keep a copy); it must not touch the cache.
        self.evicted: Callable[[BlockKey, Block], None] | None = None

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
        self._blocks[key] = block
        self.used_bytes += block.capacity_bytes
        if block.borrowed:
            self.borrowed_bytes += block.capacity_bytes
        if block.dirty:
            self.dirty_bytes += block.capacity_bytes
        if transient and not block.dirty:
            block.transient = True
            self._transient[key] = reads
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
            self.remove(key)
            self._evictions += 1
            if self.evicted is not None:
                self.evicted(key, block)
            if (
                len(self._spares) < MAX_SPARES
                and isinstance(block.buf, bytearray)
                and len(block.buf) == self.spare_size
                and unshared(block)
            ):
                self._spares.append(block.buf)
                self.used_bytes += self.spare_size

    def take_spare(self, length: int) -> bytearray | None:
        """A reused buffer to load a transient block of `length` bytes into, or None. Only
        for full blocks: the spare's old bytes are all overwritten, none lies past the
        new block's length."""
        if not self._spares or length != self.spare_size:
            return None
        self.used_bytes -= self.spare_size
        self._reused += 1
        return self._spares.pop()

    def _drop_spares(self) -> None:
        self.used_bytes -= len(self._spares) * self.spare_size
        self._spares.clear()

    def remove(self, key: BlockKey) -> Block | None:
        block = self._blocks.pop(key, None)
        if block is not None:
            if block.transient:
                del self._transient[key]
                self.transient_bytes -= block.capacity_bytes
                block.transient = False
            self.used_bytes -= block.capacity_bytes
            if block.borrowed:
                self.borrowed_bytes -= block.capacity_bytes
            if block.dirty:
                self.dirty_bytes -= block.capacity_bytes
        return block

    def replace_buffer(self, block: Block, buf: bytearray) -> None:
        """Swap a block's buffer for a bigger (or smaller) one, keeping the accounting."""
        delta = len(buf) - block.capacity_bytes
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
        self._drop_spares()
        if self.used_bytes + need_bytes <= self.budget_bytes:
            return True
        # Walk from the least recently used end and stop as soon as there is room: a
        # full cache of a million items costs a few steps per call, not a copy of its
        # keys. Dirty blocks met on the way cannot go; they move to the other end, so
        # the next walk does not step over them again (they are in use anyway).
        victims: list[tuple[BlockKey, Block]] = []
        passed: list[BlockKey] = []
        freed = 0
        for key, block in self._blocks.items():
            if block.dirty:
                passed.append(key)
                continue
            victims.append((key, block))
            freed += block.capacity_bytes
            if self.used_bytes - freed + need_bytes <= self.budget_bytes:
                break
        for key in passed:
            self._blocks.move_to_end(key)
        for key, block in victims:
            self.remove(key)
            self._evictions += 1
            if self.evicted is not None:
                self.evicted(key, block)
        return self.used_bytes + need_bytes <= self.budget_bytes

    def reserve(self, nbytes: int) -> bool:
        """Count `nbytes` held outside the LRU against the budget, evicting clean blocks
        to make room; False (nothing reserved) when they do not fit."""
        if not self.make_room(nbytes):
            return False
        self.used_bytes += nbytes
        self.reserved_bytes += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.reserved_bytes
        self.used_bytes -= nbytes
        self.reserved_bytes -= nbytes

    def owner_bytes(self, owner: int) -> int:
        return sum(b.capacity_bytes for k, b in self._blocks.items() if k.owner == owner)

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
            borrowed_bytes=self.borrowed_bytes,
            transient_bytes=self.transient_bytes,
            spare_bytes=len(self._spares) * self.spare_size,
            reused_buffers=self._reused,
        )
