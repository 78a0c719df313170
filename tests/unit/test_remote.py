"""The peer protocol on loopback: a real PeerServer and PeerTransport over TCP."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import trio

from distorefs import memory
from distorefs.cluster.rpc import (
    AUTH_MAGIC,
    HEADER,
    INLINE_BYTES,
    MAGIC,
    MAX_META_BYTES,
    MOVED,
    MOVED_EXT,
    NONCE_BYTES,
    PROOF_BYTES,
    REFUSED,
    SEND_JOIN_BYTES,
    Payload,
    PeerServer,
    PeerTransport,
    _send_pieces,
    authenticate_to,
    choose_transport,
    ints_value,
    meta_ints,
    proof,
)
from distorefs.errors import NotFound, PeerUnavailable, RemoteError

SECRET = b"a test cluster's secret, 40 bytes long."


async def connect(port: int) -> trio.SocketStream:
    """A connection to the server on `port` that has passed the handshake, as a peer's."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await authenticate_to(stream, SECRET)
    return stream


async def echo(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
    await trio.lowlevel.checkpoint()
    return {"got": len(body), "tag": meta.get("tag")}, [body, b"!"]


async def refuse(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
    await trio.lowlevel.checkpoint()
    raise NotFound("no such thing 42")


async def hang(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
    await trio.sleep_forever()
    raise AssertionError


async def reverse(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
    """The indices it was sent, reversed, and the kinds its map's values arrived as."""
    await trio.lowlevel.checkpoint()
    indices = meta_ints(meta, "indices")
    kinds = {key: type(value).__name__ for key, value in meta.items()}
    return {"indices": ints_value(indices[::-1]), "kinds": kinds, "got": len(body)}, [body]


async def start_server(nursery: trio.Nursery, port: int = 0) -> PeerServer:
    server = PeerServer(SECRET)
    for op, handler in (("echo", echo), ("refuse", refuse), ("hang", hang), ("reverse", reverse)):
        server.register(op, handler)
    await nursery.start(server.serve, "127.0.0.1", port)
    return server


async def test_a_call_carries_meta_and_a_large_payload_both_ways() -> None:
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=10, secret=SECRET)
        payload = bytes(range(256)) * (64 * 1024)  # 16 MiB
        reply, body = await peers.call("b", "echo", {"tag": "x"}, [payload[:100], memoryview(payload)[100:]])
        assert reply == {"ok": True, "got": len(payload), "tag": "x"}
        assert bytes(body) == payload + b"!"
        assert peers.stats["b"].calls == 1
        assert peers.stats["b"].bytes_received == len(payload) + 1
        peers.close()
        nursery.cancel_scope.cancel()


async def test_long_bytes_values_travel_in_the_body_so_a_million_indices_fit_a_call() -> None:
    """A million int64 indices (8 MB) in the map, past MAX_META_BYTES: sharded buffers'
    priority updates, picks and appends and a dataset run's index of small records were
    refused outright (the frame's header failed its check, the connection dropped, the
    call came back EIO). Long values now lead the body and arrive as views of it, short
    ones stay in the map; the payload after them is intact."""
    indices = np.arange(1_000_000, dtype=np.int64) * 3
    assert indices.nbytes > MAX_META_BYTES
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=10, secret=SECRET)
        payload = b"p" * 5000
        meta = {"indices": ints_value(indices), "short": b"s" * INLINE_BYTES, "tag": "t"}
        reply, body = await peers.call("b", "reverse", meta, [payload])
        assert reply["kinds"] == {"op": "str", "indices": "memoryview", "short": "bytes", "tag": "str"}
        assert reply["got"] == len(payload)
        assert bytes(body) == payload
        assert isinstance(reply["indices"], memoryview)  # the reply's long value came back the same way
        assert np.array_equal(meta_ints(reply, "indices"), indices[::-1])
        small, _ = await peers.call("b", "reverse", {"indices": ints_value([1, 2])})
        assert meta_ints(small, "indices").tolist() == [2, 1]
        peers.close()
        nursery.cancel_scope.cancel()


async def test_a_peer_error_comes_back_with_its_errno() -> None:
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), secret=SECRET)
        with pytest.raises(RemoteError, match="no such thing 42") as excinfo:
            await peers.call("b", "refuse")
        assert excinfo.value.errno == errno.ENOENT
        with pytest.raises(RemoteError, match="unknown peer op") as excinfo:
            await peers.call("b", "nope")
        assert excinfo.value.errno == errno.ENOSYS
        reply, _ = await peers.call("b", "echo")  # the connection is still good
        assert reply["ok"]
        peers.close()
        nursery.cancel_scope.cancel()


