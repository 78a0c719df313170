"""Sampling sessions over a Unix socket: batches as places in a shared-memory arena;
and the hand-over of weights' shared copies on the same socket.

Owns the socket the daemon listens on beside its shared-memory regions, the tickets
that let a connection in, and each session's held batches. A client that opened a
buffer's `sample.shm` through the mount (so the kernel and the daemon checked it may)
writes `session 2` there and reads back the socket's path and a one-time ticket; it
connects, sends the ticket, and from then on each request draws a batch whose items
it reads straight out of the buffer's arena (stores/replay/mirror.py): the daemon sends
where they are, never their bytes. docs/formats.md, "Shared-memory sampling, version
2", has the wire format.

Who may use a ticket is checked twice: the connecting process's uid (SO_PEERCRED,
from the kernel, not from anything the client says) must be the uid that opened the
control file. A session ends when its socket closes (the client exited or was killed)
or when that open is released, and the batches it held go back to the arena then.

A weights reader (`client.map_version`) asks for a ticket with a getxattr of
`user.distore.shm` on the file's path (the kernel checks it may read it); its
connection gets one reply, the version's sealed memfd (stores/weights.py,
`shared_copy`), and ends. Such a ticket is good for COPY_TICKET_S; docs/formats.md,
"Weights through shared memory, version 1".
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from distorefs import scheduling
from distorefs.errors import DistorefsError, InvalidArgument, NotSupported, OutOfMemory, TryAgain
from distorefs.stores.replay.buffer import MirroredBatch, ReplayBuffer
from distorefs.stores.replay.mirror import ArenaBudget, Mirror

log = logging.getLogger(__name__)

PREFIX = "distorefs-"
REQUEST = struct.Struct("<IIQ")  # op, count (0: the buffer's batch_size), release every batch before this id
RESPONSE = struct.Struct("<iIQQQQ")  # errno (0: a batch), items, batch id, stride, arena slots, arena number
OP_DRAW = 1
MAX_BATCH = 4096  # items in one batch through a session (a reply is one datagram of 28 bytes per item)
MAX_HELD = 16  # batches one session may hold at once
SESSION_PASS_S = 0.0003  # a session serving queued requests lets the event loop run others at least this often
MAX_TICKETS = 4096
TICKET_BYTES = 32
HELLO_TIMEOUT_S = 5.0
# Connections not past their ticket yet, at once: the socket is open to every local user
# (the ticket decides who may draw), so one user's connections that never send a ticket
# must neither pile up the daemon's descriptors nor lock other users out.
MAX_HELLOS_PER_UID = 32
MAX_HELLOS = 1024
ACCEPT_RETRY_S = 0.5  # after accept() failed (out of descriptors or memory): the socket stays
COPY_RESPONSE = struct.Struct("<iQ")  # 0 and the memfd's size, the memfd with it (a refusal: RESPONSE)
COPY_TICKET_S = 30.0  # a weights reader's ticket is good this long
MAX_COPY_TICKETS_PER_UID = 64  # unused ones a user may hold; past it their oldest is void
_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass
class Ticket:
    buffer: ReplayBuffer
    count: int | None
    uid: int
    cancel: trio.CancelScope = field(default_factory=trio.CancelScope)
    used: bool = False


@dataclass
class CopyTicket:
    """A weights reader's ticket: one connection gets `open_copy()`'s descriptor."""

    open_copy: Callable[[], Awaitable[tuple[int, int]]]
    uid: int
    expires: float
    used: bool = False


@dataclass
class _Held:
    mirror: Mirror
    arena_slots: np.ndarray
    repeated: bool | None


class SampleSessions:
    """The daemon's sampling socket and its sessions.

    Examples:
        >>> sessions = SampleSessions("/dev/shm", ArenaBudget(blocks.reserve, blocks.unreserve, limit))
        >>> sessions.listen()                            # before the mount is ready
        >>> nursery.start_soon(sessions.serve)
        >>> ticket = sessions.issue(buffer, None, uid)   # from a sample.shm open, after `session 2`
        >>> sessions.revoke(ticket)                      # that open was released
    """

    def __init__(self, directory: str, budget: ArenaBudget) -> None:
        self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}.sock")
        self.budget = budget
        self._tickets: dict[bytes, Ticket] = {}
        self._copy_tickets: dict[bytes, CopyTicket] = {}  # in the order given out
        self._listening = False
        self._listener: trio.socket.SocketType | None = None
        self._nursery: trio.Nursery | None = None
        self.sessions = 0
        self.hellos: dict[int, int] = {}  # uid -> its connections waiting for their ticket
        self.refused_connections = 0  # closed at once (MAX_HELLOS_PER_UID or MAX_HELLOS were waiting)
        # called with time.perf_counter() at a draw's request once it is answered: the
        # daemon's busy poller (fs/polling.py) then polls for the next as after a FUSE request
        self.served: Callable[[float], None] | None = None

    @property
    def available(self) -> bool:
        return self._listening

    def issue(self, buffer: ReplayBuffer, count: int | None, uid: int) -> bytes:
        """A ticket for one session of `uid` on `buffer`; EAGAIN when too many are out."""
        if not self._listening:
            raise NotSupported(f"buffers/{buffer.name}/sample.shm: this daemon has no sampling socket")
        if len(self._tickets) >= MAX_TICKETS:
            raise TryAgain(f"{MAX_TICKETS} shared-memory sampling sessions are open; close some first")
        token = secrets.token_hex(TICKET_BYTES // 2).encode()
        self._tickets[token] = Ticket(buffer, count, uid)
        return token

    def issue_copy(self, open_copy: Callable[[], Awaitable[tuple[int, int]]], uid: int, label: str) -> bytes:
        """A ticket for one hand-over of `open_copy()`'s descriptor to a process of `uid`,
        good for COPY_TICKET_S. EAGAIN when too many are out."""
        if not self._listening:
            raise NotSupported(f"{label}: this daemon has no shared-memory socket")
        now = time.monotonic()
        for token in [t for t, c in self._copy_tickets.items() if c.expires <= now]:
            del self._copy_tickets[token]
        mine = [t for t, c in self._copy_tickets.items() if c.uid == uid]
        if len(mine) >= MAX_COPY_TICKETS_PER_UID:  # a user who asks and never connects
            del self._copy_tickets[mine[0]]  # loses their own oldest ticket, nobody else's
        if len(self._copy_tickets) >= MAX_TICKETS:
            raise TryAgain(f"{MAX_TICKETS} shared-memory hand-overs are waiting; try again in {COPY_TICKET_S:.0f} s")
        token = secrets.token_hex(TICKET_BYTES // 2).encode()
        self._copy_tickets[token] = CopyTicket(open_copy, uid, now + COPY_TICKET_S)
        return token

    def revoke(self, token: bytes) -> None:
        """The open that asked for the ticket is gone: so is its session."""
        ticket = self._tickets.pop(token, None)
        if ticket is not None:
            ticket.cancel.cancel()

    def listen(self) -> bool:
        """Bind and listen now, before the mount is announced ready, so that the first
        `session 2` finds the socket; False (sessions off, clients stay on version 1)
        when the directory takes no socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o666)  # who may draw is the ticket's and SO_PEERCRED's business
            sock.listen(128)
        except OSError as exc:
            log.warning("shared-memory sampling sessions are off: cannot listen on %s: %s", self.path, exc)
            sock.close()
            return False
        self._listener = trio.socket.from_stdlib_socket(sock)
        self._listening = True
        return True

    def close(self) -> None:
        """The daemon stops: a socket that `serve` never took is closed here (one that
        it took closes when its task is cancelled)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            self._listening = False
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def serve(self) -> None:
        """Accept until cancelled (after `listen`); a session per connection."""
        listener, self._listener = self._listener, None  # serve's own from now on
        if listener is None:
            await scheduling.checkpoint()
            return
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                while True:
                    try:
                        conn, _ = await listener.accept()
                    except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: the sessions go on
                        log.warning("shm sampling: accept failed (%s); trying again", exc)
                        await trio.sleep(ACCEPT_RETRY_S)
                        continue
                    try:
                        uid = _peer_uid(conn)
                    except OSError:
                        conn.close()
                        continue
                    if self.hellos.get(uid, 0) >= MAX_HELLOS_PER_UID or sum(self.hellos.values()) >= MAX_HELLOS:
                        conn.close()
                        self.refused_connections += 1
                        if self.refused_connections % 1000 == 1:
                            log.warning(
                                "shm sampling: uid %d has %d connections without a ticket yet; closed a new one"
                                " (%d so far)", uid, self.hellos.get(uid, 0), self.refused_connections,
                            )  # fmt: skip
                        continue
                    self.hellos[uid] = self.hellos.get(uid, 0) + 1  # (given back once its ticket is checked)
                    nursery.start_soon(self._session, conn, uid, name="shm sampling session")
        finally:
            self._listening = False
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _hello_done(self, uid: int) -> None:
        left = self.hellos[uid] - 1
        if left:
            self.hellos[uid] = left
        else:
            del self.hellos[uid]

    async def _session(self, accepted: trio.socket.SocketType, uid: int) -> None:
        held: dict[int, _Held] = {}
        ticket: Ticket | None = None
        waiting = True  # counted in `hellos` until its ticket is checked
        try:
            with _Channel(accepted) as conn:
                try:
                    found = await self._hello(conn, uid)
                finally:
                    waiting = False
                    self._hello_done(uid)
                if isinstance(found, CopyTicket):
                    await self._hand_over(conn, found)
                    return
                ticket = found
                if ticket is None:
                    return
                self.sessions += 1
                assert self._nursery is not None
                with ticket.cancel:
                    await _Session(conn, ticket, self.budget, held, self._nursery, self.served).run()
        except OSError as exc:
            log.debug("shm sampling session ended: %s", exc)
        except Exception:  # a session's failure is its own: it never ends the daemon
            log.exception("shm sampling session failed")
        finally:
            if waiting:  # (the socket could not even be wrapped)
                self._hello_done(uid)
            for h in held.values():
                h.mirror.release(h.arena_slots, h.repeated)
            held.clear()
            if ticket is not None and ticket.used:
                self.sessions -= 1

    async def _hello(self, conn: _Channel, uid: int) -> Ticket | CopyTicket | None:
        """The first datagram is the ticket; its owner's uid must be the peer's (`uid`,
        SO_PEERCRED at the accept)."""
        with trio.move_on_after(HELLO_TIMEOUT_S):
            token = await conn.recv(TICKET_BYTES + 1)
            ticket: Ticket | CopyTicket | None = self._tickets.get(token)
            if ticket is None:
                ticket = self._copy_tickets.pop(token, None)
                if ticket is not None and ticket.expires <= time.monotonic():
                    ticket = None
            if ticket is None or ticket.used:
                await _send_error(conn, errno.EACCES, "not a ticket this daemon gave out (or one already used)")
                return None
            if uid != ticket.uid:
                log.warning("shm sampling: uid %d presented a ticket of uid %d; refused", uid, ticket.uid)
                await _send_error(conn, errno.EACCES, "the ticket belongs to another user")
                return None
            ticket.used = True
            return ticket
        return None

    async def _hand_over(self, conn: _Channel, ticket: CopyTicket) -> None:
        """One reply: the shared copy's descriptor and size, or why there is none."""
        try:
            fd, size = await ticket.open_copy()
        except DistorefsError as exc:  # every refusal has the sessions' error layout
            await _send_error(conn, exc.errno, str(exc))
            return
        try:
            await conn.send([COPY_RESPONSE.pack(0, size)], [fd])
        finally:
            os.close(fd)


