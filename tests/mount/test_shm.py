"""Sampling through shared memory (`sample.shm`, `client.Sampler(transport="shm")`)
through a real mount, both versions: 1 (the daemon copies each batch into a region of
the client's) and 2 (a session over the daemon's socket; the items sit in the buffer's
arena). The same batches and accounting as the files, batches held until released, a
killed client's memory reclaimed, hostile session input, and the fallbacks."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs import client, hugepages
from tests.conftest import Mount

MountFactory = Callable[..., Mount]


@pytest.fixture
def buffer(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    path = mounted.path / "buffers" / request.node.name[:60]
    path.mkdir()
    yield path
    if path.exists():
        os.rmdir(path)


def stats(path: Path) -> dict[str, object]:
    result: dict[str, object] = json.loads(client.read_all(path / "stats"))
    return result


def regions() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("distorefs-")}


def reserved(mounted: Mount) -> int:
    blocks = mounted.status()["blocks"]
    assert isinstance(blocks, dict)
    return int(blocks["dram_reserved_bytes"])


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


class Version1:
    """`sample.shm` version 1 as a client speaks it (client._ShmChannel)."""

    def __init__(self, path: Path) -> None:
        self._channel = client._ShmChannel(str(path))

    def sample(self) -> object:
        return client._decode(self._channel.next(), copy=False)

    def __enter__(self) -> Version1:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()


def arena(path: Path) -> dict[str, int]:
    result = stats(path).get("shared_memory", {})
    assert isinstance(result, dict)
    return result


def test_blob_batches_through_shared_memory_are_the_items_and_count_like_the_files(
    mounted: Mount, buffer: Path
) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 8, "sampler": "prioritized"}))
    items = [bytes([i]) * (5000 + i) for i in range(20)]
    client.append(buffer, items)
    before = regions()
    with Version1(buffer / "sample.shm") as sampler:
        for _ in range(10):
            batch = sampler.sample()
            assert isinstance(batch, list)
            assert len(batch) == 8
            for index, weight, item in batch:
                assert bytes(item) == items[index]
                assert 0 < weight <= 1
        made = regions() - before
        assert len(made) == 1
        st = os.stat(f"/dev/shm/{made.pop()}")
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.geteuid())
        assert reserved(mounted) >= 4 * 64 * 1024  # the region counts against the DRAM budget
    assert stats(buffer)["samples"] == 80
    assert wait_until(lambda: regions() == before and reserved(mounted) == 0)  # closed: gone


def test_version2_batches_are_the_arenas_items_with_the_files_accounting(mounted: Mount, buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 8, "sampler": "prioritized"}))
    items = [bytes([i]) * (5000 + i) for i in range(20)]
    client.append(buffer, items)
    client.update_priorities(buffer, [3], [50.0])  # item 3 is drawn far more often, with the smallest weight
    with client.Sampler(buffer, transport="shm") as sampler:
        assert (sampler.transport, sampler.shm_version) == ("shm", 2)
        drawn = []
        for _ in range(10):
            batch = sampler.sample()
            assert len(batch) == 8
            for index, weight, item in batch:
                assert isinstance(item, memoryview)
                assert bytes(item) == items[index]
                assert 0 < weight <= 1
                drawn.append((index, weight))
        shared = arena(buffer)
        assert shared["arena_bytes"] >= 20 * 5024
        assert shared["held_slots"] > 0  # the last batch, until the next draw or the close
        assert reserved(mounted) >= shared["arena_bytes"]  # the arena counts against the DRAM budget
    assert stats(buffer)["samples"] == 80
    indices = [index for index, _w in drawn]
    assert indices.count(3) > 20
    assert min(w for i, w in drawn if i == 3) == min(w for _i, w in drawn)
    assert wait_until(lambda: arena(buffer)["held_slots"] == 0)  # the close released the last batch
    with client.Sampler(buffer, transport="shm", prefetch=2) as ahead:
        for _ in range(5):
            assert len(ahead.sample()) == 8
    # draws in flight at the close count once the daemon answered them (at most two more)
    assert wait_until(lambda: arena(buffer)["held_slots"] == 0)
    assert 80 + 40 <= int(stats(buffer)["samples"]) <= 80 + 56  # type: ignore[call-overload]


def test_version2_schema_batches_are_gathered_from_the_arena(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"schema": {"x": "<i8", "y": ["u1", [7000]]}, "batch_size": 3}))
    records = np.zeros(30, dtype=[("x", "<i8"), ("y", "u1", (7000,))])
    records["x"] = np.arange(30) * 10
    records["y"] = np.arange(30)[:, None]
    client.append(buffer, records)
    small = np.zeros(1, dtype=[("x", "<i8"), ("y", "u1", (7000,))])
    with client.Sampler(buffer, transport="shm") as three, client.Sampler(buffer, 9, transport="shm") as nine:
        assert three.shm_version == nine.shm_version == 2
        for sampler, count in ((three, 3), (nine, 9), (three, 3)):
            batch = sampler.sample()
            assert batch.dtype.names == ("x", "y", "_index", "_weight")
            assert len(batch) == count
            assert (batch["x"] == batch["_index"] * 10).all()
            assert (batch["y"] == (batch["_index"] % 256)[:, None]).all()
            assert (batch["_weight"] == 1).all()
        assert wait_until(lambda: arena(buffer)["items"] == 30)  # the session's start brought them all in
        small["x"] = 7
        client.append(buffer, small)  # appended while a session is open: in the arena at once
        assert arena(buffer)["items"] == 31
    assert stats(buffer)["samples"] == 15


def test_version2_held_batches_stay_unchanged_while_the_ring_wraps_past_them(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 4, "capacity": 8}))
    client.append(buffer, [b"first %d" % i + b"." * 900 for i in range(8)])
    with client.Sampler(buffer, transport="shm") as sampler:
        held = sampler.sample()
        copies = [(index, bytes(item)) for index, _w, item in held]
        client.append(buffer, [b"later %d" % i + b"." * 900 for i in range(40)])  # every old item is gone
        assert [(index, bytes(item)) for index, _w, item in held] == copies
        assert all(item.startswith(b"first %d" % index) for index, item in copies)
        for index, _w, item in sampler.sample():  # the next draw released the first batch
            assert bytes(item).startswith(b"later %d" % (index - 8))
        assert arena(buffer)["held_slots"] <= 4


def test_schema_batches_have_index_and_weight_and_grow_into_a_new_region(mounted: Mount, buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"schema": {"x": "<i8", "y": ["u1", [70000]]}, "batch_size": 2}))
    records = np.zeros(6, dtype=[("x", "<i8"), ("y", "u1", (70000,))])
    records["x"] = np.arange(6) * 10
    records["y"] = np.arange(6)[:, None]
    client.append(buffer, records)
    with (
        Version1(buffer / "sample.shm") as small,
        Version1(buffer / "sample.5.shm") as big,
        Version1(buffer / "sample.70.shm") as huge,  # 4.9 MB: copied into its slot from a thread
    ):
        for sampler, count in ((small, 2), (big, 5), (small, 2), (huge, 70), (huge, 70)):
            batch = sampler.sample()
            assert isinstance(batch, np.ndarray)
            assert len(batch) == count
            assert (batch["x"] == batch["_index"] * 10).all()
            assert (batch["y"][:, 0] == batch["_index"]).all()
            assert (batch["_weight"] == 1).all()
    assert stats(buffer)["samples"] == 149


def test_held_slots_are_never_overwritten_and_a_full_ring_is_eagain_counting_nothing(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 1}))
    client.append(buffer, [b"item %d" % i for i in range(50)])
    fd = os.open(buffer / "sample.shm", os.O_RDWR)
    try:
        held = []
        for _ in range(4):
            magic, path, size, offset, length, slot = os.read(fd, 4096).split()
            assert magic == b"DSSHM1"
            held.append((path, int(size), int(offset), int(length), int(slot)))
        with pytest.raises(OSError) as full:
            os.read(fd, 4096)
        assert full.value.errno == errno.EAGAIN
        assert stats(buffer)["samples"] == 4
        assert len({path for path, *_rest in held}) == 1
        with open(held[0][0], "rb") as region:
            data = region.read()
        for _path, _size, offset, length, _slot in held:
            [(index, _weight, item)] = client.decode_blob_batch(data[offset : offset + length])
            assert item == b"item %d" % index
        os.write(fd, b"release %d\n" % held[1][4])  # one back: room for one more
        os.read(fd, 4096)
        with open(held[0][0], "rb") as region:
            after = region.read()
        for _path, _size, offset, length, slot in held:  # the three still held are unchanged
            if slot != held[1][4]:
                assert after[offset : offset + length] == data[offset : offset + length]
        with pytest.raises(OSError) as unknown:
            os.write(fd, b"release 999\n")
        assert unknown.value.errno == errno.EINVAL
        with pytest.raises(OSError) as short:
            os.read(fd, 16)
        assert short.value.errno == errno.EINVAL
    finally:
        with pytest.raises(OSError) as closed:  # a refused write is reported again at the close
            os.close(fd)
        assert closed.value.errno == errno.EINVAL


CLIENT = textwrap.dedent(
    """
    import os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)
    print(os.read(fd, 4096).split()[1].decode(), flush=True)
    time.sleep(60)
    """
)


def test_a_client_killed_while_holding_a_batch_leaks_nothing(mounted: Mount, buffer: Path) -> None:
    client.append(buffer, [b"x" * 1000] * 40)
    child = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(buffer / "sample.shm")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        assert reserved(mounted) > 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
    assert wait_until(lambda: not os.path.exists(path) and reserved(mounted) == 0)


HOLDER = textwrap.dedent(
    """
    import sys, time
    from distorefs import client
    sampler = client.Sampler(sys.argv[1], transport="shm")
    batch = sampler.sample()
    print(sampler.shm_version, len(batch), flush=True)
    time.sleep(60)
    """
)


def test_version2_a_client_killed_holding_a_batch_gives_it_back(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 5}))
    client.append(buffer, [b"x" * 1000] * 40)
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(buffer)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["2", "5"]
        assert arena(buffer)["held_slots"] > 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
    assert wait_until(lambda: arena(buffer)["held_slots"] == 0)
    assert stats(buffer)["samples"] == 5


REQUEST = struct.Struct("<IIQ")
REPLY = struct.Struct("<iIQQQQ")


def ticket_for(fd: int) -> tuple[str, bytes]:
    os.write(fd, b"session 2\n")
    magic, path, ticket = os.read(fd, 4096).split()
    assert magic == b"DSSHM2"
    return path.decode(), ticket


def reply_errno(conn: socket.socket) -> int:
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 4)
    except ConnectionResetError:
        return -1  # closed with our request unread
    for fd in fds:
        os.close(fd)
    if not data:
        return -1  # closed
    return int(REPLY.unpack_from(data)[0])


def test_version2_hostile_session_input_is_refused_and_ends_only_that_session(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 2}))
    client.append(buffer, [b"a" * 100] * 10)
    fd = os.open(buffer / "sample.shm", os.O_RDWR)
    ticket_for(fd)
    with pytest.raises(OSError) as twice:
        os.write(fd, b"session 2\n")
    assert twice.value.errno == errno.EBUSY
    with pytest.raises(OSError) as closed:  # a refused write is reported again at the close
        os.close(fd)
    assert closed.value.errno == errno.EBUSY
    fd = os.open(buffer / "sample.shm", os.O_RDWR)
    try:
        path, ticket = ticket_for(fd)
        cases = [
            (b"0" * 32, []),  # a ticket nobody was given
            (ticket, [b"short", REQUEST.pack(1, 0, 0)]),  # a request of the wrong size ends the session
        ]
        for hello, requests in cases:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                conn.settimeout(10)
                conn.connect(path)
                conn.send(hello)
                if not requests:
                    assert reply_errno(conn) == errno.EACCES
                    continue
                conn.send(requests[0])
                assert reply_errno(conn) == errno.EPROTO
                with contextlib.suppress(OSError):
                    conn.send(requests[1])
                assert reply_errno(conn) == -1
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:  # a ticket is good once
            conn.settimeout(10)
            conn.connect(path)
            conn.send(ticket)
            assert reply_errno(conn) == errno.EACCES
    finally:
        os.close(fd)
    for request, code in (
        (REQUEST.pack(1, 5000, 0), errno.EMSGSIZE),  # more than a session's batch
        (REQUEST.pack(1, 0, 99), errno.EINVAL),  # releasing batches never handed out
        (REQUEST.pack(7, 0, 0), errno.EINVAL),  # no such operation
    ):
        fd = os.open(buffer / "sample.shm", os.O_RDWR)
        try:
            path, ticket = ticket_for(fd)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                conn.settimeout(10)
                conn.connect(path)
                conn.send(ticket)
                conn.send(request)
                assert reply_errno(conn) == code
        finally:
            os.close(fd)
    assert stats(buffer)["samples"] == 0
    with client.Sampler(buffer, transport="shm") as sampler:  # the daemon and the buffer are fine
        assert sampler.shm_version == 2
        assert len(sampler.sample()) == 2


def test_version2_connections_without_a_ticket_are_capped_per_user(mounted: Mount, buffer: Path) -> None:
    """The socket is open to every local user: one user's connections that never send a
    ticket are held up to MAX_HELLOS_PER_UID (each for HELLO_TIMEOUT_S at most), more are
    closed at once, so they neither pile up the daemon's descriptors nor lock another
    user out; the user's own sessions work again once theirs are gone."""
    from distorefs.fs.shm_sessions import MAX_HELLOS_PER_UID

    (buffer / "config").write_text(json.dumps({"batch_size": 2}))
    client.append(buffer, [b"a" * 100] * 10)
    fd = os.open(buffer / "sample.shm", os.O_RDWR)
    try:
        path, _ticket = ticket_for(fd)
    finally:
        os.close(fd)
    daemon_fds = Path(f"/proc/{mounted.proc.pid}/fd")
    before = len(os.listdir(daemon_fds))
    with contextlib.ExitStack() as stack:
        flood = []
        for _ in range(4 * MAX_HELLOS_PER_UID):
            conn = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            conn.settimeout(10)
            conn.connect(path)
            flood.append(conn)
        time.sleep(0.5)  # (well within HELLO_TIMEOUT_S of the first)
        held = sum(1 for conn in flood if still_open(conn))
        assert held == MAX_HELLOS_PER_UID  # the rest were closed at once (EOF)
        assert len(os.listdir(daemon_fds)) <= before + MAX_HELLOS_PER_UID + 4
        # Another user is not locked out: their bad ticket gets its EACCES, not a closed socket.
        other = textwrap.dedent(f"""
            import socket, struct
            codes = []
            for _ in range(3):
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
                    conn.settimeout(10)
                    conn.connect({path!r})
                    conn.send(b"0" * 32)
                    data = conn.recv(4096)
                    codes.append(struct.unpack_from("<i", data)[0] if data else -1)
            print(codes)
        """)
        out = subprocess.run(["/usr/bin/python3", "-c", other], user=65534, capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == str([errno.EACCES] * 3), out.stderr
    with client.Sampler(buffer, transport="shm") as sampler:  # the flood closed: sessions as before
        assert sampler.shm_version == 2
        assert len(sampler.sample()) == 2


def still_open(conn: socket.socket) -> bool:
    """Whether the daemon holds `conn` still: nothing to read, not even its close."""
    conn.setblocking(False)
    try:
        return conn.recv(4096) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        conn.settimeout(10)


def test_a_compressed_buffer_samples_through_version1(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 2, "compression": "zstd"}))
    client.append(buffer, [b"z" * 1000] * 4)
    with client.Sampler(buffer, transport="shm") as sampler:
        batch = sampler.sample()
        assert (sampler.transport, sampler.shm_version) == ("shm", 1)
        assert [bytes(item) for _i, _w, item in batch] == [b"z" * 1000] * 2


