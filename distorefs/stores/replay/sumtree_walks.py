"""The sum tree's walks, slot by slot and level by level, as plain Python.

Owns nothing: functions over the arrays of sumtree.SegmentTree (its sum, min and max
trees, the leaves from `size` on). sumtree_jit.py compiles them with numba for every
call where numba runs; without numba, SegmentTree runs `update_sums*` as they are for
updates of a few slots (on memoryviews, whose elements are Python floats) and keeps its
vectorised numpy walks for the rest. One definition serves both ways.
"""

from __future__ import annotations

from typing import Any


def find(total: Any, depth: int, prefixes: Any, out: Any) -> None:
    """out[i] = the leaf node whose cumulative interval holds prefixes[i]; a prefix that
    float rounding sends to an empty leaf goes again, never right into a subtree
    without mass (SegmentTree._find_careful)."""
    for i in range(len(prefixes)):
        node = 1
        remaining = prefixes[i]
        for _ in range(depth):
            node <<= 1
            left = total[node]
            if remaining >= left:
                remaining -= left
                node += 1
        if total[node] <= 0:
            node = 1
            remaining = prefixes[i]
            for _ in range(depth):
                left = total[2 * node]
                if (remaining >= left and total[2 * node + 1] > 0) or left <= 0:
                    remaining -= left
                    node = 2 * node + 1
                else:
                    node = 2 * node
        out[i] = node


def update_sums(total: Any, size: int, slots: Any, values: Any) -> None:
    """Set leaf slots[i] to values[i], in order (a later duplicate wins), and each sum above."""
    for i in range(len(slots)):
        node = slots[i] + size
        total[node] = values[i]
        node >>= 1
        while node:
            total[node] = total[2 * node] + total[2 * node + 1]
            node >>= 1


def update_sums_min_max(total: Any, low: Any, high: Any, size: int, slots: Any, values: Any) -> None:
    """update_sums, and the min (of non-zero leaves) and max trees with it."""
    inf = float("inf")
    for i in range(len(slots)):
        node = slots[i] + size
        value = values[i]
        total[node] = value
        low[node] = value if value > 0 else inf
        high[node] = value
        node >>= 1
        while node:
            left = 2 * node
            total[node] = total[left] + total[left + 1]
            low[node] = min(low[left], low[left + 1])
            high[node] = max(high[left], high[left + 1])
            node >>= 1
