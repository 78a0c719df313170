"""The sum tree's walks compiled with numba: a draw's descent and an update's climb.

Owns nothing: functions over the arrays of sumtree.SegmentTree, which calls them when
this module imports (numba installed and able to run with this numpy) and keeps its
numpy walks otherwise. Each one does what the numpy code beside it in sumtree.py does,
slot by slot and level by level, in a loop compiled to machine code: a batch of 64 costs
a few µs where the numpy walks spend ~1 µs per call and five calls a level
(docs/design.md, "A compiled sum tree"). tests/unit/test_replay.py holds both to the
same answers.

The signatures are given, so the functions are compiled (or loaded from numba's cache,
`cache=True`) when this module is imported, never on the event loop at a first draw.
They keep the GIL: a walk is a few µs on the event loop, less than a hand-over of the
GIL to another thread would cost.
"""

from __future__ import annotations

import numba


@numba.njit("void(float64[::1], int64, float64[::1], int64[::1])", cache=True)
def find(total, depth, prefixes, out):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """out[i] = the leaf node whose cumulative interval holds prefixes[i]; a prefix that
    float rounding sends to an empty leaf goes again, never right into a subtree
    without mass (SegmentTree._find_careful)."""
    for i in range(prefixes.shape[0]):
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


@numba.njit("void(float64[::1], int64, int64[::1], float64[::1])", cache=True)
def update_sums(total, size, slots, values):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """Set leaf slots[i] to values[i], in order (a later duplicate wins), and each sum above."""
    for i in range(slots.shape[0]):
        node = slots[i] + size
        total[node] = values[i]
        node >>= 1
        while node:
            total[node] = total[2 * node] + total[2 * node + 1]
            node >>= 1


@numba.njit("void(float64[::1], float64[::1], float64[::1], int64, int64[::1], float64[::1])", cache=True)
def update_sums_min_max(total, low, high, size, slots, values):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """update_sums, and the min (of non-zero leaves) and max trees with it."""
    inf = float("inf")
    for i in range(slots.shape[0]):
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
