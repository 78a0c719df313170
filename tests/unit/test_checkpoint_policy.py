"""The checkpoint policy without a mount: its persister against a tree that changes under it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from distorefs.stores.checkpoints import RETRY_S, CheckpointPolicy
from distorefs.stores.files import FileStore
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
