"""Prometheus metrics for `.distore/metrics` and `--metrics-port`, built with
prometheus_client.

Owns the registry: a counter and a latency histogram of FUSE requests per operation
(the fs layer observes each request), and a collector that reads the daemon's numbers at
scrape time: `.distore/status` (DRAM, log, checkpoints, weights, degraded state, internal
errors) and, per buffer, its size, inserts, samples and blocked readers and writers.
Label sets are bounded: at most MAX_LABELLED buffers are labelled by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from distorefs.stores.replay.store import BufferStore

MAX_LABELLED = 200
LATENCY_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
BUFFER_GAUGES = ("size", "inserts", "samples", "removed", "bytes_stored", "blocked_readers", "blocked_writers")


class DaemonCollector(Collector):
    """The daemon's numbers, read at each scrape."""

    def __init__(self, status: Callable[[], dict[str, object]], buffers: BufferStore) -> None:
        self._status = status
        self._buffers = buffers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self._status()
        for key, value in status.items():
            if isinstance(value, bool):
                value = int(value)
            if isinstance(value, (int, float)) and key != "pid":
                yield GaugeMetricFamily(f"distorefs_{key}", f"{key} (as in .distore/status)", value=float(value))
        blocks = status.get("blocks")
        if isinstance(blocks, dict):
            for key, value in blocks.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield GaugeMetricFamily(f"distorefs_blocks_{key}", f"block tier: {key}", value=float(value))
        families = {
            name: GaugeMetricFamily(f"distorefs_buffer_{name}", f"replay buffer: {name}", labels=["buffer"])
            for name in BUFFER_GAUGES
        }
        for name in sorted(self._buffers.names())[:MAX_LABELLED]:
            stats: dict[str, Any] = self._buffers.get(name).stats()
            for key, family in families.items():
                family.add_metric([name], float(stats[key]))
        yield from families.values()
        yield GaugeMetricFamily("distorefs_buffers", "replay buffers", value=float(len(self._buffers.names())))


class Metrics:
    """The registry, and what the fs layer observes of each request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "distorefs_requests", "FUSE requests by operation and errno (0: ok)", ["op", "errno"],
            registry=self.registry,
        )  # fmt: skip
        self._latency = Histogram(
            "distorefs_request_seconds", "FUSE request latency inside the daemon", ["op"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def watch(self, status: Callable[[], dict[str, object]], buffers: BufferStore) -> None:
        self.registry.register(DaemonCollector(status, buffers))

    def observe(self, op: str, started: float, errno: int) -> None:
        """One request of `op` that began at `started` (time.perf_counter) and ended with `errno`."""
        key = (op, errno)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self._requests.labels(op, str(errno)), self._latency.labels(op))
        children[0].inc()
        children[1].observe(time.perf_counter() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int) -> None:
        """Serve /metrics over HTTP on loopback (a thread of prometheus_client's)."""
        start_http_server(port, addr="127.0.0.1", registry=self.registry)
