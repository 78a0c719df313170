"""copy_ranges: many byte ranges of many source buffers copied into one output buffer.

A dataset stream's batch is thousands of records copied out of the cached blocks they lie
in (ByteRanges.gather). Copied one by one in Python that costs ~5 µs a record holding the
GIL (0.5 s per GiB of 10 KB records, on the same two cores as the event loop); compiled
(copy_ranges_jit.py, numba, without the GIL) it costs the copies. `load_compiled` is
called by the daemon in a thread once the mount is up; until then, and where numba cannot
run (or DISTOREFS_GATHER=python), the loop below runs as Python, with the same result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distorefs.compiled import Kernels
from distorefs.types import Writable

KERNELS = Kernels("distorefs.tiers.copy_ranges_jit", "DISTOREFS_GATHER", "python")  # copy_ranges_jit's copy


def load_compiled() -> bool:
    """Load the compiled copy (numba's import and its cache, or a compile); False when
    numba is not usable here or DISTOREFS_GATHER=python asks for the Python loop."""
    return KERNELS.load()


def copy_ranges(
    sources: Sequence[bytes | bytearray | memoryview],
    source: np.ndarray,
    source_at: np.ndarray,
    lengths: np.ndarray,
    out: Writable,
    out_at: np.ndarray,
) -> None:
    """Copy range i, `lengths[i]` bytes at `source_at[i]` of `sources[source[i]]`, to
    `out_at[i]` of `out`. The caller keeps every range inside its buffers (compiled code
    checks no bounds). Call it from a worker thread: the compiled copy runs without the GIL.
    """
    if not len(source):
        return
    jit = KERNELS.module
    if jit is not None:
        arrays = [np.frombuffer(s, dtype=np.uint8) for s in sources]  # held (buffers exported) until the end
        addresses = np.fromiter((a.ctypes.data for a in arrays), dtype=np.uint64, count=len(arrays))
        jit.copy(
            addresses,
            np.ascontiguousarray(source, dtype=np.int64),
            np.ascontiguousarray(source_at, dtype=np.int64),
            np.ascontiguousarray(lengths, dtype=np.int64),
            np.frombuffer(out, dtype=np.uint8),
            np.ascontiguousarray(out_at, dtype=np.int64),
        )
        del arrays
        return
    view = memoryview(out)
    for s, at, n, to in zip(source.tolist(), source_at.tolist(), lengths.tolist(), out_at.tolist(), strict=True):
        view[to : to + n] = memoryview(sources[s])[at : at + n]