async def test_a_peer_that_does_not_answer_is_eio_at_the_deadline(autojump_clock: trio.abc.Clock) -> None:
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=3.0, secret=SECRET)
        started = trio.current_time()
        with pytest.raises(PeerUnavailable, match=r"peer b did not answer within 3 s \(hang\)") as excinfo:
            await peers.call("b", "hang")
        assert excinfo.value.errno == errno.EIO
        assert trio.current_time() - started == pytest.approx(3.0)
        peers.close()
        nursery.cancel_scope.cancel()


async def test_an_unknown_or_closed_peer_is_eio_after_bounded_retries() -> None:
    peers = PeerTransport(lambda node: None, secret=SECRET)
    with pytest.raises(PeerUnavailable, match="is not a live member"):
        await peers.call("gone", "echo")
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peers = PeerTransport(lambda node: ("127.0.0.1", port), retries=2, secret=SECRET)
    with pytest.raises(PeerUnavailable, match="unreachable"):
        await peers.call("b", "echo")
    assert peers.stats["b"].retries == 2
    assert peers.stats["b"].failures == 1


async def test_the_client_reconnects_after_the_peer_restarts() -> None:
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as first:
            server = await start_server(first)
            port = server.port
            peers = PeerTransport(lambda node: ("127.0.0.1", port), secret=SECRET)
            assert (await peers.call("b", "echo"))[0]["ok"]
            first.cancel_scope.cancel()  # the server goes away; the pooled connection is dead
        await start_server(outer, port)
        reply, _ = await peers.call("b", "echo", {"tag": "again"})
        assert reply["tag"] == "again"
        peers.close()
        outer.cancel_scope.cancel()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def closed_by_server(stream: trio.SocketStream) -> bool:
    """Whether the other side closed (a reset when it left bytes of ours unread)."""
    try:
        return await stream.receive_some(16) == b""
    except trio.BrokenResourceError:
        return True


def moved(length: int) -> msgpack.ExtType:
    return msgpack.ExtType(MOVED_EXT, MOVED.pack(length))


def moved_frame(meta: dict[str, Any], body: bytes) -> bytes:
    packed = msgpack.packb({"op": "echo", **meta})
    return HEADER.pack(MAGIC, 1, len(packed), len(body)) + packed + body


