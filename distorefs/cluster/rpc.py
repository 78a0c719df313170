"""Peers: the binary protocol between daemons, its server, and PeerTransport (the client
with connection pools, timeouts and the one retry policy of distorefs).

Owns bytes on the wire and the failure rules; what an operation means is the handler's
business (the daemon's cluster glue registers them). It never imports a store.

Frame (docs/formats.md), little-endian:
    magic  4s  b"DSP1"
    rid    u32 request id, echoed in the reply
    meta   u32 length of the msgpack map that follows
    body   u64 length of the payload that follows the map
A request's map has `op`; a reply's has `ok` and, when not ok, `errno` and `error`.
Payloads go to the socket as memoryviews of the caller's buffers and are received with
recv_into a buffer of their exact size: no copy beyond the kernel's.

Failure rules: one call has one deadline (`timeout_s`, default 5 s). Connection errors
are retried (`retries`, with a short backoff) on a fresh connection within it; when it
passes, or the node is not a live member, the call raises PeerUnavailable (EIO). An
error the peer answers with comes back as RemoteError with the peer's errno.

Transport choice: `choose_transport` looks for pyverbs and an RDMA device. The
one-sided RDMA read path is not built yet, so today every peer moves data over TCP; the
choice and its reason are logged and shown in `.distore/peers` (docs/cluster.md).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio

from distorefs.errors import DistorefsError, InvalidArgument, PeerUnavailable, RemoteError

log = logging.getLogger(__name__)

MAGIC = b"DSP1"
HEADER = struct.Struct("<4sIIQ")
MAX_META_BYTES = 1 << 20
MAX_BODY_BYTES = 1 << 36
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRIES = 2
BACKOFF_S = 0.05
POOL_SIZE = 4

Payload = bytes | bytearray | memoryview
Handler = Callable[[dict[str, Any], memoryview], Awaitable[tuple[dict[str, Any], Sequence[Payload]]]]


class ProtocolError(Exception):
    """The other side sent something that is not a frame of ours."""


async def _recv_exactly(stream: trio.SocketStream, view: memoryview) -> None:
    sock = stream.socket
    got = 0
    while got < len(view):
        n = await sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("peer closed the connection")
        got += n


async def send_frame(stream: trio.SocketStream, rid: int, meta: dict[str, Any], body: Sequence[Payload]) -> int:
    packed = msgpack.packb(meta, use_bin_type=True)
    length = sum(len(part) for part in body)
    await stream.send_all(HEADER.pack(MAGIC, rid, len(packed), length) + packed)
    for part in body:
        if len(part):
            await stream.send_all(part)
    return HEADER.size + len(packed) + length


async def recv_frame(stream: trio.SocketStream) -> tuple[int, dict[str, Any], memoryview]:
    """One frame: ProtocolError for anything that is not a frame of ours (a bad header,
    a meta that is not a msgpack map), OSError (ENOMEM) for a body the system cannot
    map, EOFError when the other side closed."""
    header = bytearray(HEADER.size)
    await _recv_exactly(stream, memoryview(header))
    magic, rid, meta_len, body_len = HEADER.unpack(header)
    if magic != MAGIC or meta_len > MAX_META_BYTES or body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"bad frame header {bytes(header)!r}")
    meta_buf = bytearray(meta_len)
    await _recv_exactly(stream, memoryview(meta_buf))
    body = _body_buffer(body_len)
    await _recv_exactly(stream, body)
    try:
        meta = msgpack.unpackb(meta_buf, raw=False)
    except Exception as exc:  # msgpack's FormatError, ExtraData, StackError, TypeError of a list key ...
        raise ProtocolError(f"frame meta is not msgpack: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(meta, dict):
        raise ProtocolError("frame meta is not a map")
    return rid, meta, body


LAZY_BODY_BYTES = 1 << 20  # bodies past this go into an anonymous mapping


def _body_buffer(size: int) -> memoryview:
    """Where a body of `size` bytes is received. Small: a bytearray. Past LAZY_BODY_BYTES
    an anonymous mapping, whose pages the kernel supplies only as bytes arrive: a header
    that claims 60 GiB and sends nothing costs no memory, where a bytearray of that size
    is zeroed, every page touched, before the first byte comes (the OOM killer's pick)."""
    if size <= LAZY_BODY_BYTES:
        return memoryview(bytearray(size))
    return memoryview(mmap.mmap(-1, size))


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
    if not isinstance(value, bytes):
        raise InvalidArgument(f"peer request: {key} must be bytes or a string, got {type(value).__name__}")
    return value


def split_payload(payload: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """The parts of a payload that carries several items back to back (views, no copy)."""
    ends = list(itertools.accumulate(sizes, initial=0))
    if ends[-1] != len(payload):
        raise PeerUnavailable(f"peer payload of {len(payload)} bytes does not match its sizes ({ends[-1]})")
    return [payload[start:end] for start, end in zip(ends, ends[1:], strict=False)]


# --- server -----------------------------------------------------------------------------


class PeerServer:
    """Answers peers' requests with the registered handlers, one request at a time per
    connection (a client opens several connections for parallel calls)."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.requests = 0
        self.errors = 0
        self.port = 0

    def register(self, op: str, handler: Handler) -> None:
        self.handlers[op] = handler

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection until it closes or sends what is not a frame of ours.
        Nothing a connection sends can end the server: an unexpected error drops that
        connection alone (the port is open to whoever can reach it)."""
        try:
            await self._serve_connection(stream)
        except Exception:
            self.errors += 1
            log.exception("peers: a connection failed; dropped")

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            while True:
                try:
                    rid, meta, body = await recv_frame(stream)
                except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return
                except ProtocolError as exc:
                    self.errors += 1
                    log.warning("peers: dropping a connection: %s", exc)
                    return
                reply, parts = await self._dispatch(meta, body)
                try:
                    await send_frame(stream, rid, reply, parts)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return

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
    ) -> None:
        self._lookup = lookup
        self.timeout_s = timeout_s
        self.retries = retries
        self.stats: dict[str, PeerStats] = {}
        self._rid = 0
        self._open = trio.Semaphore(POOL_SIZE * 64)

    def _stats(self, node: str) -> PeerStats:
        return self.stats.setdefault(node, PeerStats())

    async def call(
        self, node: str, op: str, meta: dict[str, Any] | None = None, body: Sequence[Payload] = (),
        timeout_s: float | None = None,
    ) -> tuple[dict[str, Any], memoryview]:  # fmt: skip
        """One request/reply with `node`, within `timeout_s` (default the transport's).

        Raises PeerUnavailable (EIO) when the node is not a live member or does not
        answer in time, RemoteError with the peer's errno when it answers with an error.
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
                    reply, payload = await self._exchange(node, address, request, body)
            except trio.TooSlowError:
                raise self._failed(node, op, f"did not answer within {timeout_s or self.timeout_s:g} s") from None
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
        self, node: str, address: tuple[str, int], request: dict[str, Any], body: Sequence[Payload]
    ) -> tuple[dict[str, Any], memoryview]:
        stats = self._stats(node)
        stream = stats.idle.pop() if stats.idle else await trio.open_tcp_stream(*address)
        ok = False
        try:
            self._rid = rid = (self._rid + 1) & 0xFFFFFFFF
            stats.bytes_sent += await send_frame(stream, rid, request, body)
            answered, reply, payload = await recv_frame(stream)
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
