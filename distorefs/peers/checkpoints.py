"""Checkpoints across nodes: replicas, and directories made or removed under checkpoints/.

CheckpointReplicas is the Replicator the checkpoint policy is given at construction:
it sends a durable file to other live nodes (rendezvous placement by path) in parts
(`ckpt.begin`, `ckpt.part` ..., `ckpt.commit`; `ckpt.abort` when it gives up) and
returns once each holds it durably. CheckpointSync announces directories made or
removed under checkpoints/ here, applies other nodes' (a node that holds files in a
removed directory keeps it), replicates closed files of `replicas` > 1 directories once
they are durable, answers the `ckpt.*` ops and drops transfers whose sender went quiet.

Shared key (docs/cluster.md): ns/checkpoints/<path>   {} for a directory made under checkpoints/
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from distorefs.cluster.etcd import WatchEvent
from distorefs.cluster.rpc import Payload, PeerServer, meta_bytes, meta_id, meta_int
from distorefs.errors import Busy, DistorefsError, PeerUnavailable, RemoteError
from distorefs.peers.core import PART_BYTES, ClusterNode, in_parts
from distorefs.stores.checkpoints import REPLICA_IDLE_S, CheckpointPolicy, ReadPart
from distorefs.stores.files import MAX_FILE_BYTES
from distorefs.stores.replay.sharded import gather

log = logging.getLogger(__name__)


class CheckpointReplicas:
    """The checkpoint policy's Replicator over the peer protocol."""

    def __init__(self, node: ClusterNode, part_bytes: int = PART_BYTES) -> None:
        self._node = node
        self.part_bytes = part_bytes
        self.errors = 0

    async def replicate(self, path: bytes, mode: int, size: int, read: ReadPart, copies: int) -> None:
        """PeerUnavailable (EIO) if fewer than `copies` other live nodes can take it, or
        one fails (whatever its errno there: the writer's fsync says EIO, with the
        target's reason). Each part is read once and sent to every target at once, the
        next part read while one is on its way; every target is told to drop what it
        received when any fails. Busy (the file changed size) is the caller's to retry."""
        others = [n for n in self._node.place(path, 64) if n != self._node.me]
        if len(others) < copies:
            raise PeerUnavailable(
                f"{path.decode(errors='replace')}: {copies + 1} replicas asked, {len(others) + 1} live nodes"
            )
        targets = others[:copies]
        call = self._node.peers.call
        begun: dict[str, str] = {}

        async def begin(node: str) -> None:
            reply, _ = await call(node, "ckpt.begin", {"path": path, "mode": mode, "size": size})
            begun[node] = meta_id(reply, "transfer")

        try:
            await gather([partial(begin, n) for n in targets])
            await self._send_parts(targets, begun, size, read)
            await gather([partial(call, n, "ckpt.commit", {"transfer": begun[n]}) for n in targets])
        except BaseException as exc:
            if isinstance(exc, DistorefsError) and not isinstance(exc, Busy):
                self.errors += 1
            with trio.CancelScope(shield=True), trio.move_on_after(self._node.config.peer_timeout_s):
                await gather([partial(self._abort, n, t) for n, t in begun.items()])
            if isinstance(exc, RemoteError):
                raise PeerUnavailable(f"{path.decode(errors='replace')}: replica refused: {exc}") from None
            raise
        log.info("cluster: %s replicated to %s", path.decode(errors="replace"), ", ".join(targets))

    async def _send_parts(self, targets: list[str], begun: dict[str, str], size: int, read: ReadPart) -> None:
        """Every part to every target, each part read once (`in_parts`: the next read
        while one travels)."""
        call = self._node.peers.call

        async def part(offset: int, nbytes: int) -> None:
            data = await read(offset, nbytes)  # in slices: the body's buffers
            await gather(
                [partial(call, n, "ckpt.part", {"transfer": begun[n], "offset": offset}, data) for n in targets]
            )

        await in_parts(size, part, self.part_bytes)

    async def _abort(self, node: str, transfer: str) -> None:
        """Best effort: a target that misses it drops the transfer when it expires."""
        try:
            await self._node.peers.call(node, "ckpt.abort", {"transfer": transfer})
        except DistorefsError as exc:
            log.info("cluster: could not tell %s to drop replica transfer %s: %s", node, transfer, exc)