async def test_garbage_on_the_peer_port_drops_that_connection_and_the_server_goes_on() -> None:
    """The peer port is open to whoever reaches it: a meta that is not msgpack (this
    ended the server, and with it the daemon, before), a meta that is not a map, a bad
    header, and a header claiming a 32 GiB body that never comes (received into memory
    the kernel supplies as bytes arrive: no 32 GiB zeroed at once) each drop their own
    connection; calls keep working."""
    meta = msgpack.packb({"op": "echo"})
    frames = [
        HEADER.pack(MAGIC, 1, 1, 0) + b"\xc1",  # a byte msgpack never uses
        HEADER.pack(MAGIC, 1, 3, 0) + b"\x93\x01\x02",  # an array cut short
        HEADER.pack(MAGIC, 1, 5, 0) + b"\xdd\xff\xff\xff\xff",  # an array of 4 billion
        HEADER.pack(MAGIC, 1, 2, 0) + b"\x91\x01",  # a list, not a map
        HEADER.pack(b"HTTP", 1, 0, 0),
        moved_frame({"a": moved(100)}, b"x" * 99),  # a moved value longer than the body
        moved_frame({"a": [moved(4)]}, b"x" * 4),  # a moved value inside a list
        moved_frame({"a": msgpack.ExtType(7, b"x")}, b""),  # an ext type we never send
    ]
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        for frame in frames:
            stream = await connect(server.port)
            await stream.send_all(frame)
            with trio.fail_after(5):
                assert await stream.receive_some(4096) == b""  # dropped, no reply
            await stream.aclose()
        before = resident_bytes()
        claim = await connect(server.port)
        await claim.send_all(HEADER.pack(MAGIC, 1, len(meta), 32 << 30) + meta + b"x" * 4096)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), secret=SECRET)
        reply, body = await peers.call("b", "echo", {"tag": "after"}, [b"abc"])
        assert reply == {"ok": True, "got": 3, "tag": "after"}
        assert bytes(body) == b"abc!"
        assert resident_bytes() - before < 256 << 20
        available = memory.available_bytes()
        assert available is not None
        if 32 << 30 > available // 2:  # more than half the memory there is: dropped at once
            with trio.fail_after(5):
                assert await closed_by_server(claim)
        assert server.errors == len(frames) + (32 << 30 > available // 2)
        await claim.aclose()
        peers.close()
        nursery.cancel_scope.cancel()


def test_transport_choice_falls_back_to_tcp_without_an_rdma_device() -> None:
    assert choose_transport("tcp") == ("tcp", "--transport tcp")
    name, reason = choose_transport("auto")
    assert name == "tcp"
    assert reason  # says why: no pyverbs, no device, or the RDMA path not built
    with pytest.raises(ValueError, match="--transport rdma: no usable RDMA transport"):
        choose_transport("rdma")


async def test_one_host_cannot_hold_every_connection_and_a_refused_one_is_closed_at_once() -> None:
    async with trio.open_nursery() as nursery:
        server = PeerServer(SECRET, max_connections=8, per_host=3)
        server.register("echo", echo)
        await nursery.start(server.serve, "127.0.0.1", 0)
        held = [await connect(server.port) for _ in range(3)]
        extra = await trio.open_tcp_stream("127.0.0.1", server.port)
        with trio.fail_after(5):
            assert await extra.receive_some(16) == b""  # closed without a byte
        assert server.refused_connections == 1
        await held.pop().aclose()
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), secret=SECRET)
        with trio.fail_after(5):
            while server.connections > 2:  # the server sees the close
                await trio.sleep(0.01)
        reply, _ = await peers.call("b", "echo", {"tag": "in"})
        assert reply["tag"] == "in"
        peers.close()
        for stream in [*held, extra]:
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_frame_left_unfinished_is_dropped_after_its_stall_and_frees_its_room() -> None:
    """Bodies held at once stay within the budget: a stranger's frame announcing more than
    all of it is received alone, so a small call waits behind it, and when the stranger
    stops sending, the frame is dropped after the stall bound and the call goes through.
    A connection idle between frames is not a stall."""
    async with trio.open_nursery() as nursery:
        server = PeerServer(SECRET, budget_bytes=1 << 20, stall_s=0.5, room_wait_s=10)
        server.register("echo", echo)
        await nursery.start(server.serve, "127.0.0.1", 0)
        idle = await connect(server.port)
        meta = msgpack.packb({"op": "echo"})
        stranger = await connect(server.port)
        await stranger.send_all(HEADER.pack(MAGIC, 1, len(meta), 4 << 20) + meta + b"x" * 1000)
        last_byte = trio.current_time()  # the stranger's stall counts from here (or a little later)
        with trio.fail_after(5):
            while server.budget.free:  # it took the whole budget
                await trio.sleep(0.01)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=5, secret=SECRET)
        reply, body = await peers.call("b", "echo", {"tag": "after"}, [b"abc"])
        assert bytes(body) == b"abc!"
        assert 0.5 <= trio.current_time() - last_byte < 4  # the call waited for the stall bound, no longer
        assert server.errors == 1  # the stranger's frame
        with trio.fail_after(5):
            assert await stranger.receive_some(16) == b""
        assert server.budget.free == server.budget.total
        await idle.send_all(HEADER.pack(MAGIC, 2, len(meta), 0) + meta)  # idle past the stall bound, then a frame
        with trio.fail_after(5):
            assert await idle.receive_some(HEADER.size)  # answered
        peers.close()
        for stream in (idle, stranger):
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_bulk_body_neither_waits_for_small_requests_nor_makes_them_wait() -> None:
    """A body past the bulk size (a checkpoint replica) is received outside the budget,
    one at a time: one arriving slowly holds back a second bulk frame but no small call."""
    async with trio.open_nursery() as nursery:
        server = PeerServer(SECRET, budget_bytes=1 << 20, bulk_bytes=2 << 20, stall_s=10)
        server.register("echo", echo)
        await nursery.start(server.serve, "127.0.0.1", 0)
        meta = msgpack.packb({"op": "echo"})
        first = await connect(server.port)
        await first.send_all(HEADER.pack(MAGIC, 1, len(meta), 4 << 20) + meta + b"x" * 1000)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=10, secret=SECRET)
        with trio.fail_after(5):
            reply, _ = await peers.call("b", "echo", {"tag": "small"}, [b"s" * 1000])
        assert reply["got"] == 1000
        assert server.budget.free == server.budget.total
        done: list[float] = []

        async def second_bulk() -> None:
            started = trio.current_time()
            _reply, body = await peers.call("b", "echo", {}, [b"y" * (3 << 20)])
            assert len(body) == (3 << 20) + 1
            done.append(trio.current_time() - started)

        nursery.start_soon(second_bulk)
        await trio.sleep(0.5)
        assert not done  # it waits for the first
        await first.send_all(b"x" * ((4 << 20) - 1000))
        with trio.fail_after(5):
            while not done:
                await trio.sleep(0.01)
        assert done[0] >= 0.5
        assert server.errors == 0
        peers.close()
        await first.aclose()
        nursery.cancel_scope.cancel()


