"""copy_ranges: many byte ranges of many source buffers copied into one output buffer;
pread_ranges: many byte ranges of files read into one output buffer; first_bad_crc: the
crc32c of many byte ranges of one buffer checked.

A dataset stream's batch is thousands of records copied out of the cached blocks they lie
in (ByteRanges.gather). Copied one by one in Python that costs ~5 µs a record holding the
GIL (0.5 s per GiB of 10 KB records, on the same two cores as the event loop); compiled
(copy_ranges_jit.py, numba, without the GIL) it costs the copies. `load_compiled` is
called by the daemon in a thread at the first use of a compiled kernel (compiled.py);
until then, and where numba cannot run (or DISTOREFS_GATHER=python), the loop below runs
as Python, with the same result.
The same holds for a batch's records read from the log's page cache (NvmeLog.read_ranges):
a `preadv` a record from a Python loop held the GIL between the calls, and two worker
threads and the event loop took turns at it (20 ms for a 16 MB batch, 8 ms of it CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
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
    compiled_only: bool = False,
) -> bool:
    """Copy range i, `lengths[i]` bytes at `source_at[i]` of `sources[source[i]]`, to
    `out_at[i]` of `out`. The caller keeps every range inside its buffers (compiled code
    checks no bounds). Call it from a worker thread: the compiled copy runs without the GIL.
    `compiled_only`: copy only where the kernels are loaded already, in one call without
    the GIL (this never starts their loading), checking the ranges against `out` first;
    False, nothing copied, where they are not. True when copied."""
    if not len(source):
        return True
    if compiled_only:
        if not KERNELS.loaded:
            return False
        check_inside(out, out_at, lengths, "copy_ranges")
    jit = KERNELS.module
    if jit is not None:
        arrays, addresses = _addresses(sources)
        jit.copy(addresses, _index(source), _index(source_at), _index(lengths), _bytes(out), _index(out_at))
        del arrays
        return True
    view = memoryview(out)
    for s, at, n, to in zip(source.tolist(), source_at.tolist(), lengths.tolist(), out_at.tolist(), strict=True):
        view[to : to + n] = memoryview(sources[s])[at : at + n]
    return True


def check_inside(out: Writable, out_at: np.ndarray, lengths: np.ndarray, who: str) -> None:
    """Raise AssertionError (a bug: never a write or a read past the buffer) unless every
    range, `lengths[i]` bytes at `out_at[i]`, lies inside `out`. The compiled kernels
    check no bounds; their callers check here first."""
    size = memoryview(out).nbytes
    if len(out_at) and (int(out_at.min()) < 0 or int((out_at + lengths).max()) > size):
        raise AssertionError(f"{who}: a range lies outside the output's {size} bytes")


def pread_ranges(
    fds: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out: Writable, out_at: np.ndarray, ahead: int
) -> int:
    """Read range i, `lengths[i]` bytes at `offsets[i]` of file `fds[i]`, to `out_at[i]` of
    `out`, in order, skipping ranges whose fd is -1; with `ahead`, each read first hints
    (WILLNEED) the range `ahead` places on. A range outside `out` raises AssertionError
    before anything is read (`check_inside`), compiled or not.

    Returns how far it got: `len(fds)` when every range is read, else the first range
    that did not read whole (an error or a short read), for the caller to read again and
    raise what it meets; 0 when the compiled kernel is not loaded (nothing read). Call it
    from a worker thread: the compiled reads run without the GIL."""
    check_inside(out, out_at, lengths, "pread_ranges")
    jit = KERNELS.module
    if jit is None or not len(fds):
        return 0
    fds = np.ascontiguousarray(fds, dtype=np.int32)
    return int(jit.read(fds, _index(offsets), _index(lengths), _bytes(out), _index(out_at), ahead))


def first_bad_crc(out: Writable, out_at: np.ndarray, lengths: np.ndarray, crcs: np.ndarray) -> int:
    """The first i whose range, `lengths[i]` bytes at `out_at[i]` of `out`, has a crc32c
    other than `crcs[i]`; -1 when all match. A range outside `out` raises AssertionError
    (`check_inside`). Compiled (without the GIL) where the kernels are loaded and the
    crc32c package uses its hardware function; else a Python loop of crc32c calls."""
    check_inside(out, out_at, lengths, "first_bad_crc")
    jit = KERNELS.module
    if jit is not None and jit.check is not None:
        crcs = np.ascontiguousarray(crcs, dtype=np.uint32)
        return int(jit.check(_bytes(out), _index(out_at), _index(lengths), crcs))
    view = memoryview(out)
    for i, (at, n, crc) in enumerate(zip(out_at.tolist(), lengths.tolist(), crcs.tolist(), strict=True)):
        if crc32c.crc32c(view[at : at + n]) != crc:
            return i
    return -1


def compiled_crcs(sources: Sequence[bytes | bytearray | memoryview], values: Sequence[int]) -> list[int] | None:
    """`crc32c.crc32c(sources[i], values[i])` for every i, in one compiled call without the
    GIL; None where the kernels are not loaded (this never starts their loading) or have
    no hardware crc: the caller computes them one by one. Call it from a worker thread."""
    jit = KERNELS.module if KERNELS.loaded else None
    if jit is None or jit.crcs is None or not sources:
        return None
    arrays, addresses = _addresses(sources)
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    out = np.empty(len(arrays), dtype=np.uint32)
    jit.crcs(addresses, lengths, np.array(values, dtype=np.uint32), out)
    del arrays
    return out.tolist()


def _addresses(sources: Sequence[bytes | bytearray | memoryview]) -> tuple[list[np.ndarray], np.ndarray]:
    """Arrays over `sources` (held by the caller, so the buffers stay exported, neither
    resized nor freed, until the kernel is done) and their addresses, for a kernel."""
    arrays = [np.frombuffer(s, dtype=np.uint8) for s in sources]
    return arrays, np.fromiter((a.ctypes.data for a in arrays), dtype=np.uint64, count=len(arrays))


def _index(array: np.ndarray) -> np.ndarray:
    """An array of positions or lengths as the kernels take it."""
    return np.ascontiguousarray(array, dtype=np.int64)


def _bytes(buffer: Writable) -> np.ndarray:
    """A writable buffer as the kernels take it: its bytes, without a copy."""
    return np.frombuffer(buffer, dtype=np.uint8)
