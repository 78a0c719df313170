"""The FUSE ceiling: a bare pyfuse3 + trio filesystem that keeps files in a dict of
bytearrays, with no log, no cache tier, no metadata database and no checks beyond what
POSIX needs. Whatever distorefs does per request costs on top of this; a benchmark
divides by it to say how much of the FUSE ceiling distorefs reaches.

    python benchmarks/ceiling_fs.py MOUNTPOINT [--direct-io] [--queued-reads]

It prints "ready" once mounted; SIGTERM or an unmount ends it.

Mounted with the options distorefs uses (pyfuse3's defaults, fsname/subtype, noatime)
and the same open flags (keep_cache for files); getxattr is left to pyfuse3's default
(ENOSYS), so the kernel stops asking for security.capability before each write, which
distorefs answers every time: that difference is part of what the ceiling shows.

`--direct-io` opens every file without the page cache (`direct_io`, no `keep_cache`), as
distorefs serves its control files and dataset streams: each read() is READ requests
answered from the filesystem's memory, the ceiling of such a file.

`--queued-reads` reads requests that are already queued at once, as distorefs does by
default (`--queued-reads-us`, scripts/pyfuse3-queued-reads.patch); without it the ceiling
runs pyfuse3's own request loop, as the issue defines it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import sys
import time
from typing import Any

import pyfuse3
import trio

QUEUED_READS_S = 300e-6  # --queued-reads (pyfuse3.set_queued_reads; distorefs' default window)

ROOT = pyfuse3.ROOT_INODE
CHUNK = 1 << 20  # file data in chunks of up to 1 MiB: appends never copy more than one chunk


class Node:
    __slots__ = ("ino", "mode", "chunks", "size", "entries", "nlink", "uid", "gid", "mtime_ns")

    def __init__(self, ino: int, mode: int, uid: int, gid: int) -> None:
        self.ino, self.mode, self.uid, self.gid = ino, mode, uid, gid
        self.chunks: list[bytearray] = []
        self.size = 0
        self.entries: dict[bytes, int] = {}
        self.nlink = 2 if stat.S_ISDIR(mode) else 1
        self.mtime_ns = time.time_ns()


class CeilingFs(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, direct_io: bool = False) -> None:
        super().__init__()
        self.direct_io = direct_io
        self.nodes = {ROOT: Node(ROOT, stat.S_IFDIR | 0o777, os.getuid(), os.getgid())}
        self.next_ino = ROOT + 1

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink = node.ino, node.mode, node.nlink
        a.st_uid, a.st_gid = node.uid, node.gid
        a.st_size = node.size
        a.st_blksize, a.st_blocks = 4096, (node.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        a.attr_timeout = a.entry_timeout = 1.0
        a.generation = 0
        return a

    def _node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attrs(self._node(inode))

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        parent = self._node(parent_inode)
        if name == b".":
            return self._attrs(parent)
        ino = parent.entries.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(self.nodes[ino])

    def _make(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Node:
        parent = self._node(parent_inode)
        if name in parent.entries:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = Node(self.next_ino, mode, ctx.uid, ctx.gid)
        self.next_ino += 1
        self.nodes[node.ino] = node
        parent.entries[name] = node.ino
        if stat.S_ISDIR(mode):
            parent.nlink += 1
        return node

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._attrs(self._make(parent_inode, name, stat.S_IFDIR | (mode & 0o7777), ctx))

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._attrs(self._make(parent_inode, name, mode, ctx))

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        node = self._make(parent_inode, name, mode, ctx)
        return self._info(node.ino), self._attrs(node)

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if flags & os.O_TRUNC:  # pyfuse3 sets atomic_o_trunc
            node.chunks, node.size = [], 0
        return self._info(inode)

    def _info(self, ino: int) -> pyfuse3.FileInfo:
        if self.direct_io:
            return pyfuse3.FileInfo(fh=ino, direct_io=True)
        return pyfuse3.FileInfo(fh=ino, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        node = self.nodes[fh]
        size = max(0, min(size, node.size - off))
        index, start = divmod(off, CHUNK)
        if size and index < len(node.chunks) and start + size <= len(node.chunks[index]):  # one chunk: no copy
            return memoryview(node.chunks[index])[start : start + size]
        parts: list[bytes | memoryview] = []
        while size > 0:
            take = min(size, CHUNK - start)
            chunk = node.chunks[index] if index < len(node.chunks) else b""
            part = memoryview(chunk)[start : start + take]
            parts.append(part)
            if len(part) < take:  # a hole left by a truncate that grew the file
                parts.append(bytes(take - len(part)))
            size -= take
            index, start = index + 1, 0
        return b"".join(parts)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        node = self.nodes[fh]
        view, pos = memoryview(buf), off
        while view:
            index, start = divmod(pos, CHUNK)
            while len(node.chunks) <= index:
                node.chunks.append(bytearray())
            chunk = node.chunks[index]
            if len(chunk) < start:  # a hole: zeros up to here
                chunk.extend(bytes(start - len(chunk)))
            take = min(len(view), CHUNK - start)
            chunk[start : start + take] = view[:take]
            view, pos = view[take:], pos + take
        node.size = max(node.size, off + len(buf))
        return len(buf)

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        if fields.update_size:
            keep = -(-attr.st_size // CHUNK)
            del node.chunks[keep:]
            if attr.st_size % CHUNK and len(node.chunks) == keep:
                del node.chunks[-1][attr.st_size % CHUNK :]  # reads past a chunk's end see zeros
            node.size = attr.st_size
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
        return self._attrs(node)

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        pass

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._node(parent_inode)
        ino = parent.entries.pop(name, None)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self.nodes.pop(ino, None)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._node(parent_inode)
        ino = parent.entries.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self.nodes[ino].entries:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del parent.entries[name]
        del self.nodes[ino]
        parent.nlink -= 1

    async def opendir(self, inode: int, ctx: Any) -> int:
        self._node(inode)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = list(self.nodes[fh].entries.items())
        for position in range(start_id, len(entries)):
            name, ino = entries[position]
            if not pyfuse3.readdir_reply(token, name, self._attrs(self.nodes[ino]), position + 1):
                return

    async def releasedir(self, fh: int) -> None:
        pass

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = 4096
        out.f_blocks = out.f_bfree = out.f_bavail = 1 << 30
        out.f_files = out.f_ffree = out.f_favail = 1 << 30
        out.f_namemax = 255
        return out


def keep_freed_memory() -> None:
    """Have malloc keep what `free()` returns (allocations under 32 MiB from the heap,
    whose top is never trimmed), so a file rewritten after a truncate reuses the memory of
    the chunks it dropped. Without this the ceiling page-faults a fresh GiB for every GiB
    it writes (262,628 faults per round of bench_posix's sequential write), which on this
    VM costs 0.5-1.5 s of system time per GiB: a cost of its heap, not of FUSE. distorefs
    reuses its block buffers (its DRAM cache's spares), so the ceiling must too."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


def main() -> int:
    mountpoint = sys.argv[1]
    keep_freed_memory()
    options = set(pyfuse3.default_options) | {"fsname=ceiling", "subtype=ceiling", "noatime"}
    pyfuse3.init(CeilingFs(direct_io="--direct-io" in sys.argv[2:]), mountpoint, options)
    if "--queued-reads" in sys.argv[2:]:  # distorefs' --queued-reads-us, at its default
        pyfuse3.set_queued_reads(QUEUED_READS_S)
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
