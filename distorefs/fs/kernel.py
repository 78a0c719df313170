"""What the daemon tells the kernel about its caches (FUSE notifications).

Each call writes to the FUSE device and the kernel acts on it before the call returns.
A call that drops or fills page-cache pages locks those pages: made from the event
loop while a read of the same inode waits for this daemon's reply, it would wait for
that reply forever. Callers on the event loop make sure no open of the inode can have
such a read under way (the sample files: no other open of the node at all); others run
the call in a thread.

A big store is cut into parts written at once, the first by the caller and the others
by helper threads (`StoreHelpers`, one per further CPU, up to STORE_PARTS_MAX): the
kernel's copy into the page cache runs on several CPUs, and the caller waits for the
slowest part instead of the sum (a DQN batch of 3.5 MB: 665 -> 476 µs on two CPUs;
docs/design.md, "A big page-cache store in parts").
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import struct
import threading
from collections.abc import Sequence

import pyfuse3

log = logging.getLogger(__name__)

FUSE_DEVICE = os.makedev(10, 229)  # /dev/fuse, a misc character device
FUSE_NOTIFY_STORE = 4  # include/uapi/linux/fuse.h, enum fuse_notify_code
# fuse_out_header (len, error = the notify code, unique = 0), fuse_notify_store_out
# (nodeid, offset, size, padding): what libfuse's fuse_lowlevel_notify_store writes
STORE_HEAD = struct.Struct("<IiQQQII")
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

# A store is cut on multiples of STORE_CUT, the largest folio the page cache uses on x86-64
# (so no folio is filled by two writers), and only where the part after the cut keeps at
# least STORE_PART_MIN bytes (a smaller part costs a helper's wake-up more than it saves).
STORE_CUT = 2 << 20
STORE_PART_MIN = 512 << 10
STORE_PARTS_MAX = 4

_device_fd: int | None = None  # this process's /dev/fuse descriptor while mounted
_helpers: StoreHelpers | None = None  # made at attach (one per further CPU), stopped at detach
_stores = [0, 0]  # stores written, those of them in parts (`statistics`)
_stores_lock = threading.Lock()  # (a big batch is stored from a worker thread)
Pieces = Sequence[bytes | bytearray | memoryview]
Notice = list[bytes | bytearray | memoryview]  # one notification: its head, then its bytes


def attach() -> int | None:
    """Find the mount's /dev/fuse descriptor (pyfuse3 opens it and keeps it to itself),
    so that `store` can write a batch from its pieces; called once the kernel's INIT
    arrives, `detach` at the unmount. One descriptor of the FUSE device in the process
    is the mount's: with none or several, `store` joins the pieces and goes through
    pyfuse3."""
    global _device_fd
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == FUSE_DEVICE:
            found.append(int(name))
    _device_fd = found[0] if len(found) == 1 else None
    if _device_fd is None:
        log.info("kernel: %d /dev/fuse descriptors in this process; page-cache stores go joined", len(found))
    global _helpers
    if _helpers is None:
        _helpers = StoreHelpers(min(STORE_PARTS_MAX, len(os.sched_getaffinity(0))) - 1)
    return _device_fd


def detach() -> None:
    global _device_fd, _helpers
    _device_fd = None
    if _helpers is not None:
        _helpers.stop()
        _helpers = None


def invalidate(ino: int, attr_only: bool) -> bool:
    """Drop the kernel's cached attributes of `ino` (and its pages unless `attr_only`);
    False where the kernel does not know the inode (it forgot it: nothing to drop)."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only)
    except OSError as exc:
        log.debug("invalidate_inode(%d): %s", ino, exc)
        return False
    return True


def forget_entry(parent: int, name: bytes, ino: int) -> None:
    """Drop the kernel's entry `name` of directory `parent` where it names `ino` (gone
    or replaced), waiting for the kernel (call it from a thread, never from a request's
    handler: the kernel takes the directory's lock). Nothing to do where the kernel
    does not cache it."""
    try:
        pyfuse3.invalidate_entry(parent, name, deleted=ino)
    except OSError as exc:  # ENOENT: the kernel has no such entry (cached)
        log.debug("invalidate_entry(%d, %r): %s", parent, name, exc)


