"""Sampling through shared memory (`sample.shm`, `client.Sampler(transport="shm")`)
through a real mount: the same batches and accounting as the files, slots held until
released, a killed client's region reclaimed, and the fallback to the files."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs import client
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


def test_blob_batches_through_shared_memory_are_the_items_and_count_like_the_files(
    mounted: Mount, buffer: Path
) -> None:
    (buffer / "config").write_text(json.dumps({"batch_size": 8, "sampler": "prioritized"}))
    items = [bytes([i]) * (5000 + i) for i in range(20)]
    client.append(buffer, items)
    before = regions()
    with client.Sampler(buffer, transport="shm") as sampler:
        assert sampler.transport == "shm"
        for _ in range(10):
            batch = sampler.sample()
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


def test_schema_batches_have_index_and_weight_and_grow_into_a_new_region(mounted: Mount, buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"schema": {"x": "<i8", "y": ["u1", [70000]]}, "batch_size": 2}))
    records = np.zeros(6, dtype=[("x", "<i8"), ("y", "u1", (70000,))])
    records["x"] = np.arange(6) * 10
    records["y"] = np.arange(6)[:, None]
    client.append(buffer, records)
    with (
        client.Sampler(buffer, transport="shm") as small,
        client.Sampler(buffer, 5, transport="shm") as big,
        client.Sampler(buffer, 70, transport="shm") as huge,  # 4.9 MB: copied into its slot from a thread
    ):
        for sampler, count in ((small, 2), (big, 5), (small, 2), (huge, 70), (huge, 70)):
            batch = sampler.sample()
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


def test_without_shared_memory_the_sampler_falls_back_to_the_files(mount_factory: MountFactory, tmp_path: Path) -> None:
    mount = mount_factory("--shm-dir", str(tmp_path / "missing"))
    path = mount.path / "buffers" / "plain"
    path.mkdir()
    client.append(path, [b"a", b"b", b"c"])
    with pytest.raises(FileNotFoundError):
        os.open(path / "sample.shm", os.O_RDWR)
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
    mount.kill9()
    with contextlib.suppress(OSError):  # ENOTCONN: the daemon is gone
        os.close(fd)
    assert os.path.exists(region)
    mount = mount_factory()
    assert not os.path.exists(region)
    assert mount.unmount() == 0


def test_regions_past_a_quarter_of_the_dram_budget_are_enomem_and_the_sampler_reads_the_files(
    mount_factory: MountFactory,
) -> None:
    mount = mount_factory("--dram-budget", "64MiB")  # regions may hold 16 MiB in all
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
        assert sampler.transport == "fuse"
    assert stats(path)["samples"] == 5
    assert reserved(mount) == 0
    assert mount.unmount() == 0
