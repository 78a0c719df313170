"""Peers: the binary protocol between daemons, its server, and PeerTransport (the client
with connection pools, timeouts and the one retry policy of distorefs).

Owns bytes on the wire and the failure rules; what an operation means is the handler's
business (the daemon's cluster glue registers them). It never imports a store.

Frame (docs/formats.md), little-endian:
    magic  4s  b"DSP2"
    rid    u32 request id, echoed in the reply
    meta   u32 length of the msgpack map that follows
    body   u64 length of the payload that follows the map
A request's map has `op`; a reply's has `ok` and, when not ok, `errno` and `error`.
Payloads go to the socket as memoryviews of the caller's buffers and are received with
recv_into a buffer of their exact size: no copy beyond the kernel's.

A bytes value of the map longer than INLINE_BYTES (an array of indices, a dataset run's
index) travels in the body instead, ahead of the payload, and is a memoryview of the body
on arrival: the map stays under MAX_META_BYTES whatever the count of items, and the
bytes are not copied through msgpack.

Authentication (formats.md, "The handshake"): before its first frame, each connection
proves on both sides that they hold the cluster's secret, by HMAC-SHA256 over two fresh
nonces; a connection that does not within AUTH_TIMEOUT_S is closed, and no frame of it is
read. The secret never travels. The frames after it are neither signed nor encrypted.

Failure rules: one call has one deadline (`timeout_s`, default 5 s). Connection errors
are retried (`retries`, with a short backoff) on a fresh connection within it; when it
passes, or the node is not a live member, the call raises PeerUnavailable (EIO). An
error the peer answers with comes back as RemoteError with the peer's errno.

Transport choice: `choose_transport` looks for pyverbs and an RDMA device. The
one-sided RDMA read path is not built yet, so today every peer moves data over TCP; the
choice and its reason are logged and shown in `.distore/peers` (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import math
import mmap
import secrets
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgpack
import numpy as np
import trio

from distorefs import logs, memory
from distorefs.errors import DistorefsError, InvalidArgument, PeerUnavailable, RemoteError

log = logging.getLogger(__name__)

MAGIC = b"DSP2"  # DSP1 had no moved fields: its nodes are refused, not misread
HEADER = struct.Struct("<4sIIQ")
MAX_META_BYTES = 1 << 20
MAX_BODY_BYTES = 1 << 36
MAX_REPLY_BYTES = 1 << 30  # a reply's body a call takes unless it says otherwise (parts keep replies far under)
INLINE_BYTES = 4096  # a bytes value of the map past this travels in the body
MOVED_EXT = 1  # msgpack ext type of a moved value: its length, u64
MOVED = struct.Struct("<Q")
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRIES = 2
BACKOFF_S = 0.05
POOL_SIZE = 4

Payload = bytes | bytearray | memoryview
Handler = Callable[[dict[str, Any], memoryview], Awaitable[tuple[dict[str, Any], Sequence[Payload]]]]


class ProtocolError(Exception):
    """The other side sent something that is not a frame of ours."""


class AuthenticationFailed(ProtocolError):
    """The other side did not prove that it holds the cluster's secret (or refused ours)."""


class ReplyTooBig(ProtocolError):
    """A reply announced a body past what its call takes (`max_reply_bytes`)."""


# --- the handshake ----------------------------------------------------------------------