async def _fill(buffer: ReplayBuffer, mirror: Mirror) -> None:
    try:
        placed = await buffer.fill_mirror(mirror)
        log.info("buffers/%s: %d items copied into the shared-memory arena", buffer.name, placed)
    except Exception:  # draws bring items in one by one instead
        log.exception("buffers/%s: filling the shared-memory arena failed", buffer.name)


def _peer_uid(sock: trio.socket.SocketType) -> int:
    """The connecting process's uid, from the kernel (SO_PEERCRED), not from anything it says."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(uid)


async def _send_error(conn: _Channel, code: int, message: str) -> None:
    await conn.send([RESPONSE.pack(code, 0, 0, 0, 0, 0) + message.encode()[:1024]])


class _Channel:
    """A session's socket, called without trio's two scheduling passes per call: a call
    that can go at once goes at once, and only one that would block waits (a DQN batch
    is a few tens of µs of work; four passes through trio's scheduler were as much)."""

    def __init__(self, accepted: trio.socket.SocketType) -> None:
        self._sock = socket.socket(fileno=accepted.detach())
        self._sock.setblocking(False)

    def try_recv(self, size: int) -> bytes | None:
        """The next datagram if one is queued (b"" once the peer closed), else None."""
        try:
            return self._sock.recv(size)
        except BlockingIOError:
            return None

    async def recv(self, size: int) -> bytes:
        while True:
            message = self.try_recv(size)
            if message is not None:
                return message
            await trio.lowlevel.wait_readable(self._sock)

    async def send(self, parts: list[bytes], fds: list[int] | None = None) -> None:
        ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            try:
                self._sock.sendmsg(parts, ancdata)
                return
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._sock)

    def __enter__(self) -> _Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        trio.lowlevel.notify_closing(self._sock)
        self._sock.close()