def test_without_shared_memory_the_sampler_falls_back_to_the_files(mount_factory: MountFactory, tmp_path: Path) -> None:
    mount = mount_factory("--shm-dir", str(tmp_path / "missing"))
    path = mount.path / "buffers" / "plain"
    path.mkdir()
    client.append(path, [b"a", b"b", b"c"])
    with pytest.raises(FileNotFoundError):
        os.open(path / "sample.shm", os.O_RDWR)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".sock")]
    with client.Sampler(path, transport="shm") as sampler:
        assert sampler.transport == "fuse"
        assert {bytes(item) for _i, _w, item in sampler.sample()} <= {b"a", b"b", b"c"}
    assert mount.unmount() == 0


def test_a_killed_daemons_regions_are_removed_at_the_next_start(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    path = mount.path / "buffers" / "left"
    path.mkdir()
    client.append(path, [b"a"] * 10)
    fd = os.open(path / "sample.shm", os.O_RDWR)
    region = os.read(fd, 4096).split()[1].decode()
    session = os.open(path / "sample.shm", os.O_RDWR)
    socket_path, _ticket = ticket_for(session)
    mount.kill9()
    for opened in (fd, session):
        with contextlib.suppress(OSError):  # ENOTCONN: the daemon is gone
            os.close(opened)
    assert os.path.exists(region)
    assert os.path.exists(socket_path)  # a killed daemon leaves its socket too
    mount = mount_factory()
    assert not os.path.exists(region)
    assert not os.path.exists(socket_path)
    session = os.open(path / "sample.shm", os.O_RDWR)
    socket_path, _ticket = ticket_for(session)
    os.close(session)
    assert mount.unmount() == 0
    assert not os.path.exists(socket_path)  # a daemon that stops takes its socket away


def test_regions_past_a_quarter_of_the_dram_budget_are_enomem_and_the_sampler_reads_the_files(
    mount_factory: MountFactory,
) -> None:
    """Version 1's regions may hold a quarter of the DRAM budget, version 2's arenas
    half: past that, a draw is ENOMEM and counts nothing, and the sampler goes on with
    the next path down (version 1, then the files)."""
    mount = mount_factory("--dram-budget", "64MiB")  # regions may hold 16 MiB in all, arenas 32 MiB
    path = mount.path / "buffers" / "big"
    path.mkdir()
    (path / "config").write_text(json.dumps({"batch_size": 5}))
    client.append(path, [bytes([i]) * 1_000_000 for i in range(6)])  # batches of 5 MB: 4 slots are 20 MB
    fd = os.open(path / "sample.shm", os.O_RDWR)
    try:
        with pytest.raises(OSError) as refused:
            os.read(fd, 4096)
        assert refused.value.errno == errno.ENOMEM
    finally:
        os.close(fd)
    assert stats(path)["samples"] == 0  # the refused batch counts nothing
    with client.Sampler(path, transport="shm") as sampler:
        assert len(sampler.sample()) == 5
        assert (sampler.transport, sampler.shm_version) == ("shm", 2)  # 6 items of 1 MB fit the arena
        client.append(path, [bytes([i]) * 1_000_000 for i in range(6, 50)])  # 50 MB do not
        drawn = 1
        while sampler.transport == "shm" and drawn < 200:
            batch = sampler.sample()
            drawn += 1
            assert all(bytes(item) == bytes([index]) * 1_000_000 for index, _w, item in batch)
        assert sampler.transport == "fuse"  # arena full, version 1's regions too big: the files
        assert int(arena(path)["arena_bytes"]) <= 32 << 20
    assert stats(path)["samples"] == 5 * drawn
    assert mount.unmount() == 0


def test_version2_sessions_follow_the_buffer_and_end_with_their_open(mounted: Mount) -> None:
    """A reconfiguration replaces the arena (the client maps the new one), the close of
    the open that asked for a session ends it, and a deleted buffer is ENOENT."""
    path = mounted.path / "buffers" / "follows"
    path.mkdir()
    (path / "config").write_text(json.dumps({"batch_size": 3, "capacity": 100}))
    items = [b"%03d" % i * 100 for i in range(30)]
    client.append(path, items)
    with client.Sampler(path, transport="shm") as sampler:
        assert all(bytes(item) == items[i] for i, _w, item in sampler.sample())
        (path / "config").write_text(json.dumps({"capacity": 200}))  # a new ring: a new arena
        for _ in range(5):
            assert all(bytes(item) == items[i] for i, _w, item in sampler.sample())
        assert sampler.shm_version == 2
    fd = os.open(path / "sample.shm", os.O_RDWR)
    socket_path, ticket = ticket_for(fd)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(10)
        conn.connect(socket_path)
        conn.send(ticket)
        conn.send(REQUEST.pack(1, 0, 0))
        assert reply_errno(conn) == 0
        assert arena(path)["held_slots"] > 0
        os.close(fd)  # the open goes: so do the session and what it held
        assert reply_errno(conn) == -1
    assert wait_until(lambda: arena(path)["held_slots"] == 0)
    with client.Sampler(path, transport="shm") as sampler:
        sampler.sample()
        os.rmdir(path)
        with pytest.raises(FileNotFoundError):
            sampler.sample()


class Alarm(Exception):
    pass


def test_version2_a_wait_cut_short_by_a_signal_counts_nothing_and_the_sampler_goes_on(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 2, "min_size_to_sample": 4, "sample_timeout": 30}))
    client.append(buffer, [b"one"])

    def ring(signum: int, frame: object) -> None:
        raise Alarm

    previous = signal.signal(signal.SIGALRM, ring)
    try:
        with client.Sampler(buffer, transport="shm") as sampler:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            started = time.monotonic()
            with pytest.raises(Alarm):
                sampler.sample()  # too few items: waits until the signal
            assert time.monotonic() - started < 10
            client.append(buffer, [b"two", b"three", b"four"])
            batch = sampler.sample()
            assert sampler.shm_version == 2
            assert {bytes(item) for _i, _w, item in batch} <= {b"one", b"two", b"three", b"four"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert wait_until(lambda: arena(buffer)["held_slots"] == 0)
    assert stats(buffer)["samples"] == 2  # the cut-short draw counted nothing


def test_version2_a_blob_bigger_than_the_arenas_slots_gets_a_new_arena(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 4, "capacity": 10}))
    items = {i: bytes([65 + i]) * 1000 for i in range(6)}
    client.append(buffer, list(items.values()))
    with client.Sampler(buffer, transport="shm") as sampler:
        held = sampler.sample()
        before = [(index, bytes(item)) for index, _w, item in held]
        assert arena(buffer)["slot_bytes"] == 1024
        items[6] = b"big" * 3000  # 9,000 bytes: no slot of this arena holds it
        client.append(buffer, [items[6]])
        seen = set()
        for _ in range(60):
            for index, _w, item in sampler.sample():
                assert bytes(item) == items[index]
                seen.add(index)
            if 6 in seen:
                break
        assert 6 in seen
        assert sampler.shm_version == 2  # not the fallback: a new arena with bigger slots
        assert arena(buffer)["slot_bytes"] >= 9000
        assert [(index, bytes(item)) for index, _w, item in held] == before  # the old arena's views live on


