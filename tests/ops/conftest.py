"""The ops level: FsOperations called directly, with no kernel and no mount, over the real
stores and tiers in tmp_path, built by the daemon's own `assemble` (as s3ql's fs API
tests do). pyfuse3's RequestContext cannot be filled in from Python, so a plain object
with the same fields stands in for it: the operations only read them."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import pytest

from distorefs.daemon import Daemon, DaemonConfig, assemble
from distorefs.stores.files import ROOT_INODE
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import NvmeLog


@dataclass(frozen=True)
class Context:
    uid: int = os.getuid()
    gid: int = os.getgid()
    pid: int = os.getpid()
    umask: int = 0o022


CTX = Context()
FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    config = DaemonConfig(mountpoint=str(tmp_path / "mnt"), data_dir=str(tmp_path / "data"), dram_budget_bytes=64 << 20)
    os.makedirs(config.data_dir)
    nvme_log = NvmeLog.open(os.path.join(config.data_dir, "log"), config.segment_bytes)
    meta = MetaDb.open(os.path.join(config.data_dir, "meta.sqlite"))
    built = await assemble(config, nvme_log, meta)
    try:
        yield built
    finally:
        await built.close()
        meta.close()


async def lookup(ops: pyfuse3.Operations, path: str) -> pyfuse3.EntryAttributes:
    """Walk `path` from the root with LOOKUP, as the kernel would."""
    attrs = await ops.getattr(ROOT_INODE, CTX)
    for part in path.strip("/").split("/"):
        attrs = await ops.lookup(attrs.st_ino, part.encode(), CTX)
    return attrs


async def write_file(ops: pyfuse3.Operations, parent: int, name: bytes, data: bytes, fsync: bool = False) -> int:
    """create, write, (fsync,) flush, release: one whole file, as `cp` would; returns its inode."""
    info, attrs = await ops.create(parent, name, FILE_MODE, os.O_WRONLY | os.O_CREAT, CTX)
    await ops.write(info.fh, 0, data)
    if fsync:
        await ops.fsync(info.fh, False)
    await ops.flush(info.fh)
    await ops.release(info.fh)
    return int(attrs.st_ino)


async def read_file(ops: pyfuse3.Operations, ino: int, size: int = 1 << 20) -> bytes:
    info = await ops.open(ino, os.O_RDONLY, CTX)
    out = b""
    while True:
        chunk = bytes(await ops.read(info.fh, len(out), size))
        if not chunk:
            break
        out += chunk
    await ops.release(info.fh)
    return out


async def write_whole(ops: pyfuse3.Operations, ino: int, data: bytes, flags: int = os.O_WRONLY) -> None:
    """open, write, flush, release: one write of a control file, as `echo > file` would."""
    info = await ops.open(ino, flags, CTX)
    await ops.write(info.fh, 0, data)
    await ops.flush(info.fh)
    await ops.release(info.fh)


async def new_buffer(ops: pyfuse3.Operations, name: bytes, config: dict[str, object], records: bytes) -> int:
    """mkdir buffers/`name`, write its `config`, append `records`; returns its inode."""
    buffers = await lookup(ops, "buffers")
    made = await ops.mkdir(buffers.st_ino, name, DIR_MODE, CTX)
    config_ino = (await ops.lookup(made.st_ino, b"config", CTX)).st_ino
    await write_whole(ops, config_ino, json.dumps(config).encode(), os.O_WRONLY | os.O_TRUNC)
    await write_whole(ops, (await ops.lookup(made.st_ino, b"append", CTX)).st_ino, records)
    return int(made.st_ino)