async def receive_all(stream: trio.SocketStream, limit_s: float = 5) -> bytes:
    """Everything the server sends until it closes (within `limit_s`)."""
    got = b""
    with trio.fail_after(limit_s):
        while True:
            try:
                chunk = await stream.receive_some(4096)
            except trio.BrokenResourceError:
                return got
            if not chunk:
                return got
            got += chunk


async def test_a_connection_that_does_not_prove_the_secret_is_closed_before_any_frame_is_read() -> None:
    """The peer port had no authentication: whoever reached it could read a node's
    weights and items and write its buffers. Now a connection proves the cluster's
    secret first (HMAC over a nonce of the server's). A node with another secret, a
    stranger sending frames straight away, a proof replayed over an old nonce, a silent
    connection and one trickling bytes: each is closed, counted, and no handler runs;
    a node with the secret is served as before."""
    served: list[str] = []

    async def note(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        await trio.lowlevel.checkpoint()
        served.append(str(meta.get("tag")))
        return {}, ()

    async with trio.open_nursery() as nursery:
        server = PeerServer(SECRET, auth_timeout_s=0.5)
        server.register("note", note)
        await nursery.start(server.serve, "127.0.0.1", 0)

        other = PeerTransport(lambda node: ("127.0.0.1", server.port), secret=b"another cluster's secret......")
        with pytest.raises(PeerUnavailable, match="failed authentication: it refused this node's proof") as excinfo:
            await other.call("b", "note", {"tag": "other secret"})
        assert excinfo.value.errno == errno.EIO
        assert other.stats["b"].retries == 0  # another try would meet the same secret
        with trio.fail_after(5):
            while server.unauthenticated_connections < 1:  # (counted as the server closes it)
                await trio.sleep(0.01)

        meta = msgpack.packb({"op": "note", "tag": "no handshake"})
        frame = HEADER.pack(MAGIC, 1, len(meta), 100) + meta + b"x" * 100
        stranger = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stranger.send_all(frame)
        got = await receive_all(stranger)
        assert got[:4] == AUTH_MAGIC
        assert len(got) == 4 + NONCE_BYTES + 1 + PROOF_BYTES
        assert got[4 + NONCE_BYTES] == REFUSED
        assert got[-PROOF_BYTES:] == bytes(PROOF_BYTES)
        await stranger.aclose()

        # a proof made over another nonce (one seen on an earlier connection) is refused
        replay = await trio.open_tcp_stream("127.0.0.1", server.port)
        hello = await replay.receive_some(4 + NONCE_BYTES)
        assert len(hello) == 4 + NONCE_BYTES  # (sent in one piece)
        mine = os.urandom(NONCE_BYTES)
        await replay.send_all(AUTH_MAGIC + mine + proof(SECRET, b"client", os.urandom(NONCE_BYTES), mine))
        assert (await receive_all(replay))[0] == REFUSED
        await replay.aclose()

        for trickle in (False, True):  # silent, or a byte every 0.1 s: closed at the bound in all
            slow = await trio.open_tcp_stream("127.0.0.1", server.port)
            started = trio.current_time()
            with trio.fail_after(5):
                assert len(await slow.receive_some(4 + NONCE_BYTES)) == 4 + NONCE_BYTES
                while trickle:
                    try:
                        await slow.send_all(b"D")
                    except trio.BrokenResourceError:
                        break
                    await trio.sleep(0.1)
                    if trio.current_time() - started > 1.0:
                        break
            assert await receive_all(slow) == b""
            assert 0.4 < trio.current_time() - started < 4
            await slow.aclose()
        assert server.unauthenticated_connections == 5
        assert served == []
        assert server.requests == 0

        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), secret=SECRET)
        await peers.call("b", "note", {"tag": "peer"})
        assert served == ["peer"]
        assert server.unauthenticated_connections == 5
        for transport in (peers, other):
            transport.close()
        nursery.cancel_scope.cancel()


