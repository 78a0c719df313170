"""Weights across nodes: a version published anywhere is fetched once per node.

Announces this node's publishes in `ns/weights/<model>` and, when another node publishes
a newer version, fetches all of that version's files from it and installs them here
under the same number (which wakes this node's `wait` readers). A version of up to 32 MiB
comes in the reply to `weights.fetch`; a bigger one is held by the publisher for the
fetch (a session) and pulled in parts of 32 MiB (`weights.part`, two in flight), then
let go (`weights.done`; a session no part was asked of for 60 s goes by itself).
Answers these ops for versions published here.

Shared key (docs/cluster.md): ns/weights/<name>   {"version": N, "node": publisher}
"""

from __future__ import annotations

import errno
import json
import logging
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from distorefs.cluster.etcd import WatchEvent
from distorefs.cluster.rpc import Payload, PeerServer, meta_bytes, meta_id, meta_int, split_payload
from distorefs.errors import Busy, Corrupted, DistorefsError, InvalidArgument, NotFound, RemoteError
from distorefs.peers.core import PART_BYTES, ClusterNode, in_parts
from distorefs.scheduling import read_sliced, write_sliced
from distorefs.stores.weights import MAX_WEIGHT_FILE_BYTES, Model, WeightFile, WeightStore

log = logging.getLogger(__name__)

MAX_FETCH_SESSIONS = 16  # versions held for other nodes' fetches at once
FETCH_IDLE_S = 60.0  # a session no part was asked of for this long goes (its fetcher is gone)
PART_MAX_BYTES = 64 << 20  # the most one `weights.part` returns
FETCH_ATTEMPTS = 3  # tries of a fetch that fails (the publisher unreachable, an error there)
FETCH_RETRY_S = 0.5  # the first wait before a fetch is tried again (then doubling, at most 5 s)
FETCH_BUSY_FOR_S = 600.0  # how long a fetch waits for a publisher busy with others' fetches


def _listing(reply: dict[str, Any]) -> list[tuple[bytes, int]]:
    """A fetch reply's files, [name, size] pairs; EINVAL for anything else."""
    files = reply.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, list) and len(f) == 2 and isinstance(f[0], bytes) and isinstance(f[1], int) for f in files
    ):
        raise InvalidArgument(f"a weights.fetch reply's files are not [name, size] pairs: {files!r:.200}")
    if any(not 0 <= size <= MAX_WEIGHT_FILE_BYTES for _name, size in files):
        raise InvalidArgument(f"a file size out of range in {files!r:.200}")
    return [(name, size) for name, size in files]


@dataclass
class _Session:
    """A version held for another node's fetch in parts: its files stay readable (and
    their bytes kept) until `weights.done` or the session's expiry, whatever is
    published meanwhile."""

    files: list[WeightFile]
    last: float


