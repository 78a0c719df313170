"""Membership and placement: which daemons are alive, where each is listening, and which
of them own a given piece of data.

Owns this daemon's registration in etcd (a key under a lease that it keeps alive; when
the daemon dies the lease runs out and the key goes), mirrors of etcd prefixes kept
current by watches, and rendezvous placement over the live nodes. It moves no data
(`cluster/rpc.py` does) and does not know what buffers or weights are: the daemon's
cluster glue turns namespace events into store calls.

Keys (under the cluster root, `/distore/` by default):
    nodes/<name>        JSON NodeInfo, under the node's lease
    ns/<kind>/<name>    JSON, one per shared object (buffers, weights, checkpoint dirs ...)
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field

import trio

from distorefs.cluster.etcd import EtcdClient, KeyValue, WatchEvent
from distorefs.errors import ConfigError, PeerUnavailable

log = logging.getLogger(__name__)

RETRY_S = 0.5


@dataclass(frozen=True)
class NodeInfo:
    name: str
    host: str
    port: int
    transport: str = "tcp"
    pid: int = 0
    lend_bytes: int = 0  # DRAM this node keeps for peers' cold buffer items (--lend-memory)
    started_ns: int = field(default_factory=time.time_ns)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeInfo:
        return cls(**json.loads(data))


class PrefixMirror:
    """The keys under one etcd prefix, kept current by a watch.

    `items` maps the key (without the prefix) to its KeyValue; `changed` is set (and
    replaced) after each batch of changes. With `events`, every change is also sent
    there for a consumer that acts on it (the channel is bounded: a slow consumer holds
    the watch back, it does not lose changes).
    """

    def __init__(
        self, etcd: EtcdClient, prefix: bytes, events: trio.MemorySendChannel[WatchEvent] | None = None
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.items: dict[bytes, KeyValue] = {}
        self.changed = trio.Event()
        self._events = events
        self._revision = 0

    async def load(self) -> None:
        """Read the prefix whole; events for what appeared or went since the last load."""
        kvs, revision = await self.etcd.get_prefix(self.prefix)
        fresh = {kv.key[len(self.prefix) :]: kv for kv in kvs}
        events = [
            WatchEvent("delete", self.prefix + key, b"", revision) for key in self.items.keys() - fresh.keys()
        ] + [
            WatchEvent("put", kv.key, kv.value, kv.mod_revision)
            for key, kv in fresh.items()
            if key not in self.items or self.items[key].mod_revision != kv.mod_revision
        ]
        self.items = fresh
        self._revision = revision
        await self._announce(events)

    async def _announce(self, events: list[WatchEvent]) -> None:
        if not events:
            return
        self.changed.set()
        self.changed = trio.Event()
        if self._events is not None:
            for event in events:
                await self._events.send(event)

    async def run(self) -> None:
        """Background task: follow the prefix; after a broken watch, re-read and go on."""
        while True:
            try:
                async for events in self.etcd.watch_prefix(self.prefix, self._revision + 1):
                    for event in events:
                        key = event.key[len(self.prefix) :]
                        if event.kind == "delete":
                            self.items.pop(key, None)
                        else:
                            self.items[key] = KeyValue(event.key, event.value, event.mod_revision)
                        self._revision = max(self._revision, event.mod_revision)
                    await self._announce(events)
            except PeerUnavailable as exc:
                log.warning("cluster: %s; re-reading in %s s", exc, RETRY_S)
            await trio.sleep(RETRY_S)
            try:
                await self.load()
            except PeerUnavailable as exc:
                log.warning("cluster: cannot re-read %r: %s", self.prefix, exc)


def rendezvous(key: bytes, nodes: list[str], count: int) -> list[str]:
    """The `count` nodes that own `key`: highest random weight, so a node that leaves
    moves only its own keys and every daemon computes the same answer."""
    ranked = sorted(nodes, key=lambda node: hashlib.blake2b(key + b"\0" + node.encode(), digest_size=8).digest())
    return ranked[:count]


class Membership:
    """This node's lease and registration, and the live nodes.

    Examples:
        >>> members = Membership(etcd, b"/distore/", NodeInfo("a", "127.0.0.1", 7000), ttl_s=3)
        >>> await members.join()            # ConfigError if a live node has the name
        >>> nursery.start_soon(members.run)
        >>> members.place(b"ckpt/run1/step10", 2)
        ['a', 'c']
    """

    def __init__(self, etcd: EtcdClient, root: bytes, me: NodeInfo, ttl_s: int) -> None:
        self.etcd = etcd
        self.root = root
        self.me = me
        self.ttl_s = ttl_s
        self.lease = 0
        self.nodes = PrefixMirror(etcd, root + b"nodes/")
        self.lease_renewals = 0
        self.lease_losses = 0

    @property
    def _key(self) -> bytes:
        return self.root + b"nodes/" + self.me.name.encode()

    async def join(self) -> None:
        self.lease = await self.etcd.grant(self.ttl_s)
        if not await self.etcd.put_if(self._key, self.me.encode(), 0, lease=self.lease):
            holder = await self.etcd.get(self._key)
            await self.etcd.revoke(self.lease)
            other = NodeInfo.decode(holder.value) if holder else None
            raise ConfigError(
                f"node name {self.me.name!r} is taken by a live daemon"
                + (f" at {other.host}:{other.port} (pid {other.pid})" if other else "")
            )
        await self.nodes.load()
        log.info("cluster: joined as %s (lease %x, ttl %d s); nodes: %s", self.me.name, self.lease, self.ttl_s,
                 ", ".join(self.alive()))  # fmt: skip

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.nodes.run, name="cluster nodes watch")
            nursery.start_soon(self._keep_alive, name="cluster lease")

    async def _keep_alive(self) -> None:
        """Renew the lease at a third of its TTL; if it ran out (etcd unreachable for a
        while), register again under a new one."""
        while True:
            await trio.sleep(self.ttl_s / 3)
            try:
                if await self.etcd.keepalive(self.lease) > 0:
                    self.lease_renewals += 1
                    continue
                self.lease_losses += 1
                log.warning("cluster: lease %x expired; registering %s again", self.lease, self.me.name)
                self.lease = await self.etcd.grant(self.ttl_s)
                await self.etcd.put(self._key, self.me.encode(), lease=self.lease)
            except PeerUnavailable as exc:
                log.warning("cluster: lease renewal failed: %s", exc)

    async def leave(self) -> None:
        """Give the name back at once (a clean stop); bounded by the client timeout."""
        try:
            await self.etcd.revoke(self.lease)
        except PeerUnavailable as exc:
            log.warning("cluster: could not revoke the lease (it runs out in %d s): %s", self.ttl_s, exc)

    def alive(self) -> list[str]:
        return sorted(key.decode() for key in self.nodes.items)

    def info(self, name: str) -> NodeInfo | None:
        kv = self.nodes.items.get(name.encode())
        return NodeInfo.decode(kv.value) if kv is not None else None

    def place(self, key: bytes, count: int) -> list[str]:
        return rendezvous(key, self.alive(), count)
