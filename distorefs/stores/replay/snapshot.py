"""The priority snapshot of a buffer: its format, and matching it to surviving items.

A snapshot is an `.npz` of four arrays over the live items at the time it was staged:
`indices` (int64, sorted), `priorities` (float64, raw), `times` (int64, times sampled)
and `sizes` (int64, uncompressed item sizes). It rides in the buffer's `buffers` row
(docs/formats.md). After a crash the items are exactly the blocks that survived; this
module gives each its saved priority, count and size, NaN priority where the snapshot
is older than the item.
"""

from __future__ import annotations

import io

import numpy as np


def encode_snapshot(indices: np.ndarray, priorities: np.ndarray, times: np.ndarray, sizes: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.savez(out, indices=indices, priorities=priorities, times=times, sizes=sizes)
    return out.getvalue()


def encode_state(slot_index: np.ndarray, priority: np.ndarray, times: np.ndarray, size: np.ndarray) -> bytes:
    """The snapshot of a ring (its slot -> index, priority, times and size arrays): the
    live items in index order. For a million items about 0.2 s, so the periodic pass
    runs it in a worker thread on copies of the arrays."""
    live = np.sort(slot_index[slot_index >= 0])
    slots = live % len(slot_index)
    return encode_snapshot(live, priority[slots], times[slots], size[slots])


def match_snapshot(
    snapshot: bytes | None, indices: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(priorities, times, sizes) for the sorted surviving `indices` whose stored sizes are
    `sizes`: the snapshot's values where it knows the item, NaN / 0 / the stored size where not."""
    priorities = np.full(len(indices), np.nan)
    times = np.zeros(len(indices), dtype=np.int64)
    sizes = sizes.copy()
    if not snapshot:
        return priorities, times, sizes
    with np.load(io.BytesIO(snapshot)) as npz:  # read each array once
        saved = {name: npz[name] for name in ("indices", "priorities", "times", "sizes")}
    if not len(saved["indices"]):
        return priorities, times, sizes
    # Both index lists are sorted: match them with one searchsorted.
    at = np.searchsorted(saved["indices"], indices)
    at_clipped = np.minimum(at, len(saved["indices"]) - 1)
    found = (at < len(saved["indices"])) & (saved["indices"][at_clipped] == indices)
    priorities[found] = saved["priorities"][at[found]]
    times[found] = saved["times"][at[found]]
    sizes[found] = saved["sizes"][at[found]]  # uncompressed sizes
    return priorities, times, sizes
