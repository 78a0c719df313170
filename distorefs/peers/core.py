"""ClusterNode: one daemon's membership, peer server and client, and namespace plumbing.

Owns what every kind shares in multi-node mode: the etcd client, this node's
registration (cluster/membership.py), the peer server and transport (cluster/rpc.py),
the remote memory tier's client and lender, and the shared namespace under `ns/`:
reading it (`shared`), writing it (`put_shared`, `delete_shared`, remembering its own
writes so the watch does not apply them back) and dispatching other nodes' changes to
the kind that owns the key's first component. It imports no kind: daemon.py builds the
kinds (peers/buffers.py, weights.py, checkpoints.py, datasets.py) and adds them here.

Shared namespace keys (docs/cluster.md): ns/<kind>/<name>, each kind's value its own.
The cluster's secret, which every peer connection proves (cluster/rpc.py), is the key
`secret` under the root (made by the first node that finds none), or the contents of
`--cluster-secret-file` on every node.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import trio

from distorefs import scheduling
from distorefs.cluster.etcd import EtcdClient, WatchEvent
from distorefs.cluster.membership import Membership, NodeInfo, PrefixMirror
from distorefs.cluster.rpc import MIN_SECRET_BYTES, Payload, PeerServer, PeerTransport, choose_transport
from distorefs.errors import ConfigError, DistorefsError, PeerUnavailable
from distorefs.tiers.remote_memory import LentMemory, RemoteMemory

log = logging.getLogger(__name__)

PART_BYTES = 32 << 20  # big transfers between nodes (checkpoint replicas, weights) go in parts of this size
PARTS_IN_FLIGHT = 2  # a transfer's parts on their way at once (each on a pooled connection of its own)


async def in_parts(size: int, job: Callable[[int, int], Awaitable[None]], part_bytes: int = PART_BYTES) -> None:
    """Run `job(offset, nbytes)` for each part of `size` bytes, in order of offset and
    PARTS_IN_FLIGHT at once (so one part is read or written while another travels, and
    at most that many are held). The first DistorefsError is raised once the jobs
    running have stopped; no job starts after it."""
    in_flight = trio.Semaphore(PARTS_IN_FLIGHT)
    failed: list[DistorefsError] = []

    async def run(offset: int, nbytes: int) -> None:
        try:
            await job(offset, nbytes)
        except DistorefsError as exc:
            failed.append(exc)
            nursery.cancel_scope.cancel()
        finally:
            in_flight.release()

    async with trio.open_nursery() as nursery:
        for offset in range(0, size, part_bytes):
            await in_flight.acquire()
            nursery.start_soon(run, offset, min(part_bytes, size - offset))
    if failed:
        raise failed[0]


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
    secret_file: str | None = None  # None: the secret is etcd's (made by the first node)

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
        if self.secret_file is not None:
            read_secret_file(self.secret_file)


MAX_SECRET_FILE_BYTES = 4096


def read_secret_file(path: str) -> bytes:
    """The cluster's secret from `path`: its bytes, trailing whitespace cut, at least
    MIN_SECRET_BYTES; ConfigError when the file is missing, not a regular file, larger
    than MAX_SECRET_FILE_BYTES, or readable by anyone but its owner (chmod 600)."""
    try:
        # (a symlink is followed: Kubernetes mounts a secret as one; the file it names is checked)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"--cluster-secret-file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"--cluster-secret-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"--cluster-secret-file {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it (chmod 600)"
            )
        data = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"--cluster-secret-file {path}: more than {MAX_SECRET_FILE_BYTES} bytes")
    secret = data.rstrip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"--cluster-secret-file {path}: {len(secret)} bytes, fewer than {MIN_SECRET_BYTES} "
            "(make one with: head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE)"
        )
    return secret


class KindSync(Protocol):
    """One kind's cluster glue (peers/<kind>.py), as the core drives it."""

    kind: str  # the ns/<kind>/ key component it owns

    def register(self, server: PeerServer) -> None:
        """Register the peer requests this kind answers."""

    def start(self, nursery: trio.Nursery) -> None:
        """Start this kind's background tasks (announcing news, replication ...)."""

    def apply(self, name: bytes, event: WatchEvent, fetches: trio.Nursery) -> None:
        """Another node changed ns/<kind>/<name>; long work goes into `fetches`."""

    def report(self) -> dict[str, Any]:
        """Counters for `.distore/peers`."""