AUTH_MAGIC = b"DSA1"
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16
AUTH_TIMEOUT_S = 5.0  # a new connection proves the secret within this, or is closed
ACCEPTED, REFUSED = 0, 1


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 with the cluster's secret over the role ("client" or "server") and two
    nonces, the other side's first: each side proves the secret over the nonce the other
    just chose, so a proof seen once is worth nothing again."""
    return hmac.digest(secret, b"distorefs peer " + role + b"\0" + first + second, "sha256")


def _check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret has {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}")


async def authenticate_to(stream: trio.SocketStream, secret: bytes, stall_s: float = AUTH_TIMEOUT_S) -> None:
    """The client's side of the handshake on a new connection: the server's nonce, then
    this side's nonce and proof, then the server's verdict and its own proof.
    AuthenticationFailed when the server refused the proof (the two hold different
    secrets) or does not prove the secret itself; ProtocolError when it is not a
    distorefs peer of this version."""
    _check_secret(secret)
    hello = memoryview(bytearray(len(AUTH_MAGIC) + NONCE_BYTES))
    await _recv_exactly(stream, hello, stall_s)
    if hello[: len(AUTH_MAGIC)] != AUTH_MAGIC:
        raise ProtocolError("the other side sent no handshake: not a distorefs peer of this version")
    theirs, mine = bytes(hello[len(AUTH_MAGIC) :]), secrets.token_bytes(NONCE_BYTES)
    await _send_all(stream, AUTH_MAGIC + mine + proof(secret, b"client", theirs, mine), stall_s)
    verdict = memoryview(bytearray(1 + PROOF_BYTES))
    await _recv_exactly(stream, verdict, stall_s)
    if verdict[0] != ACCEPTED:
        raise AuthenticationFailed("it refused this node's proof of the cluster secret (the two differ)")
    if not hmac.compare_digest(verdict[1:], proof(secret, b"server", mine, theirs)):
        raise AuthenticationFailed("it did not prove the cluster secret: not a node of this cluster")


async def _authenticate_from(stream: trio.SocketStream, secret: bytes, stall_s: float) -> None:
    """The server's side: send a nonce, check the client's proof over it, answer with the
    verdict and (accepted) this side's proof over the client's nonce."""
    mine = secrets.token_bytes(NONCE_BYTES)
    await _send_all(stream, AUTH_MAGIC + mine, stall_s)
    answer = memoryview(bytearray(len(AUTH_MAGIC) + NONCE_BYTES + PROOF_BYTES))
    await _recv_exactly(stream, answer, stall_s)
    theirs, shown = bytes(answer[4 : 4 + NONCE_BYTES]), answer[4 + NONCE_BYTES :]
    if answer[:4] != AUTH_MAGIC or not hmac.compare_digest(shown, proof(secret, b"client", mine, theirs)):
        with contextlib.suppress(OSError, trio.BrokenResourceError, ProtocolError):
            await _send_all(stream, bytes([REFUSED]) + bytes(PROOF_BYTES), stall_s)
        why = "a wrong proof of the cluster secret" if answer[:4] == AUTH_MAGIC else "no handshake"
        raise AuthenticationFailed(why)
    await _send_all(stream, bytes([ACCEPTED]) + proof(secret, b"server", theirs, mine), stall_s)


RECV_CHUNK_BYTES = 1 << 20  # the most one receive copies before the event loop runs others
JOIN_PART_BYTES = 64 << 10  # a frame's parts under this are joined with their neighbours for the send
SEND_JOIN_BYTES = 1 << 20  # the most one joined send holds


async def _recv_exactly(stream: trio.SocketStream, view: memoryview, stall_s: float = math.inf) -> None:
    """Fill `view`; ProtocolError when no byte comes for `stall_s` (a frame begun and
    left unfinished would hold its connection and its memory for ever)."""
    sock = stream.socket
    got = 0
    while got < len(view):
        with trio.move_on_after(stall_s):
            n = await sock.recv_into(view[got : got + RECV_CHUNK_BYTES])
            if n == 0:
                raise EOFError("peer closed the connection")
            got += n
            continue
        raise ProtocolError(f"no byte for {stall_s:g} s in a frame ({got} of {len(view)} received)")


async def send_frame(
    stream: trio.SocketStream, rid: int, meta: dict[str, Any], body: Sequence[Payload], stall_s: float = math.inf
) -> int:
    """Send one frame; ProtocolError when the other side takes no byte for `stall_s`."""
    inline, moved = _move_long_values(meta)
    parts = [*moved, *body]
    packed = msgpack.packb(inline, use_bin_type=True)
    length = sum(memoryview(part).nbytes for part in parts)
    for piece in _send_pieces([HEADER.pack(MAGIC, rid, len(packed), length) + packed, *parts]):
        await _send_all(stream, piece, stall_s)
    return HEADER.size + len(packed) + length


def _send_pieces(parts: Sequence[Payload]) -> Iterator[Payload]:
    """A frame's parts as they are sent: runs of small parts joined (a join ends once
    it passes SEND_JOIN_BYTES), big ones as they are (no copy). Sent one by one, the
    100,000 records of a shard's part of a batch were 100,000 sends: 0.8 s."""
    run: list[Payload] = []
    size = 0
    for part in parts:
        n = memoryview(part).nbytes
        if n >= JOIN_PART_BYTES:
            if run:
                yield b"".join(run)
                run, size = [], 0
            yield part
            continue
        run.append(part)
        size += n
        if size >= SEND_JOIN_BYTES:
            yield b"".join(run)
            run, size = [], 0
    if run:
        yield b"".join(run) if len(run) > 1 else run[0]


