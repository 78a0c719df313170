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

import pyfuse3

log = logging.getLogger(__name__)


def invalidate(ino: int, attr_only: bool) -> bool:
    """Drop the kernel's cached attributes of `ino` (and its pages unless `attr_only`);
    False where the kernel does not know the inode (it forgot it: nothing to drop)."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only)
    except OSError as exc:
        log.debug("invalidate_inode(%d): %s", ino, exc)
        return False
    return True


def store(ino: int, data: bytes | bytearray | memoryview) -> bool:
    """Put `data` into the kernel's page cache of `ino` from offset 0 (extending the
    kernel's size where it is shorter); False where the kernel refused (an unknown
    inode, or a kernel without the notification), after which some pages may hold
    part of it."""
    try:
        pyfuse3.notify_store(ino, 0, data)  # type: ignore[arg-type]  # any contiguous buffer
    except OSError as exc:
        log.debug("notify_store(%d, %d bytes): %s", ino, len(data), exc)
        return False
    return True
