"""Prometheus metrics for `.distore/metrics` and `--metrics-port`, built with
prometheus_client.

Owns the registry: a counter and a latency histogram of FUSE requests per operation
(the fs layer observes each request), bytes read and written and the latency of reads and
writes per kind of file (tree, checkpoints, buffers, weights, datasets, control), and a
collector that reads the daemon's numbers at scrape time: `.distore/status` (DRAM, log,
flush and fsync lag, compaction, checkpoints, weights, degraded state, internal errors,
the busy poller), per buffer its size, inserts, samples and blocked readers and
writers, per model its current version, and per peer the calls, failures and bytes of
cluster traffic.
Label sets are bounded: at most MAX_LABELLED buffers, models and peers are labelled.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from distorefs.stores.replay.store import BufferStore
from distorefs.stores.weights import WeightStore

MAX_LABELLED = 200
LATENCY_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
BUFFER_GAUGES = ("size", "inserts", "samples", "removed", "bytes_stored", "blocked_readers", "blocked_writers")
SHM_GAUGES = ("arena_bytes", "held_slots")  # a buffer's shared-memory arena (0: none)
PEER_GAUGES = ("calls", "failures", "retries", "bytes_sent", "bytes_received", "rtt_ms")
KINDS = ("tree", "checkpoints", "buffers", "weights", "datasets", "control")


class DaemonCollector(Collector):
    """The daemon's numbers, read at each scrape."""

    def __init__(
        self,
        status: Callable[[], dict[str, object]],
        buffers: BufferStore,
        weights: WeightStore,
        peers: Callable[[], dict[str, Any]] | None,
    ) -> None:
        self._status = status
        self._buffers = buffers
        self._weights = weights
        self._peers = peers

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        for key, value in status.items():
            if isinstance(value, bool):
                value = int(value)
            if isinstance(value, (int, float)) and key != "pid":
                yield GaugeMetricFamily(f"distorefs_{key}", f"{key} (as in .distore/status)", value=float(value))
        for part, what in (
            ("blocks", "block tier"),
            ("busy_poll", "polling for the next request"),
            ("queued_reads", "requests read at once, queued behind the one before"),
            ("waiting_requests", "requests waiting for items, the rate limiter or a version (now, limit, refused)"),
            ("page_cache_stores", "batches stored into the page cache"),
        ):
            numbers = status.get(part)
            if isinstance(numbers, dict):
                for key, value in numbers.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        yield GaugeMetricFamily(f"distorefs_{part}_{key}", f"{what}: {key}", value=float(value))
        gc = status.get("gc")
        if isinstance(gc, dict):  # Python's cyclic garbage collector (memory.gc_statistics)
            frozen = gc["frozen_objects"]
            yield GaugeMetricFamily("distorefs_gc_frozen_objects", "objects frozen at start-up", value=frozen)
            what = "collections per generation (2: full, every object visited)"
            collections = CounterMetricFamily("distorefs_gc_collections", what, labels=["generation"])
            for generation, count in enumerate(gc["collections"]):
                collections.add_metric([str(generation)], count)
            yield collections
        families = {
            name: GaugeMetricFamily(f"distorefs_buffer_{name}", f"replay buffer: {name}", labels=["buffer"])
            for name in BUFFER_GAUGES
        }
        arenas = {
            name: GaugeMetricFamily(
                f"distorefs_buffer_shm_{name}", f"replay buffer's shared-memory arena: {name}", labels=["buffer"]
            )
            for name in SHM_GAUGES
        }
        for name in sorted(self._buffers.names())[:MAX_LABELLED]:
            stats: dict[str, Any] = self._buffers.get(name).stats()
            for key, family in families.items():
                family.add_metric([name], float(stats[key]))
            arena = stats.get("shared_memory", {})
            for key, family in arenas.items():
                family.add_metric([name], float(arena.get(key, 0)))
        yield from families.values()
        yield from arenas.values()
        yield GaugeMetricFamily("distorefs_buffers", "replay buffers", value=float(len(self._buffers.names())))
        versions = GaugeMetricFamily("distorefs_weights_version", "a model's current version", labels=["model"])
        for model_name in sorted(self._weights.models)[:MAX_LABELLED]:
            model = self._weights.models[model_name]
            versions.add_metric([model_name.decode(errors="replace")], float(model.version))
        yield versions
        if self._peers is not None:
            yield from self._peer_families(self._peers())

    @staticmethod
    def _peer_families(report: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
        families = {
            name: GaugeMetricFamily(f"distorefs_peer_{name}", f"calls to a peer: {name}", labels=["peer"])
            for name in PEER_GAUGES
        }
        nodes = [n for n in report.get("live_nodes", []) + report.get("unreachable_or_gone", []) if "calls" in n]
        for node in nodes[:MAX_LABELLED]:
            for name, family in families.items():
                family.add_metric([str(node["node"])], float(node[name]))
        yield from families.values()
        live = sum(1 for n in report.get("live_nodes", []) if not n.get("self"))
        yield GaugeMetricFamily("distorefs_peers_live", "other live nodes of the cluster", value=float(live))
        for key in (
            "requests_served", "request_errors", "connections", "refused_connections", "unauthenticated_connections"
        ):  # fmt: skip
            yield GaugeMetricFamily(f"distorefs_peer_{key}", f"peer server: {key}", value=float(report.get(key, 0)))


class Tally:
    """A count, a sum of seconds and a latency histogram (LATENCY_BUCKETS), and a byte
    count, in one plain list that the event loop adds to: no lock, no object per
    increment. prometheus_client's Counter and Histogram take a lock per increment and
    cost 1.2 µs per request each (measured), and every FUSE request paid for one or two."""

    __slots__ = ("cells",)
    COUNT, SECONDS, BYTES, BUCKETS = 0, 1, 2, 3

    def __init__(self) -> None:
        self.cells: list[float] = [0, 0.0, 0, *([0] * (len(LATENCY_BUCKETS) + 1))]

    def add(self, seconds: float, nbytes: int = 0) -> None:
        cells = self.cells
        cells[0] += 1
        cells[1] += seconds
        cells[2] += nbytes
        cells[3 + bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bound >= seconds ("le")


BUCKET_LABELS = (*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf")  # type: ignore[no-untyped-call]


def histogram_buckets(cells: list[float]) -> list[tuple[str, float]]:
    """A Tally's (snapshot's) buckets, cumulative, as prometheus wants them (+Inf last)."""
    out, total = [], 0.0
    for label, count in zip(BUCKET_LABELS, cells[Tally.BUCKETS :], strict=True):
        total += count
        out.append((label, total))
    return out


class RequestCollector(Collector):
    """The fs layer's tallies of requests and data, read at each scrape (from
    prometheus_client's HTTP thread, or the event loop for `.distore/metrics`): a copy of
    each tally's list is taken whole under the GIL, so its count and its buckets agree."""

    def __init__(self, requests: dict[tuple[str, int], Tally], data: dict[tuple[str, str], Tally]) -> None:
        self._requests = requests
        self._data = data

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "distorefs_requests", "FUSE requests by operation and errno (0: ok)", labels=["op", "errno"]
        )
        by_op: dict[str, list[float]] = {}
        for (op, errno), tally in list(self._requests.items()):
            cells = list(tally.cells)
            requests.add_metric([op, str(errno)], cells[Tally.COUNT])
            merged = by_op.setdefault(op, [0.0] * len(cells))
            for i, value in enumerate(cells):
                merged[i] += value
        yield requests
        latency = HistogramMetricFamily(
            "distorefs_request_seconds", "FUSE request latency inside the daemon", labels=["op"]
        )
        for op, cells in by_op.items():
            latency.add_metric([op], histogram_buckets(cells), sum_value=cells[Tally.SECONDS])
        yield latency
        moved = CounterMetricFamily(
            "distorefs_bytes", "bytes read and written through the mount, by kind of file", labels=["kind", "direction"]
        )
        data_latency = HistogramMetricFamily(
            "distorefs_data_request_seconds", "read and write latency inside the daemon, by kind of file",
            labels=["kind", "op"],
        )  # fmt: skip
        for (kind, op), tally in list(self._data.items()):
            cells = list(tally.cells)
            moved.add_metric([kind, DIRECTIONS[op]], cells[Tally.BYTES])
            data_latency.add_metric([kind, op], histogram_buckets(cells), sum_value=cells[Tally.SECONDS])
        yield moved
        yield data_latency


DIRECTIONS = {"read": "out", "write": "in", "adopt": "adopted"}  # adopted: staged, past FUSE


class Metrics:
    """The registry, and what the fs layer observes of each request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests: dict[tuple[str, int], Tally] = {}
        self._data = {(kind, op): Tally() for kind in KINDS for op in DIRECTIONS}
        self.registry.register(RequestCollector(self._requests, self._data))

    def watch(
        self,
        status: Callable[[], dict[str, object]],
        buffers: BufferStore,
        weights: WeightStore,
        peers: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.registry.register(DaemonCollector(status, buffers, weights, peers))

    def transferred(self, kind: str, op: str, size: int, started: float) -> None:
        """A read or write (`op`) of `size` bytes of a `kind` file, begun at `started`."""
        tally = self._data.get((kind, op)) or self._data["control", op]
        tally.add(time.perf_counter() - started, size)

    def observe(self, op: str, started: float, errno: int) -> None:
        """One request of `op` that began at `started` (time.perf_counter) and ended with `errno`."""
        tally = self._requests.get((op, errno))
        if tally is None:
            tally = self._requests[op, errno] = Tally()
        tally.add(time.perf_counter() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int) -> None:
        """Serve /metrics over HTTP on loopback (a thread of prometheus_client's)."""
        start_http_server(port, addr="127.0.0.1", registry=self.registry)
