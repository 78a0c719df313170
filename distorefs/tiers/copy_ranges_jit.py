"""copy_ranges.copy_ranges compiled with numba: one memcpy a range, without the GIL.

Owns nothing: copy_ranges.copy_ranges calls `copy_ranges` here once `load_compiled` has
imported this module. The signature is given, so the kernel compiles (or loads from
numba's cache, `cache=True`) at import, never on the event loop. Sources go in as a typed
list of read-only uint8 arrays over the buffers (about 2 µs a buffer to build, in the
caller's worker thread); the kernel then runs without the GIL, so the event loop keeps
running beside a batch's copies. Each range is one call of LLVM's memcpy: a slice
assignment compiles to a byte loop that copied 2.5 GB/s here, memcpy 6.7 GB/s (and
Python's memoryview slices 4 GB/s, holding the GIL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.typed import List

from distorefs.types import Writable

_SOURCE = types.Array(types.uint8, 1, "C", readonly=True)
_INDEX = types.int64[::1]


@intrinsic
def _memcpy(typingctx: Any, dst: Any, src: Any, count: Any) -> Any:
    """memcpy(dst, src, count) on addresses, as LLVM's memcpy."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        to, at, n = args
        to_ptr, at_ptr = builder.inttoptr(to, cgutils.voidptr_t), builder.inttoptr(at, cgutils.voidptr_t)
        cgutils.raw_memcpy(builder, to_ptr, at_ptr, n, 1)  # type: ignore[no-untyped-call]
        return context.get_dummy_value()

    return types.void(types.uintp, types.uintp, types.intp), codegen


def _copy_loop(sources: Any, source: Any, source_at: Any, lengths: Any, out: Any, out_at: Any) -> None:
    base = out.ctypes.data
    for i in range(source.shape[0]):
        _memcpy(base + out_at[i], sources[source[i]].ctypes.data + source_at[i], lengths[i])  # type: ignore[call-arg]


_copy = numba.njit(
    types.void(types.ListType(_SOURCE), _INDEX, _INDEX, _INDEX, types.uint8[::1], _INDEX),  # type: ignore[no-untyped-call]
    cache=True,
    nogil=True,
)(_copy_loop)


def _readonly(buf: bytes | bytearray | memoryview) -> np.ndarray:
    array = np.frombuffer(buf, dtype=np.uint8)
    array.flags.writeable = False
    return array


def copy_ranges(
    sources: Sequence[bytes | bytearray | memoryview],
    source: np.ndarray,
    source_at: np.ndarray,
    lengths: np.ndarray,
    out: Writable,
    out_at: np.ndarray,
) -> None:
    """copy_ranges.copy_ranges, compiled."""
    arrays = List([_readonly(s) for s in sources])
    _copy(
        arrays,
        np.ascontiguousarray(source, dtype=np.int64),
        np.ascontiguousarray(source_at, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int64),
        np.frombuffer(out, dtype=np.uint8),
        np.ascontiguousarray(out_at, dtype=np.int64),
    )
