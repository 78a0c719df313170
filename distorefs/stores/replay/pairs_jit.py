"""A priority update's pairs compiled with numba: checked, then applied, in one call.

Owns nothing: once `load_compiled` (formats.py) has imported this module,
`formats.parse_priorities` calls `whole_indices` (a .npy's float index column made
int64, every value checked to be a whole number in the int64 range) and
`ReplayBuffer.set_priorities` calls `set_pairs`. Each replaces a dozen numpy calls on
arrays of a few dozen pairs, where every call costs about a microsecond whatever its
size (docs/design.md, "A priority update compiled"). The checks come in the order the
numpy path makes them and name the same first bad pair, and nothing is written before
every pair has passed. The signatures are given, so the module compiles (or loads from
numba's cache) when it is imported, never on the event loop; `boundscheck` makes a
position outside an array an IndexError, never a write past its end.
"""

from __future__ import annotations

import math
from typing import Any

import numba

GOOD = 0  # set_pairs: every pair applied or skipped (its item left)
BAD_PRIORITY = 1  # a priority that is not finite, or below 0: none applied
NEVER_APPENDED = 2  # an index below 0 or at or past next_index: none applied
TOO_HIGH = 3  # a priority past `highest` (it would scale past the sum tree's bound): none applied

INT64_BOUND = 2.0**63  # |index| below this fits in an int64


def _whole_indices(values: Any, out: Any) -> int:
    """out[i] = values[i] as an int64; -1, or the first position whose value is not a
    whole number in the int64 range (then `out` is partly written and meaningless)."""
    for i in range(len(values)):
        value = values[i]
        if not (math.isfinite(value) and value == math.floor(value) and abs(value) < INT64_BOUND):
            return i
        out[i] = numba.int64(value)
    return -1


def _set_pairs(
    indices: Any,
    priorities: Any,
    highest: float,
    next_index: int,
    capacity: int,
    slot_index: Any,
    priority: Any,
    applied: Any,
    slots: Any,
    values: Any,
    before: Any,
) -> tuple[int, int, int]:
    """Check every pair, then set priority[slot] for each pair whose item is still in
    its slot (a later pair for the same slot wins). Returns (GOOD, -1, n) with the n
    applied pairs' indices, slots, priorities and priorities before in the first n
    places of `applied`, `slots`, `values` and `before`; or (BAD_PRIORITY, TOO_HIGH or
    NEVER_APPENDED, position of the first bad pair, 0) with nothing written."""
    n = len(indices)
    for i in range(n):
        if not (math.isfinite(priorities[i]) and priorities[i] >= 0):
            return BAD_PRIORITY, i, 0
    for i in range(n):
        if priorities[i] > highest:
            return TOO_HIGH, i, 0
    for i in range(n):
        if indices[i] < 0 or indices[i] >= next_index:
            return NEVER_APPENDED, i, 0
    count = 0
    for i in range(n):
        slot = indices[i] % capacity
        if slot_index[slot] == indices[i]:
            applied[count] = indices[i]
            slots[count] = slot
            values[count] = priorities[i]
            before[count] = priority[slot]  # all read before any is written: a pair named twice
            count += 1
    for j in range(count):
        priority[slots[j]] = values[j]
    return GOOD, -1, count


_COLUMNS = [numba.types.Array(numba.float64, 1, "A", readonly=readonly) for readonly in (True, False)]
whole_indices = numba.njit(  # a column of np.frombuffer's read-only array, or of a writable one
    [numba.int64(column, numba.int64[::1]) for column in _COLUMNS], cache=True, boundscheck=True
)(_whole_indices)
set_pairs = numba.njit(
    "UniTuple(int64, 3)(int64[::1], float64[::1], float64, int64, int64, int64[::1], float64[::1],"
    " int64[::1], int64[::1], float64[::1], float64[::1])",
    cache=True,
    boundscheck=True,
)(_set_pairs)
