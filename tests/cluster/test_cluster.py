"""Three daemons, three mounts and a real etcd on loopback: one namespace across nodes."""

from __future__ import annotations

import base64
import errno
import io
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from distorefs import client
from distorefs.cluster.rpc import AUTH_MAGIC, HEADER, MAGIC, NONCE_BYTES, PROOF_BYTES, REFUSED, proof
from tests.cluster.conftest import Etcd, NodeFactory
from tests.conftest import Mount, fuse_missing, wait_for

pytestmark = pytest.mark.mount


def peers(mount: Mount) -> dict[str, object]:
    result: dict[str, object] = json.loads((mount.path / ".distore" / "peers").read_text())
    return result


def configure(buffer: Path, **config: object) -> None:
    (buffer / "config").write_text(json.dumps(config))


def read_raw(path: Path) -> bytes:
    """One os.read (a buffered read turns EAGAIN into None instead of raising)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)


def errno_of(call: object) -> int | None:
    try:
        call()  # type: ignore[operator]
    except OSError as exc:
        return exc.errno
    return None


def same(got: bytes, want: bytes) -> bool:
    """`got == want` for an assert: pytest would diff megabytes of bytes (for minutes)."""
    return got == want


def replicated_dir(mount: Mount, name: str) -> Path:
    """checkpoints/<name> on `mount`, its files kept on one more node (replicas = 2)."""
    run = mount.path / "checkpoints" / name
    run.mkdir()
    os.setxattr(run, "user.distore.replicas", b"2")
    return run


def write_fsynced(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` as the whole of `path` and fsync it (under replicas = 2 it returns
    once another node holds it durably)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_nodes_see_each_other_and_peers_shows_the_transport(three: list[Mount]) -> None:
    report = wait_for(lambda: len(peers(three[0])["live_nodes"]) == 3 and peers(three[0]), what="3 live nodes")
    assert isinstance(report, dict)
    assert report["mode"] == "cluster"
    assert report["node"] == "n0"
    assert report["transport"] == "tcp"
    assert report["transport_reason"]
    assert sorted(n["node"] for n in report["live_nodes"]) == ["n0", "n1", "n2"]


def test_a_name_taken_by_a_live_node_is_refused(cluster_node: NodeFactory, tmp_path: Path) -> None:
    first = peers(cluster_node("dup"))
    (tmp_path / "x").mkdir()
    other = subprocess.run(
        [sys.executable, "-m", "distorefs", "mount", str(tmp_path / "x"), "--foreground",
         "--data-dir", str(tmp_path / "xdata"), "--cluster", str(first["cluster"]), "--node", "dup"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert other.returncode != 0
    assert b"node name 'dup' is taken by a live daemon" in other.stderr


def cluster_secret(etcd: Etcd) -> bytes:
    """The secret the first node made and kept in etcd (every node without a file uses it)."""
    found = etcd.post("/v3/kv/range", {"key": base64.b64encode(b"/distore/secret").decode()})
    kvs = found.get("kvs")
    assert isinstance(kvs, list)
    assert kvs, "no secret in etcd"
    return base64.b64decode(kvs[0]["value"])


def recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        assert chunk, f"closed after {len(data)} of {size} bytes"
        data += chunk
    return data


def handshake(conn: socket.socket, secret: bytes) -> None:
    """The client's side of the peer handshake on a blocking socket, as a node makes it."""
    hello = recv_exactly(conn, len(AUTH_MAGIC) + NONCE_BYTES)
    assert hello[: len(AUTH_MAGIC)] == AUTH_MAGIC
    theirs, mine = hello[len(AUTH_MAGIC) :], os.urandom(NONCE_BYTES)
    conn.sendall(AUTH_MAGIC + mine + proof(secret, b"client", theirs, mine))
    verdict = recv_exactly(conn, 1 + PROOF_BYTES)
    assert verdict[0] == 0, "the node refused the proof"
    assert verdict[1:] == proof(secret, b"server", mine, theirs)


