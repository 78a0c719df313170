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
from types import ModuleType

import numpy as np

from distorefs.compiled import import_kernels
from distorefs.types import Writable

_jit: ModuleType | None = None  # copy_ranges_jit once load_compiled() has loaded it


def load_compiled() -> bool:
    """Load the compiled copy (numba's import and its cache, or a compile); False when
    numba is not usable here or DISTOREFS_GATHER=python asks for the Python loop."""
    global _jit
    if _jit is None:
        _jit = import_kernels("distorefs.tiers.copy_ranges_jit", "DISTOREFS_GATHER", "python")
    return _jit is not None


def compiled_loaded() -> bool:
    """Whether `load_compiled` has loaded the compiled copy (it never imports here)."""
    return _jit is not None


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
    if _jit is not None:
        _jit.copy_ranges(sources, source, source_at, lengths, out, out_at)
        return
    view = memoryview(out)
    for s, at, n, to in zip(source.tolist(), source_at.tolist(), lengths.tolist(), out_at.tolist(), strict=True):
        view[to : to + n] = memoryview(sources[s])[at : at + n]