def test_version2_a_sampler_polls_for_its_reply_then_sleeps_until_it_comes(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 4, "min_size_to_sample": 8, "sample_timeout": 30}))
    items = [b"item-%d" % i for i in range(8)]
    client.append(buffer, items[:4])
    with client.Sampler(buffer, transport="shm", spin_us=2_000) as sampler:
        later = threading.Timer(0.5, client.append, (buffer, items[4:]))
        started = time.monotonic()
        later.start()
        batch = sampler.sample()  # too few items until the timer: the poll ends, the wait goes on
        assert time.monotonic() - started >= 0.4
        later.join()
        assert sampler._session is not None
        assert sampler._session.spun_replies == 0
        for _ in range(30):  # served at once: most replies come while it polls
            batch = sampler.sample()
            assert {bytes(item) for _i, _w, item in batch} <= set(items)
        assert sampler._session.spun_replies > 0
    with client.Sampler(buffer, transport="shm", spin_us=0) as sleeper:
        for _ in range(10):
            assert len(sleeper.sample()) == 4
        assert sleeper._session is not None
        assert sleeper._session.spun_replies == 0
    for bad in (-1, client.MAX_SPIN_US + 1):
        with pytest.raises(ValueError, match="spin_us"):
            client.Sampler(buffer, transport="shm", spin_us=bad)
    assert stats(buffer)["samples"] == 4 * (1 + 30 + 10)


