"""ClusterNode: the daemon's multi-node wiring (only with `distore mount --cluster`).

Owns the glue between the cluster parts (cluster/: etcd membership and the shared
namespace; tiers/remote.py: the peer protocol) and the stores: it
  - announces this node's namespace changes in etcd (news from the stores' outboxes),
  - applies other nodes' changes to the local stores (a watch of `ns/`),
  - answers peers' requests (the handlers below), and
  - implements the stores' remote needs: ShardPeer for sharded buffers, Replicator for
    checkpoints, fetch-once-per-version for weights.
It sits beside the daemon, above the stores, and never touches FUSE.

Shared namespace keys (docs/cluster.md):
    ns/buffers/<name>   {"config": {...}, "layout": [node per shard]}
    ns/weights/<name>   {"version": N, "node": publisher}
    ns/checkpoints/<path>   {} for a directory made under checkpoints/
    ns/datasets/<name>  {"node": writer, "config": {...}, "sealed": bool, "count": N}
                        (node_datasets.py)
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np
import trio

from distorefs.cluster.etcd import EtcdClient, WatchEvent
from distorefs.cluster.membership import Membership, NodeInfo, PrefixMirror
from distorefs.errors import ConfigError, DistorefsError, NotFound, PeerUnavailable, RemoteError, TryAgain
from distorefs.node_datasets import DatasetSync
from distorefs.stores.checkpoints import CheckpointStore
from distorefs.stores.datasets.store import DatasetStore
from distorefs.stores.replay.buffer import Drawn, ShardState
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.sharded import ShardedBuffer, ShardLayout, gather
from distorefs.stores.replay.store import BufferStore
from distorefs.stores.weights import WeightStore
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.remote import Payload, PeerServer, PeerTransport, choose_transport, split_payload
from distorefs.tiers.remote_memory import LentMemory, RemoteMemory

log = logging.getLogger(__name__)

EAGAIN = 11


@dataclass(frozen=True)
class ClusterConfig:
    url: str
    node: str
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    peer_timeout_s: float = 5.0
    lease_ttl_s: int = 3
    transport: str = "auto"
    lend_bytes: int = 0
    root: str = "/distore/"

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"--cluster must be an etcd URL like http://HOST:2379, got {self.url!r}")
        if not self.node or "/" in self.node or len(self.node) > 64:
            raise ConfigError(f"--node must be 1..64 characters without '/', got {self.node!r}")
        if not 0 < self.peer_timeout_s <= 600:
            raise ConfigError(f"--peer-timeout must be in (0, 600] seconds, got {self.peer_timeout_s}")
        if not 1 <= self.lease_ttl_s <= 600:
            raise ConfigError(f"--lease-ttl must be 1..600 seconds, got {self.lease_ttl_s}")
        if self.lend_bytes < 0:
            raise ConfigError(f"--lend-memory must not be negative, got {self.lend_bytes}")
        if self.transport not in ("auto", "tcp", "rdma"):
            raise ConfigError(f"--transport must be auto, tcp or rdma, got {self.transport!r}")


class ClusterNode:
    """One daemon's membership, peer server and client, and namespace sync."""

    def __init__(
        self,
        config: ClusterConfig,
        blocks: BlockStore,
        buffers: BufferStore,
        weights: WeightStore,
        checkpoints: CheckpointStore,
        datasets: DatasetStore,
    ) -> None:
        self.config = config
        self.me = config.node
        self.blocks = blocks
        self.buffers = buffers
        self.weights = weights
        self.checkpoints = checkpoints
        self.etcd = EtcdClient(config.url, timeout_s=min(config.peer_timeout_s, 5.0))
        self.root = config.root.encode()
        self.server = PeerServer()
        self.peers = PeerTransport(self._address, timeout_s=config.peer_timeout_s)
        self.dataset_sync = DatasetSync(self, datasets)
        self.lent = LentMemory(config.lend_bytes) if config.lend_bytes else None
        self.lenders: list[str] = []  # kept by _follow_members: DRAM evictions ask for it
        self.remote_memory = RemoteMemory(self.me, self.peers, lambda: self.lenders)
        self.transport, self.transport_reason = "tcp", ""
        self.members: Membership | None = None
        send, self._events = trio.open_memory_channel[WatchEvent](256)
        self.ns = PrefixMirror(self.etcd, self.root + b"ns/", send)
        self._fetching: set[bytes] = set()
        # Buffer news that applying another node's change will post: not announced back
        # (announcing them would race with that node's later changes).
        self._echoes: dict[str, int] = {}
        # The revision of this node's last write of each ns key: the watch brings our own
        # writes back, and those (or older ones) must not be applied over newer local state.
        self._own: dict[bytes, int] = {}
        self._own_value: dict[bytes, bytes] = {}
        self.weights_fetched = 0
        self.weights_fetch_errors = 0
        self.replication_errors = 0

    # --- start and stop -------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Listen, join, load the shared namespace and start following it. ConfigError
        if etcd cannot be reached or the node name is taken."""
        self.config.validate()
        try:
            self.transport, self.transport_reason = choose_transport(self.config.transport)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        log.info("cluster: data transport %s (%s)", self.transport, self.transport_reason)
        self._register_handlers()
        port = await nursery.start(self.server.serve, self.config.listen_host, self.config.listen_port)
        info = NodeInfo(
            self.me, self.config.listen_host, port, self.transport, pid=os.getpid(), lend_bytes=self.config.lend_bytes
        )
        self.members = Membership(self.etcd, self.root, info, self.config.lease_ttl_s)
        try:
            await self.members.join()
        except PeerUnavailable as exc:
            raise ConfigError(f"cannot join the cluster at {self.config.url}: {exc}") from None
        self.buffers.shard_limit = lambda: len(self.members.alive()) if self.members else 1
        self.checkpoints.replicator = self
        self.blocks.attach_remote(self.remote_memory)
        nursery.start_soon(self.members.run, name="cluster membership")
        nursery.start_soon(self.remote_memory.run, name="remote memory spiller")
        nursery.start_soon(self._follow_members, name="cluster members follow")
        nursery.start_soon(self._apply_events, name="cluster namespace apply")
        await self.ns.load()
        nursery.start_soon(self.ns.run, name="cluster namespace watch")
        nursery.start_soon(self._announce_buffers, name="cluster buffer news")
        nursery.start_soon(self._announce_weights, name="cluster weights news")
        nursery.start_soon(self.dataset_sync.announce, name="cluster dataset news")
        nursery.start_soon(self._replicate_closed, name="cluster checkpoint replication")
        nursery.start_soon(self._announce_checkpoint_dirs, name="cluster checkpoint dirs news")

    async def stop(self) -> None:
        """Leave the cluster at once (the lease is revoked) and close connections."""
        with trio.move_on_after(self.config.peer_timeout_s):
            await self.remote_memory.release_all()
        self.peers.close()
        if self.members is not None:
            with trio.move_on_after(self.etcd.timeout_s):
                await self.members.leave()
        await self.etcd.aclose()

    def _address(self, node: str) -> tuple[str, int] | None:
        info = self.members.info(node) if self.members else None
        return None if info is None else (info.host, info.port)

    def alive(self, node: str) -> bool:
        return self.members is not None and node.encode() in self.members.nodes.items

    def _lenders(self) -> list[str]:
        """Live nodes, other than this one, that lend memory for cold buffer items."""
        members = self.members
        if members is None:
            return []
        infos = (members.info(name) for name in members.alive() if name != self.me)
        return [info.name for info in infos if info is not None and info.lend_bytes > 0]

    async def _follow_members(self) -> None:
        """Keep `lenders` current. When a node leaves: its borrowed items are dropped here,
        and what it held for this node is read from the log again."""
        assert self.members is not None
        known = set(self.members.alive())
        self.lenders = self._lenders()
        while True:
            await self.members.nodes.changed.wait()
            self.lenders = self._lenders()
            now = set(self.members.alive())
            for gone in known - now:
                log.info("cluster: node %s left", gone)
                self.remote_memory.forget_node(gone)
                self.peers.forget(gone)
                if self.lent is not None:
                    self.lent.drop(gone)
            known = now

    # --- namespace: announce ---------------------------------------------------------------

    def ns_key(self, kind: str, name: str | bytes) -> bytes:
        raw = name.encode() if isinstance(name, str) else name
        return self.root + b"ns/" + kind.encode() + b"/" + raw

    def shared(self, kind: str, name: str | bytes) -> Any:
        kv = self.ns.items.get(self.ns_key(kind, name)[len(self.ns.prefix) :])
        return None if kv is None else kv.json()

    async def put_shared(self, key: bytes, value: bytes) -> None:
        self._own_value[key] = value  # set before the await: the watch may bring it back first
        self._own[key] = await self.etcd.put(key, value)

    async def delete_shared(self, key: bytes) -> None:
        self._own[key] = await self.etcd.delete(key)

    async def _announce_buffers(self) -> None:
        while True:
            what, name = await self.buffers.news.next()
            if self._echoes.get(name, 0) > 0:
                self._echoes[name] -= 1
                continue
            try:
                await self._announce_buffer(what, name)
            except (DistorefsError, ValueError) as exc:
                log.warning("cluster: could not announce buffer %s (%s): %s", name, what, exc)

    async def _announce_buffer(self, what: str, name: str) -> None:
        shared = self.shared("buffers", name)
        if what == "deleted":
            if shared is not None:
                await self.delete_shared(self.ns_key("buffers", name))
            return
        try:
            buffer = self.buffers.get(name)
        except NotFound:
            return
        config = buffer.config.to_json()
        layout = list(shared["layout"]) if shared else [self.me]
        if len(layout) != buffer.config.shards:
            others = [n for n in self.members.place(name.encode(), 64) if n not in layout] if self.members else []
            layout = (layout + others)[: buffer.config.shards]
        if shared is not None and shared["config"] == config and shared["layout"] == layout:
            return
        await self.put_shared(self.ns_key("buffers", name), json.dumps({"config": config, "layout": layout}).encode())
        self._route(name, config, layout)

    async def _announce_checkpoint_dirs(self) -> None:
        """A directory made or removed under checkpoints/ here is made or removed on every
        node (the key is the path; a node keeps a removed directory that holds files)."""
        while True:
            what, path = await self.checkpoints.news.next()
            key, shared = self.ns_key("checkpoints", path), self.shared("checkpoints", path)
            try:
                if what == "made" and shared is None:
                    await self.put_shared(key, b"{}")
                elif what == "removed" and shared is not None:
                    await self.delete_shared(key)
            except DistorefsError as exc:
                log.warning("cluster: could not announce %s of %s: %s", what, path.decode(errors="replace"), exc)

    async def _announce_weights(self) -> None:
        while True:
            what, name = await self.weights.news.next()
            try:
                shared = self.shared("weights", name)
                if what == "deleted":
                    if shared is not None:
                        await self.delete_shared(self.ns_key("weights", name))
                    continue
                model = self.weights.models.get(name)
                if model is None:
                    continue
                if shared is None or model.version > int(shared["version"]):
                    value = {"version": model.version, "node": self.me}
                    await self.put_shared(self.ns_key("weights", name), json.dumps(value).encode())
            except DistorefsError as exc:
                log.warning("cluster: could not announce weights/%s (%s): %s", name.decode(errors="replace"), what, exc)

    # --- namespace: apply other nodes' changes ---------------------------------------------

    async def _apply_events(self) -> None:
        async with trio.open_nursery() as fetches:
            async for event in self._events:
                if event.mod_revision <= self._own.get(event.key, 0) or (
                    event.kind == "put" and self._own_value.get(event.key) == event.value
                ):
                    continue  # our own write (or one older than it) coming back
                key = event.key[len(self.ns.prefix) :]
                kind, _, name = key.partition(b"/")
                try:
                    if kind == b"buffers":
                        self._apply_buffer(name.decode(errors="surrogateescape"), event)
                    elif kind == b"weights":
                        self._apply_weights(name, event, fetches)
                    elif kind == b"datasets":
                        self.dataset_sync.apply(name.decode(errors="surrogateescape"), event, fetches)
                    elif kind == b"checkpoints" and event.kind == "put":
                        self.checkpoints.make_dirs(name)
                    elif kind == b"checkpoints":
                        self.checkpoints.remove_dir(name)
                except DistorefsError as exc:
                    log.warning("cluster: cannot apply %s of %r: %s", event.kind, key, exc)

    def _apply_buffer(self, name: str, event: WatchEvent) -> None:
        log.info("cluster: buffers/%s %s by another node", name, "removed" if event.kind == "delete" else "changed")
        if event.kind == "delete":
            if name in self.buffers.names():
                self._echo(name)
                self.buffers.delete(name)
            return
        shared = json.loads(event.value)
        config = BufferConfig.from_json(f"buffers/{name}", shared["config"])
        if name in self.buffers.names():
            buffer = self.buffers.get(name)
            if buffer.config.to_json() != config.to_json():
                self._echo(name)
                try:
                    buffer.reconfigure(shared["config"])
                except DistorefsError:
                    self._echoes[name] -= 1
                    raise
        else:
            self._echo(name)
            self.buffers.create(name, config)
        self._route(name, shared["config"], shared["layout"])

    def _echo(self, name: str) -> None:
        self._echoes[name] = self._echoes.get(name, 0) + 1

    def _route(self, name: str, config_json: dict[str, Any], layout: list[str]) -> None:
        """Give the local buffer a router unless it is a whole buffer of this node."""
        buffer = self.buffers.get(name)
        if layout == [self.me]:
            buffer.router = None
            return
        local = buffer if self.me in layout else None
        buffer.router = ShardedBuffer(name, buffer.config, ShardLayout(list(layout)), self.me, local, self, self.alive)

    def _apply_weights(self, name: bytes, event: WatchEvent, fetches: trio.Nursery) -> None:
        if event.kind == "delete":
            model = self.weights.models.get(name)
            if model is not None:
                fetches.start_soon(self._drop_model, name)
            return
        shared = json.loads(event.value)
        model = self.weights.models.get(name)
        if model is None:
            model = self.weights.create_model(name)
        if shared["node"] != self.me and int(shared["version"]) > model.version and name not in self._fetching:
            self._fetching.add(name)
            fetches.start_soon(self._fetch_weights, name, str(shared["node"]))

    async def _drop_model(self, name: bytes) -> None:
        model = self.weights.models.get(name)
        if model is None:
            return
        if model.files:
            await self.weights.publish(model, {}, replace_all=True)
        if name in self.weights.models:
            self.weights.remove_model(name)

    async def _fetch_weights(self, name: bytes, node: str) -> None:
        """Fetch the model's current version from `node` once for this node, and publish
        it here under the same number (which wakes this node's `wait` readers). Fetches
        again while a newer version is announced than the one installed."""
        try:
            while True:
                shared = self.shared("weights", name)
                model = self.weights.models.get(name)
                if shared is None or model is None or int(shared["version"]) <= model.version:
                    return
                node = str(shared["node"])
                try:
                    reply, payload = await self.peers.call(node, "weights.fetch", {"model": name})
                except DistorefsError as exc:
                    self.weights_fetch_errors += 1
                    log.warning(
                        "cluster: fetching weights/%s from %s failed: %s", name.decode(errors="replace"), node, exc
                    )
                    return
                parts = split_payload(payload, [size for _name, size in reply["files"]])
                files = [(bytes(name), part) for (name, _size), part in zip(reply["files"], parts, strict=True)]
                await self.weights.install(model, int(reply["version"]), files)
                self.weights_fetched += 1
        finally:
            self._fetching.discard(name)

    # --- ShardPeer (sharded buffers) ---------------------------------------------------------

    async def shard_state(self, node: str, name: str) -> ShardState:
        reply, _ = await self.peers.call(node, "buffer.state", {"name": name})
        return ShardState(reply["size"], reply["mass"], reply["min_mass"], reply["can_sample"])

    async def draw(self, node: str, name: str, count: int) -> Drawn:
        try:
            reply, payload = await self.peers.call(node, "buffer.draw", {"name": name, "count": count})
        except RemoteError as exc:
            if exc.errno == EAGAIN:
                raise TryAgain(str(exc)) from None
            raise
        indices = np.frombuffer(reply["indices"], dtype=np.int64)
        probabilities = None if reply["probabilities"] is None else np.frombuffer(reply["probabilities"], np.float64)
        payloads: list[bytes | memoryview] = list(split_payload(payload, reply["sizes"]))
        return Drawn(indices, probabilities, payloads)

    async def append(self, node: str, name: str, items: Sequence[bytes | bytearray], nonblocking: bool) -> list[int]:
        meta = {"name": name, "sizes": [len(i) for i in items], "nonblocking": nonblocking}
        reply, _ = await self.peers.call(node, "buffer.append", meta, items)
        return list(reply["indices"])

    async def update_priorities(self, node: str, name: str, indices: np.ndarray, priorities: np.ndarray) -> None:
        meta = {
            "name": name,
            "indices": indices.astype(np.int64).tobytes(),
            "priorities": priorities.astype(np.float64).tobytes(),
        }
        await self.peers.call(node, "buffer.priority", meta)

    # --- Replicator (checkpoints) --------------------------------------------------------------

    async def replicate(self, ino: int, path: bytes, copies: int) -> None:
        """Send the file to `copies` other live nodes (rendezvous placement by path) and
        return once each has it durably; PeerUnavailable (EIO) if too few can."""
        others = [n for n in self.members.place(path, 64) if n != self.me] if self.members else []
        if len(others) < copies:
            raise PeerUnavailable(
                f"{path.decode(errors='replace')}: {copies + 1} replicas asked, {len(others) + 1} live nodes"
            )
        inode = self.checkpoints.files.get(ino)
        data = await self.checkpoints.files.read(ino, 0, inode.size)
        meta = {"path": path, "mode": inode.mode}
        targets = others[:copies]
        try:
            await gather([partial(self.peers.call, n, "ckpt.put", meta, [data]) for n in targets])
        except DistorefsError:
            self.replication_errors += 1
            raise
        log.info("cluster: %s replicated to %s", path.decode(errors="replace"), ", ".join(targets))

    async def _replicate_closed(self) -> None:
        """Closed (not fsync'ed) files under replicas > 1 become replicated once durable."""
        while True:
            ino = await self.checkpoints.replication_queue.next()
            try:
                await self.checkpoints.replicate(ino)
            except (DistorefsError, KeyError, StopIteration) as exc:
                self.replication_errors += 1
                log.warning("cluster: background replication of inode %d failed: %s", ino, exc)

    # --- handlers: what this node answers ------------------------------------------------------

    def _register_handlers(self) -> None:
        server = self.server
        server.register("ping", self._on_ping)
        server.register("weights.fetch", self._on_weights_fetch)
        server.register("buffer.state", self._on_buffer_state)
        server.register("buffer.draw", self._on_buffer_draw)
        server.register("buffer.append", self._on_buffer_append)
        server.register("buffer.priority", self._on_buffer_priority)
        server.register("ckpt.put", self._on_ckpt_put)
        server.register("dataset.read", self.dataset_sync.on_read)
        if self.lent is not None:
            self.lent.register(server)

    async def _on_ping(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        await trio.lowlevel.checkpoint()
        return {"node": self.me, "time_ns": time.time_ns()}, ()

    async def _on_weights_fetch(
        self, meta: dict[str, Any], body: memoryview
    ) -> tuple[dict[str, Any], Sequence[Payload]]:
        model = self.weights.model(bytes(meta["model"]))
        files = dict(model.files)
        version = model.version
        for wf in files.values():
            self.weights.hold(wf)
        try:
            parts = [await self.weights.read(wf, 0, wf.size) for wf in files.values()]
        finally:
            for wf in files.values():
                self.weights.release(wf)
        listing = [[name, len(part)] for name, part in zip(files, parts, strict=True)]
        return {"version": version, "files": listing}, parts

    def _shard(self, meta: dict[str, Any]) -> Any:
        return self.buffers.get(str(meta["name"]))

    async def _on_buffer_state(
        self, meta: dict[str, Any], body: memoryview
    ) -> tuple[dict[str, Any], Sequence[Payload]]:
        await trio.lowlevel.checkpoint()
        return asdict(self._shard(meta).shard_state()), ()

    async def _on_buffer_draw(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        drawn = await self._shard(meta).draw(int(meta["count"]), nonblocking=True)
        probabilities = None if drawn.probabilities is None else drawn.probabilities.astype(np.float64).tobytes()
        reply = {
            "indices": drawn.indices.astype(np.int64).tobytes(),
            "probabilities": probabilities,
            "sizes": [len(p) for p in drawn.payloads],
        }
        return reply, drawn.payloads

    async def _on_buffer_append(
        self, meta: dict[str, Any], body: memoryview
    ) -> tuple[dict[str, Any], Sequence[Payload]]:
        items = [bytes(part) for part in split_payload(body, meta["sizes"])]
        buffer = self._shard(meta)
        indices = await buffer.append(items, nonblocking=bool(meta.get("nonblocking")))
        await buffer.persist()
        return {"indices": indices}, ()

    async def _on_buffer_priority(
        self, meta: dict[str, Any], body: memoryview
    ) -> tuple[dict[str, Any], Sequence[Payload]]:
        await trio.lowlevel.checkpoint()
        indices = np.frombuffer(meta["indices"], dtype=np.int64)
        priorities = np.frombuffer(meta["priorities"], dtype=np.float64)
        self._shard(meta).update_priorities(indices, priorities)
        return {}, ()

    async def _on_ckpt_put(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        ino = await self.checkpoints.receive_replica(bytes(meta["path"]), int(meta["mode"]), body)
        return {"ino": ino}, ()

    # --- `.distore/peers` ----------------------------------------------------------------------

    def peers_report(self) -> dict[str, Any]:
        members = self.members
        nodes = []
        for name in members.alive() if members else []:
            info = members.info(name) if members else None
            stats = self.peers.stats.get(name)
            nodes.append(
                {
                    "node": name,
                    "address": f"{info.host}:{info.port}" if info else None,
                    "transport": info.transport if info else None,
                    "self": name == self.me,
                    **({} if stats is None else stats.report()),
                }
            )
        dead = [
            {"node": name, "live": False, **stats.report()}
            for name, stats in self.peers.stats.items()
            if not self.alive(name)
        ]
        return {
            "mode": "cluster",
            "node": self.me,
            "cluster": self.config.url,
            "listen": f"{self.config.listen_host}:{self.server.port}",
            "transport": self.transport,
            "transport_reason": self.transport_reason,
            "peer_timeout_s": self.config.peer_timeout_s,
            "lease_ttl_s": self.config.lease_ttl_s,
            "live_nodes": nodes,
            "unreachable_or_gone": dead,
            "requests_served": self.server.requests,
            "request_errors": self.server.errors,
            "weights_fetched": self.weights_fetched,
            "weights_fetch_errors": self.weights_fetch_errors,
            "checkpoint_replicated": self.checkpoints.replicated,
            "checkpoint_replication_errors": self.replication_errors,
            "datasets_fetched_records": self.dataset_sync.fetched_records,
            "datasets_fetch_errors": self.dataset_sync.fetch_errors,
            "remote_memory": {
                "lenders": self.lenders,
                "borrowed": asdict(self.remote_memory.statistics()),
                "lent": None if self.lent is None else asdict(self.lent.statistics()),
            },
        }
