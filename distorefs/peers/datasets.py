"""DatasetSync: datasets across nodes.

A dataset is written on one node (its writer: the node where `mkdir datasets/NAME` ran).
Every other node shows it at once as a copy: same name and config, `EROFS` for writes.
When the writer seals it, each other node fetches the records once, in runs of up to
16 MiB checked against the writer's crc32c, appends them to its copy and seals it; from
then on streams, `order` and `records/` on that node read local data, with the usual
prefetch. `order` is per node (every rank sets the same one, or uses `shuffle SEED`).
rmdir on any node removes the dataset everywhere.

Shared key (docs/cluster.md): ns/datasets/<name>
    {"node": writer, "config": {...}, "sealed": bool, "count": records at the seal}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np
import trio

from distorefs.cluster.etcd import WatchEvent
from distorefs.cluster.rpc import Payload, PeerServer, meta_int, split_payload
from distorefs.errors import Corrupted, DistorefsError, NotFound
from distorefs.peers.core import ClusterNode
from distorefs.stores.datasets.dataset import Dataset, DatasetConfig
from distorefs.stores.datasets.formats import INDEX_DTYPE
from distorefs.stores.datasets.store import DatasetStore

log = logging.getLogger(__name__)

RUN_BYTES = 16 << 20  # one dataset.read carries at most this much (and at least one record)
FETCH_ATTEMPTS = 3
FETCH_BACKOFF_S = 1.0


class DatasetSync:
    """Announces this node's datasets, keeps copies of the others', answers `dataset.read`."""

    kind = "datasets"

    def __init__(self, node: ClusterNode, datasets: DatasetStore) -> None:
        self.node = node
        self.datasets = datasets
        self._echoes: dict[str, int] = {}
        self._fetching: set[str] = set()
        self.fetched_records = 0
        self.fetch_errors = 0

    # --- announce --------------------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._announce_news, name="cluster dataset news")

    def register(self, server: PeerServer) -> None:
        server.register("dataset.read", self._on_read)

    def report(self) -> dict[str, Any]:
        return {"datasets_fetched_records": self.fetched_records, "datasets_fetch_errors": self.fetch_errors}

    async def _announce_news(self) -> None:
        """Background task: this node's dataset news into etcd."""
        while True:
            what, name = await self.datasets.news.next()
            if self._echoes.get(name, 0) > 0:
                self._echoes[name] -= 1
                continue
            try:
                await self._announce(what, name)
            except DistorefsError as exc:
                log.warning("cluster: could not announce datasets/%s (%s): %s", name, what, exc)

    async def _announce(self, what: str, name: str) -> None:
        key = self.node.ns_key("datasets", name)
        if what == "deleted":
            if self.node.shared("datasets", name) is not None:
                await self.node.delete_shared(key)
            return
        try:
            ds = self.datasets.get(name)
        except NotFound:
            return
        if ds.writer is not None:
            return  # a copy announces nothing
        value = {"node": self.node.me, "config": json.loads(ds.config.dumps()), "sealed": ds.sealed}
        value["count"] = ds.count if ds.sealed else 0
        await self.node.put_shared(key, json.dumps(value).encode())

    # --- apply -----------------------------------------------------------------------------

    def _echo(self, name: str) -> None:
        self._echoes[name] = self._echoes.get(name, 0) + 1

    def apply(self, raw_name: bytes, event: WatchEvent, fetches: trio.Nursery) -> None:
        """Another node made, configured, sealed or removed a dataset."""
        name = raw_name.decode(errors="surrogateescape")
        if event.kind == "delete":
            if name in self.datasets.names():
                self._echo(name)
                fetches.start_soon(self._delete, name)
            return
        shared = json.loads(event.value)
        writer = str(shared["node"])
        if writer == self.node.me:
            return
        config = DatasetConfig(**shared["config"])
        if name in self.datasets.names():
            ds = self.datasets.get(name)
            if ds.writer is None and ds.count == 0 and not ds.sealed:
                self.datasets.make_copy(ds, writer)  # made here too, still empty: the other node's wins
            if ds.writer != writer:
                log.warning("cluster: datasets/%s is written on %s and here: keeping ours", name, writer)
                return
            if ds.config != config:
                self._echo(name)
                ds.reconfigure(shared["config"], from_writer=True)
        else:
            self._echo(name)
            ds = self.datasets.create(name, config)
            self.datasets.make_copy(ds, writer)
        if shared["sealed"] and not ds.sealed and name not in self._fetching:
            self._fetching.add(name)
            fetches.start_soon(self._fetch, name)

    async def _delete(self, name: str) -> None:
        try:
            await self.datasets.delete(name)
        except NotFound:
            self._echoes[name] -= 1

    async def _fetch(self, name: str) -> None:
        """Copy the sealed dataset's records from its writer, then seal the copy here."""
        try:
            for attempt in range(1, FETCH_ATTEMPTS + 1):
                try:
                    await self._fetch_once(name)
                    return
                except (DistorefsError, KeyError, ValueError) as exc:
                    self.fetch_errors += 1
                    log.warning("cluster: fetching datasets/%s failed (attempt %d): %s", name, attempt, exc)
                    await trio.sleep(FETCH_BACKOFF_S * attempt)
        finally:
            self._fetching.discard(name)

    async def _fetch_once(self, name: str) -> None:
        while True:
            shared = self.node.shared("datasets", name)
            try:
                ds = self.datasets.get(name)
            except NotFound:
                return
            if shared is None or ds.writer is None or ds.sealed:
                return
            total = int(shared["count"])
            if ds.count >= total:
                self._echo(name)
                await ds.seal(from_writer=True)
                log.info("cluster: datasets/%s copied from %s (%d records)", name, ds.writer, total)
                return
            await self._fetch_run(ds, str(shared["node"]))

    async def _fetch_run(self, ds: Dataset, writer: str) -> None:
        start = ds.count
        reply, payload = await self.node.peers.call(
            writer, "dataset.read", {"name": ds.name, "start": start, "max_bytes": RUN_BYTES}
        )
        entries = np.frombuffer(reply["index"], INDEX_DTYPE)
        records = split_payload(payload, entries["length"].tolist())
        for i, (record, crc) in enumerate(zip(records, entries["crc"].tolist(), strict=True)):
            if crc32c.crc32c(record) != crc:
                raise Corrupted(f"datasets/{ds.name}: record {start + i} from {writer} fails its crc32c check")
        if ds.deleted or ds.count != start:
            return  # removed, or another fetch got here first
        await ds.append(records, from_writer=True)
        await ds.persist()
        self.fetched_records += len(records)

    # --- the writer's side ------------------------------------------------------------------

    async def _on_read(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        ds = self.datasets.get(str(meta["name"]))
        start = meta_int(meta, "start", 0, (1 << 63) - 1)
        entries, data = await ds.read_run(start, min(meta_int(meta, "max_bytes", 1, (1 << 63) - 1), RUN_BYTES))
        return {"index": entries.tobytes()}, [data]
