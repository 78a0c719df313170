"""The checkpoint policy without a mount: its persister against a tree that changes under it."""

from __future__ import annotations

import errno
import itertools
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distorefs.errors import DistorefsError, StoreFull
from distorefs.stores.checkpoints import (
    MAX_INCOMING_REPLICAS,
    MAX_PARTS_AHEAD,
    REPLICA_AHEAD_BYTES,
    REPLICA_PART_MAX_BYTES,
    RETRY_S,
    CheckpointPolicy,
)
from distorefs.stores.files import MAX_FILE_BYTES, FileStore
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from tests.unit.tiers import open_tiers


@pytest.fixture
async def policy(tmp_path: Path) -> AsyncIterator[tuple[CheckpointPolicy, FileStore]]:
    blocks: BlockStore
    meta: MetaDb
    blocks, meta = open_tiers(tmp_path, 64 * 1024, 16)
    files = FileStore.load(blocks, meta)
    yield CheckpointPolicy.load(files, meta, sync_close=False), files
    await blocks.close()
    meta.close()


async def test_a_run_directory_removed_before_the_persister_pass_leaves_the_persister_working(
    policy: tuple[CheckpointPolicy, FileStore],
) -> None:
    # What a test's teardown (or `rm -r run/` right after a save) does: the kernel still
    # holds the file and its directory while both are gone from the tree. The pass that
    # makes the file durable then runs retention for a directory without a parent.
    ckpt, files = policy
    run = files.mkdir(ckpt.root, b"run", 0o755, 0, 0).ino
    kept = files.mkdir(ckpt.root, b"kept", 0o755, 0, 0).ino
    files.setxattr(kept, b"user.distore.keep_last", b"1")
    made = []
    for directory in (run, kept, kept):
        name = b"step-%d.pt" % len(made)
        ino = files.mknod(directory, name, 0o100644, 0, 0, 0).ino
        ckpt.track(ino, directory)
        await files.write(ino, 0, b"x" * 1000)
        ckpt.changed(ino)
        await ckpt.close(ino)
        made.append((directory, name, ino))
    files.ref(run)
    files.ref(made[0][2])
    files.unlink(run, made[0][1])
    files.rmdir(ckpt.root, b"run")
    ckpt.settings_changed()
    await ckpt.persist_pass()
    assert ckpt.state(made[0][2]) == "durable"
    assert [name for name, _ino in files.entries(kept)] == [b"step-2.pt"]  # retention ran on
    assert ckpt.errors == 0