def test_garbage_on_a_nodes_peer_port_leaves_the_daemon_serving(cluster_node: NodeFactory, etcd: Etcd) -> None:
    """One frame whose meta was not msgpack ended the peer server, and with it the
    daemon (anyone who reaches the port could unmount it): now each bad connection is
    dropped alone and counted, whether it proved the cluster's secret or not."""
    node = cluster_node("g0")
    secret = cluster_secret(etcd)
    host, port = str(peers(node)["listen"]).rsplit(":", 1)
    http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    frames = [HEADER.pack(MAGIC, 1, 1, 0) + b"\xc1", HEADER.pack(MAGIC, 1, 2, 0) + b"\x91\x01", http]
    for frame in frames:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            handshake(conn, secret)
            conn.sendall(frame)
            try:
                assert conn.recv(4096) == b""  # dropped without a reply
            except ConnectionResetError:
                pass  # (dropped with bytes of ours unread: the kernel resets)
    assert node.proc.poll() is None, "the daemon died"
    (node.path / "still-here").write_bytes(b"ok")
    assert (node.path / "still-here").read_bytes() == b"ok"
    assert wait_for(lambda: peers(node)["request_errors"] == 3, what="3 refused connections")
    # the same frames without the handshake: refused before any is read as a frame
    for frame in frames:
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(frame.ljust(len(AUTH_MAGIC) + NONCE_BYTES + PROOF_BYTES, b"\0"))
            assert recv_exactly(conn, len(AUTH_MAGIC) + NONCE_BYTES + 1)[-1] == REFUSED
    assert wait_for(lambda: peers(node)["unauthenticated_connections"] == 3, what="3 unauthenticated")
    assert peers(node)["request_errors"] == 3
    # one address holds at most 64 connections: the 65th is closed at once, and counted
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(64)]
    try:
        for conn in held:
            handshake(conn, secret)  # (a connection that does not is closed within 5 s)
        wait_for(lambda: peers(node)["connections"] == 64, what="64 connections open")
        with socket.create_connection((host, int(port)), timeout=10) as extra:
            try:
                assert extra.recv(16) == b""
            except ConnectionResetError:
                pass
    finally:
        for conn in held:
            conn.close()
    wait_for(lambda: peers(node)["connections"] == 0, what="the 64 closed")
    assert peers(node)["refused_connections"] == 1
    metrics = (node.path / ".distore" / "metrics").read_text()
    assert "distorefs_peer_refused_connections 1.0" in metrics
    assert "distorefs_peer_unauthenticated_connections 3.0" in metrics


def test_only_nodes_with_the_same_secret_talk(cluster_node: NodeFactory, tmp_path: Path) -> None:
    """Two nodes given one `--cluster-secret-file` fetch each other's weights; a third
    in the same etcd, with the secret etcd keeps, cannot (its fetch fails, the version
    is not installed there), and the node it asked counts the connection as
    unauthenticated. A secret file others may read, or
    a short one, is refused at the mount."""
    key = tmp_path / "secret"
    key.write_bytes(os.urandom(32).hex().encode() + b"\n")
    key.chmod(0o600)
    (tmp_path / "linked").symlink_to(key)  # as Kubernetes mounts a secret: the file it names counts
    a = cluster_node("k0", "--cluster-secret-file", str(key))
    b = cluster_node("k1", "--cluster-secret-file", str(tmp_path / "linked"))
    c = cluster_node("k2")
    assert peers(a)["secret"] == f"file {key}"
    assert peers(c)["secret"] == "etcd key /distore/secret"
    (a.path / "weights" / "policy").mkdir()
    for mount in (b, c):
        wait_for(lambda m=mount: (m.path / "weights" / "policy").is_dir(), what="model dir")
    tensor = os.urandom(1 << 20)
    (a.path / "weights" / "policy" / "params.bin").write_bytes(tensor)
    wait_for(lambda: client.model_version(b.path / "weights" / "policy") == 1, what="version 1 on k1")
    assert (b.path / "weights" / "policy" / "params.bin").read_bytes() == tensor
    assert peers(b)["weights_fetched"] == 1
    # k2 learns of version 1 from etcd, but its fetch from k0 fails authentication
    wait_for(lambda: peers(c)["weights_fetch_errors"] >= 1, what="k2's fetch refused")
    assert client.model_version(c.path / "weights" / "policy") == 0
    assert not (c.path / "weights" / "policy" / "params.bin").exists()
    wait_for(lambda: peers(a)["unauthenticated_connections"] >= 1, what="k0 counting k2's connection")
    assert peers(b)["unauthenticated_connections"] == 0
    k0 = next(n for n in peers(c)["live_nodes"] if n["node"] == "k0")  # type: ignore[union-attr]
    assert "failed authentication" in k0["last_error"]
    for mode, content, message in (
        (0o644, os.urandom(32).hex().encode(), b"lets others read it (chmod 600)"),
        (0o600, b"short\n", b"fewer than 16"),
    ):
        key.write_bytes(content)
        key.chmod(mode)
        (tmp_path / "x").mkdir(exist_ok=True)
        refused = subprocess.run(
            [sys.executable, "-m", "distorefs", "mount", str(tmp_path / "x"), "--foreground",
             "--data-dir", str(tmp_path / "xdata"), "--cluster", str(peers(a)["cluster"]), "--node", "k3",
             "--cluster-secret-file", str(key)],
            capture_output=True, timeout=60,
        )  # fmt: skip
        assert refused.returncode != 0
        assert message in refused.stderr, refused.stderr


def peer_call(address: tuple[str, int], secret: bytes, meta: dict[str, object], body: bytes = b"") -> dict[str, object]:
    """One request on a connection of its own, as a peer gone wrong would send it; the reply's map."""
    import msgpack

    packed = msgpack.packb(meta, use_bin_type=True)
    with socket.create_connection(address, timeout=10) as conn:
        handshake(conn, secret)
        conn.sendall(HEADER.pack(MAGIC, 7, len(packed), len(body)) + packed + body)
        data = b""
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[2]:
            chunk = conn.recv(1 << 20)
            assert chunk, f"no reply to {meta}"
            data += chunk
    reply = msgpack.unpackb(data[HEADER.size : HEADER.size + HEADER.unpack_from(data)[2]], raw=False)
    assert isinstance(reply, dict)
    return reply