def store(ino: int, pieces: Pieces) -> bool:
    """Put the concatenation of `pieces` (byte buffers) into the kernel's page cache of
    `ino` from offset 0 (extending the kernel's size where it is shorter); False where
    the kernel refused (an unknown inode, or a kernel without the notification), after
    which some pages may hold part of it.

    The pieces go to the kernel as they are, in one `writev` of the notification to the
    mount's device, which copies them straight into the inode's pages: no joined copy
    first (3.5 MB of a DQN batch took 137 µs to join, its store 386; design.md, "A
    sample's batch in the page cache"). Without the descriptor (`attach`), or with more
    pieces than one `writev` takes, they are joined and stored through pyfuse3. A big
    store goes in parts at once (`write_store`)."""
    fd = _device_fd
    try:
        if fd is not None and len(pieces) < IOV_MAX:
            parts = write_store(fd, ino, pieces, _helpers)
            with _stores_lock:
                _stores[0] += 1
                _stores[1] += parts > 1
        else:
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pyfuse3.notify_store(ino, 0, data)  # type: ignore[arg-type]  # any contiguous buffer
    except OSError as exc:
        log.debug("notify_store(%d, %d bytes): %s", ino, sum(len(p) for p in pieces), exc)
        return False
    return True


def store_cuts(size: int, parts: int) -> list[int]:
    """The offsets that cut a store of `size` bytes into at most `parts` parts, the
    first 0 and the last `size`: cuts on multiples of STORE_CUT, spread evenly, none
    closer than STORE_PART_MIN to the end (so a small store stays whole)."""
    last = (size - STORE_PART_MIN) // STORE_CUT  # the furthest cut, in STORE_CUTs
    parts = max(1, min(parts, last + 1))
    cuts = {min(last, max(1, round(k * size / parts / STORE_CUT))) * STORE_CUT for k in range(1, parts)}
    return [0, *sorted(cuts), size]


def statistics() -> dict[str, dict[str, int]]:
    """`page_cache_stores` of `.distore/status`: the stores written to the FUSE device,
    how many of them went in parts, and the most parts a store is cut into here."""
    most = 1 + (_helpers.count if _helpers is not None else 0)
    return {"page_cache_stores": {"stores": _stores[0], "in_parts": _stores[1], "parts_max": most}}


def write_store(fd: int, ino: int, pieces: Pieces, helpers: StoreHelpers | None) -> int:
    """Write the store of `pieces` into `ino`'s pages from offset 0 to the FUSE device
    `fd`: one notification, or one per part (`store_cuts`) with the first written here
    and the others by `helpers` at the same time; returns how many parts. Raises the
    first OSError of any part once all are done (the parts that went through are in
    the page cache)."""
    size = sum(len(p) for p in pieces)
    bounds = store_cuts(size, 1 + (helpers.count if helpers is not None else 0))
    notices: list[Notice] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        notice: Notice = [
            STORE_HEAD.pack(STORE_HEAD.size + end - start, FUSE_NOTIFY_STORE, 0, ino, start, end - start, 0)
        ]
        # (a store in one part takes the pieces as they are: no view made of each)
        notice.extend(pieces if len(bounds) == 2 else _between(pieces, start, end))
        notices.append(notice)
    if len(notices) == 1 or helpers is None:
        os.writev(fd, notices[0])
        return 1
    helpers.write(fd, notices)
    return len(notices)


def _between(pieces: Pieces, start: int, end: int) -> list[memoryview]:
    """Views of the bytes from `start` to `end` of the concatenation of `pieces`."""
    out, at = [], 0
    for piece in pieces:
        lo, hi = max(start, at), min(end, at + len(piece))
        if lo < hi:
            out.append(memoryview(piece)[lo - at : hi - at])
        at += len(piece)
    return out


class StoreHelpers:
    """Threads that write parts of a store beside the thread that asks (`write`): each
    waits on a queue of notifications, writes one, and says how it went."""

    def __init__(self, count: int) -> None:
        self.count = max(0, count)
        self._jobs: queue.SimpleQueue[tuple[int, Notice, queue.SimpleQueue[OSError | None]] | None]
        self._jobs = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"page-cache store {k}", daemon=True) for k in range(self.count)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fd, notice, done = job
            try:
                os.writev(fd, notice)
            except OSError as exc:
                done.put(exc)
            except Exception as exc:  # (never leave the caller waiting: it would wait for ever)
                done.put(OSError(errno.EIO, f"a page-cache store's part failed: {exc!r}"))
            else:
                done.put(None)

    def write(self, fd: int, notices: list[Notice]) -> None:
        """Write the first notice here and the others on helper threads, all at once;
        return when all are written, raising the first OSError where one failed."""
        done: queue.SimpleQueue[OSError | None] = queue.SimpleQueue()
        for notice in notices[1:]:
            self._jobs.put((fd, notice, done))
        error: OSError | None = None
        try:
            os.writev(fd, notices[0])
        except OSError as exc:
            error = exc
        for _ in notices[1:]:
            # a helper's write is the same kernel call as the one above: it ends as surely
            failed = done.get()
            error = error or failed
        if error is not None:
            raise error

    def stop(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
