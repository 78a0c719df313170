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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from distorefs.types import BlockKey

MIN_CAPACITY_BYTES = 4096


class Block:
    """One cached block. `version` increases on every change, so a flush can tell whether
    the block changed while its snapshot was being written."""

    __slots__ = ("buf", "length", "dirty", "version")

    def __init__(self, buf: bytearray | memoryview | bytes, length: int, dirty: bool) -> None:
        self.buf = buf
        self.length = length
        self.dirty = dirty
        self.version = 0

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
        return block

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

    def peek(self, key: BlockKey) -> Block | None:
        """Return the block without touching LRU order or counters."""
        return self._blocks.get(key)

    def insert(self, key: BlockKey, block: Block) -> None:
        """Add a block that is not cached yet; the caller made room with `make_room`."""
        assert key not in self._blocks
        self._blocks[key] = block
        self.used_bytes += block.capacity_bytes
        if block.borrowed:
            self.borrowed_bytes += block.capacity_bytes
        if block.dirty:
            self.dirty_bytes += block.capacity_bytes

    def remove(self, key: BlockKey) -> Block | None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.used_bytes -= block.capacity_bytes
            if block.borrowed:
                self.borrowed_bytes -= block.capacity_bytes
            if block.dirty:
                self.dirty_bytes -= block.capacity_bytes
        return block

    def replace_buffer(self, block: Block, buf: bytearray) -> None:
        """Swap a block's buffer for a bigger (or smaller) one, keeping the accounting."""
        delta = len(buf) - block.capacity_bytes
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
        )