async def test_a_failing_persist_pass_is_logged_and_retried_and_never_ends_the_persister(
    policy: tuple[CheckpointPolicy, FileStore], monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    ckpt, _files = policy
    passes = []
    real = ckpt.persist_pass

    async def flaky() -> None:
        passes.append(trio.current_time())
        if len(passes) == 1:
            raise RuntimeError("a bug in a pass")
        await real()

    monkeypatch.setattr(ckpt, "persist_pass", flaky)
    with trio.move_on_after(3 * RETRY_S):
        await ckpt.run_persister(idle_s=0.5)
    assert len(passes) > 2  # it went on after the failure
    assert passes[1] - passes[0] >= RETRY_S  # after a pause
    assert ckpt.errors == 1
    assert "a bug in a pass" in ckpt.last_error


# --- replicas received in parts ---------------------------------------------------------


async def receive(ckpt: CheckpointPolicy, path: bytes, data: bytes, part: int = 100_000) -> str:
    """Begin a replica of `data` for `path` and send every part (not the commit)."""
    transfer = await ckpt.begin_replica(path, 0o100640, len(data))
    for offset in range(0, len(data), part):
        await ckpt.write_replica(transfer, offset, memoryview(data)[offset : offset + part])
    return transfer


async def test_a_replica_takes_its_path_only_when_committed_and_replaces_the_old_one_whole(
    policy: tuple[CheckpointPolicy, FileStore],
) -> None:
    ckpt, files = policy
    ckpt.removed.followed = True  # as the fs layer follows it
    run = files.mkdir(ckpt.root, b"run", 0o755, 0, 0).ino
    old = files.mknod(run, b"step-1.pt", 0o100644, 0, 0, 0).ino
    ckpt.track(old, run)
    await files.write(old, 0, b"old" * 1000)
    new = os.urandom(350_000)
    transfer = await ckpt.begin_replica(b"checkpoints/run/step-1.pt", 0o100640, len(new))
    # parts in flight arrive out of order; a part sent again is written again
    for offset in (0, 200_000, 100_000, 100_000, 50_000, 300_000):
        await ckpt.write_replica(transfer, offset, memoryview(new)[offset : offset + 100_000])
        assert files.entries(run) == ((b"step-1.pt", old),)  # nothing shows before the commit
        assert bytes(await files.read(old, 0, 3000)) == b"old" * 1000
    assert ckpt.replicas_incoming == 1

    ino = await ckpt.commit_replica(transfer)

    assert ino != old
    assert files.entries(run) == ((b"step-1.pt", ino),)
    inode = files.get(ino)
    assert (inode.size, inode.mode, inode.nlink) == (len(new), 0o100640, 1)
    assert bytes(await files.read(ino, 0, len(new))) == new
    assert ckpt.state(ino) == "durable"
    assert files.dirty_bytes(ino) == 0
    assert old not in files  # nothing had it open: gone with its bytes
    assert await ckpt.removed.next() == (run, b"step-1.pt", old)  # the kernel is told
    assert await ckpt.commit_replica(transfer) == ino  # a commit sent again is answered again
    assert (ckpt.replicas_incoming, ckpt.replicas_received, ckpt.replicas_dropped) == (0, 1, 0)
    ckpt_dir = await receive(ckpt, b"checkpoints/new/deeper/x.pt", b"abc")
    made = await ckpt.commit_replica(ckpt_dir)  # directories made as needed
    deeper = files.lookup(files.lookup(ckpt.root, b"new").ino, b"deeper").ino
    assert files.lookup(deeper, b"x.pt").ino == made


@pytest.mark.parametrize(
    "bad",
    ["gap", "past-size", "too-big", "early-commit", "unknown", "dir-in-the-way", "failed-write", "aborted"],
)
async def test_a_bad_part_or_commit_is_refused_with_its_errno_and_changes_nothing(
    policy: tuple[CheckpointPolicy, FileStore], bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, files = policy
    run = files.mkdir(ckpt.root, b"run", 0o755, 0, 0).ino
    old = files.mknod(run, b"a.pt", 0o100644, 0, 0, 0).ino
    await files.write(old, 0, b"kept")
    before = files.statistics()
    data = os.urandom(150_000)
    transfer = await ckpt.begin_replica(b"checkpoints/run/a.pt", 0o100644, len(data))
    await ckpt.write_replica(transfer, 0, memoryview(data)[:100_000])
    orphan = ckpt._incoming[transfer].ino
    rest = memoryview(data)[100_000:]
    expected = {
        "gap": errno.EINVAL, "past-size": errno.EINVAL, "too-big": errno.EINVAL, "early-commit": errno.EINVAL,
        "unknown": errno.ENOENT, "dir-in-the-way": errno.EISDIR, "failed-write": errno.ENOSPC,
        "aborted": errno.ENOENT,
    }[bad]  # fmt: skip

    async def act() -> None:
        if bad == "gap":
            far = await ckpt.begin_replica(b"checkpoints/run/far.pt", 0o100644, 1 << 30)
            for i in range(MAX_PARTS_AHEAD):  # parts past a gap wait for it, so many
                await ckpt.write_replica(far, 1000 + i, memoryview(b"y"))
            with pytest.raises(DistorefsError) as one_more:
                await ckpt.write_replica(far, 1000 + MAX_PARTS_AHEAD, memoryview(b"y"))
            assert one_more.value.errno == errno.EINVAL
            await ckpt.write_replica(far, 0, memoryview(bytes(1000)))  # the gap fills: room again
            assert ckpt._incoming[far].received == 1000 + MAX_PARTS_AHEAD
            ckpt.abort_replica(far)
            await ckpt.write_replica(transfer, 100_000 + REPLICA_AHEAD_BYTES + 1, memoryview(b"x"))  # too far
        elif bad == "past-size":
            await ckpt.write_replica(transfer, 100_000, memoryview(bytes(50_001)))
        elif bad == "too-big":
            await ckpt.write_replica(transfer, 0, memoryview(bytearray(REPLICA_PART_MAX_BYTES + 1)))
        elif bad == "early-commit":
            await ckpt.commit_replica(transfer)
        elif bad == "unknown":
            await ckpt.write_replica("0" * 16, 100_000, rest)
        elif bad == "dir-in-the-way":
            await ckpt.write_replica(transfer, 100_000, rest)
            files.unlink(run, b"a.pt")
            files.mkdir(run, b"a.pt", 0o755, 0, 0)
            await ckpt.commit_replica(transfer)
        elif bad == "failed-write":

            async def full(*args: object, **kwargs: object) -> None:
                raise StoreFull("the log's disk is full")

            monkeypatch.setattr(files, "write_back", full)
            await ckpt.write_replica(transfer, 100_000, rest)
        else:
            ckpt.abort_replica(transfer)
            await ckpt.commit_replica(transfer)

    with pytest.raises(DistorefsError) as raised:
        await act()
    assert raised.value.errno == expected, raised.value
    if bad in ("dir-in-the-way", "failed-write", "aborted"):  # the transfer is dropped with its bytes
        assert orphan not in files
        assert ckpt.replicas_incoming == 0
        assert ckpt.replicas_dropped == 1
        if bad != "dir-in-the-way":
            assert files.statistics() == before
            assert files.entries(run) == ((b"a.pt", old),)
            assert bytes(await files.read(old, 0, 10)) == b"kept"
        return
    # refused, and nothing else: the old file is as it was, the transfer goes on
    assert files.entries(run) == ((b"a.pt", old),)
    assert bytes(await files.read(old, 0, 10)) == b"kept"
    await ckpt.write_replica(transfer, 100_000, rest)
    ino = await ckpt.commit_replica(transfer)
    assert files.entries(run) == ((b"a.pt", ino),)
    assert bytes(await files.read(ino, 0, len(data))) == data


async def test_begin_refuses_bad_paths_sizes_and_more_than_the_transfers_allowed(
    policy: tuple[CheckpointPolicy, FileStore],
) -> None:
    ckpt, files = policy
    for path, size, code in [
        (b"buffers/x", 1, errno.EINVAL), (b"checkpoints", 1, errno.EINVAL), (b"checkpoints/../x", 1, errno.EINVAL),
        (b"checkpoints//x", 1, errno.EINVAL), (b"checkpoints/" + b"n" * 256, 1, errno.ENAMETOOLONG),
        (b"checkpoints/a\0b", 1, errno.EINVAL), (b"checkpoints/x", -1, errno.EFBIG),
        (b"checkpoints/x", MAX_FILE_BYTES + 1, errno.EFBIG),
    ]:  # fmt: skip
        with pytest.raises(DistorefsError) as raised:
            await ckpt.begin_replica(path, 0o100644, size)
        assert raised.value.errno == code, (path, size, raised.value)
    free = await files.disk_free_bytes()
    assert free > 1 << 30
    with pytest.raises(DistorefsError) as raised:
        await ckpt.begin_replica(b"checkpoints/huge", 0o100644, free)  # would fill the disk
    assert raised.value.errno == errno.ENOSPC
    half = await ckpt.begin_replica(b"checkpoints/half", 0o100644, free // 2)
    with pytest.raises(DistorefsError) as raised:  # the bytes still coming count
        await ckpt.begin_replica(b"checkpoints/other-half", 0o100644, free // 2)
    assert raised.value.errno == errno.ENOSPC
    ckpt.abort_replica(half)
    inodes = files.statistics().files
    transfers = [await ckpt.begin_replica(b"checkpoints/f%d" % i, 0o100644, 10) for i in range(MAX_INCOMING_REPLICAS)]
    with pytest.raises(DistorefsError) as raised:
        await ckpt.begin_replica(b"checkpoints/one-more", 0o100644, 10)
    assert raised.value.errno == errno.EBUSY
    assert files.statistics().files == inodes + MAX_INCOMING_REPLICAS
    ckpt.abort_replica(transfers[0])
    await ckpt.begin_replica(b"checkpoints/one-more", 0o100644, 10)  # room again
    await trio.sleep(0.01)
    assert ckpt.expire_replicas(idle_s=1) == 0
    assert ckpt.expire_replicas(idle_s=0.005) == MAX_INCOMING_REPLICAS  # their senders went quiet
    assert files.statistics().files == inodes
    assert ckpt.replicas_incoming == 0


async def test_a_daemon_killed_during_a_transfer_keeps_the_old_file_and_drops_the_new_bytes(tmp_path: Path) -> None:
    blocks, meta = open_tiers(tmp_path, 64 * 1024, 16)
    files = FileStore.load(blocks, meta)
    ckpt = CheckpointPolicy.load(files, meta, sync_close=False)
    run = files.mkdir(ckpt.root, b"run", 0o755, 0, 0).ino
    old = files.mknod(run, b"a.pt", 0o100644, 0, 0, 0).ino
    await files.write(old, 0, b"kept" * 100_000)
    await files.fsync(old)
    transfer = await receive(ckpt, b"checkpoints/run/a.pt", os.urandom(600_000))
    orphan = ckpt._incoming[transfer].ino
    await files.commit()  # a background commit: the file in no directory is in the database
    assert any(row[0] == orphan for row in meta.rows("inodes"))
    # kill -9: the log's bytes and the committed rows stay, nothing staged
    blocks2, meta2 = open_tiers(tmp_path, 64 * 1024, 16)
    blocks._log.close()
    meta._conn.close()
    files = FileStore.load(blocks2, meta2)
    ckpt = CheckpointPolicy.load(files, meta2, sync_close=False)
    assert orphan not in files
    run = files.lookup(ckpt.root, b"run").ino
    assert files.entries(run) == ((b"a.pt", old),)
    assert bytes(await files.read(old, 0, 400_000)) == b"kept" * 100_000
    assert files.statistics().files == 1
    await blocks2.close()
    meta2.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(min_value=1, max_value=99_999), max_size=8),
    again=st.lists(st.integers(min_value=0, max_value=20), max_size=5),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_parts_in_any_order_and_sent_again_make_the_replica_whole_and_an_early_commit_changes_nothing(
    tmp_path_factory: pytest.TempPathFactory, cuts: list[int], again: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(100_000)
    bounds = [0, *sorted(set(cuts)), len(data)]
    parts = list(itertools.pairwise(bounds))
    sends = parts + [parts[i % len(parts)] for i in again]
    rng.shuffle(sends)

    async def body() -> None:
        blocks, meta = open_tiers(tmp_path_factory.mktemp("replica"), 64 * 1024, 16)
        files = FileStore.load(blocks, meta)
        ckpt = CheckpointPolicy.load(files, meta, sync_close=False)
        transfer = await ckpt.begin_replica(b"checkpoints/r.pt", 0o100644, len(data))
        ino = None
        came = bytearray(len(data))  # which bytes have been sent, as the test counts them
        for start, end in sends:
            await ckpt.write_replica(transfer, start, memoryview(data)[start:end])
            came[start:end] = b"\1" * (end - start)
            if rng.random() < 0.3:
                if all(came):
                    ino = await ckpt.commit_replica(transfer)
                    break
                with pytest.raises(DistorefsError) as early:  # before the last part came: refused
                    await ckpt.commit_replica(transfer)
                assert early.value.errno == errno.EINVAL
                assert files.entries(ckpt.root) == ()
        if ino is None:
            ino = await ckpt.commit_replica(transfer)
        assert files.entries(ckpt.root) == ((b"r.pt", ino),)
        assert bytes(await files.read(ino, 0, len(data) + 1)) == data
        await blocks.close()
        meta.close()

    trio.run(body)
