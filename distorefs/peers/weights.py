"""Weights across nodes: a version published anywhere is fetched once per node.

Announces this node's publishes in `ns/weights/<model>` and, when another node publishes
a newer version, fetches all of that version's files from it in one request and installs
them here under the same number (which wakes this node's `wait` readers). Answers
`weights.fetch` for versions published here.

Shared key (docs/cluster.md): ns/weights/<name>   {"version": N, "node": publisher}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import trio

from distorefs.cluster.etcd import WatchEvent
from distorefs.cluster.rpc import Payload, PeerServer, meta_bytes, split_payload
from distorefs.errors import DistorefsError
from distorefs.peers.core import ClusterNode
from distorefs.stores.weights import WeightStore

log = logging.getLogger(__name__)


class WeightSync:
    kind = "weights"

    def __init__(self, node: ClusterNode, weights: WeightStore) -> None:
        self._node = node
        self._weights = weights
        self._fetching: set[bytes] = set()
        self.fetched = 0
        self.fetch_errors = 0

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._announce, name="cluster weights news")

    def report(self) -> dict[str, Any]:
        return {"weights_fetched": self.fetched, "weights_fetch_errors": self.fetch_errors}

    def register(self, server: PeerServer) -> None:
        server.register("weights.fetch", self._on_fetch)

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
        the one installed."""
        try:
            while True:
                shared = self._node.shared("weights", name)
                model = self._weights.models.get(name)
                if shared is None or model is None or int(shared["version"]) <= model.version:
                    return
                node = str(shared["node"])
                try:
                    reply, payload = await self._node.peers.call(node, "weights.fetch", {"model": name})
                except DistorefsError as exc:
                    self.fetch_errors += 1
                    log.warning(
                        "cluster: fetching weights/%s from %s failed: %s", name.decode(errors="replace"), node, exc
                    )
                    return
                parts = split_payload(payload, [size for _name, size in reply["files"]])
                files = [(bytes(name), part) for (name, _size), part in zip(reply["files"], parts, strict=True)]
                await self._weights.install(model, int(reply["version"]), files)
                self.fetched += 1
        finally:
            self._fetching.discard(name)

    async def _on_fetch(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        model = self._weights.model(meta_bytes(meta, "model"))
        files = dict(model.files)
        version = model.version
        for wf in files.values():
            self._weights.hold(wf)
        try:
            parts = [await self._weights.read(wf, 0, wf.size) for wf in files.values()]
        finally:
            for wf in files.values():
                self._weights.release(wf)
        listing = [[name, len(part)] for name, part in zip(files, parts, strict=True)]
        return {"version": version, "files": listing}, parts