def test_malformed_peer_requests_are_refused_and_none_is_an_internal_error(
    cluster_node: NodeFactory, etcd: Etcd
) -> None:
    """Every op with fields missing or of every wrong kind (a seeded choice of 1,800):
    each gets its errno, none an internal error (EIO with a traceback in the log, before:
    KeyError, TypeError ...), and sizes a stranger sends are bounded (a pick of a billion
    items, a name given as the integer 2**33, which bytes() made 8 GiB of zeros)."""
    import random

    node = cluster_node("m0")
    buffer = node.path / "buffers" / "b"
    buffer.mkdir()
    (buffer / "config").write_text(json.dumps({"sampler": "prioritized"}))
    client.append(buffer, [b"x" * 10] * 20)
    host, port = str(peers(node)["listen"]).rsplit(":", 1)
    address = (host, int(port))
    secret = cluster_secret(etcd)
    assert peer_call(address, secret, {"op": "buffer.pick", "name": "b", "count": 10**9})["errno"] == errno.EINVAL
    assert peer_call(address, secret, {"op": "weights.fetch", "model": 2**33})["errno"] == errno.EINVAL
    begin = {"op": "ckpt.begin", "path": 2**33, "mode": 0o644, "size": 1}
    assert peer_call(address, secret, begin)["errno"] == errno.EINVAL
    begin = {"op": "ckpt.begin", "path": "checkpoints/x", "mode": 0o644, "size": 2**62}
    assert peer_call(address, secret, begin)["errno"] == errno.EINVAL  # past any file's size
    values: list[object] = [
        None, True, -1, 0, 2**62, 2**64 - 1, 1.5, float("nan"), "", "b", "x" * 300, b"", b"\0" * 8,
        [], [1], [[1, 2]], [[2**63 - 1, 2**63 - 1]], {}, {"a": 1}, [["b", 1]],
    ]  # fmt: skip
    ops = {
        "weights.fetch": ["model"], "weights.part": ["fetch", "file", "offset", "size"], "weights.done": ["fetch"],
        "buffer.state": ["name"], "buffer.pick": ["name", "count"],
        "buffer.commit": ["name", "indices"], "buffer.append": ["name", "sizes"],
        "buffer.priority": ["name", "indices", "priorities"], "ckpt.begin": ["path", "mode", "size"],
        "ckpt.part": ["transfer", "offset"], "ckpt.commit": ["transfer"], "ckpt.abort": ["transfer"],
        "mem.put": ["from", "keys", "sizes", "drop"], "mem.get": ["from", "keys"], "mem.drop": ["from", "keys"],
        "dataset.read": ["name", "start", "max_bytes"], "no.such.op": ["x"],
    }  # fmt: skip
    rng = random.Random(20)
    internal = []
    for op, fields in ops.items():
        for _ in range(150):
            meta: dict[str, object] = {"op": op}
            meta.update({f: rng.choice(values) for f in fields if rng.random() < 0.9})
            if "name" in meta and rng.random() < 0.5:
                meta["name"] = "b"
            reply = peer_call(address, secret, meta, rng.choice([b"", b"\0" * 8, b"x" * 100]))
            if "internal error" in str(reply.get("error", "")):
                internal.append((meta, reply))
    assert not internal, internal[:5]
    assert node.proc.poll() is None, "the daemon died"
    assert client.sample(buffer, 4)  # the buffer serves as before


def test_a_directory_made_on_one_node_appears_on_every_node(three: list[Mount]) -> None:
    a, b, c = three
    (a.path / "buffers" / "replay").mkdir()
    (b.path / "weights" / "policy").mkdir()
    (c.path / "checkpoints" / "run7" / "stage2").mkdir(parents=True)
    started = time.monotonic()
    for mount in three:
        wait_for(lambda m=mount: (m.path / "buffers" / "replay").is_dir(), what=f"buffers/replay on {mount.path}")
        wait_for(lambda m=mount: (m.path / "weights" / "policy").is_dir(), what=f"weights/policy on {mount.path}")
        wait_for(
            lambda m=mount: (m.path / "checkpoints" / "run7" / "stage2").is_dir(), what=f"checkpoints on {mount.path}"
        )
    seen_after_s = time.monotonic() - started
    print(f"visible on all three nodes after {seen_after_s:.3f} s")
    os.rmdir(c.path / "buffers" / "replay")
    for mount in three:
        wait_for(lambda m=mount: not (m.path / "buffers" / "replay").exists(), what="rmdir everywhere")
    # a checkpoint directory removed on one node goes everywhere, unless it holds files there
    (b.path / "checkpoints" / "run7" / "stage2" / "notes.txt").write_text("kept")
    os.rmdir(a.path / "checkpoints" / "run7" / "stage2")
    wait_for(lambda: not (c.path / "checkpoints" / "run7" / "stage2").exists(), what="checkpoint rmdir on n2")
    # n1 applies namespace changes in etcd's order: once a later mkdir shows there, the
    # rmdir before it has been applied (and refused, since n1 holds a file there)
    (a.path / "checkpoints" / "run7" / "after").mkdir()
    wait_for(lambda: (b.path / "checkpoints" / "run7" / "after").exists(), what="the next change on n1")
    assert (b.path / "checkpoints" / "run7" / "stage2" / "notes.txt").read_text() == "kept"


