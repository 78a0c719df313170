"""PosixTree: the ordinary POSIX file tree as the fs layer sees it, policies included.

Owns the one place where a request to the tree meets the policies that some of its
files follow: it forwards each operation to the FileStore (stores/files.py) and tells
the checkpoint policy (stores/checkpoints.py) what happened to files under
`checkpoints/` (found, opened, changed, closed, synced, released, directories made or
removed, settings changed). The fs layer calls this object only, so a request goes down
the stack once and `fs/ops.py` knows nothing of checkpoints.

Plain Python with no FUSE. Lookup counts (`ref`/`unref`) are the kernel's references,
kept by the FileStore so that an unlinked file lives while it is referenced.
"""

from __future__ import annotations

import os
import stat

from distorefs import scheduling
from distorefs.errors import NotPermitted
from distorefs.news import Outbox
from distorefs.stores.checkpoints import CHECKPOINTS, KEEP_XATTR, SETTING_XATTRS, STATE_XATTR, CheckpointPolicy
from distorefs.stores.files import ROOT_INODE, FileStatistics, FileStore, Inode


class PosixTree:
    """The POSIX tree and the checkpoint policy behind it.

    Examples:
        >>> tree = PosixTree(files, CheckpointPolicy.load(files, meta, sync_close=False))
        >>> inode = tree.create(ROOT_INODE, b"a.txt", 0o644, uid=0, gid=0)   # open for writing
        >>> await tree.write(inode.ino, 0, b"hello")
        >>> await tree.close(inode.ino, writable=True)
        >>> tree.release(inode.ino, writable=True)
    """

    reserved_names = frozenset({CHECKPOINTS})  # root entries that cannot be removed or renamed

    def __init__(self, files: FileStore, checkpoints: CheckpointPolicy) -> None:
        self.files = files
        self.checkpoints = checkpoints

    @property
    def removed(self) -> Outbox[tuple[int, bytes, int]]:
        """(parent, name, inode) of entries the daemon removed itself (retention, another node)."""
        return self.checkpoints.removed

    def _found(self, parent: int, inode: Inode) -> Inode:
        """A regular file found in `parent`: one under checkpoints/ gets its policy."""
        if inode.is_reg:
            self.checkpoints.track(inode.ino, parent)
        return inode

    def _changed(self, ino: int) -> None:
        if self.checkpoints.tracks(ino):
            self.checkpoints.changed(ino)

    def kind_of(self, ino: int) -> str:
        """ "checkpoints" for a file the checkpoint policy follows, else "tree" (for metrics)."""
        return "checkpoints" if self.checkpoints.tracks(ino) else "tree"

    # --- names and attributes -------------------------------------------------------------

    def __contains__(self, ino: int) -> bool:
        return ino in self.files

    def get(self, ino: int) -> Inode:
        return self.files.get(ino)

    def lookup(self, parent: int, name: bytes) -> Inode:
        return self._found(parent, self.files.lookup(parent, name))

    def entries(self, ino: int) -> tuple[tuple[bytes, int], ...]:
        return self.files.entries(ino)

    def ref(self, ino: int, count: int = 1) -> None:
        self.files.ref(ino, count)

    def unref(self, ino: int, count: int = 1) -> None:
        self.files.unref(ino, count)

    def parent_of(self, directory: int) -> int:
        return self.files.parent_of(directory)

    def allocated_bytes(self, inode: Inode) -> int:
        """Bytes the file's data takes (holes take none): what `du` should count."""
        return self.files.allocated_bytes(inode) if inode.is_reg else 0

    def readlink(self, ino: int) -> bytes:
        return self.files.readlink(ino)

    def statistics(self) -> FileStatistics:
        return self.files.statistics()

    async def setattr(
        self,
        ino: int,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> Inode:
        changed = await self.files.setattr(
            ino, mode=mode, uid=uid, gid=gid, size=size, atime_ns=atime_ns, mtime_ns=mtime_ns
        )
        if size is not None:
            self._changed(ino)
        return changed

    # --- creating and removing ------------------------------------------------------------

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        return self._found(parent, self.files.mknod(parent, name, mode, rdev, uid, gid))

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        inode = self.files.mkdir(parent, name, mode, uid, gid)
        self.checkpoints.dir_made(inode.ino)
        return inode

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        return self.files.symlink(parent, name, target, uid, gid)

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        return self.files.link(ino, parent, name)

    def unlink(self, parent: int, name: bytes) -> None:
        self.files.unlink(parent, name)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.files.rmdir(parent, name)
        self.checkpoints.dir_removed(parent, name)
        self.checkpoints.settings_changed()

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int) -> None:
        self.files.rename(old_parent, old_name, new_parent, new_name, flags)
        moved = self.lookup(new_parent, new_name)
        if moved.is_dir:
            self.checkpoints.settings_changed()

    # --- file contents ----------------------------------------------------------------------

    async def open(self, ino: int, flags: int) -> bool:
        """An open of an existing file (O_TRUNC empties it); returns whether it writes.
        The open holds a reference until `release`."""
        inode = self.files.get(ino)
        if flags & os.O_TRUNC and inode.size:
            await self.setattr(ino, size=0)
        self.files.ref(ino)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        self.checkpoints.opened(ino, writable)
        return writable

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        """Create a regular file, open for writing (a reference held until `release`)."""
        inode = self.mknod(parent, name, stat.S_IFREG | stat.S_IMODE(mode), 0, uid, gid)
        self.files.ref(inode.ino)
        self.checkpoints.opened(inode.ino, True)
        return inode

    async def read(self, ino: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        return await self.files.read(ino, offset, size)

    async def write(self, ino: int, offset: int, data: bytes | memoryview) -> int:
        written = await self.files.write(ino, offset, data)
        self._changed(ino)
        return written

    async def zero_range(self, ino: int, offset: int, end: int) -> None:
        await self.files.zero_range(ino, offset, end)
        self._changed(ino)

    async def adopt(self, ino: int, view: memoryview) -> Inode:
        """Make `view` (sealed memory the fs layer took over) the file's whole content, as
        if written through an open of it: under checkpoints/ it persists in the
        background like any checkpoint; elsewhere it is *logged* before this returns, as
        a close would make it."""
        inode = await self.files.adopt(ino, view)
        if self.checkpoints.tracks(ino):
            self.checkpoints.changed(ino)
        else:
            await self.files.flush(ino)
            await self.files.release_borrowed(ino)
        return inode

    async def close(self, ino: int, writable: bool) -> None:
        """A close (FLUSH) of an open that could write: the file is *logged*; under
        checkpoints/ it persists in the background instead (unless sync-close applies).
        A read-only open changed nothing, so its close writes nothing (and cannot fail
        on a full disk)."""
        if not writable:
            await scheduling.checkpoint()
        elif not self.checkpoints.tracks(ino):
            await self.files.flush(ino)
        else:
            await self.checkpoints.close(ino)

    async def fsync(self, ino: int) -> None:
        """The file is *durable* when this returns (and replicated where asked)."""
        if self.checkpoints.tracks(ino):
            await self.checkpoints.fsync(ino)
        else:
            await self.files.fsync(ino)

    def release(self, ino: int, writable: bool) -> None:
        """The last close of an open: its reference goes."""
        self.checkpoints.released(ino, writable)
        self.files.unref(ino)

    async def sync_all(self) -> None:
        await self.files.sync_all()

    async def persist_rows(self) -> None:
        """A namespace change (mkdir, rename, unlink, chmod ...) is *logged* when this
        returns, as a close's data is."""
        await self.files.persist_rows()

    # --- xattrs -----------------------------------------------------------------------------

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.checkpoints.check_setting(ino, name, value)
        self.files.setxattr(ino, name, value)
        if name in SETTING_XATTRS:
            self.checkpoints.settings_changed()
        if name == KEEP_XATTR and self.checkpoints.apply_retention(ino):
            await self.files.sync_all()

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if name == STATE_XATTR and self.checkpoints.tracks(ino):
            return self.checkpoints.state(ino).encode()
        return self.files.getxattr(ino, name)

    def listxattr(self, ino: int) -> list[bytes]:
        names = self.files.listxattr(ino)
        return [*names, STATE_XATTR] if self.checkpoints.tracks(ino) else names

    def removexattr(self, ino: int, name: bytes) -> None:
        if name == STATE_XATTR:
            raise NotPermitted(f"{STATE_XATTR.decode()} is computed; it cannot be removed")
        self.files.removexattr(ino, name)
        if name in SETTING_XATTRS:
            self.checkpoints.settings_changed()


__all__ = ["ROOT_INODE", "PosixTree"]
