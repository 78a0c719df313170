"""The peer protocol on loopback: a real PeerServer and PeerTransport over TCP."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import pytest
import trio

from distorefs.cluster.rpc import Payload, PeerServer, PeerTransport, choose_transport
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


def test_transport_choice_falls_back_to_tcp_without_an_rdma_device() -> None:
    assert choose_transport("tcp") == ("tcp", "--transport tcp")
    name, reason = choose_transport("auto")
    assert name == "tcp"
    assert reason  # says why: no pyverbs, no device, or the RDMA path not built
    with pytest.raises(ValueError, match="--transport rdma: no usable RDMA transport"):
        choose_transport("rdma")
