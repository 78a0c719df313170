"""Where the daemon's log goes, and what one line of it looks like.

Owns the logging set-up of a daemon process: one line per event (a traceback or a
message with newlines is folded into one line, its newlines written as `\\n`), to one of
three places:

- journald, when systemd started the daemon (`JOURNAL_STREAM` names our stderr): each
  line carries its syslog priority as a `<N>` prefix and no time stamp, which journald
  adds itself;
- a file, rotated by the daemon at `rotate_bytes` with `backups` old files kept
  (`daemon.log.1` ...), or, with `rotate_bytes=0`, never rotated by the daemon but reopened
  when logrotate moves it away (WatchedFileHandler);
- stderr, otherwise (`distore mount --foreground` in a terminal or under a test).

It also owns FailureLog, the WARNING line of a failed request (operation, arguments,
errno), bounded so that a client failing in a loop cannot flood the log. Which errnos
are a client's ordinary answers (ENOENT of a lookup, ENODATA of a getxattr) and stay at
DEBUG is the fs layer's choice.
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import sys
import time

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "<%(sd_priority)d>%(name)s: %(message)s"
DEFAULT_ROTATE_BYTES = 16 * 1024 * 1024
DEFAULT_BACKUPS = 4
# syslog priorities (sd-daemon.h) by logging level
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


class OneLineFormatter(logging.Formatter):
    """Formats a record (with its traceback) as one line, and gives journald its priority."""

    def format(self, record: logging.LogRecord) -> str:
        record.sd_priority = next((p for level, p in _PRIORITIES if record.levelno >= level), 7)
        return super().format(record).replace("\r", "\\r").replace("\n", "\\n")


def journald_stderr() -> bool:
    """Whether stderr is systemd's journal stream (JOURNAL_STREAM is "dev:ino" of it)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = stream.partition(":")
    if not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


def setup(
    *, debug: bool, log_file: str | None, rotate_bytes: int = DEFAULT_ROTATE_BYTES, backups: int = DEFAULT_BACKUPS
) -> str:
    """Send this process's log where it belongs (see the module docstring); returns where
    ("journald", "stderr" or the file's path). Replaces any handler set before."""
    handler: logging.Handler
    if log_file is not None:  # private like the rest of the data dir, also once rotated
        os.umask(0o077)
        os.close(os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600))
    if log_file is None and journald_stderr():
        handler, where, fmt = logging.StreamHandler(sys.stderr), "journald", JOURNAL_FORMAT
    elif log_file is None:
        handler, where, fmt = logging.StreamHandler(sys.stderr), "stderr", LOG_FORMAT
    elif rotate_bytes > 0:
        handler = logging.handlers.RotatingFileHandler(log_file, maxBytes=rotate_bytes, backupCount=backups)
        where, fmt = log_file, LOG_FORMAT
    else:
        handler, where, fmt = logging.handlers.WatchedFileHandler(log_file), log_file, LOG_FORMAT
    handler.setFormatter(OneLineFormatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    return where


def at_doubling(count: int) -> bool:
    """Whether the `count`-th time of something is logged: the 1st, 2nd, 4th, 8th ... (a
    line per doubling, with the count in it, bounds a repeated event's lines)."""
    return count > 0 and count & (count - 1) == 0


class FailureLog:
    """One WARNING line per failed request, at most `per_window` lines per operation (or
    per key of `refused`) in each `window_s`; the first line after a window says how
    many were left out. A client can make a request fail as often as it likes: its
    lines must not flood the log that every other user's lines go to."""

    def __init__(self, logger: logging.Logger, per_window: int = 20, window_s: float = 10.0) -> None:
        self._log = logger
        self._per_window = per_window
        self._window_s = window_s
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (window start, lines, left out)

    def _admit(self, key: str) -> int | None:
        """How many lines of `key` were left out before this one, or None to leave it out."""
        now = time.monotonic()
        start, lines, left_out = self._windows.get(key, (now, 0, 0))
        if now - start >= self._window_s:
            start, lines = now, 0
        if lines >= self._per_window:
            self._windows[key] = (start, lines, left_out + 1)
            return None
        self._windows[key] = (start, lines + 1, 0)
        return left_out

    def failed(self, op: str, request: str, code: int, message: str = "") -> None:
        left_out = self._admit(op)
        if left_out is None:
            return
        name = errno.errorcode.get(code, str(code))
        more = f" ({left_out} more failures of {op} left out of the log)" if left_out else ""
        self._log.warning(
            "request failed: %s(%s) -> %s (%s)%s%s",
            op, request, name, os.strerror(code), f": {message}" if message else "", more,
        )  # fmt: skip

    def refused(self, key: str, message: str) -> None:
        """A store's refusal of a client's input (`key`: whose, e.g. a buffer's name)."""
        left_out = self._admit(key)
        if left_out is not None:
            self._log.warning(
                "%s%s", message, f" ({left_out} more refusals of {key} left out of the log)" if left_out else ""
            )
