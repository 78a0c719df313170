"""weights/ through a real mount: atomic publish at close, readers keeping their version,
group publish, version and wait, killed writers, remounts and crashes, many readers."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs import client
from tests.conftest import Mount, blocked_read, dir_for_test, wait_blocked_in_read

pytestmark = pytest.mark.mount

MountFactory = Callable[..., Mount]


@pytest.fixture
def model(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    with dir_for_test(mounted.path / "weights", request) as path:
        yield path


def version(model: Path) -> int:
    return int((model / "version").read_text().split()[0])


def test_mkdir_creates_an_empty_model_at_version_0(model: Path) -> None:
    assert sorted(os.listdir(model)) == ["version", "wait"]
    line = (model / "version").read_text()
    number, published = line.split()
    assert number == "0"
    assert abs(float(published) - time.time()) < 3600
    with pytest.raises(OSError) as excinfo:
        os.mkdir(model)
    assert excinfo.value.errno == errno.EEXIST


def test_close_publishes_and_each_close_is_a_version(model: Path) -> None:
    subprocess.run(f"echo hello > {model}/a.txt", shell=True, check=True)
    assert subprocess.run(["cat", str(model / "a.txt")], capture_output=True, check=True).stdout == b"hello\n"
    assert version(model) == 1
    (model / "a.txt").write_bytes(b"second")
    assert (model / "a.txt").read_bytes() == b"second"
    assert version(model) == 2
    assert os.stat(model / "a.txt").st_size == 6


def test_readers_of_a_version_share_one_inode_and_a_writer_opens_its_own(model: Path) -> None:
    path = model / "params.bin"
    path.write_bytes(b"v1" * 50_000)
    first = os.open(path, os.O_RDONLY)
    second = os.open(path, os.O_RDONLY)
    try:
        shared = os.fstat(first).st_ino
        assert os.fstat(second).st_ino == shared  # one page cache for every reader of v1
        assert os.stat(path).st_ino == shared
        for flags in (os.O_WRONLY | os.O_TRUNC, os.O_RDWR):  # sent on to an inode of its own
            writer = os.open(path, flags)
            try:
                assert os.fstat(writer).st_ino != shared
                os.write(writer, b"v2")
            finally:
                os.close(writer)
        assert os.pread(first, 4, 0) == b"v1v1"  # the readers' pages were never cut
        assert os.stat(path).st_ino != shared  # the new version is another inode
        assert path.read_bytes() == b"v2"
        assert version(model) == 3
    finally:
        os.close(first)
        os.close(second)


def test_a_reader_keeps_the_version_it_opened(model: Path) -> None:
    first = os.urandom(3 << 20)
    (model / "w.bin").write_bytes(first)
    with open(model / "w.bin", "rb") as reader:
        head = reader.read(1000)
        for i in range(3):
            (model / "w.bin").write_bytes(bytes([i]) * (2 << 20))
        assert head + reader.read() == first
    assert (model / "w.bin").read_bytes() == bytes([2]) * (2 << 20)


@pytest.mark.parametrize("transport", ["shm", "mount"])
def test_map_version_is_a_zero_copy_view_that_outlives_newer_publishes(model: Path, transport: str) -> None:
    first = np.arange(300_000, dtype=np.float32)  # 1.2 MB
    (model / "w.bin").write_bytes(first.tobytes())
    version, view = client.map_version(model / "w.bin", transport=transport)
    assert version == 1
    weights = np.frombuffer(view, dtype=np.float32)  # no copy of the caller's
    assert not weights.flags.writeable
    for k in range(3):  # newer versions meanwhile
        (model / "w.bin").write_bytes(np.full(300_000, k, dtype=np.float32).tobytes())
    assert np.array_equal(weights, first)  # the mapped version is unchanged
    newest, again = client.map_version(model / "w.bin", transport=transport)
    assert newest == 4
    assert np.frombuffer(again, dtype=np.float32)[0] == 2
    assert client.map_version(model / "w.bin", transport=transport)[0] == 4
    with pytest.raises(FileNotFoundError):
        client.map_version(model / "missing.bin", transport=transport)
    torch = pytest.importorskip("torch")
    from safetensors.torch import load, save

    (model / "model.safetensors").write_bytes(save({"w": torch.arange(6, dtype=torch.float32)}))
    _version, st = client.map_version(model / "model.safetensors", transport=transport)
    assert load(bytes(st))["w"].tolist() == [0, 1, 2, 3, 4, 5]
    with warnings.catch_warnings():  # torch warns that the view is read-only: it is, on purpose
        warnings.simplefilter("ignore", UserWarning)
        assert torch.frombuffer(view, dtype=torch.float32)[299_999].item() == 299_999


def shared_weights(mount: Mount) -> tuple[int, int]:
    status = mount.status()
    return int(status["weight_shared_bytes"]), int(status["weight_shared_copies_made"])  # type: ignore[call-overload]


def test_map_version_maps_one_shared_copy_per_version_made_at_publish(mounted: Mount, model: Path) -> None:
    """The daemon copies a published file into a sealed memfd once, in the background;
    every map_version of that version maps it (no read through the mount); the copy goes
    when the version is freed, while mappings still held keep their bytes."""
    first, second = os.urandom(3 << 20), os.urandom(2 << 20)
    _bytes, made = shared_weights(mounted)
    (model / "w.bin").write_bytes(first)
    assert wait_until(lambda: shared_weights(mounted)[1] == made + 1)  # made after the publish
    read = weights_bytes_read(mounted)
    views = [client.map_version(model / "w.bin", transport="shm") for _ in range(3)]
    assert weights_bytes_read(mounted) == read  # not one byte through FUSE
    assert all(v == 1 and bytes(view) == first for v, view in views)
    assert bytes(views[0][1]) == (model / "w.bin").read_bytes()  # the same bytes as the mount's
    assert shared_weights(mounted)[1] == made + 1  # one copy for the three readers
    (model / "w.bin").write_bytes(second)
    assert wait_until(lambda: shared_weights(mounted) == (len(second) // 4096 * 4096, made + 2))  # v1's copy gone
    assert all(bytes(view) == first for _v, view in views)  # held mappings keep their version
    assert bytes(client.map_version(model / "w.bin", transport="shm")[1]) == second


def weights_bytes_read(mount: Mount) -> float:
    """Bytes of weights files read through the mount (the daemon's metrics)."""
    text = (mount.path / ".distore" / "metrics").read_text()
    for line in text.splitlines():
        if line.startswith("distorefs_bytes_total{") and 'kind="weights"' in line and 'direction="out"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no distorefs_bytes_total for weights reads")


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def hand_over(socket_path: bytes, ticket: bytes) -> tuple[int, bytes | None]:
    """Present a ticket on the daemon's socket: (errno, the first bytes of the memfd)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(10)
        conn.connect(socket_path.decode())
        conn.send(ticket)
        data, fds, _flags, _addr = socket.recv_fds(conn, 4096, 1)
    head = None
    for fd in fds:
        head = os.pread(fd, 16, 0)
        os.close(fd)
    return struct.unpack_from("<i", data)[0], head


def test_a_user_who_asks_for_copies_and_never_comes_voids_only_their_own_oldest_ticket(model: Path) -> None:
    (model / "w.bin").write_bytes(b"sixteen bytes!!!" * 10)
    tickets = [os.getxattr(model / "w.bin", "user.distore.shm").split() for _ in range(65)]
    _magic, path, first, version = tickets[0]
    assert version == b"1"
    assert hand_over(path, first) == (errno.EACCES, None)  # the 65th voided the first
    assert hand_over(path, tickets[1][2]) == (0, b"sixteen bytes!!!")
    assert hand_over(path, tickets[1][2]) == (errno.EACCES, None)  # one use each
    assert hand_over(path, b"0" * 32) == (errno.EACCES, None)


def test_map_version_falls_back_to_the_mount_without_shared_memory(mount_factory: MountFactory) -> None:
    mount = mount_factory("--shm-dir", "/nonexistent/shm")
    model = mount.path / "weights" / "m"
    model.mkdir()
    data = os.urandom(1 << 20)
    (model / "w.bin").write_bytes(data)
    version, view = client.map_version(model / "w.bin")  # auto: through the mount
    assert (version, bytes(view)) == (1, data)
    with pytest.raises(OSError) as excinfo:
        client.map_version(model / "w.bin", transport="shm")
    assert excinfo.value.errno == errno.ENOTSUP
    del view
    assert mount.unmount() == 0


def test_a_version_past_the_shared_memory_budget_maps_through_the_mount(mount_factory: MountFactory) -> None:
    """--dram-budget 64MiB: shared memory may take 32 MiB, copies at publish 16 MiB."""
    mount = mount_factory("--dram-budget", "64MiB")
    model = mount.path / "weights" / "m"
    model.mkdir()
    middle, big = os.urandom(20 << 20), os.urandom(40 << 20)
    (model / "mid.bin").write_bytes(middle)
    (model / "big.bin").write_bytes(big)
    assert shared_weights(mount) == (0, 0)  # both past the share for copies at publish
    _v, view = client.map_version(model / "mid.bin", transport="shm")  # made when asked
    assert bytes(view) == middle
    assert shared_weights(mount) == (20 << 20, 1)
    with pytest.raises(OSError) as excinfo:
        client.map_version(model / "big.bin", transport="shm")
    assert excinfo.value.errno == errno.ENOMEM
    _v, fallback = client.map_version(model / "big.bin")  # auto: through the mount
    assert bytes(fallback) == big
    assert shared_weights(mount) == (20 << 20, 1)
    del view, fallback
    assert mount.unmount() == 0


def test_name_at_version_is_read_only_shared_and_only_the_current_version(model: Path) -> None:
    (model / "w.bin").write_bytes(b"one")
    (model / "w.bin").write_bytes(b"two")  # version 2
    pinned = model / "w.bin@2"
    assert pinned.read_bytes() == b"two"
    assert os.stat(pinned).st_ino == os.stat(pinned).st_ino  # one inode for all its readers
    assert "w.bin@2" not in os.listdir(model)
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(OSError) as refused:
            os.open(pinned, flags)
        assert refused.value.errno in (errno.EROFS, errno.EACCES)
    with pytest.raises(FileNotFoundError):
        (model / "w.bin@1").read_bytes()  # not the current version
    (model / "x@3").write_bytes(b"a real file")  # version 3: a file of that very name wins
    assert (model / "x@3").read_bytes() == b"a real file"
    assert (model / "w.bin@3").read_bytes() == b"two"  # unchanged by the other file's publish


def test_nothing_is_visible_before_close(model: Path) -> None:
    (model / "w.bin").write_bytes(b"old")
    with open(model / "w.bin", "r+b") as writer:  # starts from the current bytes
        writer.write(b"NEW-BYTES")
        writer.flush()
        assert (model / "w.bin").read_bytes() == b"old"
        assert version(model) == 1
    assert (model / "w.bin").read_bytes() == b"NEW-BYTES"
    assert version(model) == 2


def test_a_killed_writer_publishes_nothing(model: Path) -> None:
    (model / "w.bin").write_bytes(b"intact")
    script = textwrap.dedent(f"""
        import os, signal
        f = open({str(model / "w.bin")!r}, "wb", buffering=0)
        f.write(b"half of a tensor")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False)
    assert result.returncode == -signal.SIGKILL
    assert (model / "w.bin").read_bytes() == b"intact"
    assert version(model) == 1


