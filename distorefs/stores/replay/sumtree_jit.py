"""The sum tree's walks (sumtree_walks.py) compiled with numba: a draw's descent and an
update's climb.

Owns nothing: sumtree.SegmentTree calls these once `load_compiled` has imported this
module (numba installed and able to run with this numpy) and keeps its numpy walks
otherwise. A batch of 64 costs a few µs where the numpy walks spend ~1 µs per call and
five calls a level (docs/design.md, "A compiled sum tree"). tests/unit/test_replay.py
holds both to the same answers.

The signatures are given, so the functions are compiled (or loaded from numba's cache,
`cache=True`) when this module is imported, never on the event loop at a first draw.
They keep the GIL: a walk is a few µs on the event loop, less than a hand-over of the
GIL to another thread would cost.
"""

from __future__ import annotations

import numba

from distorefs.stores.replay import sumtree_walks

find = numba.njit("void(float64[::1], int64, float64[::1], int64[::1])", cache=True)(sumtree_walks.find)
update_sums = numba.njit("void(float64[::1], int64, int64[::1], float64[::1])", cache=True)(sumtree_walks.update_sums)
update_sums_min_max = numba.njit(
    "void(float64[::1], float64[::1], float64[::1], int64, int64[::1], float64[::1])", cache=True
)(sumtree_walks.update_sums_min_max)
importance_weights = numba.njit("void(float64[::1], float64, float64, float32[::1])", cache=True)(
    sumtree_walks.importance_weights
)


@numba.njit("void(float64[::1], int64, int64, float64[::1], float64, int64[::1], float64[::1])", cache=True)
def find_stratified(total, depth, size, prefixes, step, slots, probabilities):  # type: ignore[no-untyped-def]
    """A prioritized draw in one call (SegmentTree.find_stratified): `prefixes` holds one
    uniform number per item on entry, (u_k + k) * step after, in the order
    samplers.base.stratified_prefixes computes them (the same floats); then the slots
    `find` lands them on, and each slot's probability, its leaf over the tree's total."""
    for k in range(len(prefixes)):
        prefixes[k] = (prefixes[k] + k) * step
    find(total, depth, prefixes, slots)
    grand = total[1]
    for k in range(len(slots)):
        slots[k] -= size
        probabilities[k] = total[size + slots[k]] / grand
