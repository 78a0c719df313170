"""Mirror: a buffer's items in one shared-memory arena, for samplers in other processes.

Owns the arena: a memfd cut into equal slots of `stride` bytes (one item each), which
ring slot's item sits in which arena slot, and which arena slots samplers still hold.
A sampler session (fs/shm_sessions.py) maps the memfd read-only and reads the items of a
drawn batch where this says they are, so a batch moves no item bytes through the
daemon at all (docs/formats.md, "Shared-memory sampling, version 2").

The arena is a second copy of the items in DRAM beside the block tier's (which stays
the source of truth and the path to the log); its bytes are reserved against the DRAM
budget. An arena slot is never written while a sampler holds it: a new item goes into
a free slot, and the slot of an item that left is free again once no batch holds it.
So a batch's views stay valid, unchanged, until the sampler releases it, whatever is
appended meanwhile. Each mapping asks for huge pages (hugepages.py; the sampler's
mapping asks too), which the host grants where its shmem setting allows.

Examples:
    >>> mirror = Mirror(capacity=1000, stride=4096, reserve=blocks.reserve, unreserve=blocks.unreserve)
    >>> mirror.place(np.array([5]), [b"item bytes"])          # item 5 -> some arena slot
    >>> held = mirror.lease(mirror.ring[np.array([5]) % 1000]) # a batch holds it ...
    >>> mirror.release(held)                                   # ... until given back
    >>> mirror.close()
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence

import numpy as np

from distorefs import hugepages
from distorefs.compiled import Kernels, compiled_array
from distorefs.errors import OutOfMemory

FIRST_BYTES = 8 << 20  # the first growth: this much, or 64 slots, whichever is fewer (at least 1)
FIRST_SLOTS = 64
GROWTH = 1.5
ALIGN = 64  # a slot starts on a cache line
INLINE_BYTES = 4 << 20  # items bigger than this are copied in at their first draw, from a thread


_COMPILED_TARGETS = (np.dtype(np.int64), np.dtype(np.int32))  # counts_jit.add_at's signatures


def repeats(positions: np.ndarray) -> bool:
    """Whether some position is named more than once. A drawn batch's slots come out of
    its stratified prefixes in increasing order, so one comparison of neighbours says
    "none" for nearly every batch (1 µs for 256); otherwise a sort (2-3 µs)."""
    if len(positions) < 2:
        return False
    if (positions[1:] > positions[:-1]).all():
        return False
    ordered = np.sort(positions)
    return bool((ordered[1:] == ordered[:-1]).any())


COUNTS = Kernels("distorefs.stores.replay.counts_jit", "DISTOREFS_COUNTS", "numpy")  # add_at, count_live, release


def load_compiled() -> bool:
    """Load the compiled counts (counts_jit.py); until then, or without numba, numpy's."""
    return COUNTS.load()


def batch_repeats(positions: np.ndarray) -> bool | None:
    """`repeats` for a drawn batch's one look, or None (not looked) where the compiled
    counts run, which need no look; `add_at` looks itself if it must."""
    return None if COUNTS.module is not None else repeats(positions)


def add_at(target: np.ndarray, positions: np.ndarray, delta: int, repeated: bool | None = None) -> None:
    """`np.add.at(target, positions, delta)`, a position named twice counted twice;
    IndexError, with nothing added, for a position outside 0..len(target)-1 (numpy's
    indexing alone would take a negative one from the end). Compiled (counts_jit.py)
    where loaded: a loop, 0.4 µs for 256 positions. Else with no repeats (the usual
    batch) one fancy-indexed add, a tenth of ufunc.at's 25 µs for 256 positions;
    `repeated`, where the caller knows it (a drawn batch's slots, for its lease, its
    count and its release), saves looking again."""
    jit = COUNTS.module
    if jit is not None and positions.dtype == np.int64 and target.dtype in _COMPILED_TARGETS:
        if not jit.add_at(target, compiled_array(positions, np.int64), delta):
            raise IndexError(f"a position outside 0..{len(target) - 1}; none added")
        return
    if len(positions) and (positions.min() < 0 or positions.max() >= len(target)):
        raise IndexError(f"a position outside 0..{len(target) - 1}; none added")
    if repeated is None:
        repeated = repeats(positions)
    if repeated:
        np.add.at(target, positions, delta)
    else:
        target[positions] += delta


