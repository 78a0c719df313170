"""Checkpoints whose schedule point a FUSE request may defer to its end.

Every async function of distorefs checkpoints (STYLE: a cancel point and a schedule
point), also when it finished without waiting. Inside a FUSE request that costs the
client: a schedule point hands the event loop to every other runnable task and to an
I/O poll before the request goes on, and the reply waits for all of it. Measured
through the mount (docs/benchmarks.md, "Thirteenth session"): one checkpoint fewer in
an append's WRITE took 9 µs off an open-write-close append.

So the request wrapper (fs/ops.py) marks the task that serves a request with
`deferring`, and `checkpoint()` inside it is a cancel point only
(`trio.lowlevel.checkpoint_if_cancelled`). The schedule point comes right after the
reply: pyfuse3's request loop waits for /dev/fuse before it reads the next request.
While requests are queued it reads them at once instead, for up to `--queued-reads-us`
(300 µs) after it last waited (daemon.read_queued_requests); then it waits. A request
that runs longer than DEFER_S gets real schedule points again from then on, so that a
handler looping over many awaits cannot hold the event loop. A function that really
waits (a thread, a lock, an event) yields as before. A sampling session marks its
draws the same way (`deferring`) and yields once after each reply. Outside a marked
task (the flusher, peers, a session between draws) `checkpoint()` is trio's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio

from distorefs.errors import DistorefsError

log = logging.getLogger(__name__)

DEFER_S = 0.001  # a request's schedule points are deferred for at most its first millisecond

_deferring: dict[trio.lowlevel.Task, float] = {}  # task -> perf_counter() until which it defers


def deferring_since(started: float) -> object:
    """Mark the current task as serving a request that began at `started`
    (time.perf_counter()); returns a token for `done`. Cheaper than a context manager
    on the request path."""
    task = trio.lowlevel.current_task()
    _deferring[task] = started + DEFER_S
    return task


def done(token: object) -> None:
    """The request of `deferring_since` has ended."""
    _deferring.pop(token, None)  # type: ignore[call-overload]


@contextmanager
def deferring(started: float | None = None) -> Iterator[None]:
    """`deferring_since` for a block (a sampling session's draw, tests); `started`
    defaults to now."""
    token = deferring_since(time.perf_counter() if started is None else started)
    try:
        yield
    finally:
        done(token)


def _defers() -> bool:
    until = _deferring.get(trio.lowlevel.current_task())
    return until is not None and time.perf_counter() < until


async def checkpoint() -> None:
    """`trio.lowlevel.checkpoint()`, except in a task that serves a FUSE request (its
    first DEFER_S): there a cancel point only, the schedule point following the reply."""
    if _defers():
        await trio.lowlevel.checkpoint_if_cancelled()
    else:
        await trio.lowlevel.checkpoint()


async def cancel_shielded_checkpoint() -> None:
    """`trio.lowlevel.cancel_shielded_checkpoint()` (a schedule point that cannot raise
    Cancelled), deferred the same way: nothing at all inside a request."""
    if not _defers():
        await trio.lowlevel.cancel_shielded_checkpoint()


# --- big copies in slices ---------------------------------------------------------------

SLICE_BYTES = 4 << 20  # a copy of this size holds the event loop about 2.5 ms on this VM


async def read_sliced(
    read: Callable[[int, int], Awaitable[bytes | bytearray | memoryview]], offset: int, nbytes: int
) -> list[bytes | bytearray]:
    """`read(offset, nbytes)` as reads of SLICE_BYTES with a schedule point after each
    (a part of 32 MiB copied at once held the event loop, and every request of the
    mount, for 20 ms). The slices are copies: a view of a cached block is valid only
    until the next await. For a body of several buffers."""
    slices: list[bytes | bytearray] = []
    for start in range(offset, offset + nbytes, SLICE_BYTES):
        data = await read(start, min(SLICE_BYTES, offset + nbytes - start))
        slices.append(bytes(data) if isinstance(data, memoryview) else data)
        await trio.lowlevel.checkpoint()
    return slices


async def write_sliced(write: Callable[[int, memoryview], Awaitable[object]], offset: int, data: memoryview) -> None:
    """`write(offset, data)` as writes of SLICE_BYTES with a schedule point after each."""
    for start in range(0, len(data), SLICE_BYTES):
        await write(offset + start, data[start : start + SLICE_BYTES])
        await trio.lowlevel.checkpoint()


class AfterReply:
    """Work a request's handler leaves for after its reply (fs/ops.py `run_after_reply`
    does it, one piece at a time, in the order given). Each piece has a key, and a
    newer piece replaces an older one of the same key still waiting: as many pieces
    wait as there are keys (a buffer's next batch: one per buffer)."""

    def __init__(self) -> None:
        self._work: dict[object, Callable[[], Awaitable[None]]] = {}
        self._ready = trio.Event()
        self._running: dict[object, trio.Event] = {}  # key -> set when its piece (run by `run`) ends

    def add(self, key: object, work: Callable[[], Awaitable[None]]) -> None:
        self._work.pop(key, None)  # (to the end of the queue)
        self._work[key] = work
        self._ready.set()

    def discard(self, key: object) -> None:
        self._work.pop(key, None)

    def take(self, key: object) -> Callable[[], Awaitable[None]] | None:
        """The piece of `key` still waiting, taken off the queue (None where there is
        none): a request that needs its result does it itself rather than wait its turn."""
        return self._work.pop(key, None)

    async def settle(self, key: object, run_waiting: bool = True) -> None:
        """Make sure the piece of `key` is done: the request that needs its result waits
        for the one `run` is doing (it yields at its schedule points, so the request can
        come in meanwhile), then does the one still waiting here (`take`), rather than
        do the same work a second time beside it. A failure of the piece is logged
        (`run_quietly`); the request does without its result. Without `run_waiting` the
        piece still waiting is dropped instead (a request that does not want it, but must
        not run beside the one under way)."""
        if (running := self._running.get(key)) is not None:
            await running.wait()  # (first: a newer piece of the key must not run beside it)
        work = self.take(key)
        if work is not None and run_waiting:
            await run_quietly(work)
        elif running is None:
            await checkpoint()

    async def next(self) -> tuple[object, Callable[[], Awaitable[None]]]:
        """The oldest piece waiting and its key (taken off the queue); waits for one."""
        while True:
            while not self._work:
                await self._ready.wait()
                self._ready = trio.Event()
            await checkpoint()
            if self._work:  # (unless discarded meanwhile)
                key = next(iter(self._work))
                return key, self._work.pop(key)

    async def run(self) -> None:
        """Do each piece in turn, for ever, as background work: its schedule points let
        the requests that come meanwhile in (not deferred as a request's are), so that
        what a client sends right after a reply is not served behind the work that reply
        left. Python's `open()` asks whether the file is a terminal, an ioctl the kernel
        sends to the daemon, 10-30 µs after the OPEN's reply: behind the next batch's draw
        it took 150 µs of an `np.load(open(sample))` (docs/benchmarks.md, "Twenty-sixth
        session"). A piece's failure is logged (`run_quietly`)."""
        while True:
            key, work = await self.next()
            self._running[key] = ended = trio.Event()
            try:
                await run_quietly(work)
            finally:
                del self._running[key]
                ended.set()


async def run_quietly(work: Callable[[], Awaitable[None]]) -> None:
    """Do a piece of `AfterReply` work, now or in its turn: what it fails with (a
    DistorefsError: ENOMEM of an allowance, an item gone) is logged, not raised; the
    request that wanted its result does without it and reports its own errors."""
    try:
        await work()
    except DistorefsError as exc:
        log.debug("work after a reply: %s", exc.message)