def test_version2_a_session_that_always_has_requests_queued_leaves_the_mount_served(
    mounted: Mount, buffer: Path
) -> None:
    """A session serves queued requests back to back, with a pass of the event loop only
    every SESSION_PASS_S: a client that keeps its queue full (here one that sends
    without waiting, most requests past its 16 held batches and refused with EINVAL)
    must still leave the rest of the mount answered at once, and its refusals must not
    flood the daemon's log."""
    (buffer / "config").write_text(json.dumps({"batch_size": 4}))
    client.append(buffer, [b"x" * 100] * 64)
    daemon_log = mounted.data_dir.parent / f"{mounted.data_dir.name}.daemon.log"
    refusals_before = daemon_log.read_text().count("a session may hold")
    fd = os.open(buffer / "sample.shm", os.O_RDWR)
    path, ticket = ticket_for(fd)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(10)
    conn.connect(path)
    conn.send(ticket)
    conn.setblocking(False)
    flooding = threading.Event()
    counts = {"sent": 0, "replies": 0}

    def flood() -> None:
        request = REQUEST.pack(1, 0, 0)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                for _ in range(64):
                    conn.send(request)
                    counts["sent"] += 1
            with contextlib.suppress(BlockingIOError):
                while True:
                    conn.recv(1 << 16)  # a batch's reply, or EINVAL past the 16 held
                    counts["replies"] += 1
            flooding.set()

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        assert flooding.wait(10)
        slowest = 0.0
        while flooder.is_alive():
            started = time.monotonic()
            json.loads((mounted.path / ".distore" / "status").read_text())
            slowest = max(slowest, time.monotonic() - started)
    finally:
        flooder.join()
        conn.close()
        os.close(fd)
    assert counts["replies"] > 1000, counts  # the queue really was full for the daemon
    assert slowest < 0.5, f"a read of .distore/status waited {slowest:.3f} s beside the flood"
    assert stats(buffer)["samples"] == 4 * 16  # only the 16 held batches were drawn
    # thousands of refusals, and the daemon's log took at most its 20 lines per 10 s of them
    refused = daemon_log.read_text().count("a session may hold") - refusals_before
    assert 1 <= refused <= 20, refused