def test_group_publish_by_renaming_a_staged_model(mounted: Mount, model: Path) -> None:
    (model / "a").write_bytes(b"a1")
    (model / "b").write_bytes(b"b1")
    stage = mounted.path / "weights" / f"{model.name}.stage"
    stage.mkdir()
    (stage / "a").write_bytes(b"a2")
    (stage / "b").write_bytes(b"b2")
    before = version(model)
    subprocess.run(["mv", "-T", str(stage), str(model)], check=True)
    assert version(model) == before + 1
    assert not stage.exists()
    assert (model / "a").read_bytes() + (model / "b").read_bytes() == b"a2b2"


def test_a_group_publish_is_never_seen_half_done(mounted: Mount, model: Path) -> None:
    """Readers take both files under one version (the documented client recipe) while a
    writer swaps in groups whose files carry the same stamp."""
    (model / "a").write_bytes(b"0")
    (model / "b").write_bytes(b"0")
    stop = threading.Event()
    mixes: list[tuple[bytes, bytes]] = []
    failures: list[BaseException] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        try:
            while not stop.is_set():
                _, files = client.read_model(model)
                if files[b"a"] != files[b"b"]:
                    mixes.append((files[b"a"], files[b"b"]))
                reads += 1
        except BaseException as exc:  # reported by the test below
            failures.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for stamp in range(1, 30):
            stage = mounted.path / "weights" / f"{model.name}.s"
            stage.mkdir()
            (stage / "a").write_bytes(str(stamp).encode())
            (stage / "b").write_bytes(str(stamp).encode())
            os.rename(stage, model)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert failures == []
    assert reads > 0
    assert mixes == []