async def test_a_server_that_does_not_prove_the_secret_gets_no_request() -> None:
    """The proof goes both ways: an impostor at a node's address (one that says it
    accepts without knowing the secret) is refused by the caller before any request is
    sent to it, without retries."""
    received: list[bytes] = []

    async def impostor(stream: trio.SocketStream) -> None:
        await stream.send_all(AUTH_MAGIC + os.urandom(NONCE_BYTES))
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while chunk := await stream.receive_some(4096):
                received.append(chunk)
                if sum(map(len, received)) == 4 + NONCE_BYTES + PROOF_BYTES:
                    await stream.send_all(bytes([0]) + os.urandom(PROOF_BYTES))  # "accepted", no proof

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, impostor, 0)
        port = listeners[0].socket.getsockname()[1]
        peers = PeerTransport(lambda node: ("127.0.0.1", port), secret=SECRET)
        with pytest.raises(PeerUnavailable, match="failed authentication: it did not prove the cluster secret"):
            await peers.call("b", "echo", {"tag": "for the impostor"})
        assert peers.stats["b"].retries == 0
        await trio.sleep(0.1)
        assert b"".join(received)[: len(AUTH_MAGIC)] == AUTH_MAGIC  # its handshake answer, and nothing more
        assert len(b"".join(received)) == 4 + NONCE_BYTES + PROOF_BYTES
        peers.close()
        nursery.cancel_scope.cancel()


async def test_a_server_refuses_to_serve_without_a_secret() -> None:
    with pytest.raises(ValueError, match="fewer than 16"):
        await PeerServer(b"short").serve("127.0.0.1", 0)


