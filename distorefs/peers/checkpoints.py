"""Checkpoints across nodes: replicas, and directories made or removed under checkpoints/.

CheckpointReplicas is the Replicator the checkpoint policy is given at construction:
it sends a durable file to other live nodes (rendezvous placement by path) and returns
once each holds it durably. CheckpointSync announces directories made or removed under
checkpoints/ here, applies other nodes' (a node that holds files in a removed directory
keeps it), replicates closed files of `replicas` > 1 directories once they are durable,
and answers `ckpt.put`.

Shared key (docs/cluster.md): ns/checkpoints/<path>   {} for a directory made under checkpoints/
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from distorefs.cluster.etcd import WatchEvent
from distorefs.cluster.rpc import Payload, PeerServer, meta_bytes, meta_int
from distorefs.errors import DistorefsError, PeerUnavailable
from distorefs.peers.core import ClusterNode
from distorefs.stores.checkpoints import CheckpointPolicy
from distorefs.stores.replay.sharded import gather

log = logging.getLogger(__name__)


class CheckpointReplicas:
    """The checkpoint policy's Replicator over the peer protocol."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node
        self.errors = 0

    async def replicate(self, path: bytes, mode: int, data: bytes | bytearray | memoryview, copies: int) -> None:
        """PeerUnavailable (EIO) if fewer than `copies` other live nodes can take it."""
        others = [n for n in self._node.place(path, 64) if n != self._node.me]
        if len(others) < copies:
            raise PeerUnavailable(
                f"{path.decode(errors='replace')}: {copies + 1} replicas asked, {len(others) + 1} live nodes"
            )
        meta = {"path": path, "mode": mode}
        targets = others[:copies]
        try:
            await gather([partial(self._node.peers.call, n, "ckpt.put", meta, [data]) for n in targets])
        except DistorefsError:
            self.errors += 1
            raise
        log.info("cluster: %s replicated to %s", path.decode(errors="replace"), ", ".join(targets))


class CheckpointSync:
    kind = "checkpoints"

    def __init__(self, node: ClusterNode, checkpoints: CheckpointPolicy, replicas: CheckpointReplicas) -> None:
        self._node = node
        self._checkpoints = checkpoints
        self._replicas = replicas

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._replicate_closed, name="cluster checkpoint replication")
        nursery.start_soon(self._announce_dirs, name="cluster checkpoint dirs news")

    def report(self) -> dict[str, Any]:
        return {
            "checkpoint_replicated": self._checkpoints.replicated,
            "checkpoint_replication_errors": self._replicas.errors,
        }

    def register(self, server: PeerServer) -> None:
        server.register("ckpt.put", self._on_put)

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
            try:
                await self._checkpoints.replicate(ino)
            except (DistorefsError, KeyError, StopIteration) as exc:
                self._replicas.errors += 1
                log.warning("cluster: background replication of inode %d failed: %s", ino, exc)

    async def _on_put(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        mode = meta_int(meta, "mode", 0, 0xFFFFFFFF)  # the sender's st_mode: the permission bits are kept
        ino = await self._checkpoints.receive_replica(meta_bytes(meta, "path"), mode, body)
        return {"ino": ino}, ()
