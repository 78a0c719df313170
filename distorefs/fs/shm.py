"""Shared-memory regions: the zero-copy path for sampled batches beside FUSE.

Owns the regions themselves: a file in the shared-memory directory (`/dev/shm`) made
0600 for the uid that opened the control file (taken from the FUSE request), mapped by
the daemon and by that client, cut into slots that hold one batch each until the client
releases them. A region lives as long as the open that made it: its release (a close,
or the kernel's RELEASE when the client died) unmaps and unlinks it, and its bytes
count against the DRAM budget meanwhile. The control protocol over `sample.shm` is in
docs/formats.md ("Shared-memory sampling, version 1"); the handle that speaks it is in
fs/buffers.py.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from collections.abc import Callable

import numpy as np

from distorefs.errors import AccessDenied, OutOfMemory, TryAgain

log = logging.getLogger(__name__)

PREFIX = "distorefs-"
SLOTS = 4  # batches one sampler may hold at once
MIN_SLOT_BYTES = 64 * 1024
PAGE = mmap.PAGESIZE


def region_name(pid: int) -> str:
    return f"{PREFIX}{pid}-{secrets.token_hex(8)}"


def sweep_stale(directory: str) -> int:
    """At start-up: unlink regions that a killed daemon left (their pid is gone)."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its daemon still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
            removed += 1
    if removed:
        log.info("shared memory: removed %d regions a killed daemon left in %s", removed, directory)
    return removed


def slot_bytes_for(batch_bytes: int) -> int:
    return -(-max(batch_bytes, MIN_SLOT_BYTES) // PAGE) * PAGE


def region_bytes(batch_bytes: int) -> int:
    return slot_bytes_for(batch_bytes) * SLOTS


class Region:
    """One shared-memory file of `slots` equal slots, mapped here and by one client.

    Examples:
        >>> region = Region.create("/dev/shm", 1 << 20, 1000, 1000, reserve, unreserve)
        >>> slot = region.take(11)                # None when every slot is held
        >>> region.fill(slot, [memoryview(b"batch bytes")])
        >>> region.release(slot)
        >>> region.close()                        # unmapped, unlinked, unreserved
    """

    def __init__(self, path: str, fd: int, slot_bytes: int, slots: int, unreserve: Callable[[int], None]) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.size = slot_bytes * slots
        self._fd = fd
        self._map = mmap.mmap(fd, self.size)
        self._view = memoryview(self._map)
        self._free = list(range(slots))
        self.held: dict[int, int] = {}  # slot -> length of the batch in it
        self._unreserve = unreserve
        self.closed = False
        self.filling = 0  # copies in flight (from worker threads)
        self.closing = False

    @classmethod
    def create(
        cls,
        directory: str,
        batch_bytes: int,
        uid: int,
        gid: int,
        reserve: Callable[[int], bool],
        unreserve: Callable[[int], None],
    ) -> Region:
        """A region whose slots hold a batch of `batch_bytes`, owned by uid:gid, mode 0600.

        OutOfMemory when it does not fit in the DRAM budget; AccessDenied when the daemon
        cannot give the file to that user (a daemon not run as root serves its own user
        only)."""
        slot_bytes = slot_bytes_for(batch_bytes)
        size = slot_bytes * SLOTS
        if not reserve(size):
            raise OutOfMemory(f"a shared-memory region of {size} bytes does not fit in the DRAM budget")
        path = os.path.join(directory, region_name(os.getpid()))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            unreserve(size)
            raise OutOfMemory(f"cannot make a shared-memory region in {directory}: {exc.strerror}") from None
        try:
            if (uid, gid) != (os.geteuid(), os.getegid()):
                os.fchown(fd, uid, gid)
            os.ftruncate(fd, size)
            return cls(path, fd, slot_bytes, SLOTS, unreserve)
        except BaseException as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            unreserve(size)
            if isinstance(exc, PermissionError):
                raise AccessDenied(f"cannot give a shared-memory region to uid {uid}: the daemon is not root") from None
            if isinstance(exc, OSError):
                raise OutOfMemory(f"cannot size a shared-memory region of {size} bytes: {exc.strerror}") from None
            raise

    def fits(self, length: int) -> bool:
        return length <= self.slot_bytes

    def take(self, length: int) -> int | None:
        """Hold a free slot for a batch of `length` bytes; None when all are held."""
        if not self._free:
            return None
        slot = self._free.pop(0)
        self.held[slot] = length
        return slot

    def fill(self, slot: int, pieces: list[memoryview]) -> None:
        """Copy a batch (its pieces in order) into its slot. numpy's copy lets go of the
        GIL, so a big batch copied from a worker thread does not stop the event loop."""
        region = np.frombuffer(self._view, dtype=np.uint8)
        at = slot * self.slot_bytes
        for piece in pieces:
            region[at : at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            at += len(piece)

    def release(self, slot: int) -> bool:
        """Give a held slot back; False when it was not held."""
        if self.held.pop(slot, None) is None:
            return False
        self._free.append(slot)
        return True

    def close(self) -> None:
        if self.closed or self.filling:
            self.closing = True  # a copy into it is in flight: closed when it ends
            return
        self.closed = True
        self._view.release()
        self._map.close()
        os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._unreserve(self.size)


class SharedMemory:
    """Where regions are made (the daemon's `--shm-dir`) and the set of live ones, whose
    bytes count against the DRAM budget through `reserve`/`unreserve`."""

    def __init__(
        self, directory: str, reserve: Callable[[int], bool], unreserve: Callable[[int], None], limit_bytes: int
    ) -> None:
        """`limit_bytes`: the most all regions together may hold (the daemon gives them a
        quarter of the DRAM budget), so samplers that hold regions cannot push everyone
        else's data out of DRAM."""
        self.directory = directory
        self._reserve = reserve
        self._unreserve = unreserve
        self.limit_bytes = limit_bytes
        self.regions: set[Region] = set()

    @property
    def available(self) -> bool:
        return os.path.isdir(self.directory) and os.access(self.directory, os.W_OK | os.X_OK)

    def create(self, batch_bytes: int, uid: int, gid: int) -> Region:
        """A region for batches of `batch_bytes` (see Region.create); OutOfMemory past
        `limit_bytes` in all."""
        size = region_bytes(batch_bytes)
        if self.held_bytes() + size > self.limit_bytes:
            raise OutOfMemory(
                f"a shared-memory region of {size} bytes would take the regions past {self.limit_bytes} bytes"
                " (a quarter of the DRAM budget)"
            )
        region = Region.create(self.directory, batch_bytes, uid, gid, self._reserve, self._unreserved)
        self.regions.add(region)
        return region

    def _unreserved(self, nbytes: int) -> None:
        self._unreserve(nbytes)
        self.regions = {r for r in self.regions if not r.closed}

    def held_bytes(self) -> int:
        return sum(r.size for r in self.regions)

    def close_all(self) -> None:
        for region in list(self.regions):
            region.close()


def no_room(held: int) -> TryAgain:
    return TryAgain(f"sample.shm: all {held} slots are held; release one (write 'release <slot>')")
