"""Shared memory beside FUSE: regions for sampled batches, and staged files.

Owns the regions themselves: a file in the shared-memory directory (`/dev/shm`) made
0600 for the uid that opened the control file (taken from the FUSE request), mapped by
the daemon and by that client, cut into slots that hold one batch each until the client
releases them. A region lives as long as the open that made it: its release (a close,
or the kernel's RELEASE when the client died) unmaps and unlinks it, and its bytes
count against the DRAM budget meanwhile. The control protocol over `sample.shm` is in
docs/formats.md ("Shared-memory sampling, version 1"); the handle that speaks it is in
fs/buffers.py.

Staged files go the other way: a client writes a file into a memfd of its own, seals
it and names it in a setxattr on the target file (`client.staged_open`); the daemon
takes the memfd over (`borrow_sealed`) and makes it the file's content without a copy
through FUSE (docs/formats.md, "Staged files, version 1").
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from distorefs.errors import AccessDenied, InvalidArgument, NotFound, NotPermitted, NotSupported, OutOfMemory, TryAgain
from distorefs.fs.procs import thread_group

if TYPE_CHECKING:
    from distorefs.fs.shm_sessions import SampleSessions

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
        self.sessions: SampleSessions | None = None  # version 2's socket (fs/shm_sessions.py), once it listens

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


# --- staged files: a client's sealed memfd taken over at close ------------------------

ADOPT_XATTR = b"user.distore.adopt"  # setxattr(fd of a tree file, this, b"<memfd number>")
SEALS_NEEDED = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (asm-generic)


def parse_fd(value: bytes) -> int:
    """The memfd number an adopt request names: 1-7 ASCII digits."""
    text = value.strip()
    if not text.isdigit() or len(text) > 7:
        raise InvalidArgument(f"{ADOPT_XATTR.decode()} takes a file descriptor number, got {value[:20]!r}")
    return int(text)


def _take_fd(pid: int, fd: int) -> int:
    """A duplicate of process `pid`'s descriptor `fd` (pidfd_getfd: the same open file,
    never re-opened, so a path or a device cannot be slipped in). NotPermitted when this
    daemon may not reach into that process (not root, or another user's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(thread_group(pid))
    except ProcessLookupError:
        raise NotFound(f"process {pid} is gone") from None
    try:
        got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            code = ctypes.get_errno()
            if code in (errno.EPERM, errno.EACCES):
                raise NotPermitted(f"this daemon cannot take descriptors of process {pid} (not root?)")
            if code == errno.EBADF:
                raise InvalidArgument(f"process {pid} has no file descriptor {fd}")
            if code == errno.ENOSYS:
                raise NotSupported("the kernel has no pidfd_getfd (Linux 5.6 or later)")
            raise OSError(code, os.strerror(code))
        return int(got)
    finally:
        os.close(pidfd)


def borrow_sealed(pid: int, fd: int, uid: int) -> memoryview:
    """A read-only view of the sealed memfd `fd` of the calling process `pid`, whose
    bytes are then the daemon's (docs/formats.md, "Staged files, version 1").

    Refused unless the descriptor is a memfd (a file with no name) owned by `uid` (the
    request's caller, from the kernel) and sealed against writing, growing and
    shrinking, so nobody can change the bytes after this: EACCES for another user's
    memfd, EINVAL for anything else. The daemon's mapping keeps the memory alive after
    the client closes its descriptor or dies; it is freed when the daemon drops the
    last view of it."""
    dup = _take_fd(pid, fd)
    try:
        info = os.fstat(dup)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 0:
            raise InvalidArgument(f"descriptor {fd} is not a memfd (memfd_create with MFD_ALLOW_SEALING)")
        if info.st_uid != uid:
            raise AccessDenied(f"descriptor {fd} is a memfd of uid {info.st_uid}, not of the caller (uid {uid})")
        try:
            seals = fcntl.fcntl(dup, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & SEALS_NEEDED != SEALS_NEEDED:
            raise InvalidArgument(
                f"memfd {fd} must be sealed first: fcntl(F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW)"
            )
        if info.st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(dup, info.st_size, prot=mmap.PROT_READ))
    finally:
        os.close(dup)


def no_room(held: int) -> TryAgain:
    return TryAgain(f"sample.shm: all {held} slots are held; release one (write 'release <slot>')")
