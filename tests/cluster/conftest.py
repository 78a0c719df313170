"""A real etcd server (Debian's etcd-server) on loopback, and daemons that join it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import Mount, fuse_missing, start_daemon

ETCD_READY_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Etcd:
    def __init__(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.proc = proc

    def post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=5) as response:
            answer: dict[str, object] = json.loads(response.read())
            return answer

    def wipe(self) -> None:
        """Delete every key (between tests; a test's daemons are gone by then)."""
        self.post("/v3/kv/deleterange", {"key": base64.b64encode(b"\0").decode(), "range_end": "AA=="})


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    binary = shutil.which("etcd")
    if binary is None:
        message = "etcd not found: scripts/test.sh installs Debian's etcd-server"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    data = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    log = open(data / "etcd.log", "ab")  # noqa: SIM115 - etcd owns it
    proc = subprocess.Popen(
        [
            binary, "--name", "test", "--data-dir", str(data / "data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer}",
        ],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    server = Etcd(url, proc)
    try:
        deadline = time.monotonic() + ETCD_READY_S
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as response:
                    if json.loads(response.read()).get("health") == "true":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"etcd did not get ready; log:\n{(data / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


NodeFactory = Callable[..., Mount]


@pytest.fixture
def cluster_node(etcd: Etcd, tmp_path: Path) -> Iterator[NodeFactory]:
    """Start daemons that join the test's etcd; every one is unmounted (or killed) after."""
    missing = fuse_missing()
    if missing:
        pytest.skip(missing)
    started: list[Mount] = []

    def start(name: str, *extra: str) -> Mount:
        mount = start_daemon(
            tmp_path / name / "mnt", tmp_path / name / "data",
            "--cluster", etcd.url, "--node", name, "--listen", "127.0.0.1:0",
            "--peer-timeout", "2", "--lease-ttl", "2", "--dram-budget", "64MiB", *extra,
        )  # fmt: skip
        started.append(mount)
        return mount

    yield start
    codes = {}
    for mount in started:
        if mount.proc.poll() is None:
            try:
                codes[mount.path.parent.name] = mount.unmount()
            except (subprocess.SubprocessError, OSError) as exc:
                codes[mount.path.parent.name] = repr(exc)
    for mount in started:  # after every unmount: a node restarted on a killed one's mount point
        mount.cleanup()
    etcd.wipe()
    assert all(code == 0 for code in codes.values()), f"daemons did not exit cleanly: {codes}"


@pytest.fixture
def three(cluster_node: NodeFactory) -> list[Mount]:
    return [cluster_node(f"n{i}") for i in range(3)]
