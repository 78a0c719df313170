"""Hostile input through a real mount: each bad write gets a clean errno, applies nothing,
and leaves the daemon alive and the mount writable for everyone else."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distorefs import client
from tests.conftest import Mount, dir_for_test, end_the_waits, wait_for, wait_in_samples

MountFactory = Callable[..., Mount]

SCHEMA = {"x": "int64"}
T = TypeVar("T")


@pytest.fixture
def buffer(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A schema buffer holding records 0..9 with priorities 1..10."""
    with dir_for_test(mounted.path / "buffers", request) as path:
        (path / "config").write_text(json.dumps({"schema": SCHEMA, "sampler": "prioritized"}))
        client.append(path, np.arange(10, dtype=np.int64).astype([("x", "<i8")]))
        client.update_priorities(path, list(range(10)), [float(i + 1) for i in range(10)])
        yield path


@pytest.fixture
def dataset(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    with dir_for_test(mounted.path / "datasets", request) as path:
        (path / "config").write_text(json.dumps({"schema": SCHEMA}))
        with open(path / "append", "wb") as f:
            f.write(np.arange(8, dtype=np.int64).tobytes())
        (path / "state").write_text("seal\n")
        yield path


def snapshot(path: Path) -> dict[str, object]:
    """What a refused write must leave as it was."""
    stats = json.loads(client.read_all(path / "stats"))
    return {
        "config": (path / "config").read_text(),
        "size": stats.get("size", stats.get("records")),
        "total_priority": stats.get("total_priority"),
        "inserts": stats.get("inserts"),
    }


def healthy(mount: Mount) -> None:
    """The daemon is alive, not degraded, and another client can still write."""
    assert mount.proc.poll() is None, "the daemon died"
    status = mount.status()
    assert status["degraded"] is False, status["degraded_reason"]
    probe = mount.path / "probe.txt"
    probe.write_bytes(b"still writable")
    assert probe.read_bytes() == b"still writable"


class CloseFailed(OSError):
    """Every write went through; the close failed (a stream ended mid-record)."""


def write_all(path: Path, data: bytes, flags: int = os.O_WRONLY, offset: int | None = None) -> None:
    """One open, the bytes in 1 MiB writes (or one pwrite at `offset`), one close: an
    OSError from any of them comes out (the close reports a refused write too); a failure
    of the close alone is CloseFailed."""
    fd = os.open(path, flags)
    try:
        if offset is not None:
            os.pwrite(fd, data, offset)
        else:
            for start in range(0, len(data), 1 << 20):
                os.write(fd, data[start : start + (1 << 20)])
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    try:
        os.close(fd)
    except OSError as exc:
        raise CloseFailed(exc.errno, exc.strerror) from None


def refused(fn: Callable[[], object]) -> int:
    with pytest.raises(OSError) as excinfo:
        fn()
    assert excinfo.value.errno is not None
    return excinfo.value.errno


def npy_with_header(header: str, payload: bytes = b"\0" * 16) -> bytes:
    text = header.encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + payload


BAD_NPY_HEADERS = {
    "bogus descr": "{'descr': 'bogus', 'fortran_order': False, 'shape': (2,), }",
    "object dtype": "{'descr': '|O', 'fortran_order': False, 'shape': (2,), }",
    "non-string descr": "{'descr': 5, 'fortran_order': False, 'shape': (2,), }",
    "string shape": "{'descr': '<i8', 'fortran_order': False, 'shape': ('a',), }",
    "huge shape": "{'descr': '<i8', 'fortran_order': False, 'shape': (99999999999, 99999999999), }",
    "not a dict": "[1, 2, 3]",
}


def test_an_item_over_the_size_limit_is_efbig_and_the_item_stays(mounted: Mount, buffer: Path) -> None:
    before = (buffer / "items" / "0").read_bytes()
    assert refused(lambda: write_all(buffer / "items" / "0", b"\0" * (65 << 20))) == errno.EFBIG
    assert (buffer / "items" / "0").read_bytes() == before
    healthy(mounted)


def test_a_pwrite_far_past_the_item_limit_is_efbig(mounted: Mount, buffer: Path) -> None:
    before = (buffer / "items" / "0").read_bytes()
    assert refused(lambda: write_all(buffer / "items" / "0", b"x", offset=1 << 40)) == errno.EFBIG
    assert (buffer / "items" / "0").read_bytes() == before
    healthy(mounted)


def test_a_priority_index_beyond_int64_is_einval_and_applies_nothing(mounted: Mount, buffer: Path) -> None:
    before = snapshot(buffer)
    text = b"1 5.0\n9223372036854775808 1\n"
    assert refused(lambda: write_all(buffer / "priority", text)) == errno.EINVAL
    assert snapshot(buffer) == before
    healthy(mounted)


@pytest.mark.parametrize("case", sorted(BAD_NPY_HEADERS))
@pytest.mark.parametrize("target", ["priority", "append"])
def test_a_bad_npy_header_is_einval_for_buffers(mounted: Mount, buffer: Path, target: str, case: str) -> None:
    before = snapshot(buffer)
    assert refused(lambda: write_all(buffer / target, npy_with_header(BAD_NPY_HEADERS[case]))) == errno.EINVAL
    assert snapshot(buffer) == before
    healthy(mounted)


@pytest.mark.parametrize("case", sorted(BAD_NPY_HEADERS))
def test_a_bad_npy_order_is_einval_and_the_order_stays(mounted: Mount, dataset: Path, case: str) -> None:
    before = (dataset / "order").read_bytes()
    assert refused(lambda: write_all(dataset / "order", npy_with_header(BAD_NPY_HEADERS[case]))) == errno.EINVAL
    assert (dataset / "order").read_bytes() == before
    healthy(mounted)


def test_an_order_longer_than_its_bound_is_einval_at_its_header(mounted: Mount, dataset: Path) -> None:
    """An order may repeat records, up to 16 indices a record (or 2**20 in all): a .npy
    header announcing 2**40 indices is refused as soon as it arrives (before, the daemon
    took every byte sent after it), and so is text past the bound."""
    before = (dataset / "order").read_bytes()
    header = npy_with_header("{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776,), }", b"")
    fd = os.open(dataset / "order", os.O_WRONLY)
    try:
        assert refused(lambda: os.write(fd, header)) == errno.EINVAL
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    line = b"0 " * 4096 + b"\n"  # 8 KiB a write: 4,096 indices
    assert refused(lambda: write_all(dataset / "order", line * (((1 << 20) // 4096) + 1))) == errno.EINVAL
    assert (dataset / "order").read_bytes() == before
    write_all(dataset / "order", line * 8)  # 32,768 indices of an 8-record dataset: taken
    assert len(np.load(io.BytesIO((dataset / "order").read_bytes()))) == 32_768
    healthy(mounted)


@pytest.mark.parametrize("kind", ["buffer", "dataset"])
def test_json_nested_100000_deep_is_einval(mounted: Mount, request: pytest.FixtureRequest, kind: str) -> None:
    path = request.getfixturevalue(kind)
    before = (path / "config").read_text()
    for deep in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        assert refused(lambda text=deep: write_all(path / "config", text.encode())) == errno.EINVAL
    assert (path / "config").read_text() == before
    healthy(mounted)


def test_config_input_past_its_limit_is_efbig_at_once(mounted: Mount, buffer: Path) -> None:
    before = snapshot(buffer)
    assert refused(lambda: write_all(buffer / "config", b"{" + b" " * (2 << 20))) == errno.EFBIG
    assert snapshot(buffer) == before
    healthy(mounted)


@pytest.mark.parametrize(
    "changes",
    [
        {"schema": {"x": ["int64", [99999999999, 99999999999]]}},
        {"schema": {"x": ["int64", "ab"]}},
        {"schema": {"x": {"dtype": ["int64"]}}},
        {"batch_size": 99999999999999999999},
        {"batch_size": (1 << 20) + 1},
        {"sampler": []},  # (was a TypeError: EIO and an internal error)
        {"sampler": {"prioritized": 1}},
        {"compression": "zstd:\u00b2"},  # a digit to str.isdigit, not to int()
        {"compression": "zstd:" + "9" * 5000},
        {"alpha": 1e308},  # priorities 1..10 would scale to infinity
        {"capacity": 1 << 24},  # a ring of 1.6 GB of arrays and trees: past the 256 MiB budget
        {"epsilon": 1e300, "alpha": 2},
    ],
)
def test_configs_the_buffer_could_not_serve_are_refused_at_write_time(
    mounted: Mount, buffer: Path, changes: dict[str, object]
) -> None:
    internal, before = mounted.status()["internal_errors"], snapshot(buffer)
    assert refused(lambda: write_all(buffer / "config", json.dumps(changes).encode())) == errno.EINVAL
    assert snapshot(buffer) == before
    with open(buffer / "sample", "rb") as f:
        assert len(np.load(f)) == 32
    assert mounted.status()["internal_errors"] == internal
    healthy(mounted)


def test_extreme_alpha_beta_and_priorities_sample_with_weights_in_0_1(mounted: Mount, buffer: Path) -> None:
    """A beta of 1e308 overflowed (N * P_min)^-beta and every sample failed with EIO; a
    priority whose (p + epsilon)^alpha overflows made the sum tree's total infinite. Now
    weights are (P / P_min)^-beta, in [0, 1], and an update that would scale past 1e290
    is EINVAL with nothing applied."""
    internal = mounted.status()["internal_errors"]
    priorities = np.arange(1, 11, dtype=np.float64)  # the fixture's, of items 0..9
    for alpha, beta in ((0.6, 1e308), (0.6, 1e-300), (100.0, 1.0), (1e-300, 1.0)):
        write_all(buffer / "config", json.dumps({"alpha": alpha, "beta": beta}).encode())
        scaled = np.power(priorities + 1e-6, alpha)
        with np.errstate(all="ignore"):
            expected = np.power(scaled / scaled.min(), -beta)  # (N P / N P_min)^-beta
        for _ in range(3):
            with open(buffer / "sample", "rb") as f:
                batch = np.load(f)
            weights = batch["_weight"]
            assert np.isfinite(weights).all()
            assert ((weights >= 0) & (weights <= 1)).all()
            assert weights == pytest.approx(expected[batch["_index"]].astype(np.float32), rel=1e-4, abs=1e-30)
    write_all(buffer / "config", b'{"alpha": 100.0}')
    before = snapshot(buffer)
    assert refused(lambda: write_all(buffer / "priority", b"0 1.0\n1 1e300\n")) == errno.EINVAL
    assert snapshot(buffer) == before
    stats = json.loads(client.read_all(buffer / "stats"))
    assert "scales past 1e+290" in stats["errors"][-1]
    write_all(buffer / "priority", b"0 1.0\n1 1e2\n")  # 1e200: taken
    assert math.isfinite(json.loads(client.read_all(buffer / "stats"))["total_priority"])
    assert mounted.status()["internal_errors"] == internal
    healthy(mounted)


def test_a_batch_that_would_not_fit_the_dram_budget_is_refused(mounted: Mount, request: pytest.FixtureRequest) -> None:
    """`batch_size` is checked when configured; `sample.N` (N up to 2**20, drawn with
    replacement) was not, nor was any blob buffer's batch: sample.1000000 of 1 MB items
    asked the daemon for a terabyte. Each is EFBIG before anything is read or counted."""
    with dir_for_test(mounted.path / "buffers", request) as big:
        # 8 MiB records on a 256 MiB budget: a batch may take half of it, 16 records
        (big / "config").write_text(json.dumps({"schema": {"x": ["uint8", [8 << 20]]}, "batch_size": 16}))
        assert refused(lambda: write_all(big / "config", b'{"batch_size": 17}')) == errno.EINVAL
        assert json.loads((big / "config").read_text())["batch_size"] == 16
        client.append(big, np.zeros(2, dtype=[("x", "u1", (8 << 20,))]))
        assert refused(lambda: client.read_all(big / "sample.17")) == errno.EFBIG
        assert refused(lambda: client.read_all(big / "sample.1000000")) == errno.EFBIG
        assert json.loads(client.read_all(big / "stats"))["samples"] == 0  # nothing counted
        assert len(np.load(io.BytesIO(client.read_all(big / "sample.16")))) == 16
    with dir_for_test(mounted.path / "buffers", request) as blobs:
        client.append(blobs, [bytes([i]) * (4 << 20) for i in range(4)])  # blobs of 4 MiB
        assert refused(lambda: client.read_all(blobs / "sample.33")) == errno.EFBIG  # 132 MiB
        stats = json.loads(client.read_all(blobs / "stats"))
        assert stats["samples"] == 0
        assert "more than half the daemon's DRAM budget" in stats["errors"][-1]
        assert len(client.sample(blobs, 32, copy=False)) == 32  # 128 MiB: taken
    healthy(mounted)


def test_buffers_rings_take_at_most_half_the_dram_budget_and_writes_keep_the_rest(
    mount_factory: MountFactory,
) -> None:
    """Each buffer's ring (its per-slot arrays and trees: 11.6 MB for the default 100,000
    slots) counts against the DRAM budget. Created by mkdir, they were counted whether
    they fitted or not: 600 empty buffers held 7 GB of a 4 GiB budget, and every file
    write of the mount then failed with ENOSPC. Now all rings together may take half
    the budget: a mkdir gets the default capacity or what that half still has room for
    (at least 1,024 slots), past it ENOSPC with the reason in the log and nothing
    created; files are still written."""
    mount = mount_factory("--dram-budget", "64MiB")  # rings: at most 32 MiB
    buffers = mount.path / "buffers"
    made: list[int] = []  # each buffer's capacity
    refusal = None
    while refusal is None and len(made) < 100:
        try:
            (buffers / f"b{len(made)}").mkdir()
        except OSError as exc:
            refusal = exc.errno
        else:
            made.append(json.loads((buffers / f"b{len(made)}" / "config").read_text())["capacity"])
    assert refusal == errno.ENOSPC
    assert made[:2] == [100_000, 100_000]
    assert 3 <= len(made) < 100
    assert made == sorted(made, reverse=True)
    assert min(made) >= 1024
    assert sorted(os.listdir(buffers)) == sorted(f"b{i}" for i in range(len(made)))
    assert mount.status()["blocks"]["dram_index_bytes"] <= 32 << 20  # type: ignore[index]
    log_text = (mount.data_dir.parent / f"{mount.data_dir.name}.daemon.log").read_text()
    assert f"buffers/b{len(made)}: a ring of 1024 slots takes 98304 bytes" in log_text
    with pytest.raises(OSError) as err:  # a bigger ring by config: EINVAL, the config unchanged
        (buffers / "b1" / "config").write_text(json.dumps({"capacity": 200_000}))
    assert err.value.errno == errno.EINVAL
    assert json.loads((buffers / "b1" / "config").read_text())["capacity"] == 100_000
    data = os.urandom(24 << 20)
    (mount.path / "file").write_bytes(data)  # the other half of the budget is the files'
    assert (mount.path / "file").read_bytes() == data
    for name in ("b0", "b1"):  # give their rings back
        (buffers / name / "config").write_text(json.dumps({"capacity": 1000}))
    (buffers / "again").mkdir()
    assert json.loads((buffers / "again" / "config").read_text())["capacity"] == 100_000
    client.append(buffers / "again", [b"item"])
    assert client.read_all(buffers / "again" / "items" / "0") == b"item"


def once_released(action: Callable[[], T]) -> T:
    """`action()`, tried again while it fails with ENOMEM, for up to 10 s: the kernel sends
    RELEASE after a close has returned, so the room a close frees comes a little later."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return action()
        except OSError as exc:
            if exc.errno != errno.ENOMEM or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_sample_files_held_open_hold_at_most_half_the_dram_budget(
    mounted: Mount, request: pytest.FixtureRequest
) -> None:
    """An open keeps its batch until it is closed, so one process opening sample files
    and never closing them could hold any amount of the daemon's memory. Batches held
    count against the DRAM budget (256 MiB here): past it an open's read is ENOMEM with
    nothing counted, and a close makes room again."""
    with dir_for_test(mounted.path / "buffers", request) as blobs:
        client.append(blobs, [bytes([i]) * (4 << 20) for i in range(4)])  # blobs of 4 MiB
        # 96 MiB each: a sample file's batch, and a stream's current one
        held = [os.open(blobs / name, os.O_RDONLY) for name in ("sample.24", "sample.24.stream")]
        try:
            for fd in held:
                assert os.read(fd, 16)  # drawn
            extra = os.open(blobs / "sample.24", os.O_RDONLY)
            try:
                assert refused(lambda: os.read(extra, 16)) == errno.ENOMEM
            finally:
                os.close(extra)
            assert json.loads(client.read_all(blobs / "stats"))["samples"] == 48  # the refused one counted nothing
        finally:
            for fd in held:
                os.close(fd)
        assert len(once_released(lambda: client.sample(blobs, 24, copy=False))) == 24
    healthy(mounted)


def test_input_held_by_open_control_files_is_bounded_by_the_dram_budget(
    mounted: Mount, buffer: Path, request: pytest.FixtureRequest
) -> None:
    """A `.npy` of priorities arriving in pieces, or a frame of a blob append whose
    length came first, is held until it is complete; one process keeping descriptors
    open with a partial input in each could make the daemon hold any amount of memory
    (a frame's length alone had it allocate 64 MiB). Such input counts mount-wide
    against the DRAM budget (256 MiB here): the write that would pass it is ENOMEM, its
    input dropped, and a close gives its room back."""
    out = io.BytesIO()  # the header of a .npy of 4 million pairs (61 MiB)
    np.lib.format.write_array_header_1_0(out, {"descr": "<f8", "fortran_order": False, "shape": (4_000_000, 2)})
    header = out.getvalue()
    held = []
    try:
        for _ in range(5):  # 50 MiB of a 61 MiB array in each: 250 MiB
            fd = os.open(buffer / "priority", os.O_WRONLY)
            held.append(fd)
            os.write(fd, header + bytes(50 << 20))
        fd = os.open(buffer / "priority", os.O_WRONLY)
        held.append(fd)
        os.write(fd, header)

        mib = mmap.mmap(-1, 1 << 20)  # page-aligned: each write is one request (or a write that
        # the kernel cut in two would come back short at the refusal instead of failing)

        def write_mib_by_mib() -> None:
            for _ in range(10):
                os.write(fd, mib)

        assert mounted.status()["held_input_bytes"] >= 250 << 20
        assert refused(write_mib_by_mib) == errno.ENOMEM
        blobs = buffer.with_name(buffer.name + "-blobs")
        blobs.mkdir()
        append = os.open(blobs / "append", os.O_WRONLY)
        try:  # a frame's length alone: 64 MiB it would take
            assert refused(lambda: os.write(append, b"DSITEMS1" + (64 << 20).to_bytes(8, "little"))) == errno.ENOMEM
        finally:
            assert refused(lambda: os.close(append)) == errno.ENOMEM  # a refused write, reported again
            blobs.rmdir()
        with contextlib.suppress(OSError):  # EINVAL: the close finds the .npy incomplete
            os.close(held.pop(0))
        once_released(lambda: os.write(fd, header + bytes(10 << 20)))  # the refusal dropped its input: a new .npy
    finally:
        for fd in held:
            with contextlib.suppress(OSError):
                os.close(fd)
    with dir_for_test(mounted.path / "datasets", request) as ds:
        assert refused(lambda: write_all(ds / "state", b"x" * (1 << 20))) == errno.EFBIG  # it grew without bound
        assert (ds / "state").read_text() == "open\n"
    healthy(mounted)


def test_open_listings_of_items_hold_at_most_the_dram_budget(mounted: Mount, request: pytest.FixtureRequest) -> None:
    """An open `items/` keeps its listing (16 bytes an item) until it is closed: one
    process opening it again and again could hold any amount of memory. Listings held
    count against the DRAM budget (256 MiB here): past it an opendir is ENOMEM, and a
    close makes room again."""
    with dir_for_test(mounted.path / "buffers", request) as big:
        (big / "config").write_text(json.dumps({"schema": SCHEMA, "capacity": 100_000}))
        client.append(big, np.arange(100_000, dtype=np.int64).astype([("x", "<i8")]))
        fds: list[int] = []
        try:
            with pytest.raises(OSError) as excinfo:  # noqa: PT012 - the opens until one is refused
                while len(fds) < 200:
                    fds.append(os.open(big / "items", os.O_RDONLY | os.O_DIRECTORY))
            assert excinfo.value.errno == errno.ENOMEM
            assert len(fds) == (256 << 20) // 1_600_000  # 1.6 MB each: 167 fit
            assert mounted.status()["held_listing_bytes"] == len(fds) * 1_600_000
        finally:
            for fd in fds:
                os.close(fd)
        wait_for(lambda: mounted.status()["held_listing_bytes"] == 0, what="the RELEASEDIRs, sent after the closes")
        assert len(os.listdir(big / "items")) == 100_000
        os.rmdir(big)  # at once (rm -r would unlink the items one by one)
    healthy(mounted)


def test_a_keep_last_of_5000_digits_is_einval(mounted: Mount) -> None:
    run = mounted.path / "checkpoints" / "hostile-keep"
    run.mkdir()
    try:
        assert refused(lambda: os.setxattr(run, "user.distore.keep_last", b"9" * 5000)) == errno.EINVAL
        assert "user.distore.keep_last" not in os.listxattr(run)
        healthy(mounted)
    finally:
        run.rmdir()


def test_numbers_of_5000_digits_are_einval_wherever_a_control_file_takes_one(
    mounted: Mount, buffer: Path, dataset: Path
) -> None:
    """Python parses no integer of more than 4,300 digits (a ValueError, which a request
    would turn into EIO and an internal error): a slot to release, a shuffle's seed, a
    priority's index and a config value of 5,000 digits are each refused with EINVAL,
    change nothing and count no internal error."""
    internal = mounted.status()["internal_errors"]
    digits = b"9" * 5000
    before, order = snapshot(buffer), (dataset / "order").read_bytes()
    fd = os.open(buffer / "sample.shm", os.O_RDWR)
    try:
        assert refused(lambda: os.write(fd, b"release " + digits + b"\n")) == errno.EINVAL
    finally:
        assert refused(lambda: os.close(fd)) == errno.EINVAL  # the close reports it again
    assert refused(lambda: write_all(dataset / "order", b"shuffle " + digits + b"\n")) == errno.EINVAL
    assert (dataset / "order").read_bytes() == order
    assert refused(lambda: write_all(buffer / "priority", digits + b" 1.0\n")) == errno.EINVAL
    assert refused(lambda: write_all(buffer / "config", b'{"capacity": ' + digits + b"}")) == errno.EINVAL
    assert snapshot(buffer) == before
    assert mounted.status()["internal_errors"] == internal
    write_all(dataset / "order", b"shuffle " + b"9" * 40 + b"\n")  # the longest seed taken
    assert json.loads(client.read_all(dataset / "stats"))["order"].startswith("shuffle " + "9" * 40)
    healthy(mounted)


def test_extended_attributes_past_a_files_room_are_enospc(mounted: Mount) -> None:
    """Attributes are held in the daemon's memory: a file takes 1 MiB of them (names and
    values), past it setxattr is ENOSPC and the file keeps what it had; removing one
    makes room again."""
    path = mounted.path / "xattr-room"
    path.write_bytes(b"x")
    value = bytes(60_000)
    try:
        for i in range(17):
            os.setxattr(path, f"user.v{i:04d}", value)
        assert refused(lambda: os.setxattr(path, "user.v0017", value)) == errno.ENOSPC
        assert len(os.listxattr(path)) == 17
        assert os.getxattr(path, "user.v0016") == value
        os.removexattr(path, "user.v0000")
        os.setxattr(path, "user.v0017", value)
        healthy(mounted)
    finally:
        path.unlink()


def test_np_save_of_bad_priorities_fails_at_close(mounted: Mount, buffer: Path) -> None:
    before = snapshot(buffer)
    with pytest.raises(OSError) as excinfo:  # noqa: PT012 - the close is the point
        with open(buffer / "priority", "wb") as f:
            np.save(f, np.array([[0, 1.0], [12345, 2.0]]))  # no item 12345: none applied
    assert excinfo.value.errno == errno.EINVAL
    assert snapshot(buffer) == before
    healthy(mounted)


def test_a_name_over_255_bytes_is_enametoolong_everywhere(mounted: Mount) -> None:
    long = "a" * 256
    root = mounted.path
    (root / "short").write_bytes(b"x")
    calls: list[Callable[[], object]] = [
        lambda: os.stat(root / long),
        lambda: os.chmod(root / long, 0o600),
        lambda: os.unlink(root / long),
        lambda: os.rmdir(root / long),
        lambda: os.mkdir(root / long),
        lambda: os.open(root / long, os.O_CREAT | os.O_WRONLY, 0o644),
        lambda: os.rename(root / "short", root / long),
        lambda: os.link(root / "short", root / long),
        lambda: os.symlink("short", root / long),
        lambda: os.stat(root / "buffers" / long),
    ]
    for call in calls:
        assert refused(call) == errno.ENAMETOOLONG
    assert stat.S_ISREG(os.stat(root / "short").st_mode)
    healthy(mounted)


# --- generated hostile input into every control file ----------------------------------------

hostile_bytes = st.one_of(
    st.binary(max_size=2048),
    st.text(max_size=512).map(str.encode),
    st.sampled_from([npy_with_header(h) for h in BAD_NPY_HEADERS.values()]),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
        max_leaves=20,
    ).map(lambda value: json.dumps(value).encode()),
    st.lists(st.tuples(st.integers(), st.floats()), max_size=8).map(
        lambda pairs: "".join(f"{i} {p}\n" for i, p in pairs).encode()
    ),
)


def write_hostile(mounted: Mount, path: Path, data: bytes, state: Callable[[], object], stream: bool) -> None:
    """Write `data` to `path` in one open; when it is refused, `state()` is as it was, and
    the daemon is healthy either way. Where only the close failed and the file is a
    stream (a buffer's `append`), the whole records before the incomplete tail were
    applied in order (docs/namespace.md), so only a refused write must leave no trace."""
    before = state()
    try:
        write_all(path, data)
    except CloseFailed:
        if not stream:
            assert state() == before
    except OSError:
        assert state() == before  # a write was refused: nothing applied
    healthy(mounted)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["config", "priority", "append", "items/3", "sample", "stats"]), data=hostile_bytes)
def test_generated_input_never_hurts_the_daemon_and_a_refusal_changes_nothing(
    mounted: Mount, buffer: Path, target: str, data: bytes
) -> None:
    write_hostile(mounted, buffer / target, data, lambda: snapshot(buffer), stream=target == "append")


def test_stats_name_the_reason_but_never_quote_the_input(mounted: Mount, buffer: Path) -> None:
    secret = "hunter2-SECRET"
    for bad in ({"sampler": secret}, {secret: 1}, {"schema": {secret: "nope"}}):
        assert refused(lambda bad=bad: write_all(buffer / "config", json.dumps(bad).encode())) == errno.EINVAL
    assert refused(lambda: write_all(buffer / "priority", f"1 {secret}\n".encode())) == errno.EINVAL
    stats = client.read_all(buffer / "stats").decode()
    assert "hunter2" not in stats
    assert "sampler must be one of" in stats
    healthy(mounted)


def dataset_snapshot(path: Path) -> dict[str, object]:
    return {name: (path / name).read_bytes() for name in ("config", "len", "state", "order")}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["config", "append", "state", "order", "stream", "len"]), data=hostile_bytes)
def test_generated_input_to_a_dataset_never_hurts_the_daemon(
    mounted: Mount, dataset: Path, target: str, data: bytes
) -> None:
    write_hostile(mounted, dataset / target, data, lambda: dataset_snapshot(dataset), stream=False)


def test_more_waiting_samples_than_pyfuse3s_default_tasks_leave_the_mount_answering(
    mounted: Mount, request: pytest.FixtureRequest
) -> None:
    """150 reads of `sample` wait for items at once: each holds one of pyfuse3's worker
    tasks, and with its default of 99 the mount answered no one (a status read timed
    out after 10 s). Now the mount keeps answering while all 150 wait, and each gets a
    batch once the items come."""
    with dir_for_test(mounted.path / "buffers", request) as buffer:
        outcomes, threads = wait_in_samples(buffer, 150)
        try:
            wait_for(lambda: json.loads((buffer / "stats").read_text())["blocked_readers"] == 150, timeout_s=60)
            started = time.monotonic()
            waiting = json.loads((mounted.path / ".distore" / "status").read_text())["waiting_requests"]
            (mounted.path / f"{buffer.name}-file").write_bytes(b"still answering")
            assert (mounted.path / f"{buffer.name}-file").read_bytes() == b"still answering"
            assert time.monotonic() - started < 10
            assert (waiting["now"], waiting["limit"]) == (150, 512), waiting
        finally:
            end_the_waits(buffer, threads)
        assert len(outcomes) == 150
        assert all(isinstance(batch, bytes) and b"item-" in batch for batch in outcomes), outcomes[:3]
        os.unlink(mounted.path / f"{buffer.name}-file")


def test_waits_past_max_waiting_requests_get_eagain_at_once_and_the_rest_are_served(
    mount_factory: MountFactory,
) -> None:
    """`--max-waiting-requests 8`: of twelve blocking reads of `sample`, eight wait and
    four get EAGAIN at once (counted as refused in `.distore/status`); the mount answers
    meanwhile, and the eight get their batches when the items come."""
    mount = mount_factory("--max-waiting-requests", "8")
    buffer = mount.path / "buffers" / "waits"
    buffer.mkdir()
    outcomes, threads = wait_in_samples(buffer, 12)
    try:
        wait_for(lambda: outcomes.count(errno.EAGAIN) == 4, timeout_s=60)
        wait_for(lambda: json.loads((buffer / "stats").read_text())["blocked_readers"] == 8, timeout_s=60)
        status = json.loads((mount.path / ".distore" / "status").read_text())
        assert status["waiting_requests"] == {"now": 8, "limit": 8, "refused": 4}
        assert os.listdir(buffer)  # the mount answers
    finally:
        end_the_waits(buffer, threads)
    assert outcomes.count(errno.EAGAIN) == 4
    batches = [outcome for outcome in outcomes if isinstance(outcome, bytes)]
    assert len(batches) == 8
    assert all(b"item-" in batch for batch in batches)
    assert json.loads((mount.path / ".distore" / "status").read_text())["waiting_requests"]["now"] == 0
    os.rmdir(buffer)
    assert mount.unmount() == 0
