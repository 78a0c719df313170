"""The counts of a drawn batch compiled with numba: `np.add.at` as a loop.

Owns nothing: once `load_compiled` (mirror.py) has imported this module, mirror.add_at
calls `add_at` for a batch's lease of its arena slots and its count of samples, and
Mirror.release calls `release` (the lease given back, and which slots it left idle). A
loop counts a position named twice twice by itself, so no look for repeats is needed
first, and it takes 0.4 µs for 256 positions where numpy's fancy-indexed add takes
1.3-1.5 µs (`/tmp/s15/addat.py`; docs/design.md, "A drawn batch's counts compiled").
Its signatures are given, so it compiles (or loads from numba's cache) when this module
is imported, never on the event loop; `boundscheck` makes a position outside the array
an IndexError, not a write past its end.
"""

from __future__ import annotations

from typing import Any

import numba


def _add_each(target: Any, positions: Any, delta: int) -> None:
    for i in range(len(positions)):
        target[positions[i]] += delta


def _release_each(refs: Any, index: Any, arena_slots: Any, idle: Any) -> int:
    count = 0
    for i in range(len(arena_slots)):
        slot = arena_slots[i]
        refs[slot] -= 1
        if refs[slot] == 0 and index[slot] < 0:
            idle[count] = slot
            count += 1
    return count


add_at = numba.njit(
    ["void(int64[::1], int64[::1], int64)", "void(int32[::1], int64[::1], int64)"], cache=True, boundscheck=True
)(_add_each)
release = numba.njit("int64(int32[::1], int64[::1], int64[::1], int64[::1])", cache=True, boundscheck=True)(
    _release_each
)
