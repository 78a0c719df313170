"""The sum tree's walks, eight slots side by side and level by level, as plain Python.

Owns nothing: functions over the arrays of sumtree.SegmentTree (its sum, min and max
trees, the leaves from `size` on). sumtree_jit.py compiles them with numba for every
call where numba runs; without numba, SegmentTree runs `update_sums*` as they are for
updates of a few slots (on memoryviews, whose elements are Python floats) and keeps its
vectorised numpy walks for the rest. One definition serves both ways.
"""

from __future__ import annotations

from typing import Any

LANES = 8  # descents (`find`) and climbs (`update_sums*`) walked side by side


def find(total: Any, depth: int, prefixes: Any, out: Any) -> None:
    """out[i] = the leaf node whose cumulative interval holds prefixes[i]; a prefix that
    float rounding sends to an empty leaf goes again, never right into a subtree
    without mass (SegmentTree._find_careful).

    Eight descents go down side by side, a level at a time: each level's eight loads
    depend on nothing the others load, so the CPU waits for their cache misses at once,
    where one descent at a time waits for each miss in turn (a million-slot tree's lower
    levels miss every time; docs/design.md, "Eight descents side by side"). Each prefix
    meets the same comparisons and subtractions in the same order as alone, so the
    answers are the same bit for bit.
    """
    n = len(prefixes)
    i = 0
    while i + LANES <= n:
        a = b = c = d = e = f = g = h = 1
        ra, rb, rc, rd = prefixes[i], prefixes[i + 1], prefixes[i + 2], prefixes[i + 3]
        re, rf, rg, rh = prefixes[i + 4], prefixes[i + 5], prefixes[i + 6], prefixes[i + 7]
        for _ in range(depth):
            a, b, c, d, e, f, g, h = a << 1, b << 1, c << 1, d << 1, e << 1, f << 1, g << 1, h << 1
            la, lb, lc, ld = total[a], total[b], total[c], total[d]
            le, lf, lg, lh = total[e], total[f], total[g], total[h]
            if ra >= la:
                ra -= la
                a += 1
            if rb >= lb:
                rb -= lb
                b += 1
            if rc >= lc:
                rc -= lc
                c += 1
            if rd >= ld:
                rd -= ld
                d += 1
            if re >= le:
                re -= le
                e += 1
            if rf >= lf:
                rf -= lf
                f += 1
            if rg >= lg:
                rg -= lg
                g += 1
            if rh >= lh:
                rh -= lh
                h += 1
        out[i], out[i + 1], out[i + 2], out[i + 3] = a, b, c, d
        out[i + 4], out[i + 5], out[i + 6], out[i + 7] = e, f, g, h
        i += LANES
    for k in range(i, n):  # the last few, one at a time
        node = 1
        remaining = prefixes[k]
        for _ in range(depth):
            node <<= 1
            left = total[node]
            if remaining >= left:
                remaining -= left
                node += 1
        out[k] = node
    for k in range(n):
        if total[out[k]] <= 0:
            node = 1
            remaining = prefixes[k]
            for _ in range(depth):
                left = total[2 * node]
                if (remaining >= left and total[2 * node + 1] > 0) or left <= 0:
                    remaining -= left
                    node = 2 * node + 1
                else:
                    node = 2 * node
            out[k] = node


def update_sums(total: Any, size: int, slots: Any, values: Any) -> None:
    """Set leaf slots[i] to values[i], in order (a later duplicate wins), and each sum
    above. Eight slots at a time: their leaves set in order, then their paths climbed
    side by side, a level at a time, so that the CPU waits for their cache misses at
    once (as `find`). Every inner node on a path is the sum of its two children once
    they are final, as when the slots climb one by one: the same tree, bit for bit."""
    nodes = [0] * LANES
    n = len(slots)
    i = 0
    while i < n:
        lanes = min(LANES, n - i)
        for j in range(lanes):
            node = slots[i + j] + size
            total[node] = values[i + j]
            nodes[j] = node >> 1
        while nodes[0]:  # every leaf is as deep: the lanes reach the root together
            for j in range(lanes):
                node = nodes[j]
                total[node] = total[2 * node] + total[2 * node + 1]
                nodes[j] = node >> 1
        i += lanes


def update_sums_min_max(total: Any, low: Any, high: Any, size: int, slots: Any, values: Any) -> None:
    """update_sums, and the min (of non-zero leaves) and max trees with it."""
    inf = float("inf")
    nodes = [0] * LANES
    n = len(slots)
    i = 0
    while i < n:
        lanes = min(LANES, n - i)
        for j in range(lanes):
            node = slots[i + j] + size
            value = values[i + j]
            total[node] = value
            low[node] = value if value > 0 else inf
            high[node] = value
            nodes[j] = node >> 1
        while nodes[0]:
            for j in range(lanes):
                node = nodes[j]
                left = 2 * node
                total[node] = total[left] + total[left + 1]
                low[node] = min(low[left], low[left + 1])
                high[node] = max(high[left], high[left + 1])
                nodes[j] = node >> 1
        i += lanes


FLOAT32_MAX = 3.4028234663852886e38  # np.finfo(np.float32).max (draws.py's numpy form clamps to it too)


def importance_weights(probabilities: Any, min_probability: float, beta: float, out: Any) -> None:
    """out[i] = (probabilities[i] / min_probability) ** -beta as a float32, NaN -> 1 and
    anything past the largest float32 -> that (draws.importance_weights, whose numpy
    version this is the compiled form of: one call for a batch where numpy makes five
    and an error-state switch). min_probability must be above 0, the probabilities not
    below 0."""
    for i in range(len(probabilities)):
        w = (probabilities[i] / min_probability) ** -beta
        if w != w:
            out[i] = 1.0
        elif w > FLOAT32_MAX:
            out[i] = FLOAT32_MAX
        else:
            out[i] = w
