"""The POSIX tree, control files and the checkpoint policy through FsOperations, no kernel."""

from __future__ import annotations

import errno
import functools
import io
import json
import os

import numpy as np
import pyfuse3
import pytest
import trio
import trio.testing

from distorefs import scheduling
from distorefs.daemon import Daemon
from distorefs.stores.files import ROOT_INODE
from tests.conftest import Ticker
from tests.ops.conftest import CTX, DIR_MODE, lookup, new_buffer, read_file, write_file


async def test_a_written_file_reads_back_and_has_its_size(daemon: Daemon) -> None:
    ops = daemon.ops
    ino = await write_file(ops, ROOT_INODE, b"a.txt", b"hello world")
    attrs = await lookup(ops, "a.txt")
    assert attrs.st_ino == ino
    assert attrs.st_size == 11
    assert await read_file(ops, ino) == b"hello world"


async def test_a_missing_name_is_enoent(daemon: Daemon) -> None:
    with pytest.raises(pyfuse3.FUSEError) as excinfo:
        await daemon.ops.lookup(ROOT_INODE, b"nope", CTX)
    assert excinfo.value.errno == errno.ENOENT


@pytest.mark.parametrize("name", [b"buffers", b"weights", b"datasets", b".distore", b"checkpoints"])
async def test_reserved_root_names_cannot_be_made_removed_or_renamed(daemon: Daemon, name: bytes) -> None:
    ops = daemon.ops
    with pytest.raises(pyfuse3.FUSEError) as made:
        await ops.mkdir(ROOT_INODE, name, DIR_MODE, CTX)
    assert made.value.errno == errno.EEXIST
    with pytest.raises(pyfuse3.FUSEError) as removed:
        await ops.rmdir(ROOT_INODE, name, CTX)
    assert removed.value.errno == errno.EBUSY
    await ops.mkdir(ROOT_INODE, b"d", DIR_MODE, CTX)
    with pytest.raises(pyfuse3.FUSEError) as replaced:
        await ops.rename(ROOT_INODE, b"d", ROOT_INODE, name, 0, CTX)
    assert replaced.value.errno == errno.EBUSY


async def test_status_renders_one_json_snapshot_per_open(daemon: Daemon) -> None:
    status = await lookup(daemon.ops, ".distore/status")
    report = json.loads(await read_file(daemon.ops, status.st_ino))
    assert report["pid"] == os.getpid()
    assert report["degraded"] is False


async def test_a_buffer_made_appended_and_sampled_through_its_control_files(daemon: Daemon) -> None:
    ops = daemon.ops
    config = {"schema": {"x": "int64"}, "batch_size": 4, "sampler": "fifo"}
    made = await new_buffer(ops, b"b", config, np.arange(10, dtype=np.int64).tobytes())
    sample = (await ops.lookup(made, b"sample", CTX)).st_ino
    batch = np.load(io.BytesIO(await read_file(ops, sample)))
    assert batch["x"].tolist() == [0, 1, 2, 3]
    assert batch["_index"].tolist() == [0, 1, 2, 3]
    assert daemon.buffers.get("b").samples == 4


async def test_a_bad_config_is_einval_and_changes_nothing(daemon: Daemon) -> None:
    ops = daemon.ops
    buffers = await lookup(ops, "buffers")
    made = await ops.mkdir(buffers.st_ino, b"b", DIR_MODE, CTX)
    before = daemon.buffers.get("b").config
    config_ino = (await ops.lookup(made.st_ino, b"config", CTX)).st_ino
    info = await ops.open(config_ino, os.O_WRONLY | os.O_TRUNC, CTX)
    with pytest.raises(pyfuse3.FUSEError) as excinfo:
        await ops.write(info.fh, 0, b'{"capacity": 0}')
    assert excinfo.value.errno == errno.EINVAL
    await ops.release(info.fh)
    assert daemon.buffers.get("b").config == before


# --- the checkpoint policy behind the tree -----------------------------------------------


async def checkpoint_dir(daemon: Daemon, name: bytes) -> int:
    root = await lookup(daemon.ops, "checkpoints")
    return int((await daemon.ops.mkdir(root.st_ino, name, DIR_MODE, CTX)).st_ino)


async def state(daemon: Daemon, ino: int) -> str:
    return bytes(await daemon.ops.getxattr(ino, b"user.distore.state", CTX)).decode()