async def _send_all(stream: trio.SocketStream, data: Payload, stall_s: float) -> None:
    view = memoryview(data).cast("B")
    sent = 0
    while sent < len(view):
        with trio.move_on_after(stall_s):
            sent += await stream.socket.send(view[sent:])
            continue
        raise ProtocolError(f"the other side took no byte for {stall_s:g} s ({sent} of {len(view)} sent)")


def _move_long_values(meta: dict[str, Any]) -> tuple[dict[str, Any], list[Payload]]:
    """The map as sent (each long bytes value replaced by its length, as a MOVED_EXT) and
    the values moved, in the map's order: they lead the body."""
    inline: dict[str, Any] = {}
    moved: list[Payload] = []
    for key, value in meta.items():
        if isinstance(value, bytes | bytearray | memoryview) and memoryview(value).nbytes > INLINE_BYTES:
            view = memoryview(value).cast("B")
            inline[key] = msgpack.ExtType(MOVED_EXT, MOVED.pack(view.nbytes))
            moved.append(view)
        else:
            inline[key] = value
    return inline, moved


async def recv_header(stream: trio.SocketStream, stall_s: float = math.inf) -> tuple[int, int, int]:
    """A frame's header: its rid, meta and body lengths. ProtocolError for one not of ours,
    EOFError when the other side closed before it."""
    header = bytearray(HEADER.size)
    view = memoryview(header)
    first = await stream.socket.recv_into(view)  # an idle connection waits here, unbounded
    if first == 0:
        raise EOFError("peer closed the connection")
    await _recv_exactly(stream, view[first:], stall_s)
    magic, rid, meta_len, body_len = HEADER.unpack(header)
    if magic != MAGIC or meta_len > MAX_META_BYTES or body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"bad frame header {bytes(header)!r}")
    return rid, meta_len, body_len


