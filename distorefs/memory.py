"""Giving freed memory back to the system, so the daemon's RSS follows its DRAM budget;
and buffers that the system fills, left unzeroed.

The DRAM cache frees block buffers as it evicts and as items and files go, but glibc's
malloc keeps freed heap pages (and raises its mmap threshold after the first large free,
so later 1 MiB buffers come from the heap too): after heavy work the RSS stayed at four
times the budget while the cache held nothing. A task started by daemon.py checks every
few seconds whether the process holds much more than its cache accounts for, and if so
asks malloc to return its free pages (`malloc_trim(0)`, which releases free pages inside
every arena, not only at the top). On a libc without malloc_trim it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Callable, Iterator

import trio

log = logging.getLogger(__name__)

# What the daemon holds beyond its accounted DRAM before a trim is worth it: the
# interpreter and libraries (~60 MiB) plus requests in flight.
SLACK_BYTES = 96 << 20
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


def unzeroed(size: int) -> bytearray:
    """A bytearray of `size` bytes whose contents are whatever the memory held: for a
    buffer that a read fills whole before anything looks at it (a log record's payload).
    `bytearray(size)` zeroes it with memset while holding the GIL, and that first touch
    of fresh memory takes its page faults with the GIL held too: 0.65 s per GiB of 1 MiB
    buffers here, time every other thread (the event loop) waits. Left unzeroed, the
    pages are first touched by the read itself, in the kernel, without the GIL (10 ms per
    GiB to allocate). The C API's `PyByteArray_FromStringAndSize(NULL, size)`."""
    if size < 0:
        raise ValueError(f"negative size {size}")
    buf: bytearray = _new_bytearray(None, size)
    return buf


def available_bytes() -> int | None:
    """The memory the kernel says is available for new allocations without swapping
    (`MemAvailable` in /proc/meminfo: free memory and the page cache it can drop), or
    None where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def freeze_loaded_objects() -> int:
    """Once start-up has loaded the tree: collect, then put every object alive now out of
    the cyclic garbage collector's reach (`gc.freeze`); returns how many that is.

    A full collection visits every tracked object, and the daemon answers nothing while
    it runs: a tree of 100,000 files loaded at start-up (an `Inode` each) took 45 ms a
    collection, one of 300,000 files 183 ms, and Python starts one whenever the
    objects that survived two collections grow by a quarter. What start-up loads lives
    until the daemon stops or the file goes, and a file's inode goes by its reference
    count (it is in no cycle), so frozen objects still free. What this must not be given
    is cyclic garbage to come: `assemble` calls it after the files store and the block
    index are loaded and before the stores whose objects refer to each other (docs/design.md,
    "Pauses of Python's garbage collector")."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_holds = 0  # full_collections_held contexts open now


def full_collections_held() -> contextlib.AbstractContextManager[None]:
    """Around a bulk load of objects that live on (start-up's tree, the buffers' warm-up
    of a million items into DRAM): Python's automatic collections are off, and the
    loader calls `collect_young` between chunks, so the garbage of requests served
    meanwhile still goes. Python starts a full collection each time the objects that
    survived two collections grow by a quarter, and each one visits all of them: a
    million items' warm-up ran 10 of them, 2.9 s of its 7.3 s (65, 4.7 s of 10 s, once
    the block index's entries were no longer tracked and a quarter came sooner). Nested
    and concurrent holds count; collections come back with the last one, which first
    runs one full collection itself: the loaded objects then count as long-lived
    (without it Python's next check found a million new survivors and ran a full
    collection, 146 ms, in the middle of the first requests after the warm-up)."""
    return _collections_off(collect_at_end=True)


def automatic_collections_paused() -> contextlib.AbstractContextManager[None]:
    """Around one request's bulk step that makes many short-lived tracked objects (a
    draw of a million items makes a key each): Python's automatic collections are off,
    and come back afterwards without a collection of their own (what the step kept, if
    anything, meets the next automatic one). Python counts every new tracked object
    towards its next collection, and starts a full one (visiting every object the daemon
    holds) as the survivors grow: `sample.1000000` of a blob buffer ran three of them
    (3.0 s for the request, 2.2 s without them), the event loop stopped throughout.
    Counts as a hold of `full_collections_held` (one of those that ends later does its
    full collection)."""
    return _collections_off(collect_at_end=False)


@contextlib.contextmanager
def _collections_off(collect_at_end: bool) -> Iterator[None]:
    """Automatic collections off while any hold or pause is open; the last one to end
    turns them back on, after a full collection where it is a hold."""
    global _holds
    if _holds == 0:
        gc.disable()
    _holds += 1
    try:
        yield
    finally:
        _holds -= 1
        if _holds == 0:
            if collect_at_end:
                gc.collect()
            gc.enable()


def collect_young() -> None:
    """Between a held bulk load's chunks: collect the two young generations (what was
    made since the last chunk; not the loaded objects, which have moved on to the old
    one). Nothing while collections run on their own."""
    if _holds:
        gc.collect(1)


def gc_statistics() -> dict[str, object]:
    """`gc` in `.distore/status`, the cyclic garbage collector: objects frozen at
    start-up, and collections so far per generation (a generation-2 collection visits
    every tracked object)."""
    return {"gc": {"frozen_objects": gc.get_freeze_count(), "collections": [g["collections"] for g in gc.get_stats()]}}


def rss_bytes() -> int:
    """This process's resident set, from /proc (no syscall beyond one read)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # allocations under this come from the heap (glibc's own dynamic maximum)
TRIM_THRESHOLD_BYTES = 256 << 20  # free() gives the heap's top back only past this; the trim task does the rest


def keep_freed_memory() -> bool:
    """Have malloc keep the memory `free()` returns, for the next allocation: buffers
    under MMAP_THRESHOLD_BYTES come from the heap, and free() trims the heap's top only
    past TRIM_THRESHOLD_BYTES (docs/design.md, "Freed memory is kept for the next
    request"). glibc's defaults adapt both after the first large free, to twice the
    largest chunk freed, so a daemon whose requests each allocate and free a 1 MiB
    buffer (pyfuse3 hands every WRITE over as a new bytes object) grew its heap and gave
    it back again and again: two page faults per 4 KiB written into the tree, 1 s of
    system time per GiB on this VM. Setting them turns the adaptation off. What the
    heap keeps beyond the DRAM cache's accounting is still bounded: the memory trim
    task returns it (`malloc_trim`, which ignores these thresholds) once it passes
    SLACK_BYTES. False (and nothing changed) on a libc without mallopt."""
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def _libc_function(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """The C library's function `name` (returning an int), or None where it has none."""
    library = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(library), name, None) if library is not None else None
    if function is None:
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def _malloc_trim() -> Callable[[int], int] | None:
    return _libc_function("malloc_trim", [ctypes.c_size_t])


async def run_memory_trim(accounted: Callable[[], int], shed: Callable[[], int], interval_s: float = 5.0) -> None:
    """Background task: every `interval_s`, first `shed()` idle reusable buffers (the
    DRAM cache's spares, which `accounted` counts), then, when RSS exceeds `accounted()`
    (DRAM the cache holds or reserved) by more than SLACK_BYTES, return malloc's free
    pages to the system (in a thread)."""
    trim = _malloc_trim()
    if trim is None:
        log.info("memory: this libc has no malloc_trim; freed memory stays with the process")
        return
    while True:
        await trio.sleep(interval_s)
        shed()
        before = rss_bytes()
        if before <= accounted() + SLACK_BYTES:
            continue
        await trio.to_thread.run_sync(trim, 0)
        after = rss_bytes()
        if before - after > (16 << 20):
            log.info("memory: returned %d MiB to the system (RSS %d MiB)", (before - after) >> 20, after >> 20)