class CheckpointSync:
    kind = "checkpoints"

    def __init__(self, node: ClusterNode, checkpoints: CheckpointPolicy, replicas: CheckpointReplicas) -> None:
        self._node = node
        self._checkpoints = checkpoints
        self._replicas = replicas

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._replicate_closed, name="cluster checkpoint replication")
        nursery.start_soon(self._announce_dirs, name="cluster checkpoint dirs news")
        nursery.start_soon(self._expire_transfers, name="cluster checkpoint replicas expiry")

    def report(self) -> dict[str, Any]:
        return {
            "checkpoint_replicated": self._checkpoints.replicated,
            "checkpoint_replication_errors": self._replicas.errors,
            "checkpoint_replicas_received": self._checkpoints.replicas_received,
            "checkpoint_replicas_incoming": self._checkpoints.replicas_incoming,
            "checkpoint_replicas_dropped": self._checkpoints.replicas_dropped,
        }

    def register(self, server: PeerServer) -> None:
        server.register("ckpt.begin", self._on_begin)
        server.register("ckpt.part", self._on_part)
        server.register("ckpt.commit", self._on_commit)
        server.register("ckpt.abort", self._on_abort)

    async def _announce_dirs(self) -> None:
        """A directory made or removed under checkpoints/ here is made or removed on every
        node (the key is the path; a node keeps a removed directory that holds files)."""
        node = self._node
        while True:
            what, path = await self._checkpoints.news.next()
            key, shared = node.ns_key("checkpoints", path), node.shared("checkpoints", path)
            try:
                if what == "made" and shared is None:
                    await node.put_shared(key, b"{}")
                elif what == "removed" and shared is not None:
                    await node.delete_shared(key)
            except DistorefsError as exc:
                log.warning("cluster: could not announce %s of %s: %s", what, path.decode(errors="replace"), exc)

    def apply(self, name: bytes, event: WatchEvent, fetches: trio.Nursery) -> None:
        if event.kind == "put":
            self._checkpoints.make_dirs(name)
        else:
            self._checkpoints.remove_dir(name)

    async def _replicate_closed(self) -> None:
        """Closed (not fsync'ed) files under replicas > 1 become replicated once durable."""
        while True:
            ino = await self._checkpoints.replication_queue.next()
            counted = self._replicas.errors
            try:
                await self._checkpoints.replicate(ino)
            except (DistorefsError, KeyError, StopIteration) as exc:
                if self._replicas.errors == counted:  # (a failed send counts itself)
                    self._replicas.errors += 1
                log.warning("cluster: background replication of inode %d failed: %s", ino, exc)

    async def _expire_transfers(self) -> None:
        """Replicas being received whose sender went quiet are dropped (their bytes go)."""
        while True:
            await trio.sleep(REPLICA_IDLE_S / 6)
            self._checkpoints.expire_replicas()

    async def _on_begin(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        mode = meta_int(meta, "mode", 0, 0xFFFFFFFF)  # the sender's st_mode: the permission bits are kept
        size = meta_int(meta, "size", 0, MAX_FILE_BYTES)
        return {"transfer": (await self._checkpoints.begin_replica(meta_bytes(meta, "path"), mode, size)).encode()}, ()

    async def _on_part(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        offset = meta_int(meta, "offset", 0, MAX_FILE_BYTES)
        await self._checkpoints.write_replica(meta_id(meta, "transfer"), offset, body)
        return {}, ()

    async def _on_commit(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        return {"ino": await self._checkpoints.commit_replica(meta_id(meta, "transfer"))}, ()

    async def _on_abort(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        self._checkpoints.abort_replica(meta_id(meta, "transfer"))
        return {}, ()