def test_weights_published_on_one_node_wake_wait_and_are_fetched_once_per_node(three: list[Mount]) -> None:
    a, b, c = three
    (a.path / "weights" / "policy").mkdir()
    for mount in (b, c):
        wait_for(lambda m=mount: (m.path / "weights" / "policy").is_dir(), what="model dir")
    woke: dict[str, bytes] = {}

    def waiter(mount: Mount) -> None:
        with open(mount.path / "weights" / "policy" / "wait", "rb") as f:
            assert f.readline().split()[0] == b"0"  # the first read: the version now
            woke[mount.path.parent.name] = f.readline()  # the next: blocks until a newer one

    threads = [threading.Thread(target=waiter, args=(m,)) for m in (b, c)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # let the waiters block (a late one still sees version 1 as newer than 0)
    tensor = np.arange(1 << 20, dtype=np.float32).tobytes()  # 4 MiB
    with open(a.path / "weights" / "policy" / "params.bin", "wb") as f:
        f.write(tensor)
    for t in threads:
        t.join(timeout=30)
    assert {k: v.split()[0] for k, v in woke.items()} == {"n1": b"1", "n2": b"1"}
    for mount in (b, c):
        for _ in range(5):  # many readers on a node: still one fetch
            assert (mount.path / "weights" / "policy" / "params.bin").read_bytes() == tensor
        assert peers(mount)["weights_fetched"] == 1
    with open(a.path / "weights" / "policy" / "params.bin", "wb") as f:
        f.write(tensor[::-1])
    for mount in (b, c):
        wait_for(lambda m=mount: client.model_version(m.path / "weights" / "policy") == 2, what="version 2")
        assert (mount.path / "weights" / "policy" / "params.bin").read_bytes() == tensor[::-1]
    # the metrics of a node that fetched: peer traffic by peer, live peers, the model's version
    metrics = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families((b.path / ".distore" / "metrics").read_text())
        for sample in family.samples
    }
    assert metrics[("distorefs_peer_bytes_received", (("peer", "n0"),))] >= 2 * len(tensor)
    assert metrics[("distorefs_peer_calls", (("peer", "n0"),))] >= 2
    assert metrics[("distorefs_peers_live", ())] == 2
    assert metrics[("distorefs_weights_version", (("model", "policy"),))] == 2


def test_a_big_model_is_fetched_in_parts_from_a_version_held_for_the_fetch(
    cluster_node: NodeFactory, etcd: Etcd
) -> None:
    """A version past 32 MiB is not one reply: the publisher holds it for the fetch and
    the fetcher pulls 32 MiB parts, then lets it go. The session's ops refuse what they
    cannot serve, and a node holds at most 16 versions for fetches at once: a fetcher
    that finds it busy waits and asks again."""
    a, b = cluster_node("w0"), cluster_node("w1")
    model = a.path / "weights" / "big"
    model.mkdir()
    wait_for(lambda: (b.path / "weights" / "big").is_dir(), what="model dir on w1")
    files = {"layers.bin": os.urandom(40 << 20), "head.bin": os.urandom(30 << 20), "empty": b""}
    for name, data in files.items():
        (model / name).write_bytes(data)  # a version at each close: w1 fetches the newest
    wait_for(lambda: client.model_version(b.path / "weights" / "big") == 3, what="version 3 on w1", timeout_s=60)
    for name, data in files.items():
        assert same((b.path / "weights" / "big" / name).read_bytes(), data), name
    assert peers(b)["weights_fetch_errors"] == 0
    wait_for(lambda: peers(a)["weights_fetch_sessions"] == 0, what="the fetch let go of the version")
    host, port = str(peers(a)["listen"]).rsplit(":", 1)
    address, secret = (host, int(port)), cluster_secret(etcd)
    fetch = peer_call(address, secret, {"op": "weights.fetch", "model": "big"})
    assert fetch["version"] == 3
    assert sorted(fetch["files"]) == sorted([[n.encode(), len(d)] for n, d in files.items()])  # type: ignore[arg-type]
    index = [f[0] for f in fetch["files"]].index(b"layers.bin")  # type: ignore[union-attr]
    session = fetch["fetch"]
    part = {"op": "weights.part", "fetch": session, "file": index}
    assert peer_call(address, secret, {**part, "offset": 0, "size": 1 << 20}).get("ok") is True
    for bad, code in (
        ({"file": 3}, errno.EINVAL), ({"offset": (40 << 20) + 1, "size": 0}, errno.EINVAL),
        ({"offset": 40 << 20, "size": 1}, errno.EINVAL), ({"offset": 0, "size": (64 << 20) + 1}, errno.EINVAL),
        ({"fetch": "0" * 16, "offset": 0, "size": 1}, errno.ENOENT),
    ):  # fmt: skip
        assert peer_call(address, secret, {**part, "offset": 0, "size": 1, **bad})["errno"] == code, bad
    sessions = [session] + [
        peer_call(address, secret, {"op": "weights.fetch", "model": "big"})["fetch"] for _ in range(15)
    ]
    assert peers(a)["weights_fetch_sessions"] == 16
    assert peer_call(address, secret, {"op": "weights.fetch", "model": "big"})["errno"] == errno.EBUSY
    # a version published meanwhile: w1's fetch waits for room (a big model's fan-out
    # to more nodes than the publisher serves at once), and gets it once there is room
    (model / "layers.bin").write_bytes(files["layers.bin"][::-1])
    wait_for(lambda: peers(b)["weights_fetch_waits"] >= 1, what="w1 waiting for a busy w0")
    assert client.model_version(b.path / "weights" / "big") == 3
    for held in sessions:
        assert peer_call(address, secret, {"op": "weights.done", "fetch": held}).get("ok") is True
    wait_for(lambda: client.model_version(b.path / "weights" / "big") == 4, what="version 4 on w1", timeout_s=60)
    assert same((b.path / "weights" / "big" / "layers.bin").read_bytes(), files["layers.bin"][::-1])
    assert peers(b)["weights_fetch_errors"] == 0
    wait_for(lambda: peers(a)["weights_fetch_sessions"] == 0, what="w1's fetch let go of version 4")
    assert peer_call(address, secret, {**part, "offset": 0, "size": 1})["errno"] == errno.ENOENT


