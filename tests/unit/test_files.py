"""The POSIX store without a mount: structure rules, references, persistence."""

from __future__ import annotations

import errno
import random
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from distorefs.errors import DistorefsError, InvalidArgument, NotEmpty, StoreFull
from distorefs.stores import files as files_module
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


def set_until_full(store: FileStore, ino: int, names: list[bytes], value: bytes) -> int:
    """Set `names` to `value` in order until the store refuses with ENOSPC; how many it took."""
    for taken, name in enumerate(names):
        try:
            store.setxattr(ino, name, value)
        except StoreFull:
            return taken
    return len(names)


async def test_extended_attributes_are_bounded_per_file_and_in_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attributes live in the daemon's memory, outside the DRAM budget: a file's names fit
    one listxattr (64 KiB with their NULs), a file holds at most 1 MiB of names and
    values, all files at most XATTR_TOTAL_BYTES; past any, ENOSPC and nothing changes.
    Removing, replacing and unlinking give room back, and a reload counts the same."""
    monkeypatch.setattr(files_module, "XATTR_TOTAL_BYTES", 3 << 20)
    store, blocks, meta = open_files(tmp_path)
    a = store.mknod(ROOT_INODE, b"a", 0o100644, 0, 0, 0)
    value = bytes(60_000)
    # 17 x (60,000 + 10) bytes fit in 1 MiB, an 18th does not
    assert set_until_full(store, a.ino, [b"user.v%04d" % i for i in range(100)], value) == 17
    assert len(store.listxattr(a.ino)) == 17
    assert store.getxattr(a.ino, b"user.v0016") == value
    store.setxattr(a.ino, b"user.v0000", b"small")  # a replacement makes room
    store.setxattr(a.ino, b"user.v9999", value)
    names = store.mknod(ROOT_INODE, b"names", 0o100644, 0, 0, 0)
    long = [b"user." + b"n" * 241 + b"%04d" % i for i in range(1000)]  # 250 bytes, 251 with its NUL
    assert set_until_full(store, names.ino, long, b"") == 64 * 1024 // 251
    assert sum(len(n) + 1 for n in store.listxattr(names.ino)) <= 64 * 1024
    others = [store.mknod(ROOT_INODE, b"o%d" % i, 0o100644, 0, 0, 0) for i in range(3)]
    taken = [set_until_full(store, o.ino, [b"user.v%04d" % i for i in range(17)], value) for o in others]
    assert taken[0] == 17
    assert taken[-1] < 17  # the daemon's 3 MiB ran out
    held = store.xattr_bytes
    assert held <= 3 << 20
    store.unlink(ROOT_INODE, b"a")  # its attributes go with it
    assert store.xattr_bytes == held - (16 * 60_010 + 15 + 60_010)
    store.removexattr(names.ino, long[0])
    before_reload = store.xattr_bytes
    await blocks.commit()
    await blocks.close()
    meta.close()
    store, blocks, meta = open_files(tmp_path)
    assert store.xattr_bytes == before_reload
    await blocks.close()
    meta.close()


def counted(store: FileStore) -> tuple[int, int, int, int, int]:
    """The statistics by a walk of every inode, as statistics() made them before."""
    kinds = [0, 0, 0, 0]
    size = 0
    for inode in store._inodes.values():
        kind = stat.S_IFMT(inode.mode)
        kinds[0 if kind == stat.S_IFREG else 1 if kind == stat.S_IFDIR else 2 if kind == stat.S_IFLNK else 3] += 1
        size += inode.size if kind == stat.S_IFREG else 0
    return kinds[0], kinds[1], kinds[2], kinds[3], size


async def test_statistics_are_kept_as_the_tree_changes_and_match_a_walk(tmp_path: Path) -> None:
    """statistics() walked every inode (44 ms for 300,000 files at each statfs and each
    status read, on the event loop); now counts kept at every create, size change and
    purge give the same numbers as the walk, across changes and a reload."""
    rng = random.Random(7)
    store, blocks, meta = open_files(tmp_path)
    d = store.mkdir(ROOT_INODE, b"d", 0o755, 0, 0)
    files: list[int] = []
    for step in range(400):
        choice = rng.random()
        if choice < 0.3 or not files:
            files.append(store.mknod(d.ino, b"f%d" % step, 0o100644, 0, 0, 0).ino)
        elif choice < 0.5:
            await store.write(rng.choice(files), rng.randrange(100_000), bytes(rng.randrange(1, 5000)))
        elif choice < 0.6:
            await store.setattr(rng.choice(files), size=rng.randrange(200_000))
        elif choice < 0.7:
            ino = files.pop(rng.randrange(len(files)))
            name = next(n for n, i in store.entries(d.ino) if i == ino)
            store.unlink(d.ino, name)
        elif choice < 0.8:
            store.symlink(d.ino, b"l%d" % step, b"target-%d" % step, 0, 0)
        elif choice < 0.9:
            store.mkdir(d.ino, b"s%d" % step, 0o755, 0, 0)
        else:
            store.mknod(d.ino, b"p%d" % step, stat.S_IFIFO | 0o644, 0, 0, 0)
        assert tuple(vars(store.statistics()).values()) == counted(store)
    await blocks.commit()
    await blocks.close()
    meta.close()
    store, blocks, meta = open_files(tmp_path)
    assert tuple(vars(store.statistics()).values()) == counted(store)
    await blocks.close()
    meta.close()