class _Session:
    """One connection: requests in order, one reply each."""

    def __init__(
        self,
        conn: _Channel,
        ticket: Ticket,
        budget: ArenaBudget,
        held: dict[int, _Held],
        nursery: trio.Nursery,
        served: Callable[[float], None] | None = None,
    ) -> None:
        self._conn = conn
        self._served = served
        self._nursery = nursery
        self._ticket = ticket
        self._budget = budget
        self._held = held
        self._next_id = 1
        self._sent_mirror: Mirror | None = None
        self._mirror_number = 0

    async def run(self) -> None:
        buffer = self._ticket.buffer
        first = True
        passed = time.perf_counter()  # when this session last let the event loop run others
        while True:
            # After a reply the event loop gets a pass, unless the next request is queued
            # already (a sampler's prefetch) and the last pass was less than
            # SESSION_PASS_S ago: a pass cost 22-24 µs of a DQN batch's 60-70
            # (docs/design.md, "Sampling sessions").
            message = None if first else self._conn.try_recv(REQUEST.size + 1)
            if not first and (message is None or time.perf_counter() - passed >= SESSION_PASS_S):
                await trio.lowlevel.checkpoint()
                passed = time.perf_counter()
            first = False
            if message is None:
                message = await self._conn.recv(REQUEST.size + 1)
            started = time.perf_counter()
            if not message:
                return  # the client closed (or died)
            if len(message) != REQUEST.size:
                await _send_error(self._conn, errno.EPROTO, f"a request is {REQUEST.size} bytes")
                return
            op, count, release_before = REQUEST.unpack(message)
            if op != OP_DRAW or release_before > self._next_id:
                await _send_error(
                    self._conn, errno.EINVAL, f"expected a draw (op 1) releasing batches up to {self._next_id}"
                )
                return
            for batch_id in [b for b in self._held if b < release_before]:
                held = self._held.pop(batch_id)
                held.mirror.release(held.arena_slots, held.repeated)
            wanted = count or self._ticket.count or buffer.config.batch_size
            if wanted > MAX_BATCH:
                await _send_error(self._conn, errno.EMSGSIZE, f"a session's batch is at most {MAX_BATCH} items")
                continue
            if buffer.deleted:
                await _send_error(self._conn, errno.ENOENT, f"buffers/{buffer.name} was deleted")
                return
            try:
                if len(self._held) >= MAX_HELD:
                    raise InvalidArgument(f"a session may hold {MAX_HELD} batches; release some first")
                with scheduling.deferring(started):  # its schedule points wait for the reply
                    await self._draw(buffer, count or self._ticket.count)
            except DistorefsError as exc:
                buffer.record_error(str(exc))
                await _send_error(self._conn, exc.errno, str(exc))
            if self._served is not None:
                self._served(started)

    async def _draw(self, buffer: ReplayBuffer, count: int | None) -> None:
        """Draw into the buffer's arena; once more into a new one when a drawn blob was
        bigger than the arena's slots (nothing was counted for the first try)."""
        for attempt in range(2):
            mirror = buffer.open_mirror(self._budget.reserve, self._budget.unreserve)
            if not mirror.filling:
                mirror.filling = True
                self._nursery.start_soon(_fill, buffer, mirror, name="shm arena fill")
            try:
                await buffer.draw_mirrored(mirror, count, False, self._place)
                return
            except OutOfMemory:
                if attempt or not mirror.outgrown:
                    raise

    async def _place(self, batch: MirroredBatch) -> None:
        """Lease the items, then send where they are (and the arena, the first time)."""
        mirror = batch.mirror
        batch_id = self._next_id
        self._held[batch_id] = _Held(mirror, mirror.lease(batch.arena_slots, batch.repeated), batch.repeated)
        self._next_id += 1
        if mirror is not self._sent_mirror:
            self._mirror_number += 1
        head = RESPONSE.pack(0, len(batch.indices), batch_id, mirror.stride, mirror.slots, self._mirror_number)
        body = [
            head,
            batch.indices.astype("<i8", copy=False).tobytes(),
            batch.weights.astype("<f4", copy=False).tobytes(),
            batch.arena_slots.astype("<i8", copy=False).tobytes(),
            batch.lengths.astype("<i8", copy=False).tobytes(),
        ]
        if mirror is self._sent_mirror:
            await self._conn.send(body)
            return
        fd = mirror.read_only_fd()
        try:
            await self._conn.send(body, [fd])
        finally:
            os.close(fd)
        self._sent_mirror = mirror