def test_a_sharded_buffer_samples_across_nodes_by_priority_with_global_weights(three: list[Mount]) -> None:
    a, b, c = three
    buf = a.path / "buffers" / "sh"
    buf.mkdir()
    configure(buf, schema={"x": "int64"}, sampler="prioritized", alpha=1.0, beta=1.0, epsilon=0.0, shards=3,
              capacity=1000, batch_size=100)  # fmt: skip
    for mount in three:
        wait_for(lambda m=mount: json.loads((m.path / "buffers" / "sh" / "config").read_text())["shards"] == 3,
                 what="sharded config")  # fmt: skip
    stats = json.loads((buf / "stats").read_text())
    layout = [s["node"] for s in stats["cluster"]["shards"]]
    assert sorted(layout) == ["n0", "n1", "n2"]
    # each node appends to its own shard: 100, 200 and 100 items, valued by node
    sizes = {"n0": 100, "n1": 200, "n2": 100}
    for k, mount in enumerate(three):
        name = mount.path.parent.name
        values = np.arange(sizes[name], dtype=np.int64) + 1000 * k
        client.append(mount.path / "buffers" / "sh", values.astype([("x", "<i8")]))
    # raise every item of n2's shard to priority 3, written on n1 with global indices
    shard_of_n2 = layout.index("n2")
    indices = np.arange(100) * 3 + shard_of_n2
    client.update_priorities(b.path / "buffers" / "sh", indices.tolist(), [3.0] * 100)
    counts = np.zeros(3)
    for _ in range(30):
        array = np.load(io.BytesIO((c.path / "buffers" / "sh" / "sample").read_bytes()))
        shard = array["_index"] % 3
        counts += np.bincount(shard, minlength=3)
        node_of = np.array([int(layout[s][1]) for s in shard])
        assert (array["x"] // 1000 == node_of).all()  # the index names the shard that holds the item
        assert np.allclose(array["_weight"], np.where(shard == shard_of_n2, 1 / 3, 1.0), rtol=1e-5)
    fractions = counts / counts.sum()
    expected = np.array([{"n0": 100, "n1": 200, "n2": 300}[n] for n in layout]) / 600
    assert np.allclose(fractions, expected, atol=0.04), (fractions, expected)


def test_a_hundred_thousand_items_cross_nodes_in_one_call(cluster_node: NodeFactory) -> None:
    """A priority update of 100,000 pairs for another node's shard, a pick of 100,000 of
    its items and a dataset run of 100,000 small records each put more than a MiB of
    indices into one peer frame's map, whose header was then refused: EIO to the writer,
    the sample and the dataset's copy. Long values now travel in the frame's body."""
    a, b = cluster_node("w0"), cluster_node("w1")
    buf = a.path / "buffers" / "big"
    buf.mkdir()
    configure(buf, schema={"x": "int64"}, sampler="prioritized", alpha=1.0, beta=1.0, epsilon=0.0, shards=2,
              capacity=200_000)  # fmt: skip
    wait_for(lambda: json.loads((b.path / "buffers" / "big" / "config").read_text())["shards"] == 2,
             what="sharded config on w1")  # fmt: skip
    layout = [s["node"] for s in json.loads((buf / "stats").read_text())["cluster"]["shards"]]
    shard_of_b = layout.index("w1")
    for k, mount in enumerate((a, b)):  # 100,000 items on each node's shard, valued by node
        client.append(mount.path / "buffers" / "big", (np.arange(100_000) + 10**6 * k).astype([("x", "<i8")]))
    # written on w0: every item of w1's shard, the first half to priority 0 (never drawn)
    theirs = np.arange(100_000) * 2 + shard_of_b
    client.update_priorities(buf, theirs.tolist(), (np.arange(100_000) >= 50_000).astype(float).tolist())
    batch = np.load(io.BytesIO((buf / "sample.200000").read_bytes()))
    from_b = batch["_index"] % 2 == shard_of_b
    assert 50_000 < from_b.sum() < 80_000  # a third of the mass: about 66,667 items from w1
    assert (batch["x"][from_b] // 10**6 == 1).all()
    assert (batch["x"][from_b] % 10**6 >= 50_000).all()  # every pair of the update arrived

    ds_a, ds_b = a.path / "datasets" / "small", b.path / "datasets" / "small"
    ds_a.mkdir()
    (ds_a / "config").write_text(json.dumps({"schema": {"x": "int64"}}))
    wait_for(lambda: json.loads((ds_b / "config").read_text())["schema"] is not None, what="config on w1")
    client.append(ds_a, (np.arange(100_000) * 5).astype([("x", "<i8")]))
    (ds_a / "state").write_text("seal")
    wait_for(lambda: (ds_b / "state").read_text().strip() == "sealed", what="sealed copy on w1", timeout_s=30)
    assert (ds_b / "len").read_text().strip() == "100000"
    assert np.load(io.BytesIO((ds_b / "stream").read_bytes()))["x"].tolist() == (np.arange(100_000) * 5).tolist()


def test_kill9_keeps_replicated_checkpoints_and_fails_fast_on_unreplicated_data(three: list[Mount]) -> None:
    a, b, c = three
    run = replicated_dir(a, "run1")
    data = os.urandom(3 << 20)
    write_fsynced(run / "step10.pt", data)  # returns once a second node holds it durably
    holders = [m for m in (b, c) if (m.path / "checkpoints" / "run1" / "step10.pt").exists()]
    assert len(holders) == 1
    holder = holders[0]
    other = c if holder is b else b
    # a buffer that lives on n0 only
    (a.path / "buffers" / "solo").mkdir()
    client.append(a.path / "buffers" / "solo", [b"x" * 100] * 10)
    wait_for(lambda: (other.path / "buffers" / "solo").is_dir(), what="solo visible")
    assert len(client.sample(other.path / "buffers" / "solo", 4)) == 4  # served by n0 over the network

    a.kill9()

    assert (holder.path / "checkpoints" / "run1" / "step10.pt").read_bytes() == data
    started = time.monotonic()
    assert errno_of(lambda: read_raw(other.path / "buffers" / "solo" / "sample")) == errno.EAGAIN
    with open(other.path / "buffers" / "solo" / "append", "wb") as f:
        f.write(b"y" * 10)
        assert errno_of(f.close) == errno.EIO
    took = time.monotonic() - started
    assert took < 2 * (2 + 2) + 2, took  # bounded by peer timeout and lease TTL (docs/cluster.md)
    # the cluster goes on without n0
    wait_for(lambda: len(peers(holder)["live_nodes"]) == 2, what="n0 leaves the member list")
    (holder.path / "buffers" / "after").mkdir()
    wait_for(lambda: (other.path / "buffers" / "after").is_dir(), what="new dir visible after the kill")


def test_a_replica_travels_in_parts_and_replaces_the_old_one_on_its_holder_at_once(three: list[Mount]) -> None:
    """A replica bigger than a part (32 MiB) goes as begin, parts and commit; the holder
    shows it only whole, and a new version takes the old one's name in one change that
    the holder's kernel hears of at once (it cached the old file's entry and pages)."""
    a, b, c = three
    run = replicated_dir(a, "big")
    previous = b""
    for version in range(2):
        data = os.urandom(80 << 20)  # three parts
        calls_before = {n["node"]: n.get("calls", 0) for n in peers(a)["live_nodes"]}  # type: ignore[union-attr]
        write_fsynced(run / "model.pt", data, 0o640)
        holders = [m for m in (b, c) if (m.path / "checkpoints" / "big" / "model.pt").exists()]
        assert len(holders) == 1
        holder = holders[0]
        copy = holder.path / "checkpoints" / "big" / "model.pt"
        got = copy.read_bytes()
        assert same(got, data), f"version {version}: read {len(got)} bytes, the old version's: {got == previous}"
        previous = data
        assert stat.S_IMODE(copy.stat().st_mode) == 0o640
        report = peers(holder)
        assert report["checkpoint_replicas_received"] == version + 1
        assert (report["checkpoint_replicas_incoming"], report["checkpoint_replicas_dropped"]) == (0, 0)
        calls = {n["node"]: n.get("calls", 0) for n in peers(a)["live_nodes"]}  # type: ignore[union-attr]
        holder_name = holder.path.parent.name
        assert calls[holder_name] - calls_before.get(holder_name, 0) >= 5  # begin, 3 parts, commit
    assert peers(a)["checkpoint_replication_errors"] == 0


def test_a_holder_killed_while_a_new_replica_comes_keeps_the_old_one_whole(cluster_node: NodeFactory) -> None:
    """kill -9 of the receiving node in the middle of a replica's parts: the writer's
    fsync fails (EIO, nothing acknowledged), and the restarted holder has the previous
    replica, byte for byte, and nothing of the new one (no entry, no bytes held)."""
    a, b = cluster_node("h0"), cluster_node("h1")
    run = replicated_dir(a, "run")
    old = os.urandom(3 << 20)
    write_fsynced(run / "model.pt", old)
    held = b.path / "checkpoints" / "run" / "model.pt"
    assert same(held.read_bytes(), old)
    before = json.loads((b.path / ".distore" / "status").read_text())
    new = os.urandom(400 << 20)  # 13 parts: time to catch the transfer under way
    outcome: list[object] = []

    def save() -> None:
        try:
            write_fsynced(run / "model.pt", new)
            outcome.append("acknowledged")
        except OSError as exc:
            outcome.append(exc.errno)

    saver = threading.Thread(target=save)
    saver.start()
    try:
        wait_for(lambda: peers(b)["checkpoint_replicas_incoming"] == 1, what="the replica under way", timeout_s=60)
        b.kill9()
    finally:
        saver.join(timeout=60)
    assert outcome == [errno.EIO]
    wait_for(lambda: len(peers(a)["live_nodes"]) == 1, what="h1 leaves the member list")
    b = cluster_node("h1")
    assert same(held.read_bytes(), old)
    assert os.listdir(b.path / "checkpoints" / "run") == ["model.pt"]
    status = json.loads((b.path / ".distore" / "status").read_text())
    # the new replica's file, in no directory, went with the dead daemon
    assert (status["files"], status["file_bytes"]) == (before["files"], before["file_bytes"])


def test_a_replica_its_holder_refuses_fails_the_fsync_with_eio_and_counts_once(
    cluster_node: NodeFactory, etcd: Etcd
) -> None:
    """A holder receiving 8 replicas already refuses a 9th (EBUSY there): the writer's
    fsync says EIO (its own disk is fine), the failure is counted once, and once the
    holder has room the next fsync replicates."""
    a, b = cluster_node("r0"), cluster_node("r1")
    run = replicated_dir(a, "run")
    host, port = str(peers(b)["listen"]).rsplit(":", 1)
    address, secret = (host, int(port)), cluster_secret(etcd)
    begin = {"op": "ckpt.begin", "mode": 0o644, "size": 1 << 20}
    transfers = [peer_call(address, secret, {**begin, "path": f"checkpoints/hold{i}"})["transfer"] for i in range(8)]
    assert peers(b)["checkpoint_replicas_incoming"] == 8
    data = os.urandom(1 << 20)
    fd = os.open(run / "step-1.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        assert errno_of(lambda: os.fsync(fd)) == errno.EIO
        assert peers(a)["checkpoint_replication_errors"] == 1
        for transfer in transfers:
            assert peer_call(address, secret, {"op": "ckpt.abort", "transfer": transfer}).get("ok") is True
        os.fsync(fd)  # room again
    finally:
        os.close(fd)
    assert (b.path / "checkpoints" / "run" / "step-1.pt").read_bytes() == data
    assert peers(a)["checkpoint_replication_errors"] == 1
    assert peers(b)["checkpoint_replicas_dropped"] == 8


def test_a_shard_made_by_a_peer_and_appended_to_just_before_kill_9_comes_back_with_its_items(
    cluster_node: NodeFactory,
) -> None:
    """n1 makes its shard of a buffer created on n0 when the config reaches it (no mkdir
    there to commit the row). Its appends persist log-only; a start-up adopts logged
    items only into buffers whose row it finds, so the first append must commit it."""
    a = cluster_node("n0")
    b = cluster_node("n1", "--flush-interval", "60")  # no background commit inside the test's window
    buf = a.path / "buffers" / "sh"
    buf.mkdir()
    configure(buf, schema={"x": "int64"}, shards=2, capacity=1000)
    on_b = b.path / "buffers" / "sh"
    wait_for(lambda: len(json.loads((on_b / "stats").read_text())["cluster"]["shards"]) == 2, what="n1's shard")
    values = np.arange(50, dtype=np.int64) + 7000
    with open(on_b / "append", "wb") as f:  # into n1's own shard, with nothing else opened first
        np.save(f, values.astype([("x", "<i8")]))

    def shard_size(mount: Mount) -> int:
        stats = json.loads((mount.path / "buffers" / "sh" / "stats").read_text())
        return int(stats["size"])  # this node's shard

    assert shard_size(b) == 50
    b.kill9()
    wait_for(lambda: len(peers(a)["live_nodes"]) == 1, what="n1 leaves the member list")
    b = cluster_node("n1", "--flush-interval", "60")
    assert shard_size(b) == 50
    samples = np.load(io.BytesIO((on_b / "sample").read_bytes()))
    assert set(samples["x"].tolist()) <= set(values.tolist())


def test_a_background_mount_keeps_its_cluster_flags(etcd: Etcd, tmp_path: Path) -> None:
    missing = fuse_missing()
    if missing:
        pytest.skip(missing)
    mnt = tmp_path / "bg"
    mnt.mkdir()
    key = tmp_path / "secret"
    key.write_bytes(os.urandom(24).hex().encode())
    key.chmod(0o600)
    command = [sys.executable, "-m", "distorefs"]
    subprocess.run(
        [*command, "mount", str(mnt), "--data-dir", str(tmp_path / "bgdata"), "--cluster", etcd.url,
         "--node", "bg", "--peer-timeout", "3", "--lease-ttl", "4", "--cluster-secret-file", "secret"],
        check=True, capture_output=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    try:
        report = json.loads((mnt / ".distore" / "peers").read_text())
        assert report["node"] == "bg"
        assert report["peer_timeout_s"] == 3.0
        assert report["lease_ttl_s"] == 4
        assert report["secret"] == f"file {key}"  # a relative path, made absolute for the daemon
    finally:
        done = subprocess.run([*command, "umount", str(mnt)], capture_output=True, timeout=120)
        if done.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        etcd.wipe()
    assert done.returncode == 0, done.stderr


def test_a_full_node_spills_cold_items_to_a_peers_memory_and_reads_them_back(cluster_node: NodeFactory) -> None:
    """n0 has 8 MiB of DRAM for 20 MB of items; n1 lends it 64 MiB. Samples on n0 get the
    right items from n1's memory, and after kill -9 of n1 from n0's own log."""
    a = cluster_node("n0", "--dram-budget", "8MiB")
    b = cluster_node("n1", "--lend-memory", "64MiB")
    wait_for(lambda: peers(a)["remote_memory"]["lenders"] == ["n1"], what="n1 lends")  # type: ignore[index]
    buf = a.path / "buffers" / "big"
    buf.mkdir()
    configure(buf, schema={"x": "int64", "pad": {"dtype": "uint8", "shape": [50_000]}}, capacity=1000,
              batch_size=32)  # fmt: skip
    items = np.zeros(400, dtype=[("x", "<i8"), ("pad", "u1", (50_000,))])
    items["x"] = np.arange(400)
    items["pad"] = (np.arange(400) % 251)[:, None]
    for chunk in np.array_split(items, 20):
        client.append(buf, chunk)

    def sample_checked() -> np.ndarray:
        array = np.load(io.BytesIO((buf / "sample").read_bytes()))
        assert (array["x"] == array["_index"]).all()
        assert (array["pad"] == (array["x"] % 251)[:, None]).all()  # each item is the one it names
        return array

    def borrowed() -> dict[str, int]:
        return peers(a)["remote_memory"]["borrowed"]  # type: ignore[index,no-any-return]

    wait_for(lambda: borrowed()["remote_items"] > 100, what="cold items spilled to n1")
    lent = peers(b)["remote_memory"]["lent"]  # type: ignore[index]
    assert lent["items"] > 100
    assert lent["borrowers"] == 1
    before = borrowed()["hits"]
    for _ in range(20):
        sample_checked()
    assert borrowed()["hits"] > before  # cold items came back from n1's memory
    stats = json.loads((buf / "stats").read_text())
    assert stats["bytes_remote_memory"] > 100 * 50_000

    b.kill9()
    started = time.monotonic()
    for _ in range(20):
        sample_checked()  # from the log now: no item lost, no error
    assert time.monotonic() - started < 2 + 10  # one peer timeout at most, then the log
    wait_for(lambda: borrowed()["remote_items"] == 0, what="n1's items forgotten")


def test_a_dataset_written_on_one_node_streams_on_the_others_once_sealed(cluster_node: NodeFactory) -> None:
    a, b = cluster_node("n0"), cluster_node("n1")
    ds_a, ds_b = a.path / "datasets" / "meta", b.path / "datasets" / "meta"
    ds_a.mkdir()
    (ds_a / "config").write_text(json.dumps({"schema": {"x": "int64", "pad": {"dtype": "uint8", "shape": [1000]}}}))
    wait_for(lambda: json.loads((ds_b / "config").read_text())["schema"] is not None, what="config on n1")
    records = np.zeros(20_000, dtype=[("x", "<i8"), ("pad", "u1", (1000,))])  # 20 MB: two fetch runs
    records["x"] = np.arange(20_000) * 7
    records["pad"] = (np.arange(20_000) % 253)[:, None]
    client.append(ds_a, records)
    assert (ds_b / "state").read_text().strip() == "open"  # records reach n1 at the seal
    with pytest.raises(OSError) as excinfo, open(ds_b / "append", "wb") as f:
        f.write(records[:1].tobytes())
    assert excinfo.value.errno == errno.EROFS  # a copy is written on its writer only

    (ds_a / "state").write_text("seal")
    wait_for(lambda: (ds_b / "state").read_text().strip() == "sealed", what="sealed copy on n1", timeout_s=30)
    assert (ds_b / "len").read_text().strip() == "20000"
    assert (ds_b / "records" / "123").read_bytes() == records[123].tobytes()
    (ds_b / "order").write_text("shuffle 5")
    stream = np.load(io.BytesIO((ds_b / "stream").read_bytes()))
    order = np.random.default_rng(5).permutation(20_000)
    assert (stream["_index"] == order).all()
    assert (stream["x"] == records["x"][order]).all()
    assert (stream["pad"] == records["pad"][order]).all()
    assert peers(b)["datasets_fetched_records"] == 20_000

    os.rmdir(ds_b)  # removal on any node removes it everywhere
    wait_for(lambda: not ds_a.exists(), what="dataset removed on n0")
