"""The peer protocol on loopback: a real PeerServer and PeerTransport over TCP."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
import trio

from distorefs.cluster.rpc import HEADER, MAGIC, Payload, PeerServer, PeerTransport, choose_transport
from distorefs.errors import NotFound, PeerUnavailable, RemoteError


async def echo(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
    await trio.lowlevel.checkpoint()
    return {"got": len(body), "tag": meta.get("tag")}, [body, b"!"]


async def refuse(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
    await trio.lowlevel.checkpoint()
    raise NotFound("no such thing 42")


async def hang(meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
    await trio.sleep_forever()
    raise AssertionError


async def start_server(nursery: trio.Nursery, port: int = 0) -> PeerServer:
    server = PeerServer()
    for op, handler in (("echo", echo), ("refuse", refuse), ("hang", hang)):
        server.register(op, handler)
    await nursery.start(server.serve, "127.0.0.1", port)
    return server


async def test_a_call_carries_meta_and_a_large_payload_both_ways() -> None:
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=10)
        payload = bytes(range(256)) * (64 * 1024)  # 16 MiB
        reply, body = await peers.call("b", "echo", {"tag": "x"}, [payload[:100], memoryview(payload)[100:]])
        assert reply == {"ok": True, "got": len(payload), "tag": "x"}
        assert bytes(body) == payload + b"!"
        assert peers.stats["b"].calls == 1
        assert peers.stats["b"].bytes_received == len(payload) + 1
        peers.close()
        nursery.cancel_scope.cancel()


async def test_a_peer_error_comes_back_with_its_errno() -> None:
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port))
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
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port), timeout_s=3.0)
        started = trio.current_time()
        with pytest.raises(PeerUnavailable, match=r"peer b did not answer within 3 s \(hang\)") as excinfo:
            await peers.call("b", "hang")
        assert excinfo.value.errno == errno.EIO
        assert trio.current_time() - started == pytest.approx(3.0)
        peers.close()
        nursery.cancel_scope.cancel()


async def test_an_unknown_or_closed_peer_is_eio_after_bounded_retries() -> None:
    peers = PeerTransport(lambda node: None)
    with pytest.raises(PeerUnavailable, match="is not a live member"):
        await peers.call("gone", "echo")
    with trio.socket.socket() as sock:  # a port nobody listens on
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    peers = PeerTransport(lambda node: ("127.0.0.1", port), retries=2)
    with pytest.raises(PeerUnavailable, match="unreachable"):
        await peers.call("b", "echo")
    assert peers.stats["b"].retries == 2
    assert peers.stats["b"].failures == 1


async def test_the_client_reconnects_after_the_peer_restarts() -> None:
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as first:
            server = await start_server(first)
            port = server.port
            peers = PeerTransport(lambda node: ("127.0.0.1", port))
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
    ]
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery)
        for frame in frames:
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            await stream.send_all(frame)
            with trio.fail_after(5):
                assert await stream.receive_some(4096) == b""  # dropped, no reply
            await stream.aclose()
        before = resident_bytes()
        claim = await trio.open_tcp_stream("127.0.0.1", server.port)
        await claim.send_all(HEADER.pack(MAGIC, 1, len(meta), 32 << 30) + meta + b"x" * 4096)
        peers = PeerTransport(lambda node: ("127.0.0.1", server.port))
        reply, body = await peers.call("b", "echo", {"tag": "after"}, [b"abc"])
        assert reply == {"ok": True, "got": 3, "tag": "after"}
        assert bytes(body) == b"abc!"
        assert resident_bytes() - before < 256 << 20
        assert server.errors == len(frames)
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