def test_rename_of_a_file_publishes_it_under_the_new_name(model: Path) -> None:
    (model / "w.tmp").write_bytes(b"complete")
    os.rename(model / "w.tmp", model / "w")
    assert sorted(os.listdir(model)) == ["version", "w", "wait"]
    assert (model / "w").read_bytes() == b"complete"


def test_unlink_publishes_a_version_without_the_file_and_rm_r_removes_the_model(model: Path) -> None:
    (model / "a").write_bytes(b"a")
    (model / "b").write_bytes(b"b")
    os.unlink(model / "a")
    assert version(model) == 3
    assert sorted(os.listdir(model)) == ["b", "version", "wait"]
    with pytest.raises(OSError) as excinfo:
        os.rmdir(model)
    assert excinfo.value.errno == errno.ENOTEMPTY
    subprocess.run(["rm", "-r", str(model)], check=True)
    assert not model.exists()


def test_bad_input_gets_clear_errnos(mounted: Mount, model: Path) -> None:
    cases: list[tuple[Callable[[], object], int]] = [
        (lambda: (model / "version").write_bytes(b"9"), errno.EROFS),
        (lambda: os.mkdir(model / "sub"), errno.EPERM),
        (lambda: os.rename(model, mounted.path / "checkpoints" / "x"), errno.EXDEV),
        (lambda: (mounted.path / "weights" / "stray.bin").write_bytes(b"x"), errno.EROFS),
        (lambda: (model / "missing").read_bytes(), errno.ENOENT),
    ]
    for call, expected in cases:
        with pytest.raises(OSError) as excinfo:
            call()
        assert excinfo.value.errno == expected, call
    (model / "w").write_bytes(b"w")
    with pytest.raises(OSError) as excinfo:
        os.truncate(model / "w", 0)
    assert excinfo.value.errno == errno.EROFS
    assert (model / "w").read_bytes() == b"w"


