"""copy_ranges.copy_ranges compiled with numba: one memcpy a range, without the GIL;
copy_ranges.pread_ranges: one pread a range from files, without the GIL; and
copy_ranges.first_bad_crc: one crc32c a range, without the GIL.

Owns nothing: copy_ranges.copy_ranges calls `copy` here once `load_compiled` has
imported this module. The signature is given, so the kernel compiles (or loads from
numba's cache, `cache=True`) at import, never on the event loop. Sources go in as an
array of the buffers' addresses (the caller's list keeps the buffers alive, and the
arrays over them keep them exported, so none is resized or freed during the copy; a
numba typed list of arrays cost 2 µs a buffer to build, holding the GIL); the kernel
then runs without the GIL, so the event loop keeps running beside a batch's copies.
Each range is one call of LLVM's memcpy: a slice assignment compiles to a byte loop
that copied 2.5 GB/s here, memcpy 6.7 GB/s (Python's memoryview slices 4 GB/s, holding
the GIL).

`read` calls libc's `pread` and `posix_fadvise` by name (numba's ExternalFunction: the
symbols are resolved in the process, so the kernel caches like the others). It reads
range by range into the output and stops at the first range that does not read whole
(an error, a short read): the caller reads that one again in Python, which raises what
it met.

`check` computes each range's crc32c with the crc32c package's own hardware function
(`_crc32c_hw_adler`, the one its Python call uses on x86-64; ExternalFunction again, its
library loaded into the symbol table first) and stops at the first that differs: 23 GB/s
here, where a Python loop of crc32c calls paid 0.8 µs a 10 KB record holding the GIL.
Only where the package itself uses that function (`crc32c.hardware_based` on x86-64) and
it gives the standard check value; else `check` is None and the caller's loop runs.
`crcs` (the same function) computes the crc32c of many buffers, each continued from a
value of its own (a log record's crc runs over its header, then its payload): one call
without the GIL for a whole batch of records (NvmeLog's big appends), where a Python
call per record gave the GIL back and waited for it again each time.
"""

from __future__ import annotations

import platform
from typing import Any

import crc32c
import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


def _copy_loop(addresses: Any, source: Any, source_at: Any, lengths: Any, out: Any, out_at: Any) -> None:
    base = out.ctypes.data
    for i in range(source.shape[0]):
        _memcpy(base + out_at[i], addresses[source[i]] + source_at[i], lengths[i])  # type: ignore[call-arg]


copy = numba.njit(
    types.void(types.uint64[::1], _INDEX, _INDEX, _INDEX, types.uint8[::1], _INDEX), cache=True, nogil=True
)(_copy_loop)


_pread: Any = types.ExternalFunction("pread", types.intp(types.int32, types.uintp, types.uintp, types.int64))
_fadvise: Any = types.ExternalFunction("posix_fadvise", types.int32(types.int32, types.int64, types.int64, types.int32))
_WILLNEED = 3  # POSIX_FADV_WILLNEED on Linux


def _read_loop(fds: Any, offsets: Any, lengths: Any, out: Any, out_at: Any, ahead: Any) -> Any:
    base = out.ctypes.data
    n = fds.shape[0]
    if ahead > 0:
        for k in range(min(ahead, n)):
            if fds[k] >= 0:
                _fadvise(fds[k], offsets[k], lengths[k], _WILLNEED)
    for i in range(n):
        k = i + ahead
        if ahead > 0 and k < n and fds[k] >= 0:
            _fadvise(fds[k], offsets[k], lengths[k], _WILLNEED)
        if fds[i] < 0:
            continue
        if _pread(fds[i], base + out_at[i], lengths[i], offsets[i]) != lengths[i]:
            return i
    return n


read = numba.njit(
    types.int64(types.int32[::1], _INDEX, _INDEX, types.uint8[::1], _INDEX, types.int64),
    cache=True,
    nogil=True,
)(_read_loop)


def _crc_function() -> Any:
    """The crc32c package's hardware crc function, or None where it does not use it."""
    if platform.machine() not in ("x86_64", "AMD64") or not crc32c.hardware_based:
        return None
    import llvmlite.binding as llvm  # noqa: PLC0415 (numba's own dependency)
    from crc32c import _crc32c  # noqa: PLC0415 (the extension module that holds the function)

    llvm.load_library_permanently(_crc32c.__file__)
    return types.ExternalFunction("_crc32c_hw_adler", types.uint32(types.uint32, types.uintp, types.uintp))


_crc: Any = _crc_function()
_ALL_ONES = np.uint32(0xFFFFFFFF)


def _check_loop(out: Any, out_at: Any, lengths: Any, crcs: Any) -> Any:
    base = out.ctypes.data
    for i in range(out_at.shape[0]):
        if _crc(_ALL_ONES, base + out_at[i], lengths[i]) ^ _ALL_ONES != crcs[i]:
            return i
    return -1


def _compiled_check() -> Any:
    if _crc is None:
        return None
    kernel = numba.njit(types.int64(types.uint8[::1], _INDEX, _INDEX, types.uint32[::1]), cache=True, nogil=True)(
        _check_loop
    )
    sample = np.frombuffer(b"123456789", dtype=np.uint8).copy()
    expected = np.array([0xE3069283], dtype=np.uint32)  # CRC-32C's check value
    if kernel(sample, np.zeros(1, np.int64), np.full(1, 9, np.int64), expected) != -1:
        return None
    return kernel


check = _compiled_check()


def _crcs_loop(addresses: Any, lengths: Any, values: Any, out: Any) -> None:
    for i in range(addresses.shape[0]):
        out[i] = _crc(values[i] ^ _ALL_ONES, addresses[i], lengths[i]) ^ _ALL_ONES


def _compiled_crcs() -> Any:
    if _crc is None:
        return None
    kernel = numba.njit(
        types.void(types.uint64[::1], _INDEX, types.uint32[::1], types.uint32[::1]), cache=True, nogil=True
    )(_crcs_loop)
    sample = np.frombuffer(b"123456789", dtype=np.uint8).copy()
    out = np.zeros(1, np.uint32)
    kernel(np.array([sample.ctypes.data], np.uint64), np.full(1, 9, np.int64), np.zeros(1, np.uint32), out)
    if out[0] != 0xE3069283:  # CRC-32C's check value
        return None
    return kernel


crcs = _compiled_crcs()