async def recv_frame(
    stream: trio.SocketStream,
    header: tuple[int, int, int] | None = None,
    stall_s: float = math.inf,
    max_body: int = MAX_BODY_BYTES,
) -> tuple[int, dict[str, Any], memoryview]:
    """One frame (the rest of it after `header`, when that was read already):
    ProtocolError for anything that is not a frame of ours (a bad header, a meta that is
    not a msgpack map, a stall of `stall_s`), ReplyTooBig for a body past `max_body`
    (before any of it is received), OSError (ENOMEM) for a body the system cannot map,
    EOFError when the other side closed."""
    rid, meta_len, body_len = header or await recv_header(stream, stall_s)
    if body_len > max_body:
        raise ReplyTooBig(f"a body of {body_len} bytes, more than the {max_body} expected")
    meta_buf = bytearray(meta_len)
    await _recv_exactly(stream, memoryview(meta_buf), stall_s)
    body = _body_buffer(body_len)
    await _recv_exactly(stream, body, stall_s)
    lengths: list[int] = []
    try:
        meta = msgpack.unpackb(meta_buf, raw=False, ext_hook=partial(_moved_value, lengths))
    except Exception as exc:  # msgpack's FormatError, ExtraData, StackError, TypeError of a list key ...
        raise ProtocolError(f"frame meta is not msgpack: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(meta, dict):
        raise ProtocolError("frame meta is not a map")
    return rid, meta, _put_back_moved(meta, lengths, body)


@dataclass(frozen=True)
class _Moved:
    """A value of the map that travels in the body: the `position`-th of the frame's."""

    position: int


def _moved_value(lengths: list[int], code: int, data: bytes) -> _Moved:
    if code != MOVED_EXT or len(data) != MOVED.size:
        raise ProtocolError(f"unknown msgpack ext type {code} of {len(data)} bytes")
    lengths.append(MOVED.unpack(data)[0])
    return _Moved(len(lengths) - 1)


def _put_back_moved(meta: dict[str, Any], lengths: list[int], body: memoryview) -> memoryview:
    """Replace the map's moved values by their views of the body, which they lead in order;
    what follows them is the payload. ProtocolError if they do not fit the body, or one
    sits anywhere but as a value of the map itself."""
    ends = list(itertools.accumulate(lengths, initial=0))
    if ends[-1] > len(body):
        raise ProtocolError(f"moved values of {ends[-1]} bytes in a body of {len(body)}")
    found = 0
    for key, value in meta.items():
        if isinstance(value, _Moved):
            meta[key] = body[ends[value.position] : ends[value.position + 1]]
            found += 1
    if found != len(lengths):
        raise ProtocolError("a moved value inside a list or a nested map")
    return body[ends[-1] :]


LAZY_BODY_BYTES = 1 << 20  # bodies past this go into an anonymous mapping


def _body_buffer(size: int) -> memoryview:
    """Where a body of `size` bytes is received. Small: a bytearray. Past LAZY_BODY_BYTES
    an anonymous mapping, whose pages the kernel supplies only as bytes arrive: a header
    that claims 60 GiB and sends nothing costs no memory, where a bytearray of that size
    is zeroed, every page touched, before the first byte comes (the OOM killer's pick)."""
    if size <= LAZY_BODY_BYTES:
        return memoryview(bytearray(size))
    return memoryview(mmap.mmap(-1, size))


def meta_id(meta: dict[str, Any], key: str) -> str:
    """An id a node handed out (a transfer's, a fetch's) as a request names it: text of
    at most 64 characters; EINVAL when missing or of another kind. An id that was never
    handed out finds nothing where it is looked up."""
    return meta_bytes(meta, key)[:64].decode(errors="replace")


def meta_int(meta: dict[str, Any], key: str, low: int, high: int) -> int:
    """A request's integer field, in low..high; EINVAL otherwise (missing, another kind)."""
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(f"peer request: {key} must be an integer in {low}..{high}, got {str(value)[:40]}")
    return value


def meta_bytes(meta: dict[str, Any], key: str) -> bytes:
    """A request's bytes (or str, as UTF-8) field; EINVAL otherwise. (`bytes(n)` of an
    integer n would make n zero bytes: a field of 2**33 asked for 8 GiB.)"""
    value = meta.get(key)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, memoryview):  # a long one, moved to the body
        return bytes(value)
    if not isinstance(value, bytes):
        raise InvalidArgument(f"peer request: {key} must be bytes or a string, got {type(value).__name__}")
    return value


def ints_value(values: Iterable[int] | np.ndarray) -> bytes:
    """Integers as a map value: int64 bytes (long ones travel in the body), where a
    msgpack list would put a million items' sizes or keys into the map."""
    array = values if isinstance(values, np.ndarray) else np.fromiter(values, dtype=np.int64)
    return array.astype("<i8", copy=False).tobytes()