async def test_a_checkpoint_close_returns_before_durable_and_the_persister_makes_it_durable(daemon: Daemon) -> None:
    run = await checkpoint_dir(daemon, b"run1")
    ino = await write_file(daemon.ops, run, b"step-1.pt", os.urandom(3 << 20))
    assert await state(daemon, ino) == "persisting"
    assert daemon.checkpoints.statistics()["checkpoint_files_waiting"] == 1
    await daemon.checkpoints.persist_pass()
    assert await state(daemon, ino) == "durable"
    assert daemon.checkpoints.statistics()["checkpoint_files_waiting"] == 0


async def test_fsync_of_a_checkpoint_returns_durable_while_it_is_still_open(daemon: Daemon) -> None:
    run = await checkpoint_dir(daemon, b"run1")
    info, attrs = await daemon.ops.create(run, b"step-1.pt", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
    await daemon.ops.write(info.fh, 0, b"weights")
    assert await state(daemon, attrs.st_ino) == "dram"
    await daemon.ops.fsync(info.fh, False)
    assert await state(daemon, attrs.st_ino) == "durable"
    await daemon.ops.release(info.fh)
    assert b"user.distore.state" in await daemon.ops.listxattr(attrs.st_ino, CTX)


async def test_keep_last_removes_older_checkpoints_and_tells_the_kernel(daemon: Daemon) -> None:
    ops = daemon.ops
    run = await checkpoint_dir(daemon, b"run1")
    await ops.setxattr(run, b"user.distore.keep_last", b"2", CTX)
    removed: list[tuple[int, bytes, int]] = []
    async with trio.open_nursery() as nursery:

        async def follow() -> None:
            while True:
                removed.append(await ops.tree.removed.next())

        nursery.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        first = await write_file(ops, run, b"step-1.pt", b"1", fsync=True)
        await write_file(ops, run, b"step-2.pt", b"2", fsync=True)
        await write_file(ops, run, b"step-3.pt", b"3", fsync=True)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert removed == [(run, b"step-1.pt", first)]
    with pytest.raises(pyfuse3.FUSEError) as excinfo:
        await ops.lookup(run, b"step-1.pt", CTX)
    assert excinfo.value.errno == errno.ENOENT
    assert (await ops.lookup(run, b"step-3.pt", CTX)).st_size == 1


async def test_sync_close_set_on_a_parent_applies_below_it_and_stops_when_removed(daemon: Daemon) -> None:
    ops = daemon.ops
    run = await checkpoint_dir(daemon, b"run1")
    sub = (await ops.mkdir(run, b"sub", DIR_MODE, CTX)).st_ino
    await ops.setxattr(run, b"user.distore.sync_close", b"1", CTX)
    synced = await write_file(ops, sub, b"a.pt", b"a")
    assert await state(daemon, synced) == "durable"  # the close waited
    await ops.removexattr(run, b"user.distore.sync_close", CTX)
    background = await write_file(ops, sub, b"b.pt", b"b")
    assert await state(daemon, background) == "persisting"  # the setting is gone: no stale answer


@pytest.mark.parametrize(
    ("name", "value"),
    [(b"user.distore.keep_last", b"0"), (b"user.distore.sync_close", b"yes"), (b"user.distore.replicas", b"2")],
)
async def test_a_bad_setting_is_einval_and_not_stored(daemon: Daemon, name: bytes, value: bytes) -> None:
    run = await checkpoint_dir(daemon, b"run1")
    with pytest.raises(pyfuse3.FUSEError) as excinfo:
        await daemon.ops.setxattr(run, name, value, CTX)
    assert excinfo.value.errno == errno.EINVAL
    assert name not in await daemon.ops.listxattr(run, CTX)


async def test_the_state_xattr_cannot_be_set_or_removed(daemon: Daemon) -> None:
    run = await checkpoint_dir(daemon, b"run1")
    ino = await write_file(daemon.ops, run, b"step-1.pt", b"x")
    for call in (
        daemon.ops.setxattr(ino, b"user.distore.state", b"durable", CTX),
        daemon.ops.removexattr(ino, b"user.distore.state", CTX),
    ):
        with pytest.raises(pyfuse3.FUSEError) as excinfo:
            await call
        assert excinfo.value.errno == errno.EPERM


# --- what an unexpected error does ----------------------------------------------------------


async def test_an_unexpected_error_fails_its_request_only(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = daemon.ops

    def broken(*args: object) -> None:
        raise ValueError("a bug reached by one request")

    monkeypatch.setattr(daemon.ops.tree, "readlink", broken)
    with pytest.raises(pyfuse3.FUSEError) as excinfo:
        await ops.readlink(ROOT_INODE, CTX)
    assert excinfo.value.errno == errno.EIO
    status = json.loads(await read_file(ops, (await lookup(ops, ".distore/status")).st_ino))
    assert status["degraded"] is False
    assert status["internal_errors"] == 1
    assert status["last_internal_error"] == "readlink: ValueError"
    await write_file(ops, ROOT_INODE, b"still.txt", b"writable")  # nobody else is hurt


async def test_a_broken_invariant_turns_the_mount_degraded_and_says_why(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = daemon.ops

    def broken(*args: object) -> None:
        raise AssertionError("slot index and ring disagree")

    monkeypatch.setattr(daemon.ops.tree, "readlink", broken)
    with pytest.raises(pyfuse3.FUSEError) as excinfo:
        await ops.readlink(ROOT_INODE, CTX)
    assert excinfo.value.errno == errno.EIO
    status = json.loads(await read_file(ops, (await lookup(ops, ".distore/status")).st_ino))
    assert status["degraded"] is True
    assert status["degraded_reason"] == "readlink: broken invariant: slot index and ring disagree"
    with pytest.raises(pyfuse3.FUSEError) as refused:
        await ops.mkdir(ROOT_INODE, b"d", DIR_MODE, CTX)
    assert refused.value.errno == errno.EROFS


async def test_forget_never_raises(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise KeyError("no such inode")

    monkeypatch.setattr(daemon.ops.tree, "unref", broken)
    await daemon.ops.forget([(12345, 1)])
    assert daemon.ops.virtual.internal_errors == 1


async def test_a_reader_whose_version_was_replaced_after_its_lookup_is_sent_to_the_current_one(
    daemon: Daemon,
) -> None:
    ops = daemon.ops
    weights = await lookup(ops, "weights")
    model = (await ops.mkdir(weights.st_ino, b"m", DIR_MODE, CTX)).st_ino
    await write_file(ops, model, b"w.bin", b"version one")
    old = (await ops.lookup(model, b"w.bin", CTX)).st_ino  # the reader's lookup
    await write_file(ops, model, b"w.bin", b"version two")  # republished: version one is freed
    # Its open: ESTALE, not ENOENT (the old inode's size and pages are version one's);
    # the kernel then looks the name up again and opens the current version.
    with pytest.raises(pyfuse3.FUSEError) as stale:
        await ops.open(old, os.O_RDONLY, CTX)
    assert stale.value.errno == errno.ESTALE
    current = (await ops.lookup(model, b"w.bin", CTX)).st_ino
    assert current != old
    assert await read_file(ops, current) == b"version two"


async def test_requests_that_need_not_wait_make_no_schedule_point_before_their_reply(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's checkpoints are cancel points only (distorefs/scheduling.py): another
    runnable task gets the event loop after the reply, when pyfuse3's loop yields, not in
    the middle. Reading a buffer's config, drawing a batch from DRAM and reading its
    stats (open, read, read at the end, release) wait for nothing: none may let the
    ticker run. (A priority update or an append may wait for a log write in a thread
    here, where no background task makes the inline path ready: that yields.)

    A request past its first DEFER_S yields again by design (test_scheduling.py tests
    that); beside a CPU hog a draw was descheduled past 1 ms and the ticker ran, so here
    the deferral lasts the whole test: what is checked is that nothing else yields."""
    monkeypatch.setattr(scheduling, "DEFER_S", 60.0)
    ops = daemon.ops
    made = await new_buffer(ops, b"b", {"schema": {"x": "int64"}, "batch_size": 4}, np.arange(10).tobytes())
    names = ("config", "sample", "stats")
    inos = {name: (await ops.lookup(made, name.encode(), CTX)).st_ino for name in names}
    calls = {name: functools.partial(read_file, ops, ino) for name, ino in inos.items()}
    ticker = Ticker()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker.run)
        for name, call in calls.items():
            await call()  # once to warm up whatever a first call makes
            assert await ticker.runs_during(trio.lowlevel.checkpoint)  # (the ticker runs)
            before = ticker.passes
            for _ in range(20):
                await call()
            assert ticker.passes == before, f"{name}: a schedule point inside its requests"
        nursery.cancel_scope.cancel()
    assert daemon.buffers.get("b").samples >= 84