def test_wait_returns_now_then_blocks_until_a_newer_version(model: Path) -> None:
    (model / "w").write_bytes(b"1")
    fd = os.open(model / "wait", os.O_RDONLY)
    try:
        assert os.read(fd, 100).split()[0] == b"1"
        timer = threading.Timer(0.3, lambda: (model / "w").write_bytes(b"2"))
        timer.start()
        started = time.monotonic()
        line = os.read(fd, 100)
        timer.join()
        assert line.split()[0] == b"2"
        assert time.monotonic() - started >= 0.25
    finally:
        os.close(fd)


def test_wait_nonblocking_says_eagain(model: Path) -> None:
    fd = os.open(model / "wait", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert os.read(fd, 100).split()[0] == b"0"
        with pytest.raises(BlockingIOError):
            os.read(fd, 100)
        (model / "w").write_bytes(b"x")
        assert os.read(fd, 100).split()[0] == b"1"
    finally:
        os.close(fd)


def test_wait_read_a_byte_at_a_time_gives_whole_lines(model: Path) -> None:
    (model / "w").write_bytes(b"1")
    fd = os.open(model / "wait", os.O_RDONLY | os.O_NONBLOCK)
    try:
        line = b""
        while not line.endswith(b"\n"):  # how unbuffered readline reads
            line += os.read(fd, 1)
        assert line == (model / "version").read_bytes()
        with pytest.raises(BlockingIOError):  # the line is used up: the next waits for a new version
            os.read(fd, 1)
        (model / "w").write_bytes(b"2")
        with open(fd, "rb", buffering=0, closefd=False) as raw:
            assert raw.readline().split()[0] == b"2"
    finally:
        os.close(fd)


def test_a_signal_interrupts_a_blocked_wait(model: Path) -> None:
    queue: multiprocessing.Queue[str] = multiprocessing.Queue()
    waiter = multiprocessing.get_context("fork").Process(target=blocked_read, args=(str(model / "wait"), queue, 1))
    waiter.start()
    try:
        assert queue.get(timeout=10) == "reading"
        wait_blocked_in_read(waiter.pid or 0)
        os.kill(waiter.pid or 0, signal.SIGUSR1)
        assert queue.get(timeout=10) == "interrupted"
    finally:
        waiter.join(timeout=10)
        if waiter.is_alive():
            waiter.kill()


def test_wait_times_out_with_etimedout(mount_factory: MountFactory) -> None:
    mount = mount_factory("--wait-timeout", "0.5")
    model = mount.path / "weights" / "m"
    model.mkdir()
    fd = os.open(model / "wait", os.O_RDONLY)
    try:
        os.read(fd, 100)
        with pytest.raises(OSError) as excinfo:
            os.read(fd, 100)
        assert excinfo.value.errno == errno.ETIMEDOUT
    finally:
        os.close(fd)
    assert mount.unmount() == 0


def test_versions_survive_remount_and_kill_9(mount_factory: MountFactory, tmp_path: Path) -> None:
    mount = mount_factory()
    model = mount.path / "weights" / "policy"
    model.mkdir()
    payload = os.urandom(5 << 20)
    (model / "params.bin").write_bytes(payload)
    (model / "config.json").write_text("{}")
    assert mount.unmount() == 0

    mount = mount_factory()
    assert version(model) == 2
    assert (model / "params.bin").read_bytes() == payload
    (model / "params.bin").write_bytes(payload[::-1])  # acknowledged by close
    mount.kill9()

    mount = mount_factory()
    assert version(model) == 3
    assert (model / "params.bin").read_bytes() == payload[::-1]
    assert (model / "config.json").read_text() == "{}"
    assert mount.unmount() == 0


READER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    path, seconds, stop = sys.argv[1], float(sys.argv[2]), sys.argv[4]
    reads, bad, versions = 0, [], set()
    deadline = time.monotonic() + seconds
    # Read until the writer is done (the stop file) or the deadline: on a loaded 2-core
    # machine, 32 readers may spend seconds just starting, so a fixed span saw no publish.
    while time.monotonic() < deadline and not (reads and os.path.exists(stop)):
        with open(path, "rb") as f:
            data = f.read()
        words = np.frombuffer(data, dtype=np.uint64)
        seq = int(words[0] >> np.uint64(32))
        expected = (np.uint64(seq) << np.uint64(32)) + np.arange(len(words), dtype=np.uint64)
        if len(data) != int(sys.argv[3]) or not np.array_equal(words, expected):
            bad.append(seq)
        versions.add(seq)
        reads += 1
    print(json.dumps({"reads": reads, "bad": bad, "versions": sorted(versions)}))
""")


def test_32_readers_always_read_a_whole_published_version(mount_factory: MountFactory) -> None:
    """A writer publishes a 64 MB file four times, a second apart, while 32 processes read
    it in a loop: each read is one complete version, and the daemon's memory stays
    bounded. (Beside 32 readers on 2 cores, a publish takes 3-5 s itself.)"""
    size = 64 << 20
    budget = 512 << 20
    mount = mount_factory("--dram-budget", "512MiB")
    model = mount.path / "weights" / "big"
    model.mkdir()
    path = model / "tensor.bin"
    base = np.arange(size // 8, dtype=np.uint64)

    def publish(seq: int) -> None:
        (base + np.uint64(seq << 32)).tofile(path)

    publish(1)
    stop = mount.data_dir.parent / "readers-stop"
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(path), "60", str(size), str(stop)],
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for _ in range(32)
    ]
    try:
        for seq in range(2, 6):
            time.sleep(1.0)
            publish(seq)
        stop.touch()
        results = []
        for proc in readers:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0
            results.append(__import__("json").loads(out))
    finally:
        for proc in readers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(r["bad"] == [] for r in results), [r["bad"] for r in results if r["bad"]]
    assert sum(r["reads"] for r in results) >= 32, results
    assert len({v for r in results for v in r["versions"]}) >= 2, results  # readers saw publishes
    status = mount.status()
    assert int(status["dram_used_bytes"]) <= budget, status  # type: ignore[call-overload]
    with open(f"/proc/{mount.proc.pid}/status", encoding="ascii") as f:
        peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert peak_kib * 1024 < budget + (400 << 20), f"daemon peak RSS {peak_kib} KiB"
    assert int(status["weight_files"]) == 1  # type: ignore[call-overload]
    assert mount.unmount() == 0
