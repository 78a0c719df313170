"""The `buffers/` kind: replay buffers as directories of control files.

Owns the FUSE side of buffers: the nodes (`config`, `append`, `sample`, `sample.N`,
`priority`, `stats`, `items/<index>`), what each open's handle does with reads and
writes, and turning a signal to a blocked reader into EINTR. The buffers themselves are
stores/replay; nothing here keeps buffer state.

Item inodes are computed, not stored: ITEM_BASE | buffer number << 36 | index, so a
million items cost no memory here.

Blocking reads and writes (`sample` below min_size_to_sample, `append` held by the rate
limiter) poll the caller's pending signals in /proc every 50 ms while they wait. pyfuse3
has no FUSE_INTERRUPT hook, so this is how a signal interrupts them with EINTR.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import trio

from distorefs import scheduling
from distorefs.errors import (
    Busy,
    DistorefsError,
    FileTooLarge,
    Interrupted,
    InvalidArgument,
    NotFound,
    NotSupported,
    ReadOnly,
    Stale,
    TryAgain,
)
from distorefs.fs import kernel
from distorefs.fs.shm import SLOTS as SHM_SLOTS
from distorefs.fs.shm import Region, SharedMemory, no_room
from distorefs.fs.virtual import (
    READ_PIECES,
    Access,
    Allowance,
    AppendStreamHandle,
    ControlFile,
    Entry,
    NamedDir,
    NamedKindDirectory,
    PositionListing,
    ReadReply,
    VirtualDir,
    VirtualFile,
    VirtualHandle,
    VirtualNode,
    VirtualTree,
    WholeInputHandle,
    json_object,
)
from distorefs.ids import BUFFER_OWNER_BASE, INDEX_BITS, ITEM_BASE, ITEM_SPAN
from distorefs.stores.replay.buffer import ReplayBuffer
from distorefs.stores.replay.draws import Batch
from distorefs.stores.replay.formats import (
    MAX_ITEM_BYTES,
    NPY_MAGIC,
    BlobStream,
    RecordStream,
    ScatteredBytes,
    batch_dtype,
    joined,
    npy_batch_bytes,
    parse_priorities,
)
from distorefs.stores.replay.store import BufferStore

T = TypeVar("T")


SIGNAL_POLL_S = 0.05  # a waiting request looks for a signal to its caller this often, while few wait
SIGNAL_CHECKS_PER_POLL = 64  # past this many waiting, their checks (40 µs each) spread out to keep this rate
# The default of --max-waiting-requests: requests that may wait at once, mount-wide, for
# items, a rate limiter or a new weights version. Each holds one of pyfuse3's worker tasks
# while it waits (daemon.request_tasks), and with all of them waiting the mount answered
# no one (docs/design.md, "Requests that wait, bounded").
MAX_WAITING_REQUESTS = 512
CONTROL_NAMES = (b"config", b"append", b"sample", b"priority", b"stats")
MAX_SAMPLE_COUNT = 1 << 20
PRIORITY_INPUT_BYTES = 64 << 20
PARSE_IN_THREAD_BYTES = 256 << 10  # priority input this big is parsed in a worker thread (text: ~20,000 lines)
APPEND_SLICE = 128  # items appended and logged between two turns of other requests


def signal_pending(pid: int) -> bool:
    """True when thread `pid` has a pending signal it neither blocks nor ignores (or is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True  # the caller is gone: stop waiting for it
    try:
        pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
        return bool(pending & ~int(fields["SigBlk"], 16) & ~int(fields["SigIgn"], 16))
    except (KeyError, ValueError):
        return False


class WaitingRequests:
    """How many requests wait in `interruptible` now, the most that may, and how many
    were refused for it (`.distore/status` `waiting_requests`). One per daemon process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.now = 0
        self.refused = 0

    def enter(self, label: str) -> None:
        if self.now >= self.limit:
            self.refused += 1
            raise TryAgain(
                f"{label}: {self.now} requests of this mount are waiting already, the most that may"
                f" (samples without enough items, appends held by a rate limiter, reads of a model's wait):"
                f" try again later"
            )
        self.now += 1

    def leave(self) -> None:
        self.now -= 1

    def signal_poll_s(self) -> float:
        """How long a waiting request sleeps between two looks for a signal: SIGNAL_POLL_S,
        longer once more than SIGNAL_CHECKS_PER_POLL wait (512 waiting: 0.4 s)."""
        return SIGNAL_POLL_S * max(1.0, self.now / SIGNAL_CHECKS_PER_POLL)

    def statistics(self) -> dict[str, object]:
        return {"waiting_requests": {"now": self.now, "limit": self.limit, "refused": self.refused}}


WAITING = WaitingRequests(MAX_WAITING_REQUESTS)


async def interruptible(pid: int, wait: Callable[[], Awaitable[T]], label: str = "a request") -> T:
    """Run `wait`; if the process `pid` gets a signal meanwhile, cancel it: Interrupted.
    TryAgain at once where `WAITING.limit` (--max-waiting-requests) wait already.

    Errors of `wait` (TryAgain ...) come out as themselves, not in an ExceptionGroup.
    """
    WAITING.enter(label)
    try:
        return await _interruptible(pid, wait)
    finally:
        WAITING.leave()


async def _interruptible(pid: int, wait: Callable[[], Awaitable[T]]) -> T:
    result: list[T] = []
    failure: list[DistorefsError] = []
    interrupted = False
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal interrupted
            while True:
                await trio.sleep(WAITING.signal_poll_s())
                if signal_pending(pid):
                    interrupted = True
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch)
        try:
            result.append(await wait())
        except DistorefsError as exc:
            failure.append(exc)
        nursery.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not result:
        assert interrupted
        raise Interrupted("interrupted by a signal while waiting")
    return result[0]


async def run_waiting(
    pid: int, nonblocking: bool, ready: bool, call: Callable[[bool], Awaitable[T]], label: str = "a request"
) -> T:
    """Run `call(nonblocking)`. When it is going to wait (not ready, and blocking is
    allowed), run it so that a signal to the caller interrupts it (EINTR), and only
    where fewer than `WAITING.limit` wait already (else TryAgain, naming `label`)."""
    if nonblocking or ready:
        return await call(nonblocking)
    return await interruptible(pid, lambda: call(False), label)


def config_text(buffer: ReplayBuffer) -> bytes:
    """What a read of `config` returns: the buffer's config as indented JSON."""
    return (json.dumps(buffer.config.to_json(), indent=2) + "\n").encode()


def item_ino(buffer: ReplayBuffer, index: int) -> int:
    return ITEM_BASE | ((buffer.owner - BUFFER_OWNER_BASE) << INDEX_BITS) | index


def _recorded(buffer: ReplayBuffer, exc: DistorefsError) -> DistorefsError:
    buffer.record_error(exc.message)
    return exc


# --- handles ----------------------------------------------------------------------------


class ConfigHandle(WholeInputHandle):
    """Reads the config as JSON; a write of a complete JSON object applies it (or none)."""

    kind = "buffers"

    incomplete = "config is not valid JSON"

    def __init__(self, buffer: ReplayBuffer) -> None:
        super().__init__(f"buffers/{buffer.name}", buffer.record_error, config_text(buffer))
        self._buffer = buffer

    async def _apply_if_complete(self, pending: bytearray) -> bool:
        changes = json_object(self.label, pending)
        if changes is None:
            return False
        self._buffer.reconfigure(changes)
        return True

    async def flush(self) -> None:
        await super().flush()
        if self.applied:  # a read of the config commits nothing
            self.applied = False
            await self._buffer.persist()


class AppendHandle(AppendStreamHandle):
    """Applies each complete record (or frame) as it arrives, and logs it before the
    write that completed it returns: a write whose records are whole is acknowledged
    when it returns, as a close is (docs/design.md, "Appends acknowledged at the write")."""

    kind = "buffers"

    def __init__(self, buffer: ReplayBuffer, nonblocking: bool, pid: int) -> None:
        self._buffer = buffer
        self._nonblocking = nonblocking
        self._pid = pid
        dtype = buffer.config.dtype
        self._stream: RecordStream | BlobStream = RecordStream(dtype) if dtype is not None else BlobStream()

    async def _add(self, items: Sequence[bytes | bytearray]) -> None:
        """Append and log `items`, APPEND_SLICE at a time: each slice costs some 15 µs
        an item on the event loop, and a WRITE of 1 MiB of 8-byte records in one piece
        held every other request of the mount for 0.5-0.9 s."""
        buffer = self._buffer
        for at in range(0, len(items), APPEND_SLICE):
            if buffer.deleted:
                raise NotFound(f"buffers/{buffer.name} was removed")
            part = items[at : at + APPEND_SLICE]
            ready = buffer.can_append(len(part))
            append = functools.partial(buffer.append, part)
            await run_waiting(self._pid, self._nonblocking, ready, append, f"buffers/{buffer.name}/append")
            await buffer.persist_appends()

    async def write(self, offset: int, data: bytes) -> int:
        try:
            items = self._stream.feed(offset, data)
        except InvalidArgument as exc:
            self._stream.reset()  # the bad input is dropped; later writes start afresh
            raise _recorded(self._buffer, exc) from None
        finally:
            self._follow_stream()
        if items:
            await self._add(items)
        else:
            await scheduling.checkpoint()
        return len(data)

    def input_label(self) -> str:
        return f"buffers/{self._buffer.name}/append: a partial record"

    async def flush(self) -> None:
        """Every close of a descriptor of this open (dup'ed ones too: bash dup2s the
        file onto stdout and closes the original before it writes) finishes what has
        arrived so far, and acknowledges it."""
        try:
            tail = self._stream.finish()
        except InvalidArgument as exc:
            raise _recorded(self._buffer, exc) from None
        finally:
            self._follow_stream()
        if tail:
            await self._add(tail)
        await self._buffer.persist_appends()

    async def fsync(self) -> None:
        """fsync of `append`: the complete records so far survive a power loss."""
        await self._buffer.persist(durable=True)


NPZ_SIZE_MAX_BYTES = 4 << 20  # sample.npz reports its length up to this (measured once by making one: <= ~30 ms)


@functools.lru_cache(maxsize=64)
def npz_batch_bytes(schema: np.dtype[Any], count: int) -> int:
    """How long `sample.npz` of `count` records is: an .npz of stored arrays has the same
    length whatever the values, so one of zeros measures it (once per schema and count;
    0, unknown, past NPZ_SIZE_MAX_BYTES). As its st_size, it lets Python's `read()` take
    the file in one call instead of dozens of reads that grow by an eighth each."""
    if count * (schema.itemsize + 12) > NPZ_SIZE_MAX_BYTES:
        return 0
    out = io.BytesIO()
    np.save(out, np.zeros(count, batch_dtype(schema)))
    return len(columnar_npz(out.getvalue()))


def columnar_npz(batch: bytes) -> bytes:
    """A schema batch (.npy of packed records) as an .npz of one contiguous array per
    field, `_index` and `_weight` included: each loads straight into torch.as_tensor."""
    records = np.load(io.BytesIO(batch), allow_pickle=False)
    out = io.BytesIO()
    assert records.dtype.names is not None
    fields: dict[str, Any] = {name: np.ascontiguousarray(records[name]) for name in records.dtype.names}
    np.savez(out, **fields)
    return out.getvalue()


CACHED_BATCH_MAX_BYTES = 64 << 20  # a sample batch up to this size may be served from the page cache
STREAM_JOIN_MAX_BYTES = 4 << 20  # the most a stream's open keeps for joining a read's pieces
# A bigger batch than this goes into the page cache from a worker thread, the event loop
# serving other requests meanwhile (R2D2's 40 MB took 3-4 ms to store on two CPUs).
LOOP_STORE_MAX_BYTES = 16 << 20


async def columnar_batch(data: bytearray | bytes | ScatteredBytes) -> bytes:
    """`columnar_npz` of a drawn batch, in a worker thread."""
    joined = data.tobytes() if isinstance(data, ScatteredBytes) else bytes(data)
    return await trio.to_thread.run_sync(columnar_npz, joined)


def store_batch(node: BufferFile, data: bytearray | bytes | ScatteredBytes) -> bool:
    """Put a batch as long as `node`'s size into the kernel's page cache of `node`; False
    where the kernel refused (the open then stays direct). The caller makes sure no open
    of the node but its own exists (SampleHandle.draw_at_open)."""
    if len(data) < node.widest:
        # The kernel may hold pages past this batch's end (and a size that shows
        # them) from a longer batch before a reconfigure: drop them first.
        if not kernel.invalidate(node.ino, attr_only=False):
            return False
        node.widest = len(data)
    return kernel.store(node.ino, data.pieces() if isinstance(data, ScatteredBytes) else [data])


async def store_batch_off_loop(node: BufferFile, data: bytearray | bytes | ScatteredBytes) -> bool:
    """`store_batch`, from a worker thread for a batch past LOOP_STORE_MAX_BYTES. The
    caller's rule holds the same: no open of `node` whose client may read it meanwhile."""
    if len(data) <= LOOP_STORE_MAX_BYTES:
        await scheduling.checkpoint()
        return store_batch(node, data)
    return await trio.to_thread.run_sync(store_batch, node, data)


# After a cached open of a sample file its next batch is drawn ahead (BufferDir.want_ahead)
# until this many in a row were dropped unused (the buffer changed before the next open:
# an RL loop that updates priorities between samples); then only every AHEAD_PROBE-th open.
AHEAD_MISSES = 4
AHEAD_PROBE = 8
# ... and only for batches this big: a smaller one is read and parsed by the client before
# the daemon has drawn the next, which then waits behind the draw all the same (a 66 KB
# batch's np.load(open(sample.64)) took 30 us more p50 with it; docs/benchmarks.md)
AHEAD_MIN_BYTES = 256 << 10


@dataclasses.dataclass
class Ahead:
    """A batch drawn for the next open of `node` (for a stream's next read: None), not
    counted as sampled yet, held in the mount's allowance for batches drawn ahead
    (`held_bytes`; whoever takes it holds it in the batch allowance), stored in the
    node's page cache where `stored`."""

    node: BufferFile | None
    count: int | None
    columnar: bool
    changes: int  # the buffer's `changes` when it was drawn
    data: bytearray | bytes | ScatteredBytes
    indices: np.ndarray
    held_bytes: int
    stored: bool


class AheadPolicy:
    """When a buffer's next batch is drawn ahead (its sample files' and streams'), and
    how many were: after AHEAD_MISSES dropped unused in a row, only every
    AHEAD_PROBE-th chance draws one, until one is taken again."""

    def __init__(self) -> None:
        self.drawn = 0  # batches drawn ahead: taken, or dropped
        self.taken = 0
        self._misses = 0  # dropped in a row
        self._skipped = 0  # chances let go since the last probe

    def wanted(self, batch_bytes: int) -> bool:
        if batch_bytes < AHEAD_MIN_BYTES:
            return False
        if self._misses >= AHEAD_MISSES:
            self._skipped += 1
            if self._skipped < AHEAD_PROBE:
                return False
            self._skipped = 0
        return True

    def took(self) -> None:
        self._misses = 0
        self.taken += 1

    def dropped(self) -> None:
        self._misses += 1


@dataclasses.dataclass
class AheadContext:
    """A buffer's batches drawn ahead, for its sample files (BufferDir) and its streams:
    where the work goes, the allowance they are held in until taken, the policy, and
    the draw, hand-over and drop they share."""

    after_reply: scheduling.AfterReply
    aheads: Allowance
    policy: AheadPolicy

    async def draw(
        self, buffer: ReplayBuffer, count: int | None, columnar: bool, expected_bytes: int, node: BufferFile | None
    ) -> Ahead | None:
        """The next batch of `count` drawn without counting it (the caller keeps or
        drops it), held in `aheads` (`expected_bytes` before the draw, then its length);
        None where the buffer changed while it was drawn. ENOMEM when the allowance
        cannot hold it; whatever the draw raises (nothing held then)."""

        def label() -> str:
            return f"buffers/{buffer.name}: a batch drawn ahead"

        held = self.aheads.take(expected_bytes, label)
        try:
            changes = buffer.changes
            batch = await buffer.draw_uncounted(count, nonblocking=True)
            data = await columnar_batch(batch.data) if columnar else batch.data
            if len(data) != held:  # (a blob buffer's batches differ in length)
                self.aheads.give(held)
                held = 0
                held = self.aheads.take(len(data), label)
        except BaseException:
            self.aheads.give(held)
            raise
        if buffer.changes != changes:
            self.aheads.give(held)
            return None
        return Ahead(node, count, columnar, changes, data, batch.indices, held, stored=False)

    def hand_over(
        self, ahead: Ahead, buffer: ReplayBuffer, held: Allowance, label: Callable[[], str], fits: bool
    ) -> bool:
        """Give `ahead` to the open or read that `fits` it: False (and it is dropped)
        where it does not, the buffer changed since its draw, or `held` (the batch
        allowance) cannot take it; True once it is held there and counted as sampled."""
        self.aheads.give(ahead.held_bytes)
        if not fits or ahead.changes != buffer.changes:
            self.policy.dropped()
            return False
        try:
            ahead.held_bytes = held.take(len(ahead.data), label)
        except DistorefsError:
            return False
        buffer.commit(ahead.indices)
        self.policy.took()
        return True

    def drop(self, ahead: Ahead, missed: bool = True) -> None:
        """Let `ahead` go (`missed`: it was drawn for nothing, which the policy counts)."""
        self.aheads.give(ahead.held_bytes)
        if missed:
            self.policy.dropped()


class BatchHolder(VirtualHandle):
    """A handle that keeps the batch it drew (counted in `held` until it lets it go)."""

    def __init__(self, buffer: ReplayBuffer, held: Allowance) -> None:
        self._buffer = buffer
        self._held = held
        self._held_bytes = 0

    async def _hold(self, batch: Batch) -> Batch:
        """`sample_into`'s `place`: count the batch as held before its items count as
        sampled (a refusal counts nothing)."""
        await scheduling.checkpoint()
        self._held_bytes = self._held.take(len(batch.data), self._batch_label)
        return batch

    def _batch_label(self) -> str:
        return f"buffers/{self._buffer.name}: a batch"

    def _let_go(self) -> None:
        self._held.give(self._held_bytes)
        self._held_bytes = 0


class SampleHandle(BatchHolder):
    """Draws its batch at the first read, or at the open when the batch can be served
    from the kernel's page cache (`draw_at_open`); the batch stays fixed for this open,
    counted in `held` until the release. With `columnar`, a schema batch is served as an
    .npz of contiguous fields (`sample.npz`)."""

    kind = "buffers"

    def __init__(
        self, buffer: ReplayBuffer, count: int | None, nonblocking: bool, pid: int, held: Allowance,
        columnar: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(buffer, held)
        self._count = count
        self._nonblocking = nonblocking
        self._pid = pid
        self._columnar = columnar
        self._data: bytearray | bytes | ScatteredBytes | None = None
        self._node: BufferFile | None = None

    async def draw_at_open(self, node: BufferFile) -> None:
        """Draw now and put the batch into the kernel's page cache of `node`, so that the
        client's reads cost no request (numpy reads a file it is given twice, through a
        dup) and nothing drops the file's cached attributes (a read the daemon serves
        does, and the next fstat asks again). design.md, "A sample's batch in the page
        cache". A batch drawn ahead after the last open's reply (`BufferDir.want_ahead`)
        is taken as it is when nothing changed since: then the open draws nothing, and
        stores nothing when the last release stored it.

        Only where that is safe: no other open of the node exists (the kernel keeps one
        cache per inode, and with no other open no read of it can be waiting for this
        daemon while the pages are filled from the event loop), the batch can be drawn
        without waiting, and its length is the node's size (the kernel reads a cached
        file up to its size). Otherwise the open stays direct and its first read draws
        (and waits, interruptibly) as before."""
        node.opens += 1  # released in `release`, or here if the open fails
        self._node = node
        try:
            if isinstance(node.governor, BufferDir):
                await node.governor.settle_ahead(node)
            if not await self._take_ahead(node):
                await self._fill_cache(node)
        except BaseException:
            node.opens -= 1
            self._node = None
            raise
        if self.keep_cache and isinstance(node.governor, BufferDir):
            node.governor.want_ahead(node, self._count, self._columnar)

    async def _take_ahead(self, node: BufferFile) -> bool:
        """This open's batch is the one drawn ahead for it, if there is one still good:
        counted as sampled now, served from the page cache where the release stored it."""
        governor = node.governor
        if not isinstance(governor, BufferDir):
            await scheduling.checkpoint()
            return False
        ahead = governor.take_ahead(node, self._count, self._columnar, self._batch_label)
        if ahead is None:
            await scheduling.checkpoint()
            return False
        self._data, self._held_bytes = ahead.data, ahead.held_bytes
        if ahead.stored or await store_batch_off_loop(node, ahead.data):
            self._from_page_cache(node)
        return True

    async def _fill_cache(self, node: BufferFile) -> None:
        size = node.size
        if node.opens > 1 or not 0 < size <= CACHED_BATCH_MAX_BYTES or not self._buffer.can_sample(self._count):
            await scheduling.checkpoint()
            return
        try:
            await self._draw(nonblocking=True)
        except DistorefsError:  # drawn again at the first read, which reports it
            return
        data = self._data
        if data is None or len(data) != size or node.opens > 1:
            return
        if await store_batch_off_loop(node, data):
            self._from_page_cache(node)

    def _from_page_cache(self, node: BufferFile) -> None:
        """The node's page cache holds this open's batch: the open is cached, not direct."""
        self.direct_io, self.keep_cache = False, True
        if isinstance(node.governor, BufferDir):
            node.governor.page_cache_batches += 1

    async def _draw(self, nonblocking: bool) -> None:
        buffer, count = self._buffer, self._count
        if self._columnar:
            self._check_fields()
        ready = buffer.can_sample(count)
        batch = await run_waiting(
            self._pid, nonblocking, ready, lambda nb: buffer.sample_into(count, nb, self._hold),
            f"buffers/{buffer.name}/sample",
        )  # fmt: skip
        self._data = batch.data
        if self._columnar:
            self._check_fields(batch.data)
            self._data = await columnar_batch(batch.data)

    def _check_fields(self, data: bytearray | bytes | ScatteredBytes | None = None) -> None:
        """`sample.npz` is for a buffer with a schema, and its batch is a schema batch
        (an .npy); the schema can go while the buffer is empty (a config write), after
        this file was looked up or opened, or between the draw's start and its end."""
        if data is None:
            fields = self._buffer.config.dtype is not None
        else:
            head = (
                b"".join(data.parts(0, len(NPY_MAGIC)))
                if isinstance(data, ScatteredBytes)
                else bytes(data[: len(NPY_MAGIC)])
            )
            fields = head == NPY_MAGIC
        if not fields:
            raise Stale(f"buffers/{self._buffer.name}/sample.npz: the buffer has no schema since this open")

    async def release(self) -> None:
        await scheduling.checkpoint()
        self._let_go()
        self._data = None
        node, self._node = self._node, None
        if node is None:
            return
        node.opens -= 1
        if not node.opens and isinstance(node.governor, BufferDir):
            node.governor.released(node)

    async def read(self, offset: int, size: int) -> ReadReply:
        if self._data is None:
            await self._draw(self._nonblocking)
        else:
            await scheduling.checkpoint()
        assert self._data is not None
        if isinstance(self._data, ScatteredBytes):
            return scattered_reply(self._data, offset, size)
        return memoryview(self._data)[offset : offset + size]


def scattered_reply(data: ScatteredBytes, offset: int, size: int, into: bytearray | None = None) -> ReadReply:
    """A read of a batch kept in pieces: the pieces it spans as they are, where pyfuse3
    takes a reply in pieces (READ_PIECES: one writev, no copy here), else joined (into
    `into` where it is big enough: `joined`). The pieces are views of the batch's items,
    which the batch holds until its release, and pyfuse3 writes the reply before anything
    else of this open runs."""
    parts = data.parts(offset, size)
    if 1 < len(parts) <= READ_PIECES:
        pieces: list[bytes | memoryview] = list(parts)
        return pieces
    return joined(parts, into)


class StreamHandle(BatchHolder):
    """`sample.stream`: one open, endless batches. Reads go forward: a read at the end of
    the current batch draws the next one (waiting as `sample` does), so a learner keeps
    one descriptor and reads one batch per call (`os.read(fd, st_size)` for a schema
    buffer, whose batches are all `st_size` long). A read never spans two batches: it
    ends at the current batch's end. With `ahead`, a read that reaches the end of a
    batch has the next one drawn after its reply, while the client works on this one;
    the read that asks for it takes it if the buffer has not changed since (design.md,
    "The next batch drawn while the client reads")."""

    kind = "buffers"

    def __init__(
        self, buffer: ReplayBuffer, count: int | None, nonblocking: bool, pid: int, held: Allowance,
        ahead: AheadContext | None = None,
    ) -> None:  # fmt: skip
        super().__init__(buffer, held)  # (the current batch is held)
        self._count = count
        self._nonblocking = nonblocking
        self._pid = pid
        self._start = 0  # offset of the current batch in the stream
        self._data: bytearray | bytes | ScatteredBytes = b""
        self.batches = 0
        self._ahead = ahead
        self._next: Ahead | None = None  # the next batch, drawn ahead
        self._released = False
        # A read that spans a batch's pieces is joined here, kept for the next: pyfuse3
        # copies a reply into the kernel before any other request of this open runs.
        self._joined = bytearray()

    async def read(self, offset: int, size: int) -> ReadReply:
        end = self._start + len(self._data)
        if offset < self._start or offset > end:
            raise _recorded(
                self._buffer,
                InvalidArgument(
                    f"buffers/{self._buffer.name}/sample.stream: reads go forward batch by batch; a read at"
                    f" {offset} is not in the current batch ({self._start}..{end}) nor at its end"
                ),
            )
        if offset == end:
            buffer, count = self._buffer, self._count
            self._let_go()  # read to its end: the next batch replaces it
            self._start, self._data = end, b""
            if self._ahead is not None:  # (asked for after the last read's reply: drawn now, or its draw ended)
                await self._ahead.after_reply.settle(self)
            ahead = self._take_next()
            if ahead is None:
                ready = buffer.can_sample(count)
                batch = await run_waiting(
                    self._pid, self._nonblocking, ready, lambda nb: buffer.sample_into(count, nb, self._hold),
                    f"buffers/{buffer.name}/sample.stream",
                )  # fmt: skip
                self._data = batch.data
            else:
                await scheduling.checkpoint()
                self._data = ahead.data
            self.batches += 1
        else:
            await scheduling.checkpoint()
        at = offset - self._start
        if at + size >= len(self._data) and self._ahead is not None and self._ahead.policy.wanted(len(self._data)):
            self._ahead.after_reply.add(self, self._draw_next)
        if isinstance(self._data, ScatteredBytes):
            if not READ_PIECES and len(self._joined) < size <= STREAM_JOIN_MAX_BYTES:
                self._joined = bytearray(size)
            return scattered_reply(self._data, at, size, self._joined)
        return memoryview(self._data)[at : at + size]

    async def _draw_next(self) -> None:
        """The next batch, drawn without counting it, held apart (`AheadContext`)."""
        ahead = self._ahead
        assert ahead is not None
        self._drop_next()
        buffer = self._buffer
        if self._released or not buffer.can_sample(self._count):
            await scheduling.checkpoint()
            return
        drawn = await ahead.draw(buffer, self._count, False, len(self._data), None)
        if drawn is None:
            return
        if self._released:
            ahead.drop(drawn, missed=False)
            return
        self._drop_next()  # (one drawn meanwhile: the draw yields to requests)
        self._next = drawn
        ahead.policy.drawn += 1

    def _take_next(self) -> Ahead | None:
        """The batch drawn ahead, counted as sampled and held now, if the buffer has not
        changed since its draw (and the open's batches fit); None otherwise."""
        drawn, self._next = self._next, None
        if drawn is None:
            return None
        assert self._ahead is not None
        if not self._ahead.hand_over(drawn, self._buffer, self._held, self._batch_label, fits=True):
            return None
        self._held_bytes = drawn.held_bytes
        return drawn

    def _drop_next(self) -> None:
        drawn, self._next = self._next, None
        if drawn is not None:
            assert self._ahead is not None
            self._ahead.drop(drawn)

    async def release(self) -> None:
        await scheduling.checkpoint()
        self._released = True
        self._let_go()
        self._data = b""
        self._drop_next()
        if self._ahead is not None:
            self._ahead.after_reply.discard(self)


SHM_MAGIC = b"DSSHM1"
SHM_SESSION_MAGIC = b"DSSHM2"
SHM_READ_BYTES = 512  # a read of sample.shm must take at least this much (one descriptor line)
SHM_INPUT_BYTES = 64 * 1024
SLOT_DIGITS = 18  # a slot number in a release line (Python parses no more than 4,300 digits)
SHM_INLINE_COPY_BYTES = 4 << 20  # bigger batches (over ~0.4 ms of copying) go into their slot from a thread


class ShmSampleHandle(VirtualHandle):
    """`sample.shm`: batches through shared memory (docs/formats.md, "Shared-memory
    sampling, version 1"). Each read draws a batch into a free slot of a region made
    for the opener's uid and returns one descriptor line: `DSSHM1 <path> <region bytes>
    <offset> <length> <slot>`. The slot stays the client's until it writes `release
    <slot>`; the close (or the kernel's release when the client died) frees the regions."""

    kind = "buffers"

    def __init__(
        self, buffer: ReplayBuffer, count: int | None, nonblocking: bool, pid: int, shared: SharedMemory
    ) -> None:
        self._buffer = buffer
        self._count = count
        self._nonblocking = nonblocking
        self._pid = pid
        self._shared = shared
        self._owner = (os.geteuid(), os.getegid())
        self._slots: dict[int, tuple[Region, int]] = {}  # slot id -> (region, slot in it)
        self._region: Region | None = None  # the newest; older ones close once their slots are back
        self._next_id = 0
        self._input = bytearray()
        self._ticket: bytes | None = None  # version 2: the session this open asked for

    def opened_by(self, uid: int, gid: int) -> None:
        self._owner = (uid, gid)

    async def _place(self, batch: Batch) -> bytes:
        data = batch.data
        pieces = data.pieces() if isinstance(data, ScatteredBytes) else [memoryview(data)]
        length = len(data)
        region = self._region
        if region is None or not region.fits(length):
            region = self._shared.create(length, *self._owner)
            self._retire()
            self._region = region
        slot = region.take(length)
        if slot is None:
            raise no_room(len(self._slots))
        slot_id = self._next_id
        self._next_id += 1
        self._slots[slot_id] = (region, slot)
        if length <= SHM_INLINE_COPY_BYTES:
            region.fill(slot, pieces)
        else:
            region.filling += 1
            try:
                await trio.to_thread.run_sync(region.fill, slot, pieces)
            finally:
                region.filling -= 1
                if region.closing:
                    region.close()
        return b"%s %s %d %d %d %d\n" % (
            SHM_MAGIC, region.path.encode(), region.size, slot * region.slot_bytes, length, slot_id,
        )  # fmt: skip

    def _retire(self) -> None:
        """Close the current region if no slot of it is held (a bigger one replaces it)."""
        old = self._region
        if old is not None and not any(r is old for r, _slot in self._slots.values()):
            old.close()

    async def read(self, offset: int, size: int) -> bytes:
        if size < SHM_READ_BYTES:
            raise _recorded(
                self._buffer,
                InvalidArgument(f"buffers/{self._buffer.name}/sample.shm: read at least {SHM_READ_BYTES} bytes"),
            )
        sessions = self._shared.sessions
        if self._ticket is not None and sessions is not None:
            await scheduling.checkpoint()
            return b"%s %s %s\n" % (SHM_SESSION_MAGIC, sessions.path.encode(), self._ticket)
        region = self._region
        if region is not None and len(region.held) == SHM_SLOTS:
            raise no_room(SHM_SLOTS)  # before the draw: nothing is counted
        buffer, count = self._buffer, self._count
        ready = buffer.can_sample(count)
        return await run_waiting(
            self._pid, self._nonblocking, ready, lambda nb: buffer.sample_into(count, nb, self._place),
            f"buffers/{buffer.name}/sample.shm",
        )  # fmt: skip

    async def write(self, offset: int, data: bytes) -> int:
        """`release <slot> [<slot> ...]` lines give slots back; an unknown slot is EINVAL.
        `session 2` asks for a version 2 session: reads return its ticket from then on
        (ENOTSUP where the daemon has none, EBUSY for a second one)."""
        await scheduling.checkpoint()
        if len(self._input) + len(data) > SHM_INPUT_BYTES:
            self._input.clear()
            raise InvalidArgument(f"buffers/{self._buffer.name}/sample.shm: a release line of more than 64 KiB")
        self._input += data
        *lines, rest = self._input.split(b"\n")
        self._input = bytearray(rest)
        for line in lines:
            words = line.split()
            if not words:
                continue
            if words == [b"session", b"2"]:
                self._start_session()
                continue
            if words[0] != b"release" or not all(w.isdigit() and len(w) <= SLOT_DIGITS for w in words[1:]):
                raise _recorded(
                    self._buffer,
                    InvalidArgument(
                        f"buffers/{self._buffer.name}/sample.shm: expected 'release <slot> ...', got"
                        f" {bytes(line[:40])!r}"
                    ),
                )
            for word in words[1:]:
                self._release(int(word))
        return len(data)

    def _start_session(self) -> None:
        sessions = self._shared.sessions
        name = f"buffers/{self._buffer.name}/sample.shm"
        if sessions is None or not sessions.available:
            raise NotSupported(f"{name}: this daemon has no shared-memory sampling sessions")
        if self._ticket is not None:
            raise Busy(f"{name}: this open has its session already (open the file again for another)")
        self._ticket = sessions.issue(self._buffer, self._count, self._owner[0])

    def _release(self, slot_id: int) -> None:
        held = self._slots.pop(slot_id, None)
        if held is None:
            raise _recorded(
                self._buffer, InvalidArgument(f"buffers/{self._buffer.name}/sample.shm: slot {slot_id} is not held")
            )
        region, slot = held
        region.release(slot)
        if region is not self._region and not region.held:
            region.close()

    async def release(self) -> None:
        await scheduling.checkpoint()
        if self._ticket is not None and self._shared.sessions is not None:
            self._shared.sessions.revoke(self._ticket)
        for region, _slot in list(self._slots.values()):
            region.close()
        if self._region is not None:
            self._region.close()
        self._slots.clear()


class PriorityHandle(WholeInputHandle):
    """Applies each complete chunk of (index, priority) pairs whole, or none of it.

    `priority.npy` (`npy_only`) takes .npy arrays only, and its closes send no FLUSH:
    each array is applied (or refused, with its errno) at the write that completes it,
    so a close has nothing left to do but report an array left incomplete, and that
    report is what the FLUSH round trip cost (docs/namespace.md). An incomplete array
    there is dropped at the release, recorded in `stats` errors and the log."""

    kind = "buffers"

    incomplete = "priority input ended mid-record; not applied"
    max_input_bytes = PRIORITY_INPUT_BYTES  # one chunk: a .npy, or lines up to a newline

    def __init__(self, buffer: ReplayBuffer, npy_only: bool = False) -> None:
        super().__init__(f"buffers/{buffer.name}", buffer.record_error)
        self._buffer = buffer
        self._npy_only = npy_only
        self.flushes = not npy_only

    async def _apply_if_complete(self, pending: bytearray) -> bool:
        if self._npy_only and not NPY_MAGIC.startswith(bytes(pending[: len(NPY_MAGIC)])):
            raise InvalidArgument(
                f"buffers/{self._buffer.name}/priority.npy: takes .npy arrays of (index, priority) pairs;"
                " write text to `priority`"
            )
        if len(pending) < PARSE_IN_THREAD_BYTES:
            parsed = parse_priorities(pending)
        else:  # a line at a time in Python (0.4 µs each): beside the event loop, not on it
            parsed = await trio.to_thread.run_sync(parse_priorities, bytes(pending))
        if parsed is None:
            return False
        await self._buffer.update_priorities(*parsed)
        return True

    async def release(self) -> None:
        """Where no FLUSH came (priority.npy), what is still pending was never applied:
        `_end_of_input` records its refusal in `stats` errors and the log (bounded per
        buffer), the only places it shows, as no close reports it."""
        await scheduling.checkpoint()  # (one: the next request waits behind a release)
        self._end_of_input()


class ItemHandle(VirtualHandle):
    """Reads an item; writes build its replacement, applied whole at close. A write past
    the item limit refuses the whole replacement: it and every later write of this open
    get EFBIG, and the close applies nothing."""

    kind = "buffers"

    def __init__(self, buffer: ReplayBuffer, index: int, truncate: bool) -> None:
        self._buffer = buffer
        self._index = index
        self._content: bytearray | bytes | memoryview | None = bytearray() if truncate else None
        self._dirty = truncate
        self._refused: FileTooLarge | None = None

    async def _load(self) -> bytearray | bytes | memoryview:
        if self._content is None:
            self._content = await self._buffer.read_item(self._index)
        return self._content

    async def read(self, offset: int, size: int) -> bytes | bytearray | memoryview:
        content = await self._load()
        return memoryview(content)[offset : offset + size]

    async def write(self, offset: int, data: bytes) -> int:
        if self._refused is None and offset + len(data) > MAX_ITEM_BYTES:
            label = f"buffers/{self._buffer.name}/items/{self._index}"
            self._refused = FileTooLarge(f"{label}: at most {MAX_ITEM_BYTES} bytes; nothing of this open applied")
            self._buffer.record_error(self._refused.message)
            self._content, self._dirty = None, False
        if self._refused is not None:
            raise self._refused
        content = await self._load()
        if not isinstance(content, bytearray):
            content = self._content = bytearray(content)
        if offset > len(content):
            content.extend(bytes(offset - len(content)))
        content[offset : offset + len(data)] = data
        self._dirty = True
        self.hold_input(len(content), self._drop)
        return len(data)

    def _drop(self) -> None:
        self._content, self._dirty = None, False

    def input_label(self) -> str:
        return f"buffers/{self._buffer.name}/items/{self._index}: a replacement"

    def truncate(self) -> None:
        self._content = bytearray()
        self._dirty = True
        self.hold_input(0, self._drop)

    async def release(self) -> None:
        await scheduling.checkpoint()
        self.hold_input(0, self._drop)

    async def flush(self) -> None:
        if not self._dirty:
            await scheduling.checkpoint()
            return
        self._dirty = False
        assert self._content is not None
        try:
            await self._buffer.write_item(self._index, bytes(self._content))
        except InvalidArgument as exc:
            raise _recorded(self._buffer, exc) from None
        await self._buffer.persist()


# --- nodes ------------------------------------------------------------------------------


class BufferFile(VirtualFile):
    """A control file of one buffer; `make` builds the handle for an open."""

    def __init__(
        self,
        ino: int,
        name: bytes,
        mode: int,
        buffer: ReplayBuffer,
        make: Callable[[int, int], VirtualHandle],
        writable: bool,
    ) -> None:
        super().__init__(ino, name, stat.S_IFREG | mode)
        self.buffer = buffer
        self._make = make
        self.writable = writable
        self.batch_of: int | None = None  # a sample file: records per batch (0: batch_size)
        self.columnar = False  # sample.npz: its batch is an .npz
        self.opens = 0  # sample files: opens the kernel has not released yet
        self.widest = 0  # sample files: the longest size stat has shown or a batch has had

    @property
    def size(self) -> int:
        """A sample file of a schema buffer is as long as its batch will be (the .npy of a
        known count of fixed-size records), so `read()` of the whole file is one call.
        Reads are direct, so a size the kernel still caches after a reconfigure only
        costs a read, never a short or wrong batch."""
        config = self.buffer.config
        if self.batch_of is None or config.dtype is None:
            return super().size
        count = self.batch_of or config.batch_size
        size = npz_batch_bytes(config.dtype, count) if self.columnar else npy_batch_bytes(config.dtype, count)
        self.widest = max(self.widest, size)  # every size stat shows passes here
        return size

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        await scheduling.checkpoint()
        if not self.writable and flags & os.O_ACCMODE != os.O_RDONLY:
            raise ReadOnly(f"buffers/{self.buffer.name}/{self.name.decode()} is read-only")
        handle = self._make(flags, pid)
        if isinstance(handle, SampleHandle):
            await handle.draw_at_open(self)
        return handle


ITEM_CACHE_S = 5.0
# `append`, `priority` and the samples keep their attributes (size 0, the buffer's mode):
# the kernel may cache them, which saves a GETATTR on every open of the RL loop's calls.
# A chmod or chown of the buffer drops them at once (FsOperations._stale_attrs).
CONTROL_CACHE_S = 1.0
MAX_KEPT_NODES = 256  # unlisted sample files one buffer directory keeps


class ItemNode(VirtualFile):
    # Items rarely change, and `ls -l` of a million of them needs cached attributes. An
    # item evicted behind the kernel's back may still stat for this long; open and read
    # are always checked (ENOENT).
    writable = True
    cache_s = ITEM_CACHE_S

    def __init__(self, buffer: ReplayBuffer, index: int) -> None:
        super().__init__(item_ino(buffer, index), str(index).encode(), stat.S_IFREG | 0o644)
        self.mtime_ns = buffer.loaded_ns  # one node per lookup: a stable time, or tar sees a change
        self.buffer = buffer
        self.index = index

    @property
    def size(self) -> int:
        return self.buffer.item_size(self.index)

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        await scheduling.checkpoint()
        self.buffer.item_size(self.index)  # NotFound if it left
        return ItemHandle(self.buffer, self.index, truncate=bool(flags & os.O_TRUNC))


class ItemsDir(VirtualDir):
    """`items/`: one file per live index."""

    child_cache_s = ITEM_CACHE_S

    def __init__(self, ino: int, buffer: ReplayBuffer) -> None:
        super().__init__(ino, b"items", stat.S_IFDIR | 0o755)
        self.buffer = buffer
        self.mtime_ns = buffer.loaded_ns  # readdir hands its items this directory's times

    def lookup(self, name: bytes) -> VirtualNode:
        if not name.isdigit():
            raise NotFound(f"buffers/{self.buffer.name}/items: {name.decode(errors='replace')!r} is not an index")
        index = int(name)
        self.buffer.item_size(index)  # NotFound if not live
        return ItemNode(self.buffer, index).govern(self.governor or self, Access.READ_WRITE)

    def entries(self) -> list[tuple[bytes, int]]:
        base = item_ino(self.buffer, 0)
        return [(b"%d" % i, base | i) for i in self.buffer.live_indices().tolist()]

    def listing(self) -> Sequence[tuple[bytes, int, int, int]]:
        live, sizes = self.buffer.live_items()
        mode = stat.S_IFREG | self.child_bits(Access.READ_WRITE, 0o644)
        return ItemListing(live, sizes, item_ino(self.buffer, 0), mode)

    async def unlink(self, name: bytes) -> None:
        await scheduling.checkpoint()
        node = self.lookup(name)
        assert isinstance(node, ItemNode)
        self.buffer.delete_item(node.index)


class ItemListing(PositionListing):
    """`items/` for readdir as of its open: the live indices and sizes as two arrays (16
    bytes an item), each entry made when readdir reaches it. A list of the entries, made
    at every opendir, was about 100 bytes an item: a million-item buffer's `items/`
    opened a hundred times held 10 GB."""

    def __init__(self, live: np.ndarray, sizes: np.ndarray, base: int, mode: int) -> None:
        super().__init__(len(live))
        self._live, self._sizes, self._base, self._mode = live, sizes, base, mode
        self.held_bytes = live.nbytes + sizes.nbytes

    def _entry(self, position: int) -> Entry:
        index = int(self._live[position])
        return (b"%d" % index, self._base | index, self._mode, int(self._sizes[position]))


class BufferDir(NamedDir):
    """`buffers/<name>/`: the control files and `items/`."""

    aliases = {b"append.npy": b"append"}  # (priority.npy is a file of its own: _priority_npy)

    def __init__(self, tree: VirtualTree, buffer: ReplayBuffer, shared: SharedMemory | None = None) -> None:
        super().__init__(tree.new_ino(), buffer.name.encode(), stat.S_IFDIR | 0o755)
        self.own(tree.owners, b"buffers", tree.default_owner())
        self._tree = tree
        self.buffer = buffer
        self._held = held = tree.batches  # the batches its sample files keep, counted mount-wide
        b = buffer
        files = [
            (b"config", 0o664, lambda flags, pid: ConfigHandle(b), True, Access.READ_WRITE),
            (
                b"append", 0o664, lambda flags, pid: AppendHandle(b, bool(flags & os.O_NONBLOCK), pid), True,
                Access.WRITE,
            ),
            (
                b"sample", 0o444,
                lambda flags, pid: SampleHandle(b, None, bool(flags & os.O_NONBLOCK), pid, held), False,
                Access.CHANGES_ON_READ,
            ),
            (b"priority", 0o664, lambda flags, pid: PriorityHandle(b), True, Access.WRITE),
        ]  # fmt: skip
        for name, mode, make, writable, access in files:
            node = BufferFile(tree.new_ino(), name, mode, buffer, make, writable).govern(self, access)
            if name == b"config":
                node.snapshot = lambda: config_text(b)  # its size: copy tools read it whole
            node.acts_on_read = name == b"sample"
            if name == b"sample":
                node.batch_of = 0
            if name != b"config":
                node.cache_s = CONTROL_CACHE_S
            self._add(node)
        self.page_cache_batches = 0  # batches of its sample files served from the page cache
        self.ahead: Ahead | None = None  # the next batch of the sample file last released
        self.ahead_policy = AheadPolicy()
        # (the batch drawn for the next open, and its streams', counted mount-wide apart)
        self._ahead = AheadContext(tree.after_reply, tree.aheads, self.ahead_policy)
        self.forgotten = False  # the buffer left (forget_nodes)
        self._wanted: BufferFile | None = None  # the file whose next batch was asked for last
        stats = ControlFile(tree.new_ino(), b"stats", self._stats_text)
        self._add(stats.govern(self, Access.READ))
        self._add(ItemsDir(tree.new_ino(), buffer).govern(self, Access.DIRECTORY))
        self._unlisted: dict[bytes, BufferFile] = {}  # sample.N, sample.npz, sample.stream, sample.shm ...
        self._shared = shared

    def _stats_text(self) -> bytes:
        counts = {
            **self.buffer.stats(),
            "page_cache_batches": self.page_cache_batches,
            "batches_drawn_ahead": self.ahead_policy.drawn,
            "batches_drawn_ahead_taken": self.ahead_policy.taken,
        }
        return (json.dumps(counts, indent=2) + "\n").encode()

    def want_ahead(self, node: BufferFile, count: int | None, columnar: bool) -> None:
        """An open of sample file `node` took its batch from the page cache: draw the
        next batch after the reply, while the client reads this one, so that the next
        open finds it drawn and already in the page cache (`_draw_ahead`, `released`,
        `take_ahead`; design.md, "The next batch drawn while the client reads"). After
        AHEAD_MISSES batches in a row were dropped unused, only every AHEAD_PROBE-th open
        asks."""
        if not self.ahead_policy.wanted(node.size):
            return
        self._wanted = node
        self._tree.after_reply.add(self, functools.partial(self._draw_ahead, node, count, columnar))

    async def _draw_ahead(self, node: BufferFile, count: int | None, columnar: bool) -> None:
        """Draw `node`'s next batch, counting nothing as sampled: only what an open would
        draw itself (a batch that can be drawn without waiting, fits the page cache and
        the mount's batch allowance; no other open of the node). It goes into the page
        cache once no open of the node is left (`released`)."""
        self.drop_ahead()
        buffer, size = self.buffer, node.size
        if self.forgotten or node.opens > 1 or not 0 < size <= CACHED_BATCH_MAX_BYTES or not buffer.can_sample(count):
            await scheduling.checkpoint()
            return
        ahead = await self._ahead.draw(buffer, count, columnar, size, node)
        if ahead is None:
            return
        if self.forgotten or node.opens > 1 or len(ahead.data) != size:
            self._ahead.drop(ahead, missed=False)
            return
        self.drop_ahead()  # (one drawn meanwhile: the draw yields to requests)
        self.ahead = ahead
        self.ahead_policy.drawn += 1
        if not node.opens:  # (released while it was drawn)
            self.released(node)

    async def settle_ahead(self, node: BufferFile) -> None:
        """An open of sample file `node`: the next batch asked for after an earlier reply
        but not drawn yet (the client came back first) is drawn now when it is this
        file's, so that the open takes it rather than draw another (and dropped when it
        is another file's). One being drawn (the draw yields to requests) is waited for.
        A failure here is the open's own draw's to report."""
        # (another file's piece is dropped, but one under way finishes first: a store into
        # this node's pages from a thread must not run beside this open's own)
        await self._tree.after_reply.settle(self, run_waiting=self._wanted is node)

    def released(self, node: BufferFile) -> None:
        """No open of sample file `node` is left: the batch drawn ahead for it goes into
        its page cache now (from the event loop: with no open, no read of the node can
        wait for this daemon while its pages are locked)."""
        ahead = self.ahead
        if ahead is None or ahead.node is not node or ahead.stored:
            return
        if ahead.changes != self.buffer.changes:
            self.drop_ahead()
            return
        if len(ahead.data) > LOOP_STORE_MAX_BYTES:  # from a thread, after this reply (the next open settles it)
            self._tree.after_reply.add(self, functools.partial(self._store_ahead, node, ahead))
            return
        ahead.stored = store_batch(node, ahead.data)

    async def _store_ahead(self, node: BufferFile, ahead: Ahead) -> None:
        """A big batch drawn ahead into `node`'s page cache from a worker thread, queued by
        `released`: an open of the node settles it before it replies, so no client of
        the node reads while its pages are filled."""
        if self.ahead is not ahead or node.opens > 1 or ahead.changes != self.buffer.changes:
            await scheduling.checkpoint()
            return
        ahead.stored = await store_batch_off_loop(node, ahead.data)

    def take_ahead(self, node: BufferFile, count: int | None, columnar: bool, label: Callable[[], str]) -> Ahead | None:
        """The batch drawn ahead for this open of `node` (the only open of it), now held
        for the open in the mount's batch allowance and counted as sampled; None where
        there is none, the buffer changed since it was drawn, or the open batches hold
        all they may (then it is dropped, and the open draws its own as before)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        fits = (ahead.node, ahead.count, ahead.columnar) == (node, count, columnar) and node.opens == 1
        return ahead if self._ahead.hand_over(ahead, self.buffer, self._held, label, fits) else None

    def drop_ahead(self) -> None:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self._ahead.drop(ahead)

    def _add(self, node: VirtualNode) -> None:
        self.children[node.name] = node
        self._tree.register(node)

    def lookup(self, name: bytes) -> VirtualNode:
        if name.startswith(b"sample.") and name[7:].isdigit():
            return self._sized_sample(int(name[7:]))
        if name == b"sample.shm" or (name.startswith(b"sample.") and name.endswith(b".shm") and name[7:-4].isdigit()):
            return self._shm(int(name[7:-4]) if name != b"sample.shm" else None)
        if name.startswith(b"sample.") and name.endswith(b".stream"):
            count = name[7:-7]
            if count == b"" or count.isdigit():
                return self._stream(int(count) if count else None)
        if name == b"priority.npy":
            return self._priority_npy()
        if name == b"sample.npz":
            return self._columnar_sample()
        return super().lookup(name)

    def _sample_node(
        self,
        name: bytes,
        make: Callable[[int, int], VirtualHandle],
        access: Access = Access.CHANGES_ON_READ,
        batch_of: int | None = None,
    ) -> BufferFile:
        """A sample-like control file that readdir does not list (`sample.N`,
        `sample.npz`, `sample.stream`, `sample.shm` ...): made at its first lookup, kept
        (up to MAX_KEPT_NODES of them; others are made per lookup) so its inode and
        cached attributes stay put, and forgotten with the buffer."""
        node = self._unlisted.get(name)
        if node is None:
            writable = access is Access.CHANGES_ON_READ_WRITE
            node = BufferFile(self._tree.new_ino(), name, 0o666 if writable else 0o444, self.buffer, make, writable)
            node.govern(self, access)
            node.acts_on_read = True
            node.cache_s = CONTROL_CACHE_S
            node.batch_of = batch_of
            if len(self._unlisted) < MAX_KEPT_NODES:
                self._unlisted[name] = node
            self._tree.register(node)
        return node

    def _priority_npy(self) -> BufferFile:
        """`priority.npy` (not listed): `priority` for .npy arrays, whose closes send no
        FLUSH (PriorityHandle). np.save adds .npy to a path that lacks it, so
        `np.save(f"{b}/priority", pairs)` writes here."""
        node = self._unlisted.get(b"priority.npy")
        if node is None:
            b = self.buffer
            node = BufferFile(
                self._tree.new_ino(), b"priority.npy", 0o664, b, lambda flags, pid: PriorityHandle(b, npy_only=True),
                True,
            )  # fmt: skip
            node.govern(self, Access.WRITE)
            node.cache_s = CONTROL_CACHE_S
            self._unlisted[b"priority.npy"] = node
            self._tree.register(node)
        return node

    def _columnar_sample(self) -> BufferFile:
        """`sample.npz`: the batch as one contiguous array per field (not listed)."""
        if self.buffer.config.dtype is None:
            raise NotFound(f"buffers/{self.buffer.name}/sample.npz: only a buffer with a schema has fields")
        b = self.buffer
        node = self._sample_node(
            b"sample.npz",
            lambda flags, pid: SampleHandle(b, None, bool(flags & os.O_NONBLOCK), pid, self._held, columnar=True),
            batch_of=0,
        )
        node.columnar = True
        return node

    def _shm(self, count: int | None) -> BufferFile:
        """`sample.shm` and `sample.N.shm`: batches through shared memory (not listed);
        ENOENT where this daemon has no shared-memory directory (clients fall back)."""
        shared = self._shared
        if shared is None or not shared.available:
            raise NotFound(f"buffers/{self.buffer.name}/sample.shm: no shared memory on this machine")
        if count is not None and not 0 < count <= MAX_SAMPLE_COUNT:
            raise NotFound(f"buffers/{self.buffer.name}/sample.{count}.shm: batch size must be 1..{MAX_SAMPLE_COUNT}")
        b = self.buffer
        return self._sample_node(
            b"sample.shm" if count is None else b"sample.%d.shm" % count,
            lambda flags, pid: ShmSampleHandle(b, count, bool(flags & os.O_NONBLOCK), pid, shared),
            Access.CHANGES_ON_READ_WRITE,
        )

    def _stream(self, count: int | None) -> BufferFile:
        """`sample.stream` and `sample.N.stream`: endless batches through one open (not
        listed by readdir)."""
        if count is not None and not 0 < count <= MAX_SAMPLE_COUNT:
            raise NotFound(
                f"buffers/{self.buffer.name}/sample.{count}.stream: batch size must be 1..{MAX_SAMPLE_COUNT}"
            )
        b = self.buffer
        return self._sample_node(
            b"sample.stream" if count is None else b"sample.%d.stream" % count,
            lambda flags, pid: StreamHandle(b, count, bool(flags & os.O_NONBLOCK), pid, self._held, self._ahead),
            batch_of=count or 0,
        )

    def _sized_sample(self, count: int) -> BufferFile:
        """`sample.N`: like `sample` with a batch of N (not listed by readdir)."""
        if not 0 < count <= MAX_SAMPLE_COUNT:
            raise NotFound(f"buffers/{self.buffer.name}/sample.{count}: batch size must be 1..{MAX_SAMPLE_COUNT}")
        b = self.buffer
        return self._sample_node(
            b"sample.%d" % count,
            lambda flags, pid: SampleHandle(b, count, bool(flags & os.O_NONBLOCK), pid, self._held),
            batch_of=count,
        )

    async def unlink(self, name: bytes) -> None:
        """Control files come back: unlinking one is a no-op, so `rm -r` works."""
        await scheduling.checkpoint()
        if name not in CONTROL_NAMES:
            raise NotFound(f"buffers/{self.buffer.name}: no file {name.decode(errors='replace')!r}")

    async def rmdir(self, name: bytes) -> None:
        """`items/` stays (a no-op, for `rm -r`); its items were unlinked one by one."""
        await scheduling.checkpoint()
        if name != b"items":
            raise NotFound(f"buffers/{self.buffer.name}: no directory {name.decode(errors='replace')!r}")

    def forget_nodes(self) -> None:
        self.forgotten = True
        self._tree.after_reply.discard(self)
        self.drop_ahead()
        for node in [*self.children.values(), *self._unlisted.values(), self]:
            self._tree.unregister(node.ino)


class BuffersDir(NamedKindDirectory):
    """`buffers/`: mkdir creates a buffer, rmdir (or `rm -r`) deletes it with its data."""

    def __init__(self, tree: VirtualTree, store: BufferStore, shared: SharedMemory | None = None) -> None:
        """`shared`: where `sample.shm` makes its regions (None: no shared-memory path)."""
        super().__init__(tree, b"buffers")
        self._store = store
        self._shared = shared
        tree.add_resolver(ITEM_BASE, ITEM_BASE + ITEM_SPAN, self._resolve_item)

    def _names(self) -> list[str]:
        return self._store.names()

    def _object(self, name: str) -> ReplayBuffer:
        return self._store.get(name)

    def _make_dir(self, obj: Any) -> BufferDir:
        return BufferDir(self._tree, obj, self._shared)

    async def mkdir(self, name: bytes, mode: int) -> VirtualNode:
        """A new buffer, its row committed before the mkdir returns: appends then persist
        log-only, and a start-up adopts logged items only into buffers whose row it
        finds (before, a buffer made and appended to just before a kill -9 came back
        missing, with its acknowledged items)."""
        buffer = self._store.create(name.decode(errors="surrogateescape"))
        await buffer.persist()
        return self._dir(name.decode(errors="surrogateescape"))

    async def rmdir(self, name: bytes) -> None:
        key = name.decode(errors="surrogateescape")
        self._store.delete(key)
        self._forget(key)
        self._tree.owners.delete(self.name, name)
        await scheduling.checkpoint()

    def _resolve_item(self, ino: int) -> VirtualNode:
        number = (ino - ITEM_BASE) >> INDEX_BITS
        index = ino & ((1 << INDEX_BITS) - 1)
        buffer = self._store.by_owner(BUFFER_OWNER_BASE + number)
        buffer.item_size(index)  # NotFound if it left
        return ItemNode(buffer, index).govern(self._dir(buffer.name), Access.READ_WRITE)
