"""Replay buffers across nodes: the ShardPeer a sharded buffer calls, and the sync of
`ns/buffers/<name>`.

BufferPeers is what the BufferStore is given at construction (stores/replay/sharded.py's
ShardPeer): this node's name, which nodes are live, and the calls to another node's shard
(state, pick, commit, append, priorities) over cluster/rpc.py. BufferSync announces this
node's buffer news in etcd, applies other nodes' (create, reconfigure, delete, layout)
through store calls, and answers the shard requests.

Shared key (docs/cluster.md): ns/buffers/<name>   {"config": {...}, "layout": [node per shard]}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import trio

from distorefs import scheduling
from distorefs.cluster.etcd import WatchEvent
from distorefs.cluster.rpc import MAX_BODY_BYTES, Payload, PeerServer, ints_value, meta_int, meta_ints, split_payload
from distorefs.errors import DistorefsError, NotFound, PeerUnavailable, RemoteError, TryAgain
from distorefs.peers.core import ClusterNode
from distorefs.stores.replay.buffer import ReplayBuffer
from distorefs.stores.replay.config import MAX_BATCH_SIZE, BufferConfig
from distorefs.stores.replay.draws import Drawn, ShardState
from distorefs.stores.replay.store import BufferStore

log = logging.getLogger(__name__)

EAGAIN = 11
Reply = tuple[dict[str, Any], Sequence[Payload]]


class BufferPeers:
    """ShardPeer over the peer protocol."""

    def __init__(self, node: ClusterNode) -> None:
        self._node = node

    @property
    def me(self) -> str:
        return self._node.me

    def alive(self, node: str) -> bool:
        return self._node.alive(node)

    def shard_limit(self) -> int:
        return self._node.live_count()

    async def shard_state(self, node: str, name: str) -> ShardState:
        reply, _ = await self._node.peers.call(node, "buffer.state", {"name": name})
        return ShardState(reply["size"], reply["mass"], reply["min_mass"], reply["can_sample"])

    async def pick(self, node: str, name: str, count: int) -> Drawn:
        try:
            # a shard's part of a batch may pass the transport's usual bound on a big node:
            # the joined batch is checked against this node's own (ReplayBuffer.sample_into)
            meta = {"name": name, "count": count}
            reply, payload = await self._node.peers.call(node, "buffer.pick", meta, max_reply_bytes=MAX_BODY_BYTES)
        except RemoteError as exc:
            if exc.errno == EAGAIN:
                raise TryAgain(str(exc)) from None
            raise
        indices = meta_ints(reply, "indices")
        probabilities = None if reply["probabilities"] is None else np.frombuffer(reply["probabilities"], np.float64)
        if probabilities is not None and len(probabilities) != len(indices):
            raise PeerUnavailable(f"peer pick: {len(probabilities)} probabilities for {len(indices)} items")
        if "itemsize" not in reply:
            sizes = meta_ints(reply, "sizes")
            if len(sizes) != len(indices):
                raise PeerUnavailable(f"peer pick: {len(sizes)} sizes for {len(indices)} items")
            payloads: list[bytes | memoryview] = list(split_payload(payload, sizes.tolist()))
            return Drawn(indices, probabilities, payloads)
        # a schema buffer's records, back to back: one array (no view per record)
        itemsize = meta_int(reply, "itemsize", 1, MAX_BODY_BYTES)
        if len(payload) != len(indices) * itemsize:
            raise PeerUnavailable(f"peer pick: {len(payload)} bytes for {len(indices)} records of {itemsize}")
        return Drawn(indices, probabilities, np.frombuffer(payload, np.uint8).reshape(len(indices), itemsize))

    async def commit(self, node: str, name: str, indices: np.ndarray) -> None:
        meta = {"name": name, "indices": indices.astype(np.int64).tobytes()}
        await self._node.peers.call(node, "buffer.commit", meta)

    async def append(self, node: str, name: str, items: Sequence[bytes | bytearray], nonblocking: bool) -> list[int]:
        meta = {"name": name, "sizes": ints_value(len(i) for i in items), "nonblocking": nonblocking}
        reply, _ = await self._node.peers.call(node, "buffer.append", meta, items)
        indices: list[int] = meta_ints(reply, "indices").tolist()
        return indices

    async def update_priorities(self, node: str, name: str, indices: np.ndarray, priorities: np.ndarray) -> None:
        meta = {
            "name": name,
            "indices": indices.astype(np.int64).tobytes(),
            "priorities": priorities.astype(np.float64).tobytes(),
        }
        await self._node.peers.call(node, "buffer.priority", meta)


class BufferSync:
    """ns/buffers/ announce and apply, and the shard requests this node answers."""

    kind = "buffers"

    def __init__(self, node: ClusterNode, buffers: BufferStore) -> None:
        self._node = node
        self._buffers = buffers
        # Buffer news that applying another node's change will post: not announced back
        # (announcing them would race with that node's later changes).
        self._echoes: dict[str, int] = {}

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._announce, name="cluster buffer news")

    def report(self) -> dict[str, Any]:
        return {}

    # --- announce ---------------------------------------------------------------------------

    async def _announce(self) -> None:
        while True:
            what, name = await self._buffers.news.next()
            if self._echoes.get(name, 0) > 0:
                self._echoes[name] -= 1
                continue
            try:
                await self._announce_one(what, name)
            except (DistorefsError, ValueError) as exc:
                log.warning("cluster: could not announce buffer %s (%s): %s", name, what, exc)

    async def _announce_one(self, what: str, name: str) -> None:
        node = self._node
        shared = node.shared("buffers", name)
        if what == "deleted":
            if shared is not None:
                await node.delete_shared(node.ns_key("buffers", name))
            return
        try:
            buffer = self._buffers.get(name)
        except NotFound:
            return
        config = buffer.config.to_json()
        layout = list(shared["layout"]) if shared else [node.me]
        if len(layout) != buffer.config.shards:
            others = [n for n in node.place(name.encode(), 64) if n not in layout]
            layout = (layout + others)[: buffer.config.shards]
        if shared is not None and shared["config"] == config and shared["layout"] == layout:
            return
        await node.put_shared(node.ns_key("buffers", name), json.dumps({"config": config, "layout": layout}).encode())
        self._buffers.set_layout(name, layout)

    # --- apply ------------------------------------------------------------------------------

    def _echo(self, name: str) -> None:
        self._echoes[name] = self._echoes.get(name, 0) + 1

    def apply(self, raw_name: bytes, event: WatchEvent, fetches: trio.Nursery) -> None:
        name = raw_name.decode(errors="surrogateescape")
        log.info("cluster: buffers/%s %s by another node", name, "removed" if event.kind == "delete" else "changed")
        if event.kind == "delete":
            if name in self._buffers.names():
                self._echo(name)
                self._buffers.delete(name)
            return
        shared = json.loads(event.value)
        config = BufferConfig.from_json(f"buffers/{name}", shared["config"])
        if name in self._buffers.names():
            buffer = self._buffers.get(name)
            if buffer.config.to_json() != config.to_json():
                self._echo(name)
                try:
                    buffer.reconfigure(shared["config"])
                except DistorefsError:
                    self._echoes[name] -= 1
                    raise
        else:
            self._echo(name)
            self._buffers.create(name, config)
        self._buffers.set_layout(name, list(shared["layout"]))

    # --- what this node answers ---------------------------------------------------------------

    def register(self, server: PeerServer) -> None:
        server.register("buffer.state", self._on_state)
        server.register("buffer.pick", self._on_pick)
        server.register("buffer.commit", self._on_commit)
        server.register("buffer.append", self._on_append)
        server.register("buffer.priority", self._on_priority)

    def _shard(self, meta: dict[str, Any]) -> ReplayBuffer:
        return self._buffers.get(str(meta["name"]))

    async def _on_state(self, meta: dict[str, Any], body: memoryview) -> Reply:
        await scheduling.checkpoint()
        return asdict(self._shard(meta).shard_state()), ()

    async def _on_pick(self, meta: dict[str, Any], body: memoryview) -> Reply:
        drawn = await self._shard(meta).pick(meta_int(meta, "count", 1, MAX_BATCH_SIZE), nonblocking=True)
        probabilities = None if drawn.probabilities is None else drawn.probabilities.astype(np.float64).tobytes()
        reply: dict[str, Any] = {"indices": ints_value(drawn.indices), "probabilities": probabilities}
        if isinstance(drawn.payloads, np.ndarray):  # a schema buffer's records: one part
            records = np.ascontiguousarray(drawn.payloads)
            reply["itemsize"] = records.shape[1]
            return reply, [records.data.cast("B")]
        reply["sizes"] = ints_value(len(p) for p in drawn.payloads)
        return reply, drawn.payloads

    async def _on_commit(self, meta: dict[str, Any], body: memoryview) -> Reply:
        await scheduling.checkpoint()
        self._shard(meta).commit(np.frombuffer(meta["indices"], dtype=np.int64))
        return {}, ()

    async def _on_append(self, meta: dict[str, Any], body: memoryview) -> Reply:
        items = [bytes(part) for part in split_payload(body, meta_ints(meta, "sizes").tolist())]
        buffer = self._shard(meta)
        indices = await buffer.append_local(items, nonblocking=bool(meta.get("nonblocking")))
        await buffer.persist_appends()
        return {"indices": ints_value(indices)}, ()

    async def _on_priority(self, meta: dict[str, Any], body: memoryview) -> Reply:
        indices = np.frombuffer(meta["indices"], dtype=np.int64)
        priorities = np.frombuffer(meta["priorities"], dtype=np.float64)
        await self._shard(meta).apply_priorities(indices, priorities)
        return {}, ()
