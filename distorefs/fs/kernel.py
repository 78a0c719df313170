"""What the daemon tells the kernel about its caches (FUSE notifications).

Each call writes to the FUSE device and the kernel acts on it before the call returns.
A call that drops or fills page-cache pages locks those pages: made from the event
loop while a read of the same inode waits for this daemon's reply, it would wait for
that reply forever. Callers on the event loop make sure no open of the inode can have
such a read under way (the sample files: no other open of the node at all); others run
the call in a thread.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
from collections.abc import Sequence

import pyfuse3

log = logging.getLogger(__name__)

FUSE_DEVICE = os.makedev(10, 229)  # /dev/fuse, a misc character device
FUSE_NOTIFY_STORE = 4  # include/uapi/linux/fuse.h, enum fuse_notify_code
# fuse_out_header (len, error = the notify code, unique = 0), fuse_notify_store_out
# (nodeid, offset, size, padding): what libfuse's fuse_lowlevel_notify_store writes
STORE_HEAD = struct.Struct("<IiQQQII")
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

_device_fd: int | None = None  # this process's /dev/fuse descriptor while mounted


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
    return _device_fd


def detach() -> None:
    global _device_fd
    _device_fd = None


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


def store(ino: int, pieces: Sequence[bytes | bytearray | memoryview]) -> bool:
    """Put the concatenation of `pieces` (byte buffers) into the kernel's page cache of
    `ino` from offset 0 (extending the kernel's size where it is shorter); False where
    the kernel refused (an unknown inode, or a kernel without the notification), after
    which some pages may hold part of it.

    The pieces go to the kernel as they are, in one `writev` of the notification to the
    mount's device, which copies them straight into the inode's pages: no joined copy
    first (3.5 MB of a DQN batch took 137 µs to join, its store 386; design.md, "A
    sample's batch in the page cache"). Without the descriptor (`attach`), or with more
    pieces than one `writev` takes, they are joined and stored through pyfuse3."""
    size = sum(len(p) for p in pieces)
    fd = _device_fd
    try:
        if fd is not None and len(pieces) < IOV_MAX:
            os.writev(fd, [STORE_HEAD.pack(STORE_HEAD.size + size, FUSE_NOTIFY_STORE, 0, ino, 0, size, 0), *pieces])
        else:
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pyfuse3.notify_store(ino, 0, data)  # type: ignore[arg-type]  # any contiguous buffer
    except OSError as exc:
        log.debug("notify_store(%d, %d bytes): %s", ino, size, exc)
        return False
    return True
