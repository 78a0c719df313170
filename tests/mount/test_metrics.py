"""Prometheus metrics through a real mount: `.distore/metrics` and `--metrics-port`,
parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from distorefs import client
from tests.conftest import mounted_at


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_file_and_port_serve_requests_state_and_buffers(tmp_path: Path) -> None:
    port = free_port()
    with mounted_at(tmp_path / "mnt", tmp_path / "data", "--metrics-port", str(port)) as mount:
        buffer = mount.path / "buffers" / "m"
        buffer.mkdir()
        client.append(buffer, [b"x" * 100] * 5)
        client.sample(buffer, 2)
        (mount.path / "f.txt").write_bytes(b"hello")
        with client.Sampler(buffer, 5, transport="shm") as sampler:
            assert len(sampler.sample()) == 5  # held until the next draw or the close: its arena slots count
            status = json.loads((mount.path / ".distore" / "status").read_text())
            text = client.read_all(mount.path / ".distore" / "metrics").decode()
        got = samples(text)
        # frozen objects only ever leave (freed), none come after the start-up's freeze:
        # the status read between two metrics reads saw a count between theirs
        before = got[("distorefs_gc_frozen_objects", ())]
        status_again = json.loads((mount.path / ".distore" / "status").read_text())
        after = samples(client.read_all(mount.path / ".distore" / "metrics").decode())
        assert before >= status_again["gc"]["frozen_objects"] >= after[("distorefs_gc_frozen_objects", ())] > 0
        assert got[("distorefs_dram_budget_bytes", ())] == status["dram_budget_bytes"]
        assert got[("distorefs_degraded", ())] == 0
        assert got[("distorefs_buffer_size", (("buffer", "m"),))] == 5
        assert got[("distorefs_buffer_samples", (("buffer", "m"),))] == 7
        for held in ("batch", "input", "listing"):  # nothing held open at the scrape
            assert got[(f"distorefs_held_{held}_bytes", ())] == 0
        assert got[("distorefs_buffer_shm_arena_bytes", (("buffer", "m"),))] >= 5 * 128
        assert got[("distorefs_buffer_shm_held_slots", (("buffer", "m"),))] >= 1
        assert got[("distorefs_requests_total", (("errno", "0"), ("op", "write")))] >= 1
        assert got[("distorefs_requests_total", (("errno", "2"), ("op", "lookup")))] >= 1  # f.txt did not exist
        assert got[("distorefs_request_seconds_count", (("op", "write"),))] >= 1
        assert got[("distorefs_busy_poll_max_us", ())] == 200  # the poller, on by default
        assert got[("distorefs_busy_poll_requests", ())] >= 1
        assert got[("distorefs_queued_reads_window_us", ())] == 300  # on by default
        assert got[("distorefs_queued_reads_requests", ())] >= status["queued_reads"]["requests"]  # read before
        assert got[("distorefs_waiting_requests_limit", ())] == 512  # --max-waiting-requests
        assert got[("distorefs_waiting_requests_now", ())] == 0
        assert got[("distorefs_gc_collections_total", (("generation", "2"),))] >= 1  # start-up's own
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            served = samples(reply.read().decode())
        assert served[("distorefs_buffer_size", (("buffer", "m"),))] == 5


def test_metrics_count_bytes_per_kind_model_versions_and_lags(tmp_path: Path) -> None:
    with mounted_at(tmp_path / "mnt", tmp_path / "data") as mount:
        (mount.path / "tree.bin").write_bytes(b"t" * 300_000)
        (mount.path / "checkpoints" / "step-1.pt").write_bytes(b"c" * 200_000)
        assert (mount.path / "checkpoints" / "step-1.pt").read_bytes() == b"c" * 200_000
        (mount.path / "weights" / "policy").mkdir()
        for _ in range(2):
            (mount.path / "weights" / "policy" / "model.bin").write_bytes(b"w" * 1000)
        got = samples(client.read_all(mount.path / ".distore" / "metrics").decode())

        def moved(kind: str, direction: str) -> float:
            return got[("distorefs_bytes_total", (("direction", direction), ("kind", kind)))]

        assert moved("tree", "in") == 300_000
        assert moved("checkpoints", "in") == 200_000
        assert moved("weights", "in") == 2000
        assert moved("control", "out") == 0  # this read of metrics is counted after it is rendered
        assert got[("distorefs_data_request_seconds_count", (("kind", "tree"), ("op", "write")))] >= 1
        assert got[("distorefs_weights_version", (("model", "policy"),))] == 2
        for lag in ("distorefs_blocks_flush_lag_s", "distorefs_blocks_durable_lag_s"):
            assert got[(lag, ())] >= 0