def stride_for(item_bytes: int) -> int:
    return max(ALIGN, -(-item_bytes // ALIGN) * ALIGN)


class Mirror:
    """The arena of one buffer. Everything here is synchronous: the buffer calls it
    between awaits, and copies of big items go to a thread through `copy_into`."""

    def __init__(
        self, capacity: int, stride: int, reserve: Callable[[int], bool], unreserve: Callable[[int], None]
    ) -> None:
        self.stride = stride
        self.capacity = capacity
        # room for every ring slot, plus slots of items that left while batches hold them
        self.max_slots = capacity + max(256, capacity // 4)
        self._reserve = reserve
        self._unreserve = unreserve
        self._fd = os.memfd_create("distorefs-mirror", os.MFD_CLOEXEC)
        self.slots = 0
        self._map: mmap.mmap | None = None
        self.rows = np.zeros((0, stride), dtype=np.uint8)
        self.ring = np.full(capacity, -1, dtype=np.int64)  # ring slot -> arena slot (-1: not here)
        self.index = np.zeros(0, dtype=np.int64)  # arena slot -> the item's index (-1: none)
        self.refs = np.zeros(0, dtype=np.int32)  # batches holding the arena slot
        self._free: list[int] = []
        self.closed = False
        self.failed_growth = False  # the DRAM budget refused more slots once
        self.outgrown = 0  # the biggest item that did not fit a slot (0: none)
        self.filling = False  # a task is bringing the items in (fill_mirror)

    @property
    def size_bytes(self) -> int:
        return self.slots * self.stride

    def read_only_fd(self) -> int:
        """A new read-only descriptor of the arena, to hand to a sampler (it can map it,
        not change it)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def _grow(self) -> bool:
        """More slots (x1.5, up to max_slots), reserved against the DRAM budget first.
        Views of the old mapping stay valid: both map the same memfd pages."""
        if self.slots >= self.max_slots or self.closed:
            return False
        first = max(1, min(FIRST_SLOTS, FIRST_BYTES // self.stride))
        new = min(self.max_slots, max(first, int(self.slots * GROWTH), self.slots + 1))
        if not self._reserve((new - self.slots) * self.stride):
            new = self.slots + 1  # the budget is nearly spent: one slot at a time
            if not self._reserve(self.stride):
                self.failed_growth = True
                return False
        os.ftruncate(self._fd, new * self.stride)
        self._map = mmap.mmap(self._fd, new * self.stride)
        hugepages.advise(self._map)
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(new, self.stride)
        self.index = np.concatenate([self.index, np.full(new - self.slots, -1, dtype=np.int64)])
        self.refs = np.concatenate([self.refs, np.zeros(new - self.slots, dtype=np.int32)])
        self._free.extend(range(new - 1, self.slots - 1, -1))  # lowest first off the end
        self.slots = new
        return True

    def _take(self) -> int | None:
        if not self._free and not self._grow():
            return None
        return self._free.pop()

    def forget(self, indices: np.ndarray) -> None:
        """These items left (or are being replaced): their arena slots are free now, or
        once the last batch holding them is released. Indices not here are skipped."""
        if self.closed or not len(indices):
            return
        ring = indices % self.capacity
        arena_slots = self.ring[ring]
        here = arena_slots >= 0
        here[here] = self.index[arena_slots[here]] == indices[here]
        if not here.any():
            return
        self.ring[ring[here]] = -1
        self._vacate(arena_slots[here])

    def _vacate(self, arena_slots: np.ndarray) -> None:
        """These slots hold no live item any more: free now, or when the last holder lets go."""
        self.index[arena_slots] = -1
        idle = arena_slots[self.refs[arena_slots] == 0]
        self._free.extend(np.unique(idle).tolist())

    def reserve_slot(self, length: int) -> int | None:
        """A free arena slot for an item of `length` bytes; None when it does not fit a
        slot (`outgrown` remembers the biggest such item) or the arena is full."""
        if length > self.stride:
            self.outgrown = max(self.outgrown, length)
            return None
        if self.closed:
            return None
        return self._take()

    def commit_slot(self, index: int, arena_slot: int) -> None:
        """Item `index`'s bytes are in `arena_slot`: samplers find it there from now on
        (whatever its ring slot pointed at before, an older copy or an older item, goes)."""
        ring_slot = index % self.capacity
        before = int(self.ring[ring_slot])
        if before >= 0:
            self._vacate(np.array([before]))
        self.ring[ring_slot] = arena_slot
        self.index[arena_slot] = index

    def abandon_slot(self, arena_slot: int) -> None:
        """A reserved slot that was not committed (the item left during the copy)."""
        if not self.closed:
            self._free.append(arena_slot)

    def copy_into(self, arena_slot: int, data: bytes | bytearray | memoryview) -> None:
        """Write an item's bytes into its reserved slot (from a thread for big items:
        numpy lets go of the GIL for the copy)."""
        self.rows[arena_slot, : len(data)] = np.frombuffer(data, dtype=np.uint8)

    def place(self, indices: np.ndarray, items: Sequence[bytes | bytearray | memoryview]) -> None:
        """Copy these new items in at once (appends, overwrites); a big one, or one that
        finds no room, is left out (its ring slot says -1) and comes in at its first draw."""
        if self.closed:
            return
        self.forget(indices)
        for index, data in zip(indices.tolist(), items, strict=True):
            if len(data) > INLINE_BYTES:
                continue
            arena_slot = self.reserve_slot(len(data))
            if arena_slot is None:
                continue
            self.copy_into(arena_slot, data)
            self.commit_slot(index, arena_slot)

    def lease(self, arena_slots: np.ndarray, repeated: bool | None = None) -> np.ndarray:
        """A batch holds these slots (an item drawn twice is held twice) until `release`
        (`repeated`: whether a slot is named twice, where the caller knows)."""
        try:
            add_at(self.refs, arena_slots, 1, repeated)  # checks every slot, then holds them
        except IndexError:  # (-1: the item has no arena slot)
            raise OutOfMemory("a drawn item is not in the shared-memory arena") from None
        return arena_slots

    def release(self, arena_slots: np.ndarray, repeated: bool | None = None) -> None:
        if self.closed or not len(arena_slots):
            return
        jit = COUNTS.module
        if jit is not None and arena_slots.dtype == np.int64:
            idle = np.empty(len(arena_slots), dtype=np.int64)
            found = jit.release(self.refs, self.index, compiled_array(arena_slots, np.int64), idle)
            if found:  # (rare: an item left while a batch held it)
                self._free.extend(np.unique(idle[:found]).tolist())
            return
        add_at(self.refs, arena_slots, -1, repeated)
        unheld = (self.refs[arena_slots] == 0) & (self.index[arena_slots] < 0)
        if unheld.any():
            self._free.extend(np.unique(arena_slots[unheld]).tolist())

    def free_slots(self) -> int:
        """Slots free now and slots it may still grow by."""
        return len(self._free) + self.max_slots - self.slots

    def full(self) -> bool:
        return not self._free and (self.slots >= self.max_slots or self.failed_growth)

    def held_slots(self) -> int:
        return int(np.count_nonzero(self.refs))

    def statistics(self) -> dict[str, int]:
        return {
            "arena_bytes": self.size_bytes,
            "items": int(np.count_nonzero(self.ring >= 0)),
            "held_slots": self.held_slots(),
            "slot_bytes": self.stride,
            "huge_pages": hugepages.shmem_huge(),
        }

    def close(self) -> None:
        """Unreserve and let the memory go (with the last mapping of it: a sampler's
        views stay readable until it drops them)."""
        if self.closed:
            return
        self.closed = True
        self._unreserve(self.size_bytes)
        self.rows = np.zeros((0, self.stride), dtype=np.uint8)
        self._free = []
        self._map = None  # closed by the last view that goes
        os.close(self._fd)


class ArenaBudget:
    """What all mirrors together may reserve of the DRAM budget (the daemon gives them
    half of it), so arenas cannot push everything else out of DRAM."""

    def __init__(self, reserve: Callable[[int], bool], unreserve: Callable[[int], None], limit_bytes: int) -> None:
        self._reserve = reserve
        self._unreserve = unreserve
        self.limit_bytes = limit_bytes
        self.used_bytes = 0

    def reserve(self, nbytes: int) -> bool:
        if self.used_bytes + nbytes > self.limit_bytes or not self._reserve(nbytes):
            return False
        self.used_bytes += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
        self._unreserve(nbytes)