class WeightSync:
    kind = "weights"

    def __init__(self, node: ClusterNode, weights: WeightStore, part_bytes: int = PART_BYTES) -> None:
        self._node = node
        self._weights = weights
        self.part_bytes = part_bytes
        self._fetching: set[bytes] = set()
        self._sessions: dict[str, _Session] = {}
        self.fetched = 0
        self.fetch_errors = 0
        self.fetch_waits = 0  # waits for a busy publisher
        self.sessions_expired = 0

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._announce, name="cluster weights news")
        nursery.start_soon(self._expire_sessions, name="cluster weights fetch sessions expiry")

    def report(self) -> dict[str, Any]:
        return {
            "weights_fetched": self.fetched,
            "weights_fetch_errors": self.fetch_errors,
            "weights_fetch_waits": self.fetch_waits,
            "weights_fetch_sessions": len(self._sessions),
            "weights_fetch_sessions_expired": self.sessions_expired,
        }

    def register(self, server: PeerServer) -> None:
        server.register("weights.fetch", self._on_fetch)
        server.register("weights.part", self._on_part)
        server.register("weights.done", self._on_done)

    async def _announce(self) -> None:
        node = self._node
        while True:
            what, name = await self._weights.news.next()
            try:
                shared = node.shared("weights", name)
                if what == "deleted":
                    if shared is not None:
                        await node.delete_shared(node.ns_key("weights", name))
                    continue
                model = self._weights.models.get(name)
                if model is None:
                    continue
                if shared is None or model.version > int(shared["version"]):
                    value = {"version": model.version, "node": node.me}
                    await node.put_shared(node.ns_key("weights", name), json.dumps(value).encode())
            except DistorefsError as exc:
                log.warning("cluster: could not announce weights/%s (%s): %s", name.decode(errors="replace"), what, exc)

    def apply(self, name: bytes, event: WatchEvent, fetches: trio.Nursery) -> None:
        if event.kind == "delete":
            if self._weights.models.get(name) is not None:
                fetches.start_soon(self._drop_model, name)
            return
        shared = json.loads(event.value)
        model = self._weights.models.get(name)
        if model is None:
            model = self._weights.create_model(name)
        if shared["node"] != self._node.me and int(shared["version"]) > model.version and name not in self._fetching:
            self._fetching.add(name)
            fetches.start_soon(self._fetch, name)

    async def _drop_model(self, name: bytes) -> None:
        model = self._weights.models.get(name)
        if model is None:
            return
        if model.files:
            await self._weights.publish(model, {}, replace_all=True)
        if name in self._weights.models:
            self._weights.remove_model(name)

    async def _fetch(self, name: bytes) -> None:
        """Fetch the model's current version once for this node, and publish it here
        under the same number. Fetches again while a newer version is announced than
        the one installed. A publisher that holds MAX_FETCH_SESSIONS versions for other
        nodes' fetches already (EBUSY there: a big model's fan-out to many nodes) is
        asked again after a wait, for FETCH_BUSY_FOR_S; a fetch that fails otherwise is
        tried FETCH_ATTEMPTS times in all, then left for the next version."""
        failures, busy_since, wait = 0, None, FETCH_RETRY_S
        try:
            while True:
                shared = self._node.shared("weights", name)
                model = self._weights.models.get(name)
                if shared is None or model is None or int(shared["version"]) <= model.version:
                    return
                node = str(shared["node"])
                now = trio.current_time()
                try:
                    await self._fetch_once(node, model, name)
                except (DistorefsError, KeyError, TypeError, ValueError) as exc:  # (a reply's fields)
                    if isinstance(exc, RemoteError) and exc.errno == errno.EBUSY:
                        busy_since = now if busy_since is None else busy_since
                        if now - busy_since < FETCH_BUSY_FOR_S:
                            self.fetch_waits += 1
                            await trio.sleep(wait * random.uniform(0.5, 1.5))
                            wait = min(2 * wait, 5.0)
                            continue
                    failures += 1
                    if not await self._failed(name, node, exc, failures):
                        return
                    continue
                self.fetched += 1
                failures, busy_since, wait = 0, None, FETCH_RETRY_S
        finally:
            self._fetching.discard(name)

    async def _failed(self, name: bytes, node: str, exc: Exception, failures: int) -> bool:
        """Count and log a failed fetch; whether to try again (after a wait)."""
        self.fetch_errors += 1
        log.warning(
            "cluster: fetching weights/%s from %s failed (try %d of %d): %s",
            name.decode(errors="replace"), node, failures, FETCH_ATTEMPTS, exc,
        )  # fmt: skip
        if failures >= FETCH_ATTEMPTS:
            return False
        await trio.sleep(FETCH_RETRY_S * failures)
        return True

    async def _fetch_once(self, node: str, model: Model, name: bytes) -> None:
        """One fetch of the version `node` publishes now, installed here."""
        reply, payload = await self._node.peers.call(node, "weights.fetch", {"model": name})
        listing = _listing(reply)
        if "fetch" in reply:
            await self._fetch_parts(node, model, int(reply["version"]), listing, reply)
        else:
            parts = split_payload(payload, [size for _n, size in listing])
            files = [(n, part) for (n, _size), part in zip(listing, parts, strict=True)]
            await self._weights.install(model, int(reply["version"]), files)

    async def _fetch_parts(
        self, node: str, model: Model, version: int, listing: list[tuple[bytes, int]], reply: dict[str, Any]
    ) -> None:
        """A version the publisher holds for this fetch: each file pulled in parts into
        a file of this node's, then all installed at once; the publisher is told to let
        the version go, whatever happened."""
        session = meta_id(reply, "fetch")
        call = self._node.peers.call
        added: dict[bytes, WeightFile] = {}
        try:
            for index, (file_name, size) in enumerate(listing):
                pending = added[file_name] = await self._weights.begin_write()

                async def part(offset: int, nbytes: int, index: int = index, pending: WeightFile = pending) -> None:
                    meta = {"fetch": session, "file": index, "offset": offset, "size": nbytes}
                    _reply, data = await call(node, "weights.part", meta, max_reply_bytes=nbytes)
                    if len(data) != nbytes:
                        raise Corrupted(f"weights.part of {nbytes} bytes from {node} brought {len(data)}")
                    await write_sliced(partial(self._weights.write, pending), offset, data)

                await in_parts(size, part, self.part_bytes)
                if pending.size != size:  # an empty file, or a short one: its size all the same
                    await self._weights.truncate(pending, size)
            await self._weights.install_written(model, version, added)
        finally:
            for pending in added.values():
                self._weights.release(pending)
            with trio.CancelScope(shield=True), trio.move_on_after(self._node.config.peer_timeout_s):
                try:
                    await call(node, "weights.done", {"fetch": session})
                except DistorefsError as exc:  # the session expires there
                    log.info("cluster: could not end weights fetch %s on %s: %s", session, node, exc)

    async def _on_fetch(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        model = self._weights.model(meta_bytes(meta, "model"))
        files = dict(model.files)
        version = model.version
        if sum(wf.size for wf in files.values()) > self.part_bytes:
            listing = [[name, wf.size] for name, wf in files.items()]
            return {"version": version, "files": listing, "fetch": self._open_session(list(files.values()))}, ()
        for wf in files.values():
            self._weights.hold(wf)
        parts: list[Payload] = []
        try:
            for wf in files.values():  # the files back to back, in slices
                parts += await read_sliced(partial(self._weights.read, wf), 0, wf.size)
        finally:
            for wf in files.values():
                self._weights.release(wf)
        listing = [[name, wf.size] for name, wf in files.items()]
        return {"version": version, "files": listing}, parts

    def _open_session(self, files: list[WeightFile]) -> str:
        self._expire(FETCH_IDLE_S)
        if len(self._sessions) >= MAX_FETCH_SESSIONS:
            raise Busy(
                f"{len(self._sessions)} weights fetches hold versions here already (at most {MAX_FETCH_SESSIONS})"
            )
        held: list[WeightFile] = []
        try:
            for wf in files:
                self._weights.hold(wf)
                held.append(wf)
        except DistorefsError:
            for wf in held:
                self._weights.release(wf)
            raise
        session = secrets.token_hex(8)
        self._sessions[session] = _Session(held, trio.current_time())
        return session

    def _session(self, meta: dict[str, Any]) -> _Session:
        session = self._sessions.get(meta_id(meta, "fetch"))
        if session is None:
            raise NotFound("no such weights fetch here (never begun, done or expired)")
        return session

    async def _on_part(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        session = self._session(meta)
        wf = session.files[meta_int(meta, "file", 0, len(session.files) - 1)]
        offset = meta_int(meta, "offset", 0, wf.size)
        nbytes = meta_int(meta, "size", 0, min(PART_MAX_BYTES, wf.size - offset))
        session.last = trio.current_time()
        data = await read_sliced(partial(self._weights.read, wf), offset, nbytes)
        session.last = trio.current_time()
        return {}, data

    async def _on_done(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        session = self._sessions.pop(meta_id(meta, "fetch"), None)
        if session is not None:
            self._release(session)
        return {}, ()

    def _release(self, session: _Session) -> None:
        for wf in session.files:
            self._weights.release(wf)

    def _expire(self, idle_s: float) -> None:
        now = trio.current_time()
        for key, session in list(self._sessions.items()):
            if now - session.last > idle_s:
                del self._sessions[key]
                self._release(session)
                self.sessions_expired += 1
                log.warning("cluster: a weights fetch expired after %.0f s without a part", now - session.last)

    async def _expire_sessions(self) -> None:
        """Versions held for fetchers that went quiet are let go."""
        while True:
            await trio.sleep(FETCH_IDLE_S / 6)
            self._expire(FETCH_IDLE_S)
