"""The POSIX store without a mount: structure rules, references, persistence."""

from __future__ import annotations

import errno
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from distorefs.errors import DistorefsError, InvalidArgument, NotEmpty
from distorefs.stores.files import ROOT_INODE, FileStore
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from tests.unit.tiers import open_tiers

BLOCK = 64 * 1024


def open_files(path: Path) -> tuple[FileStore, BlockStore, MetaDb]:
    blocks, meta = open_tiers(path, BLOCK, 16)
    return FileStore.load(blocks, meta), blocks, meta


@pytest.fixture
async def files(tmp_path: Path) -> AsyncIterator[FileStore]:
    store, blocks, meta = open_files(tmp_path)
    yield store
    await blocks.close()
    meta.close()


async def test_read_spans_blocks_and_holes(files: FileStore) -> None:
    f = files.mknod(ROOT_INODE, b"f", 0o100644, 0, 0, 0)
    await files.write(f.ino, BLOCK - 2, b"abcd")
    await files.write(f.ino, 3 * BLOCK, b"z")
    data = bytes(await files.read(f.ino, 0, 4 * BLOCK))
    assert len(data) == 3 * BLOCK + 1
    assert data[BLOCK - 2 : BLOCK + 2] == b"abcd"
    assert data[BLOCK + 2 : 3 * BLOCK] == bytes(2 * BLOCK - 2)
    assert data[-1:] == b"z"


async def test_unlinked_file_lives_until_its_last_reference(files: FileStore) -> None:
    f = files.mknod(ROOT_INODE, b"f", 0o100644, 0, 0, 0)
    await files.write(f.ino, 0, b"x" * (2 * BLOCK))
    files.ref(f.ino)
    files.unlink(ROOT_INODE, b"f")
    assert bytes(await files.read(f.ino, 0, 3)) == b"xxx"
    files.unref(f.ino)
    assert f.ino not in files


async def test_rename_checks_everything_before_changing_anything(files: FileStore) -> None:
    d = files.mkdir(ROOT_INODE, b"d", 0o755, 0, 0)
    files.mkdir(d.ino, b"sub", 0o755, 0, 0)
    with pytest.raises(InvalidArgument, match="^cannot move a directory into itself$"):
        files.rename(ROOT_INODE, b"d", d.ino, b"inside")
    full = files.mkdir(ROOT_INODE, b"full", 0o755, 0, 0)
    files.mknod(full.ino, b"x", 0o100644, 0, 0, 0)
    with pytest.raises(NotEmpty):
        files.rename(ROOT_INODE, b"d", ROOT_INODE, b"full")
    assert [name for name, _ in files.entries(ROOT_INODE)] == [b"d", b"full"]
    assert files.get(ROOT_INODE).nlink == 4


@pytest.mark.parametrize(
    ("name", "code"),
    [(b"a" * 256, errno.ENAMETOOLONG), (b"a/b", errno.EINVAL), (b".", errno.EINVAL), (b"", errno.EINVAL)],
)
async def test_bad_names_are_refused_with_their_errno(files: FileStore, name: bytes, code: int) -> None:
    with pytest.raises(DistorefsError) as excinfo:
        files.mknod(ROOT_INODE, name, 0o100644, 0, 0, 0)
    assert excinfo.value.errno == code


async def test_setgid_directories_pass_their_group_on(files: FileStore) -> None:
    d = files.mkdir(ROOT_INODE, b"shared", 0o2775, 0, 100)
    sub = files.mkdir(d.ino, b"sub", 0o755, 0, 0)
    f = files.mknod(d.ino, b"f", 0o100644, 0, 0, 0)
    assert (sub.gid, f.gid) == (100, 100)
    assert sub.mode & stat.S_ISGID


async def test_tree_survives_a_reload(tmp_path: Path) -> None:
    store, blocks, meta = open_files(tmp_path)
    d = store.mkdir(ROOT_INODE, b"d", 0o750, 1, 2)
    f = store.mknod(d.ino, b"f", 0o100600, 0, 1, 2)
    await store.write(f.ino, 5, b"data")
    store.symlink(d.ino, b"l", b"f", 1, 2)
    store.setxattr(f.ino, b"user.k", b"v")
    await blocks.close()
    meta.close()

    store, blocks, meta = open_files(tmp_path)
    f2 = store.lookup(store.lookup(ROOT_INODE, b"d").ino, b"f")
    assert (f2.mode, f2.uid, f2.gid, f2.size) == (0o100600, 1, 2, 9)
    assert bytes(await store.read(f2.ino, 0, 100)) == bytes(5) + b"data"
    assert store.readlink(store.lookup(d.ino, b"l").ino) == b"f"
    assert store.getxattr(f2.ino, b"user.k") == b"v"
    await blocks.close()
    meta.close()
