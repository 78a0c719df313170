"""SegmentTree: sums, minimums and maximums over slot priorities, in numpy.

Owns the arrays. Where numba runs, the walks of `find` and `update` are compiled
(sumtree_jit.py: a few µs for a batch of 64); elsewhere they are vectorised over a whole
batch in numpy (an update of k slots costs O(k log n) in numpy calls, not k Python
loops). Leaves with value 0 are empty: they are never found by `find`, and the min tree
ignores them.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np

from distorefs.compiled import Kernels
from distorefs.stores.replay import sumtree_walks

log = logging.getLogger(__name__)

FEW_SLOTS = 5  # updates of up to this many slots walk the tree in Python (measured: faster up to 5)


KERNELS = Kernels("distorefs.stores.replay.sumtree_jit", "DISTOREFS_SUMTREE", "numpy")  # sumtree_jit's walks


def load_compiled() -> bool:
    """Load the compiled walks (numba's import and its cache, or a compile: 0.3-1 s),
    after which every tree uses them; until then trees walk in numpy, with the same
    results. The daemon calls this in a thread of its own at start, so that neither the
    mount nor the event loop waits for it. False (numpy walks stay) when numba is not
    installed, cannot run with this numpy, or DISTOREFS_SUMTREE=numpy asks for numpy."""
    return KERNELS.load()


class SegmentTree:
    """Sum (and optionally min and max) of `capacity` non-negative leaf values.

    Examples:
        >>> tree = SegmentTree(4, with_min_max=True)
        >>> tree.update(np.array([0, 2]), np.array([1.0, 3.0]))
        >>> tree.total, tree.min, tree.max
        (4.0, 1.0, 3.0)
        >>> tree.find(np.array([0.5, 1.5]))     # prefix sums -> slots
        array([0, 2])
    """

    def __init__(self, capacity: int, with_min_max: bool = False, compiled: bool = True) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        size = 1
        while size < capacity:
            size *= 2
        self._size = size
        self._depth = size.bit_length() - 1
        self._sum = np.zeros(2 * size, dtype=np.float64)
        self._min = np.full(2 * size, np.inf) if with_min_max else None
        self._max = np.zeros(2 * size, dtype=np.float64) if with_min_max else None
        self._may_compile = compiled

    @property
    def compiled(self) -> bool:
        """Whether the walks run compiled (numba) rather than in numpy."""
        return self._compiled_walks() is not None

    def _compiled_walks(self) -> ModuleType | None:
        return KERNELS.module if self._may_compile else None

    @property
    def total(self) -> float:
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """The smallest non-zero leaf (inf when all are zero)."""
        assert self._min is not None
        return float(self._min[1])

    @property
    def max(self) -> float:
        assert self._max is not None
        return float(self._max[1])

    def leaves(self) -> np.ndarray:
        return self._sum[self._size : self._size + self.capacity]

    def update(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set leaf `slots[i]` to `values[i]` (later duplicates win) and fix the sums above."""
        if len(slots) == 0:
            return
        jit = self._compiled_walks()
        if jit is not None and len(slots) < self._size // 8:
            slots = np.ascontiguousarray(slots, dtype=np.int64)
            values = np.ascontiguousarray(values, dtype=np.float64)
            if int(slots.min()) < 0 or int(slots.max()) >= self.capacity:
                raise IndexError(f"a slot outside 0..{self.capacity - 1}")  # compiled code checks no bounds
            self._climb(jit, self._sum, self._min, self._max, slots, values)
            return
        if len(slots) <= FEW_SLOTS:
            # without numba: the same walks as Python on memoryviews, whose elements are
            # Python floats (a numpy scalar costs 3-4x more); a dozen numpy calls per level
            # cost ~150 us a slot on a deep tree
            self._climb_in_python(np.asarray(slots).tolist(), np.asarray(values, dtype=np.float64).tolist())
            return
        nodes = np.asarray(slots, dtype=np.int64) + self._size
        values = np.asarray(values, dtype=np.float64)
        self._sum[nodes] = values
        if self._min is not None and self._max is not None:
            self._min[nodes] = np.where(values > 0, values, np.inf)
            self._max[nodes] = values
        if len(slots) >= self._size // 8:
            self._rebuild()  # many slots (a restore, a config change): every level at once
            return
        # Parents are recomputed from their children, so a parent named twice gets the
        # same value twice: no np.unique per level (it cost more than the duplicates).
        nodes >>= 1
        total, low, high = self._sum, self._min, self._max
        for _ in range(self._depth):
            left = nodes << 1
            right = left + 1
            total[nodes] = total[left] + total[right]
            if low is not None and high is not None:
                low[nodes] = np.minimum(low[left], low[right])
                high[nodes] = np.maximum(high[left], high[right])
            nodes >>= 1

    def update_one(self, slot: int, value: float) -> None:
        """`update` of one leaf, without the numpy calls that check a batch's bounds and
        types (an append's: each costs about a µs, several times the walk)."""
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} outside 0..{self.capacity - 1}")
        jit = self._compiled_walks()
        if jit is not None:
            self._climb(jit, self._sum, self._min, self._max, np.array([slot], np.int64), np.array([value]))
        else:
            self._climb_in_python([slot], [value])

    def _climb_in_python(self, slots: list[int], values: list[float]) -> None:
        low, high = self._min, self._max
        self._climb(
            sumtree_walks,
            self._sum.data,
            None if low is None else low.data,
            None if high is None else high.data,
            slots,
            values,
        )

    def _climb(self, walks: ModuleType, total: Any, low: Any, high: Any, slots: Any, values: Any) -> None:
        """Set the leaves and walk each one's path to the root with `walks` (compiled, or
        sumtree_walks as Python), the min and max trees too where there are."""
        if len(slots) != len(values):
            raise ValueError(f"{len(slots)} slots and {len(values)} values")
        if low is not None and high is not None:
            walks.update_sums_min_max(total, low, high, self._size, slots, values)
        else:
            walks.update_sums(total, self._size, slots, values)

    def _rebuild(self) -> None:
        """Recompute every inner node from the leaves, a level at a time: O(n) with no
        sorting, where the per-slot path costs a np.unique per level."""
        low = self._size // 2
        while low >= 1:
            level = slice(low, 2 * low)
            left, right = slice(2 * low, 4 * low, 2), slice(2 * low + 1, 4 * low, 2)
            self._sum[level] = self._sum[left] + self._sum[right]
            if self._min is not None and self._max is not None:
                self._min[level] = np.minimum(self._min[left], self._min[right])
                self._max[level] = np.maximum(self._max[left], self._max[right])
            low //= 2

    def find_stratified(self, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
        """A prioritized draw of `count` slots, one in each of `count` equal segments of
        [0, total), with their probabilities (leaf / total), in one compiled call: the
        same floats as `find(samplers.base.stratified_prefixes(total, count, rng))` and
        `leaves()[slots] / total` (the sampler's numpy way, four calls more). None where
        the walks are not compiled (the caller draws the numpy way)."""
        jit = self._compiled_walks()
        if jit is None:
            return None
        prefixes = rng.random(count)
        slots = np.empty(count, dtype=np.int64)
        probabilities = np.empty(count, dtype=np.float64)
        jit.find_stratified(self._sum, self._depth, self._size, prefixes, self.total / count, slots, probabilities)
        return slots, probabilities

    def find(self, prefixes: np.ndarray) -> np.ndarray:
        """For each prefix in [0, total), the slot whose cumulative interval holds it.

        Never returns an empty slot. The plain descent (six numpy calls a level) is
        right unless float rounding at an edge sends a prefix into a subtree without
        mass, which ends on an empty leaf: those few go again through the careful
        descent, which only goes right where the right subtree has mass.
        """
        jit = self._compiled_walks()
        if jit is not None:
            nodes = np.empty(len(prefixes), dtype=np.int64)
            jit.find(self._sum, self._depth, np.ascontiguousarray(prefixes, dtype=np.float64), nodes)
            return nodes - self._size
        total = self._sum
        nodes = np.ones(len(prefixes), dtype=np.int64)
        remaining = np.array(prefixes, dtype=np.float64)
        for _ in range(self._depth):
            nodes <<= 1
            left = total[nodes]
            go_right = remaining >= left
            remaining -= left * go_right
            nodes += go_right
        empty = total[nodes] <= 0
        if empty.any():
            nodes[empty] = self._find_careful(np.asarray(prefixes, dtype=np.float64)[empty])
        return nodes - self._size

    def _find_careful(self, prefixes: np.ndarray) -> np.ndarray:
        """The descent that never enters a subtree without mass; returns leaf nodes."""
        nodes = np.ones(len(prefixes), dtype=np.int64)
        remaining = prefixes.copy()
        for _ in range(self._depth):
            left = self._sum[2 * nodes]
            go_right = ((remaining >= left) & (self._sum[2 * nodes + 1] > 0)) | (left <= 0)
            remaining = np.where(go_right, remaining - left, remaining)
            nodes = 2 * nodes + go_right
        return nodes
