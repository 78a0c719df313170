"""Progress of long work: recovery at mount, the persist at unmount, a dataset seal.

Owns how progress is shown: a rich progress bar when stderr is a terminal, and otherwise
(a log file, journald, a pipe) an INFO line at most every `every_s` seconds and one when
the work ends, with the amount done, the total and the rate. Work that ends within
`every_s` shows nothing either way. `watch` follows work whose
progress is a number of bytes still to go (dirty bytes to persist), sampled while the
work runs. What counts as progress is the caller's.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from distorefs.units import format_size

if TYPE_CHECKING:  # rich is imported when a bar is drawn: 45 ms of every daemon's start otherwise
    from rich.progress import Progress as RichProgress

T = TypeVar("T")
WATCH_EVERY_S = 0.5


class Progress:
    """One piece of long work with a known `total` in `unit` ("bytes" or a noun such as
    "rows"). Use as a context manager; `update(done)` or `advance(n)` as it goes."""

    def __init__(
        self, what: str, total: int, unit: str, logger: logging.Logger, every_s: float = 2.0, tty: bool | None = None
    ) -> None:
        self.what, self.total, self.unit = what, max(total, 0), unit
        self.done = 0
        self._log = logger
        self._every_s = every_s
        self._started = self._logged = time.monotonic()
        self._tty = sys.stderr.isatty() if tty is None else tty
        self._bar: RichProgress | None = None  # drawn once the work has taken every_s

    def _start_bar(self) -> RichProgress:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        amount = DownloadColumn() if self.unit == "bytes" else MofNCompleteColumn()
        bar = RichProgress(
            TextColumn("{task.description}"), BarColumn(), amount, TimeRemainingColumn(),
            console=Console(stderr=True), transient=False,
        )  # fmt: skip
        self._task = bar.add_task(self.what, total=self.total)
        bar.start()
        return bar

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish(failed=exc[0] is not None)

    def _amount(self, n: int) -> str:
        return format_size(n) if self.unit == "bytes" else f"{n:,} {self.unit}"

    def update(self, done: int) -> None:
        self.done = min(max(done, 0), self.total) if self.total else max(done, 0)
        now = time.monotonic()
        if self._tty:
            if self._bar is None and now - self._started >= self._every_s:
                self._bar = self._start_bar()
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done)
            return
        if now - self._logged >= self._every_s:
            self._logged = now
            rate = self.done / max(now - self._started, 1e-6)
            share = f" ({self.done * 100 // self.total}%)" if self.total else ""
            self._log.info(
                "%s: %s of %s%s, %s/s",
                self.what, self._amount(self.done), self._amount(self.total), share, self._amount(int(rate)),
            )  # fmt: skip

    def advance(self, n: int) -> None:
        self.update(self.done + n)

    def finish(self, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elapsed = time.monotonic() - self._started
        if failed:
            self._log.info("%s: stopped after %s in %.1f s", self.what, self._amount(self.done), elapsed)
        elif elapsed >= self._every_s:  # quick work says nothing
            self._log.info("%s: %s in %.1f s", self.what, self._amount(self.done), elapsed)


async def watch(
    what: str,
    remaining: Callable[[], int],
    work: Callable[[], Awaitable[T]],
    logger: logging.Logger,
    also: Callable[[int], None] | None = None,
) -> T:
    """Run `work()`, showing progress as `remaining()` (bytes still to go) falls; `also`
    gets each sample of `remaining()` too. Nothing is shown when nothing remains.

    What `work()` raises comes out as it is, not in an ExceptionGroup of the sampling
    nursery (a full disk at the daemon's final persist ended in a CRITICAL traceback,
    its reason lost; callers catch DistorefsError and OSError)."""
    total = remaining()
    if total == 0:
        return await work()
    failure: Exception | None = None
    with Progress(what, total, "bytes", logger) as progress:
        async with trio.open_nursery() as nursery:

            async def sample() -> None:
                while True:
                    left = remaining()
                    progress.update(total - left)
                    if also is not None:
                        also(left)
                    await trio.sleep(WATCH_EVERY_S)

            nursery.start_soon(sample)
            try:
                result = await work()
                progress.update(total - remaining())
            except Exception as exc:  # (cancellation goes through the nursery as usual)
                failure = exc
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
    return result