async def test_any_answer_to_the_nonce_but_a_proof_is_refused_and_the_server_goes_on() -> None:
    """Seeded garbage of every length around the answer's 68 bytes (the magic right or
    wrong, a proof of the wrong role or nonce order), each on its own connection: each
    is closed and counted, no handler runs, and a peer with the secret is served after."""
    import random

    served: list[str] = []

    async def note(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        await trio.lowlevel.checkpoint()
        served.append(str(meta.get("tag")))
        return {}, ()

    rng = random.Random(22)
    async with trio.open_nursery() as nursery:
        server = PeerServer(SECRET, auth_timeout_s=0.3)
        server.register("note", note)
        await nursery.start(server.serve, "127.0.0.1", 0)
        answers = 0
        for k in range(60):
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            hello = await stream.receive_some(4 + NONCE_BYTES)
            theirs, mine = hello[4:], os.urandom(NONCE_BYTES)
            choice = k % 4
            if choice == 0:  # random bytes of any length up to two answers
                answer = rng.randbytes(rng.randrange(0, 140))
            elif choice == 1:  # the right magic and nonce, a random proof
                answer = AUTH_MAGIC + mine + rng.randbytes(PROOF_BYTES)
            elif choice == 2:  # a proof made as the server makes its own (wrong role)
                answer = AUTH_MAGIC + mine + proof(SECRET, b"server", theirs, mine)
            else:  # the client's proof with the nonces swapped
                answer = AUTH_MAGIC + mine + proof(SECRET, b"client", mine, theirs)
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(answer)
            got = await receive_all(stream)
            assert not got or got[0] == REFUSED  # refused, or closed at the time bound
            await stream.aclose()
            answers += 1
        with trio.fail_after(5):
            while server.unauthenticated_connections < answers:
                await trio.sleep(0.01)
        assert server.unauthenticated_connections == answers
        assert served == []
        assert server.requests == 0
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), secret=SECRET)
        await peers.call("b", "note", {"tag": "peer"})
        assert served == ["peer"]
        peers.close()
        nursery.cancel_scope.cancel()


async def test_a_reply_past_what_the_call_takes_is_refused_before_its_body_and_not_retried() -> None:
    """A peer gone wrong (or a stranger that learned the secret) cannot make a node hold
    more than a call takes: the header's length is enough to refuse the reply, the
    connection is dropped, and the call is not sent again."""
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=10, secret=SECRET)
        payload = b"x" * (2 << 20)
        before = server.requests
        with pytest.raises(PeerUnavailable, match="a reply this call does not take") as excinfo:
            await peers.call("b", "echo", {}, [payload], max_reply_bytes=1 << 20)
        assert excinfo.value.errno == errno.EIO
        assert server.requests == before + 1  # not retried
        assert peers.stats["b"].idle == []  # its connection was dropped, not pooled
        reply, body = await peers.call("b", "echo", {}, [payload])  # the usual bound: taken
        assert reply["got"] == len(payload)
        assert len(body) == len(payload) + 1
        peers.close()
        nursery.cancel_scope.cancel()


async def test_a_body_of_many_small_parts_goes_in_few_sends_and_arrives_whole() -> None:
    """A shard's part of a batch of 100,000 small records was 100,000 parts, each sent by
    itself: a 200,000-item sample across two nodes took 1.25 s, and past the peer timeout
    under load it came back EAGAIN. Runs of small parts now go joined, big ones as they
    are (the same object, no copy), and the body arrives byte for byte."""
    small = [i.to_bytes(8, "little") for i in range(100_000)]
    big = memoryview(bytes(range(256)) * 512)  # 128 KiB: past JOIN_PART_BYTES
    parts: list[Payload] = [b"head", *small[:50_000], big, *small[50_000:]]
    pieces = list(_send_pieces(parts))
    assert len(pieces) <= 4  # head and 400 KB of records, the big part, 400 KB of records
    assert any(piece is big for piece in pieces)
    assert b"".join(pieces) == b"".join(parts)
    assert all(memoryview(p).nbytes <= SEND_JOIN_BYTES or p is big for p in pieces)
    many = [b"x" * 1000] * 3000  # 3 MB of small parts: cut at SEND_JOIN_BYTES
    assert 3 <= len(list(_send_pieces(many))) <= 4
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=10, secret=SECRET)
        reply, body = await peers.call("b", "echo", {"tag": "many"}, parts)
        assert reply["got"] == sum(memoryview(p).nbytes for p in parts)
        assert bytes(body) == b"".join(parts) + b"!"
        peers.close()
        nursery.cancel_scope.cancel()