def meta_ints(meta: dict[str, Any], key: str, width: int = 1) -> np.ndarray:
    """A map value made by `ints_value`: int64s, in rows of `width` when more than one
    (keys are (owner, number) pairs). EINVAL for anything else."""
    value = meta.get(key)
    if not isinstance(value, bytes | memoryview) or len(value) % (8 * width):
        raise InvalidArgument(f"peer request: {key} must be int64 bytes in rows of {width}")
    array = np.frombuffer(value, dtype="<i8")
    return array.reshape(-1, width) if width > 1 else array


def split_payload(payload: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """The parts of a payload that carries several items back to back (views, no copy)."""
    if any(size < 0 for size in sizes):
        raise PeerUnavailable("peer payload with a negative size")
    ends = list(itertools.accumulate(sizes, initial=0))
    if ends[-1] != len(payload):
        raise PeerUnavailable(f"peer payload of {len(payload)} bytes does not match its sizes ({ends[-1]})")
    return [payload[start:end] for start, end in zip(ends, ends[1:], strict=False)]


# --- server -----------------------------------------------------------------------------


MAX_CONNECTIONS = 256  # open at once; a cluster's nodes keep POOL_SIZE each to a peer
MAX_CONNECTIONS_PER_HOST = 64  # so that one host cannot take every connection from the others
FRAME_STALL_S = 30.0  # a frame begun must go on arriving
RECEIVE_BUDGET_BYTES = 1 << 30  # bodies being received or served at once, all connections
BULK_BODY_BYTES = 256 << 20  # a body past this is received alone among such, outside the budget


class ByteBudget:
    """Bytes that requests' bodies may hold at once. A body bigger than the whole budget
    takes all of it (it is received alone), so what is held stays under the budget plus
    one frame's body."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting = trio.lowlevel.ParkingLot()

    async def take(self, nbytes: int) -> int:
        """Wait until `nbytes` (at most the total) are free and take them; returns what
        to give back."""
        nbytes = min(nbytes, self.total)
        while self.free < nbytes:
            await self._waiting.park()
        self.free -= nbytes
        return nbytes

    def give(self, nbytes: int) -> None:
        self.free += nbytes
        self._waiting.unpark_all()


def _host_of(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:  # gone already
        return ""


class PeerServer:
    """Answers peers' requests with the registered handlers, one request at a time per
    connection (a client opens several connections for parallel calls).

    A connection is served once it proves the cluster's `secret` (the handshake, within
    `auth_timeout_s`); one that does not is closed and counted in
    `unauthenticated_connections`, and nothing it sent is read as a frame.

    Bounded against whoever reaches the port, before and after the handshake: at most
    `max_connections` open, `per_host` of them from one address (one more is
    closed at once); a frame begun may stall `stall_s` at most; the bodies of requests
    being received or answered hold at most `budget_bytes` (a frame waits `room_wait_s`
    at most for its room), and one body past `bulk_bytes` more (at most half the memory
    available; a second one waits)."""

    def __init__(
        self, secret: bytes = b"", max_connections: int = MAX_CONNECTIONS, per_host: int = MAX_CONNECTIONS_PER_HOST,
        budget_bytes: int = RECEIVE_BUDGET_BYTES, bulk_bytes: int = BULK_BODY_BYTES, stall_s: float = FRAME_STALL_S,
        room_wait_s: float = FRAME_STALL_S, auth_timeout_s: float = AUTH_TIMEOUT_S,
    ) -> None:  # fmt: skip
        self.secret = secret  # (a cluster node sets it at its start, before `serve`)
        self.auth_timeout_s = auth_timeout_s
        self.unauthenticated_connections = 0
        self.handlers: dict[str, Handler] = {}
        self.requests = 0
        self.errors = 0
        self.port = 0
        self.max_connections = max_connections
        self.per_host = per_host
        self.connections = 0
        self._hosts: dict[str, int] = {}  # open connections by the other side's address
        self.refused_connections = 0
        self.budget = ByteBudget(budget_bytes)
        self.bulk_bytes = bulk_bytes
        self._bulk = trio.Lock()
        self.stall_s = stall_s
        self.room_wait_s = room_wait_s

    def register(self, op: str, handler: Handler) -> None:
        self.handlers[op] = handler

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        _check_secret(self.secret)
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection until it closes or sends what is not a frame of ours.
        Nothing a connection sends can end the server: an unexpected error drops that
        connection alone (the port is open to whoever can reach it)."""
        host = _host_of(stream)
        from_host = self._hosts.get(host, 0)
        if self.connections >= self.max_connections or from_host >= self.per_host:
            self.refused_connections += 1
            if logs.at_doubling(self.refused_connections):
                log.warning(
                    "peers: %d connections open (%d from %s), the most allowed; closed another (%d so far)",
                    self.connections, from_host, host, self.refused_connections,
                )  # fmt: skip
            await trio.aclose_forcefully(stream)
            return
        self.connections += 1
        self._hosts[host] = from_host + 1
        try:
            await self._authenticate(stream, host)
            await self._serve_connection(stream)
        except AuthenticationFailed:
            await trio.aclose_forcefully(stream)  # (counted and logged by _authenticate)
        except ProtocolError as exc:
            self.errors += 1
            log.warning("peers: dropping a connection: %s", exc)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the other side went away (or its body could not be mapped)
        except Exception:
            self.errors += 1
            log.exception("peers: a connection failed; dropped")
        finally:
            self.connections -= 1
            left = self._hosts.pop(host) - 1
            if left:
                self._hosts[host] = left

    async def _authenticate(self, stream: trio.SocketStream, host: str) -> None:
        """The handshake, within `auth_timeout_s` in all (a stranger trickling bytes
        holds its connection no longer); AuthenticationFailed, counted and logged (the
        1st, 2nd, 4th, 8th ... time), when it fails for any reason."""
        why = f"no proof within {self.auth_timeout_s:g} s"
        with trio.move_on_after(self.auth_timeout_s):
            try:
                await _authenticate_from(stream, self.secret, self.auth_timeout_s)
                return
            except ProtocolError as exc:
                why = str(exc)
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                why = "closed during the handshake"
        self.unauthenticated_connections += 1
        count = self.unauthenticated_connections
        if logs.at_doubling(count):
            log.warning("peers: a connection from %s did not authenticate (%s); closed (%d so far)", host, why, count)
        raise AuthenticationFailed(why)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            while True:
                header = await recv_header(stream, self.stall_s)
                async with self._room_for(header[2]):
                    rid, meta, body = await recv_frame(stream, header, self.stall_s)
                    reply, parts = await self._dispatch(meta, body)
                # (its room is free for others while the reply goes, as fast as the peer reads)
                await send_frame(stream, rid, reply, parts, self.stall_s)

    @contextlib.asynccontextmanager
    async def _room_for(self, nbytes: int) -> AsyncIterator[None]:
        """Hold room for a request's body of `nbytes` while it is received and answered:
        a share of the budget, or for a body past `bulk_bytes` (a checkpoint replica) the
        one bulk slot, so that it neither waits for small requests nor makes them wait.
        ProtocolError when no room comes within `room_wait_s`, or at once for a body
        of more than half the memory the system has available."""
        bulk = nbytes > self.bulk_bytes
        if bulk:
            available = memory.available_bytes()
            if available is not None and nbytes > available // 2:
                raise ProtocolError(f"a body of {nbytes} bytes, more than half the memory available ({available})")
        held = 0
        with trio.move_on_after(self.room_wait_s) as waited:
            if bulk:
                await self._bulk.acquire()
            else:
                held = await self.budget.take(nbytes)
        if waited.cancelled_caught:
            raise ProtocolError(f"a body of {nbytes} bytes found no room in {self.room_wait_s:g} s")
        try:
            yield
        finally:
            if bulk:
                self._bulk.release()
            else:
                self.budget.give(held)

    async def _dispatch(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        self.requests += 1
        op = meta.get("op")
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            self.errors += 1
            return {"ok": False, "errno": 38, "error": f"unknown peer op {op!r}"}, ()  # ENOSYS
        try:
            reply, parts = await handler(meta, body)
        except DistorefsError as exc:
            self.errors += 1
            return {"ok": False, "errno": exc.errno, "error": str(exc)}, ()
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            # a field missing or of the wrong kind (the port is open to whoever reaches it):
            # EINVAL and one line, where a traceback per request would flood the log
            self.errors += 1
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
            log.warning("peers: op %s: a malformed request (%s)", op, why, exc_info=log.isEnabledFor(logging.DEBUG))
            return {"ok": False, "errno": 22, "error": f"{op}: a malformed request ({why})"}, ()  # EINVAL
        except Exception as exc:
            self.errors += 1
            log.exception("peers: op %s failed", op)
            return {"ok": False, "errno": 5, "error": f"{op}: internal error: {exc}"}, ()
        return {"ok": True, **reply}, parts


# --- client -----------------------------------------------------------------------------


@dataclass
class PeerStats:
    calls: int = 0
    failures: int = 0
    retries: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rtt_ms: float = 0.0  # moving average of successful calls
    last_error: str = ""
    last_error_ns: int = 0
    idle: list[trio.SocketStream] = field(default_factory=list, repr=False)

    def report(self) -> dict[str, Any]:
        """The numbers, for `.distore/peers` (not the pooled connections)."""
        return {
            "calls": self.calls,
            "failures": self.failures,
            "retries": self.retries,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rtt_ms": round(self.rtt_ms, 3),
            "pooled_connections": len(self.idle),
            "last_error": self.last_error,
            "last_error_ns": self.last_error_ns,
        }


class PeerTransport:
    """Calls to other daemons by node name.

    Examples:
        >>> peers = PeerTransport(lookup=members.address, timeout_s=5.0)
        >>> meta, payload = await peers.call("b", "weights.fetch", {"model": "policy"})
    """

    def __init__(
        self,
        lookup: Callable[[str], tuple[str, int] | None],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        secret: bytes = b"",
    ) -> None:
        self._lookup = lookup
        self.secret = secret  # (a cluster node sets it at its start, before any call)
        self.timeout_s = timeout_s
        self.retries = retries
        self.stats: dict[str, PeerStats] = {}
        self._rid = 0
        self._open = trio.Semaphore(POOL_SIZE * 64)

    def _stats(self, node: str) -> PeerStats:
        return self.stats.setdefault(node, PeerStats())

    async def call(
        self, node: str, op: str, meta: dict[str, Any] | None = None, body: Sequence[Payload] = (),
        timeout_s: float | None = None, max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> tuple[dict[str, Any], memoryview]:  # fmt: skip
        """One request/reply with `node`, within `timeout_s` (default the transport's).

        Raises PeerUnavailable (EIO) when the node is not a live member or does not
        answer in time, or announces a reply body past `max_reply_bytes` (refused before
        any of it is received: a peer gone wrong cannot make this node hold more),
        RemoteError with the peer's errno when it answers with an error.
        """
        stats = self._stats(node)
        stats.calls += 1
        deadline = trio.current_time() + (timeout_s or self.timeout_s)
        request = {"op": op, **(meta or {})}
        attempt = 0
        while True:
            address = self._lookup(node)
            if address is None:
                raise self._failed(node, op, "is not a live member of the cluster")
            started = time.monotonic()
            try:
                with trio.fail_at(deadline):
                    reply, payload = await self._exchange(node, address, request, body, max_reply_bytes)
            except trio.TooSlowError:
                raise self._failed(node, op, f"did not answer within {timeout_s or self.timeout_s:g} s") from None
            except AuthenticationFailed as exc:  # not retried: another try meets the same secret
                raise self._failed(node, op, f"at {address[0]}:{address[1]} failed authentication: {exc}") from None
            except ReplyTooBig as exc:  # not retried: the peer would send it again
                raise self._failed(node, op, f"sent a reply this call does not take: {exc}") from None
            except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
                attempt += 1
                stats.last_error, stats.last_error_ns = f"{type(exc).__name__}: {exc}", time.time_ns()
                if attempt > self.retries or trio.current_time() + BACKOFF_S * attempt >= deadline:
                    raise self._failed(node, op, f"unreachable at {address[0]}:{address[1]} ({exc})") from None
                stats.retries += 1
                await trio.sleep(BACKOFF_S * attempt)
                continue
            rtt = (time.monotonic() - started) * 1000
            stats.rtt_ms = rtt if stats.rtt_ms == 0 else 0.8 * stats.rtt_ms + 0.2 * rtt
            if not reply.get("ok"):
                raise RemoteError(int(reply.get("errno", 5)), f"peer {node}: {reply.get('error', 'failed')}")
            return reply, payload

    def _failed(self, node: str, op: str, why: str) -> PeerUnavailable:
        stats = self._stats(node)
        stats.failures += 1
        message = f"peer {node} {why} ({op})"
        stats.last_error, stats.last_error_ns = message, time.time_ns()
        for stream in stats.idle:
            stream.socket.close()
        stats.idle.clear()
        return PeerUnavailable(message)

    async def _exchange(
        self, node: str, address: tuple[str, int], request: dict[str, Any], body: Sequence[Payload],
        max_reply_bytes: int,
    ) -> tuple[dict[str, Any], memoryview]:  # fmt: skip
        stats = self._stats(node)
        stream = stats.idle.pop() if stats.idle else await self._connect(address)
        ok = False
        try:
            self._rid = rid = (self._rid + 1) & 0xFFFFFFFF
            stats.bytes_sent += await send_frame(stream, rid, request, body)
            answered, reply, payload = await recv_frame(stream, max_body=max_reply_bytes)
            if answered != rid:
                raise ProtocolError(f"reply to request {answered}, expected {rid}")
            stats.bytes_received += len(payload)
            ok = True
            return reply, payload
        finally:
            if ok and len(stats.idle) < POOL_SIZE:
                stats.idle.append(stream)
            else:
                stream.socket.close()

    async def _connect(self, address: tuple[str, int]) -> trio.SocketStream:
        """A new connection to `address`, authenticated (the handshake)."""
        stream = await trio.open_tcp_stream(*address)
        try:
            await authenticate_to(stream, self.secret)
        except BaseException:
            stream.socket.close()
            raise
        return stream

    def forget(self, node: str) -> None:
        """A node left: close its idle connections (calls in flight fail on their own)."""
        stats = self.stats.get(node)
        if stats is not None:
            for stream in stats.idle:
                stream.socket.close()
            stats.idle.clear()

    def close(self) -> None:
        for node in list(self.stats):
            self.forget(node)


# --- transport choice -------------------------------------------------------------------


def choose_transport(requested: str) -> tuple[str, str]:
    """Pick the data transport: `requested` is "auto", "tcp" or "rdma". Returns (name,
    reason). "rdma" with no usable device raises ConfigError-worthy ValueError."""
    if requested == "tcp":
        return "tcp", "--transport tcp"
    devices: list[str] = []
    why = ""
    try:
        from pyverbs.device import get_device_list

        devices = [d.name.decode() for d in get_device_list()]
        if not devices:
            why = "pyverbs found no RDMA device"
    except ImportError:
        why = "pyverbs is not installed"
    except Exception as exc:  # pyverbs raises its own errors when the verbs library is missing
        why = f"pyverbs failed: {exc}"
    if devices:
        why = f"RDMA device {devices[0]} found, but the RDMA read path is not built yet"
    if requested == "rdma":
        raise ValueError(f"--transport rdma: no usable RDMA transport ({why})")
    return "tcp", why