def mapping_flags(pid: int | str, name: str) -> list[set[str]]:
    """The VmFlags of each mapping of process `pid` whose path starts with `name`."""
    found: list[set[str]] = []
    matching = False
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and ":" not in fields[0]:  # a mapping's first line
                matching = len(fields) >= 6 and fields[5].startswith(name)
            elif matching and fields and fields[0] == "VmFlags:":
                found.append(set(fields[1:]))
    return found


@pytest.mark.skipif(not os.path.exists(hugepages.SHMEM_SETTING), reason="a kernel without transparent huge pages")
def test_version2_arena_mappings_ask_for_huge_pages_on_both_sides(mounted: Mount, buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 4}))
    client.append(buffer, [bytes([i]) * 5000 for i in range(40)])
    with client.Sampler(buffer, transport="shm") as sampler:
        assert len(sampler.sample()) == 4
        in_daemon = mapping_flags(mounted.proc.pid, "/memfd:distorefs-mirror")
        in_client = mapping_flags("self", "/memfd:distorefs-mirror")
    assert in_daemon
    assert in_client
    assert all("hg" in flags for flags in in_daemon), in_daemon
    assert all("hg" in flags for flags in in_client), in_client
    assert arena(buffer)["huge_pages"] == hugepages.shmem_huge()
