"""Domain errors of distorefs. Each carries the errno the fs layer answers with.

Only `fs/ops.py` turns these into `pyfuse3.FUSEError`; the layers below raise these and
never import pyfuse3.
"""

from __future__ import annotations

import errno as _errno


class DistorefsError(Exception):
    """Base class: a failure with an errno and a message naming the offending value."""

    errno: int = _errno.EIO

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(DistorefsError):
    errno = _errno.EINVAL


class NotFound(DistorefsError):
    errno = _errno.ENOENT


class Exists(DistorefsError):
    errno = _errno.EEXIST


class NotEmpty(DistorefsError):
    errno = _errno.ENOTEMPTY


class IsADirectory(DistorefsError):
    errno = _errno.EISDIR


class NotADirectory(DistorefsError):
    errno = _errno.ENOTDIR


class NameTooLong(DistorefsError):
    errno = _errno.ENAMETOOLONG


class NotPermitted(DistorefsError):
    errno = _errno.EPERM


class AccessDenied(DistorefsError):
    errno = _errno.EACCES


class OutOfMemory(DistorefsError):
    """Memory the request needs does not fit (the DRAM budget, shared memory)."""

    errno = _errno.ENOMEM


class Busy(DistorefsError):
    errno = _errno.EBUSY


class ReadOnly(DistorefsError):
    errno = _errno.EROFS


class NoSuchAttribute(DistorefsError):
    errno = _errno.ENODATA


class NotSupported(DistorefsError):
    errno = _errno.ENOTSUP


class TooBig(DistorefsError):
    errno = _errno.E2BIG


class FileTooLarge(DistorefsError):
    errno = _errno.EFBIG


class TryAgain(DistorefsError):
    """Not possible now (too few items, the rate limiter, O_NONBLOCK, a timeout)."""

    errno = _errno.EAGAIN


class CrossDevice(DistorefsError):
    """A rename between parts of the namespace that hold different kinds."""

    errno = _errno.EXDEV


class Stale(DistorefsError):
    """The inode the kernel named is not the one for this request: look the name up
    again (the kernel retries an open that gets ESTALE once, with a fresh lookup)."""

    errno = _errno.ESTALE


class TimedOut(DistorefsError):
    """A bounded wait ran out of time."""

    errno = _errno.ETIMEDOUT


class Interrupted(DistorefsError):
    """A signal arrived for the process waiting on this request."""

    errno = _errno.EINTR


class StoreFull(DistorefsError):
    errno = _errno.ENOSPC


class Corrupted(DistorefsError):
    """A log record failed its length, key or crc32c check."""

    errno = _errno.EIO


class ConfigError(Exception):
    """Bad command-line or configuration input; the CLI prints it as one line and exits 2."""


class PeerUnavailable(DistorefsError):
    """A peer daemon (or etcd) did not answer within its deadline, or is known dead."""

    errno = _errno.EIO


class RemoteError(DistorefsError):
    """A peer answered with an error: its errno and message, passed on unchanged."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(message)
        self.errno = errno


def describe(value: object) -> str:
    """What a refused input was, without quoting its text: error messages reach `stats`
    files that other users may read, so a string is named by its kind and length, never
    shown. Numbers and true/false are shown (they say what was wrong, and carry no text)."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)[:40] if value is not None else "null"
    if isinstance(value, (str, bytes, bytearray)):
        return f"a {'string' if isinstance(value, str) else 'byte string'} of {len(value)} characters"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} fields"
    return f"a {type(value).__name__}"
