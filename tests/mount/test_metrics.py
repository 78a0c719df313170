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
        status = json.loads((mount.path / ".distore" / "status").read_text())
        text = client.read_all(mount.path / ".distore" / "metrics").decode()
        got = samples(text)
        assert got[("distorefs_dram_budget_bytes", ())] == status["dram_budget_bytes"]
        assert got[("distorefs_degraded", ())] == 0
        assert got[("distorefs_buffer_size", (("buffer", "m"),))] == 5
        assert got[("distorefs_buffer_samples", (("buffer", "m"),))] == 2
        assert got[("distorefs_requests_total", (("errno", "0"), ("op", "write")))] >= 1
        assert got[("distorefs_requests_total", (("errno", "2"), ("op", "lookup")))] >= 1  # f.txt did not exist
        assert got[("distorefs_request_seconds_count", (("op", "write"),))] >= 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            served = samples(reply.read().decode())
        assert served[("distorefs_buffer_size", (("buffer", "m"),))] == 5