class ClusterNode:
    """Membership, peers and the shared namespace; kinds are added with `add`."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.me = config.node
        self.etcd = EtcdClient(config.url, timeout_s=min(config.peer_timeout_s, 5.0))
        self.root = config.root.encode()
        self.server = PeerServer()
        self.peers = PeerTransport(self._address, timeout_s=config.peer_timeout_s)
        self.lent = LentMemory(config.lend_bytes) if config.lend_bytes else None
        self.lenders: list[str] = []  # kept by _follow_members: DRAM evictions ask for it
        self.remote_memory = RemoteMemory(self.me, self.peers, lambda: self.lenders)
        self.transport, self.transport_reason = "tcp", ""
        self.secret_source = ""  # where the cluster's secret came from (`.distore/peers`)
        self.members: Membership | None = None
        send, self._events = trio.open_memory_channel[WatchEvent](256)
        self.ns = PrefixMirror(self.etcd, self.root + b"ns/", send)
        self._kinds: dict[bytes, KindSync] = {}
        # The revision of this node's last write of each ns key: the watch brings our own
        # writes back, and those (or older ones) must not be applied over newer local state.
        self._own: dict[bytes, int] = {}
        self._own_value: dict[bytes, bytes] = {}

    def add(self, kind: KindSync) -> None:
        """Let `kind` own ns/<kind.kind>/ keys and answer its peer requests (before start)."""
        self._kinds[kind.kind.encode()] = kind

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
        secret = await self._secret()
        self.server.secret = self.peers.secret = secret
        self.server.register("ping", self._on_ping)
        for kind in self._kinds.values():
            kind.register(self.server)
        if self.lent is not None:
            self.lent.register(self.server)
        port = await nursery.start(self.server.serve, self.config.listen_host, self.config.listen_port)
        info = NodeInfo(
            self.me, self.config.listen_host, port, self.transport, pid=os.getpid(), lend_bytes=self.config.lend_bytes
        )
        self.members = Membership(self.etcd, self.root, info, self.config.lease_ttl_s)
        try:
            await self.members.join()
        except PeerUnavailable as exc:
            raise ConfigError(f"cannot join the cluster at {self.config.url}: {exc}") from None
        nursery.start_soon(self.members.run, name="cluster membership")
        nursery.start_soon(self.remote_memory.run, name="remote memory spiller")
        nursery.start_soon(self._follow_members, name="cluster members follow")
        nursery.start_soon(self._apply_events, name="cluster namespace apply")
        await self.ns.load()
        nursery.start_soon(self.ns.run, name="cluster namespace watch")
        for kind in self._kinds.values():
            kind.start(nursery)

    async def _secret(self) -> bytes:
        """The cluster's secret: the file's, or etcd's key `secret` under the root, made
        here (random, 32 bytes hex) if no node has made it yet; ConfigError when etcd
        cannot be reached or holds one too short."""
        if self.config.secret_file is not None:
            self.secret_source = f"file {self.config.secret_file}"
            return read_secret_file(self.config.secret_file)
        key = self.root + b"secret"
        self.secret_source = f"etcd key {key.decode(errors='replace')}"
        try:
            found = await self.etcd.get(key)
            if found is None:
                await self.etcd.put_if(key, secrets.token_hex(32).encode(), 0)  # the first node's wins
                found = await self.etcd.get(key)
        except PeerUnavailable as exc:
            raise ConfigError(f"cannot join the cluster at {self.config.url}: {exc}") from None
        if found is None or len(found.value) < MIN_SECRET_BYTES:
            raise ConfigError(f"the cluster secret ({self.secret_source}) is missing or under {MIN_SECRET_BYTES} bytes")
        return found.value

    async def stop(self) -> None:
        """Leave the cluster at once (the lease is revoked) and close connections."""
        with trio.move_on_after(self.config.peer_timeout_s):
            await self.remote_memory.release_all()
        self.peers.close()
        if self.members is not None:
            with trio.move_on_after(self.etcd.timeout_s):
                await self.members.leave()
        await self.etcd.aclose()

    # --- members ----------------------------------------------------------------------------

    def _address(self, node: str) -> tuple[str, int] | None:
        info = self.members.info(node) if self.members else None
        return None if info is None else (info.host, info.port)

    def alive(self, node: str) -> bool:
        return self.members is not None and node.encode() in self.members.nodes.items

    def live_count(self) -> int:
        return len(self.members.alive()) if self.members else 1

    def place(self, key: bytes, count: int) -> list[str]:
        """Up to `count` live nodes for `key`, in rendezvous order (empty before joining)."""
        return self.members.place(key, count) if self.members else []

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

    # --- the shared namespace ---------------------------------------------------------------

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

    async def _apply_events(self) -> None:
        async with trio.open_nursery() as fetches:
            async for event in self._events:
                if event.mod_revision <= self._own.get(event.key, 0) or (
                    event.kind == "put" and self._own_value.get(event.key) == event.value
                ):
                    continue  # our own write (or one older than it) coming back
                key = event.key[len(self.ns.prefix) :]
                kind_name, _, name = key.partition(b"/")
                kind = self._kinds.get(kind_name)
                if kind is None:
                    log.warning("cluster: no kind owns %r; ignored", key)
                    continue
                try:
                    kind.apply(name, event, fetches)
                except DistorefsError as exc:
                    log.warning("cluster: cannot apply %s of %r: %s", event.kind, key, exc)

    # --- what the core answers and reports --------------------------------------------------

    async def _on_ping(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        await scheduling.checkpoint()
        return {"node": self.me, "time_ns": time.time_ns()}, ()

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
        report: dict[str, Any] = {
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
            "connections": self.server.connections,
            "refused_connections": self.server.refused_connections,
            "unauthenticated_connections": self.server.unauthenticated_connections,
            "secret": self.secret_source,
            "receive_budget_free_bytes": self.server.budget.free,
        }
        for kind in self._kinds.values():
            report.update(kind.report())
        report["remote_memory"] = {
            "lenders": self.lenders,
            "borrowed": asdict(self.remote_memory.statistics()),
            "lent": None if self.lent is None else asdict(self.lent.statistics()),
        }
        return report
