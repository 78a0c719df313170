"""FileStore: the ordinary POSIX tree (checkpoints/ and everything not reserved).

Owns inodes, directory entries, symlink targets and xattrs: in memory for speed, staged
into MetaDb on every change. File bytes live in the block tier as blocks keyed
(inode, block index). Plain Python with no FUSE: the fs layer maps requests here, and
this module raises DistorefsError subclasses that carry the errno.

The kernel checks permissions (`default_permissions`); this store checks the structure:
names, types, emptiness, rename cycles. References (kernel lookups and open handles)
are counted by the caller through `ref`/`unref`: an unlinked inode lives until the last
one goes, then its blocks are deleted.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass

import trio

from distorefs.errors import (
    Exists,
    FileTooLarge,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoSuchAttribute,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    NotSupported,
    StoreFull,
    TooBig,
)
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from distorefs.types import InodeId

log = logging.getLogger(__name__)

ROOT_INODE = InodeId(1)
NAME_MAX = 255
XATTR_VALUE_MAX = 64 * 1024
# Extended attributes live in the daemon's memory (and SQLite), outside the DRAM budget:
# bounded per file, as ext4 and XFS bound them, and in all, so that no user can grow the
# daemon without end through setxattr (ENOSPC past either; docs/namespace.md).
XATTR_NAMES_MAX = 64 * 1024  # a file's names, each with its NUL: what one listxattr (XATTR_LIST_MAX) returns
XATTR_FILE_BYTES = 1 << 20  # a file's names and values together
XATTR_TOTAL_BYTES = 256 << 20  # every file's together
MAX_FILE_BYTES = 1 << 44  # 16 TiB
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


@dataclass(slots=True)
class Inode:
    ino: InodeId
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes | None = None

    def row(self) -> tuple[object, ...]:
        return (
            self.mode, self.nlink, self.uid, self.gid, self.rdev, self.size,
            self.atime_ns, self.mtime_ns, self.ctime_ns, self.target,
        )  # fmt: skip

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


@dataclass(frozen=True)
class FileStatistics:
    files: int
    directories: int
    symlinks: int
    other: int
    file_bytes: int


def check_name(name: bytes) -> None:
    """Raise for names the tree cannot hold: empty, `.`, `..`, with `/` or NUL, too long."""
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name of {len(name)} bytes exceeds {NAME_MAX}: {name[:32]!r}...")
    if name in (b"", b".", b"..") or b"/" in name or b"\0" in name:
        raise InvalidArgument(f"invalid name {name!r}")


def _xattr_change(name: bytes, old: bytes | None, new: bytes | None) -> tuple[int, int]:
    """What attribute `name` going from `old` to `new` (None: absent) adds to a file's
    names with their NULs (what listxattr returns), and to its names and values."""

    def held(value: bytes | None) -> tuple[int, int]:
        return (0, 0) if value is None else (len(name) + 1, len(name) + len(value))

    (old_names, old_bytes), (new_names, new_bytes) = held(old), held(new)
    return new_names - old_names, new_bytes - old_bytes


class FileStore:
    """The POSIX tree over a BlockStore.

    Examples:
        >>> files = FileStore.load(blocks, meta)
        >>> f = files.mknod(ROOT_INODE, b"a.txt", 0o100644, 0, uid=0, gid=0)
        >>> await files.write(f.ino, 0, b"hello")
        >>> bytes(await files.read(f.ino, 0, 5))
        b'hello'
    """

    def __init__(self, blocks: BlockStore, meta: MetaDb) -> None:
        self._blocks = blocks
        self._meta = meta
        self.block_bytes = blocks.block_bytes
        self._inodes: dict[int, Inode] = {}
        self._dirs: dict[int, dict[bytes, int]] = {}
        # A directory's entries as `entries` last listed them, until its next change: every
        # open of an unchanged directory shares one listing (each opendir made its own,
        # 64 bytes an entry: a million-entry directory opened a thousand times was 64 GB).
        self._listings: dict[int, tuple[tuple[bytes, int], ...]] = {}
        self._parent: dict[int, int] = {}
        self._xattrs: dict[int, dict[bytes, bytes]] = {}
        self._xattr_sizes: dict[int, tuple[int, int]] = {}  # ino -> (names with NULs, names + values)
        # statistics() kept as things change: a walk of every inode at each statfs and each
        # read of status took 44 ms for 300,000 files, on the event loop (`df` in a loop, a
        # status poller, held the mount for everyone)
        self._kinds = [0, 0, 0, 0]  # regular files, directories, symlinks, other
        self._file_bytes = 0  # the regular files' sizes
        self.xattr_bytes = 0  # names + values of every file's attributes
        self._refs: dict[int, int] = {}
        self._next_ino = 2

    @classmethod
    def load(cls, blocks: BlockStore, meta: MetaDb) -> FileStore:
        """Build the tree from the committed metadata, create the root, drop orphans."""
        self = cls(blocks, meta)
        for ino, *values in meta.rows("inodes"):
            self._inodes[ino] = Inode(InodeId(ino), *values)
            if stat.S_ISDIR(values[0]):
                self._dirs[ino] = {}
        for parent, name, ino in meta.rows("dentries"):
            self._dirs.setdefault(parent, {})[name] = ino
            if ino in self._dirs:
                self._parent[ino] = parent
        for ino, name, value in meta.rows("xattrs"):
            self._xattrs.setdefault(ino, {})[name] = value
            self._count_xattr(ino, name, None, value)
        self._next_ino = max([ROOT_INODE, *self._inodes]) + 1
        for inode in self._inodes.values():
            self._count(inode, 1)
        if ROOT_INODE not in self._inodes:
            now = time.time_ns()
            root = Inode(ROOT_INODE, stat.S_IFDIR | 0o755, 2, os.getuid(), os.getgid(), 0, 0, now, now, now)
            self._inodes[ROOT_INODE] = root
            self._count(root, 1)
            self._dirs[ROOT_INODE] = {}
            self._stage(root)
        self._parent[ROOT_INODE] = ROOT_INODE
        orphans = [ino for ino, inode in self._inodes.items() if inode.nlink == 0]
        for ino in orphans:
            self._purge(ino)
        if orphans:
            log.info("dropped %d unlinked inodes left open by the previous run", len(orphans))
        return self

    # --- staging (sync) ---------------------------------------------------------------

    def _stage(self, inode: Inode) -> None:
        self._meta.put("inodes", (inode.ino,), inode.row())

    def _stage_dentry(self, parent: int, name: bytes, ino: int | None) -> None:
        self._listings.pop(parent, None)  # (every change of a directory's entries comes here)
        if ino is None:
            self._meta.delete("dentries", (parent, name))
        else:
            self._meta.put("dentries", (parent, name), (ino,))

    # --- lookups ------------------------------------------------------------------------

    def get(self, ino: int) -> Inode:
        inode = self._inodes.get(ino)
        if inode is None:
            raise NotFound(f"no inode {ino}")
        return inode

    def __contains__(self, ino: int) -> bool:
        return ino in self._inodes

    def _dir(self, ino: int) -> dict[bytes, int]:
        entries = self._dirs.get(ino)
        if entries is None:
            if ino not in self._inodes:
                raise NotFound(f"no inode {ino}")
            raise NotADirectory(f"inode {ino} is not a directory")
        return entries

    def lookup(self, parent: int, name: bytes) -> Inode:
        """Return the inode `name` names in directory `parent` (`.` and `..` included)."""
        entries = self._dir(parent)
        if name == b".":
            return self._inodes[parent]
        if name == b"..":
            return self._inodes[self._parent[parent]]
        ino = entries.get(name)
        if ino is None:
            raise NotFound(f"no entry {name.decode(errors='replace')!r} in directory {parent}")
        return self._inodes[ino]

    def entries(self, ino: int) -> tuple[tuple[bytes, int], ...]:
        """A snapshot of a directory's entries, in creation order: one shared by every
        caller until the directory changes (so never to be changed by one)."""
        listing = self._listings.get(ino)
        if listing is None:
            listing = self._listings[ino] = tuple(self._dir(ino).items())
        return listing

    # --- creating -----------------------------------------------------------------------

    def _new_inode(self, mode: int, uid: int, gid: int, rdev: int = 0, target: bytes | None = None) -> Inode:
        now = time.time_ns()
        ino = InodeId(self._next_ino)
        self._next_ino += 1
        nlink = 2 if stat.S_ISDIR(mode) else 1
        size = len(target) if target is not None else 0
        inode = Inode(ino, mode, nlink, uid, gid, rdev, size, now, now, now, target)
        self._inodes[ino] = inode
        self._count(inode, 1)
        return inode

    def _count(self, inode: Inode, sign: int) -> None:
        """`statistics` with `inode` come (sign 1) or gone (-1)."""
        kind = stat.S_IFMT(inode.mode)
        if kind == stat.S_IFREG:
            self._kinds[0] += sign
            self._file_bytes += sign * inode.size
        else:
            self._kinds[1 if kind == stat.S_IFDIR else 2 if kind == stat.S_IFLNK else 3] += sign

    def _resize(self, inode: Inode, size: int) -> None:
        if inode.is_reg:
            self._file_bytes += size - inode.size
        inode.size = size

    def _prepare_create(self, parent: int, name: bytes) -> Inode:
        check_name(name)
        entries = self._dir(parent)
        if name in entries:
            raise Exists(f"{name.decode(errors='replace')!r} exists in directory {parent}")
        return self._inodes[parent]

    def _inherit(self, parent: Inode, mode: int, gid: int) -> tuple[int, int]:
        # BSD group semantics for setgid directories, as ext4 and tmpfs do.
        if parent.mode & stat.S_ISGID:
            gid = parent.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return mode, gid

    def _link_entry(self, parent: Inode, name: bytes, inode: Inode) -> None:
        self._dirs[parent.ino][name] = inode.ino
        self._stage_dentry(parent.ino, name, inode.ino)
        parent.mtime_ns = parent.ctime_ns = time.time_ns()
        self._stage(parent)
        self._stage(inode)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        """Create a regular file (or fifo, socket, device node) named `name` in `parent`."""
        parent_inode = self._prepare_create(parent, name)
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise InvalidArgument(f"mknod cannot create file type {oct(kind)}")
        mode, gid = self._inherit(parent_inode, kind | stat.S_IMODE(mode), gid)
        inode = self._new_inode(mode, uid, gid, rdev)
        self._link_entry(parent_inode, name, inode)
        return inode

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        parent_inode = self._prepare_create(parent, name)
        mode, gid = self._inherit(parent_inode, stat.S_IFDIR | stat.S_IMODE(mode), gid)
        inode = self._new_inode(mode, uid, gid)
        self._dirs[inode.ino] = {}
        self._parent[inode.ino] = parent
        parent_inode.nlink += 1
        self._link_entry(parent_inode, name, inode)
        return inode

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        parent_inode = self._prepare_create(parent, name)
        if not target or len(target) > 4095:
            raise InvalidArgument(f"symlink target of {len(target)} bytes must be 1..4095")
        _, gid = self._inherit(parent_inode, stat.S_IFLNK, gid)
        inode = self._new_inode(stat.S_IFLNK | 0o777, uid, gid, target=target)
        self._link_entry(parent_inode, name, inode)
        return inode

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        """Add a hard link `name` in `parent` to the non-directory `ino`."""
        inode = self.get(ino)
        if inode.is_dir:
            raise NotPermitted(f"cannot hard-link directory {ino}")
        parent_inode = self._prepare_create(parent, name)
        inode.nlink += 1
        inode.ctime_ns = time.time_ns()
        self._link_entry(parent_inode, name, inode)
        return inode

    def create_unlinked(self, mode: int, uid: int, gid: int) -> Inode:
        """A regular file in no directory (like `O_TMPFILE`), held by one reference:
        `link_replacing` names it, `unref` deletes it, and a daemon that dies first
        drops it at the next start (an orphan)."""
        inode = self._new_inode(stat.S_IFREG | stat.S_IMODE(mode), uid, gid)
        inode.nlink = 0
        self._stage(inode)
        self.ref(inode.ino)
        return inode

    def link_replacing(self, ino: int, parent: int, name: bytes) -> Inode | None:
        """Name the regular file `ino` `name` in `parent`, replacing the non-directory
        that has the name, as one change (rename's atomicity); returns the replaced
        inode, None if there was none."""
        inode = self._regular(ino)
        check_name(name)
        old_ino = self._dir(parent).get(name)
        old = None if old_ino is None else self._inodes[old_ino]
        if old is not None and old.is_dir:
            raise IsADirectory(f"{name.decode(errors='replace')!r} is a directory")
        if old is not None and old.ino == ino:
            return None
        # Checks done: nothing below can fail.
        if old is not None:
            self._unlink_entry(self._inodes[parent], name, old)
        inode.nlink += 1
        inode.ctime_ns = time.time_ns()
        self._link_entry(self._inodes[parent], name, inode)
        return old

    def readlink(self, ino: int) -> bytes:
        inode = self.get(ino)
        if inode.target is None:
            raise InvalidArgument(f"inode {ino} is not a symlink")
        return inode.target

    # --- removing -----------------------------------------------------------------------

    def _unlink_entry(self, parent: Inode, name: bytes, inode: Inode) -> None:
        del self._dirs[parent.ino][name]
        self._stage_dentry(parent.ino, name, None)
        now = time.time_ns()
        parent.mtime_ns = parent.ctime_ns = now
        self._stage(parent)
        if inode.is_dir:
            parent.nlink -= 1
            inode.nlink = 0
            del self._dirs[inode.ino]
            del self._parent[inode.ino]
            self._listings.pop(inode.ino, None)
        else:
            inode.nlink -= 1
        inode.ctime_ns = now
        self._stage(inode)
        self._purge_if_unused(inode.ino)

    def unlink(self, parent: int, name: bytes) -> None:
        inode = self.lookup(parent, name)
        if inode.is_dir:
            raise IsADirectory(f"{name.decode(errors='replace')!r} is a directory")
        self._unlink_entry(self._inodes[parent], name, inode)

    def rmdir(self, parent: int, name: bytes) -> None:
        if name == b".":
            raise InvalidArgument("rmdir of '.'")
        inode = self.lookup(parent, name)
        if not inode.is_dir:
            raise NotADirectory(f"{name.decode(errors='replace')!r} is not a directory")
        if self._dirs[inode.ino]:
            raise NotEmpty(f"directory {name.decode(errors='replace')!r} is not empty")
        self._unlink_entry(self._inodes[parent], name, inode)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int = 0) -> None:
        """Move `old_name` to `new_name` atomically, replacing a compatible target."""
        if flags & ~RENAME_NOREPLACE:
            raise InvalidArgument(f"rename flags {flags:#x} not supported (RENAME_NOREPLACE only)")
        check_name(new_name)
        inode = self.lookup(old_parent, old_name)
        new_entries = self._dir(new_parent)
        target_ino = new_entries.get(new_name)
        if target_ino == inode.ino:
            return  # the same file under both names: POSIX says do nothing
        if inode.is_dir:
            walk = new_parent
            while True:
                if walk == inode.ino:
                    raise InvalidArgument("cannot move a directory into itself")
                if walk == ROOT_INODE:
                    break
                walk = self._parent[walk]
        target = None if target_ino is None else self._inodes[target_ino]
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise Exists(f"{new_name.decode(errors='replace')!r} exists")
            if inode.is_dir and not target.is_dir:
                raise NotADirectory(f"{new_name.decode(errors='replace')!r} is not a directory")
            if not inode.is_dir and target.is_dir:
                raise IsADirectory(f"{new_name.decode(errors='replace')!r} is a directory")
            if target.is_dir and self._dirs[target.ino]:
                raise NotEmpty(f"directory {new_name.decode(errors='replace')!r} is not empty")
        # Checks done: from here on nothing can fail, so the rename applies whole.
        if target is not None:
            self._unlink_entry(self._inodes[new_parent], new_name, target)
        old_parent_inode = self._inodes[old_parent]
        new_parent_inode = self._inodes[new_parent]
        del self._dirs[old_parent][old_name]
        self._stage_dentry(old_parent, old_name, None)
        new_entries[new_name] = inode.ino
        self._stage_dentry(new_parent, new_name, inode.ino)
        now = time.time_ns()
        if inode.is_dir and old_parent != new_parent:
            self._parent[inode.ino] = new_parent
            old_parent_inode.nlink -= 1
            new_parent_inode.nlink += 1
        for changed in (old_parent_inode, new_parent_inode):
            changed.mtime_ns = changed.ctime_ns = now
            self._stage(changed)
        inode.ctime_ns = now
        self._stage(inode)

    def remove_tree(self, parent: int, name: bytes) -> list[int]:
        """Remove `name` from `parent`, a directory with everything below it (retention).
        Returns the inodes of the regular files removed."""
        inode = self.lookup(parent, name)
        removed: list[int] = []
        if inode.is_dir:
            for child in list(self._dirs[inode.ino]):
                removed += self.remove_tree(inode.ino, child)
            self.rmdir(parent, name)
        else:
            if inode.is_reg:
                removed.append(inode.ino)
            self.unlink(parent, name)
        return removed

    def parent_of(self, directory: int) -> int:
        """The parent of directory `directory` (the root is its own parent). ENOENT for a
        directory removed from the tree that is still referenced (an open, a kernel
        lookup): it has no parent any more."""
        parent = self._parent.get(directory)
        if parent is None:
            raise NotFound(f"directory inode {directory} is no longer in the tree")
        return parent

    def is_within(self, directory: int, ancestor: int) -> bool:
        """Whether directory `directory` is `ancestor` or below it."""
        walk = directory
        while walk in self._parent:
            if walk == ancestor:
                return True
            if walk == ROOT_INODE:
                return False
            walk = self._parent[walk]
        return False

    def find_entry(self, ino: int) -> tuple[int, bytes] | None:
        """(parent, name) of one entry naming `ino`, by a scan of every directory (slow:
        for recovery, not for requests)."""
        for parent, entries in self._dirs.items():
            for name, child in entries.items():
                if child == ino:
                    return parent, name
        return None

    # --- references and purging ---------------------------------------------------------

    def ref(self, ino: int, count: int = 1) -> None:
        """Count a kernel lookup or an open handle on `ino`."""
        self._refs[ino] = self._refs.get(ino, 0) + count

    def unref(self, ino: int, count: int = 1) -> None:
        """Drop references; an unlinked inode with none left is deleted with its data."""
        left = self._refs.get(ino, 0) - count
        if left > 0:
            self._refs[ino] = left
            return
        self._refs.pop(ino, None)
        self._purge_if_unused(ino)

    def _purge_if_unused(self, ino: int) -> None:
        inode = self._inodes.get(ino)
        if inode is not None and inode.nlink == 0 and self._refs.get(ino, 0) == 0:
            self._purge(ino)

    def _purge(self, ino: int) -> None:
        self._blocks.delete_owner(ino)
        self._count(self._inodes.pop(ino), -1)
        self._meta.delete("inodes", (ino,))
        for name in self._xattrs.pop(ino, {}):
            self._meta.delete("xattrs", (ino, name))
        _names, held = self._xattr_sizes.pop(ino, (0, 0))
        self.xattr_bytes -= held

    # --- attributes ---------------------------------------------------------------------

    async def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> Inode:
        """Change the given attributes; `size` truncates or extends (with a hole)."""
        inode = self.get(ino)
        if size is not None:
            if inode.is_dir:
                raise IsADirectory(f"cannot truncate directory {ino}")
            if not inode.is_reg:
                raise InvalidArgument(f"cannot truncate inode {ino} of type {oct(stat.S_IFMT(inode.mode))}")
            if size < 0 or size > MAX_FILE_BYTES:
                raise FileTooLarge(f"size {size} outside 0..{MAX_FILE_BYTES}")
            await self._truncate(inode, size)
        now = time.time_ns()
        if mode is not None:
            inode.mode = stat.S_IFMT(inode.mode) | stat.S_IMODE(mode)
        if uid is not None:
            inode.uid = uid
        if gid is not None:
            inode.gid = gid
        if atime_ns is not None:
            inode.atime_ns = atime_ns
        if mtime_ns is not None:
            inode.mtime_ns = mtime_ns
        inode.ctime_ns = now
        self._stage(inode)
        return inode

    async def _truncate(self, inode: Inode, size: int) -> None:
        await self._blocks.truncate_range(inode.ino, inode.size, size)
        if size != inode.size:
            self._resize(inode, size)
            inode.mtime_ns = time.time_ns()

    # --- data ---------------------------------------------------------------------------

    def _regular(self, ino: int) -> Inode:
        inode = self.get(ino)
        if inode.is_dir:
            raise IsADirectory(f"inode {ino} is a directory")
        if not inode.is_reg:
            raise InvalidArgument(f"inode {ino} is not a regular file")
        return inode

    async def read(self, ino: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        """Return up to `size` bytes at `offset` (short at EOF; holes read as zeros).

        A read inside one cached block returns a memoryview of it without copying; the
        caller must use it before its next await.
        """
        inode = self._regular(ino)
        return await self._blocks.read_range(ino, offset, size, inode.size)

    async def write(self, ino: int, offset: int, data: bytes | memoryview) -> int:
        """Write `data` at `offset` into DRAM (write-back); return the bytes written."""
        inode = self._regular(ino)
        if offset + len(data) > MAX_FILE_BYTES:
            raise FileTooLarge(f"write past {MAX_FILE_BYTES} bytes")
        await self._blocks.write_range(ino, offset, data)
        end = offset + len(data)
        if end > inode.size:
            self._resize(inode, end)
        inode.mtime_ns = inode.ctime_ns = time.time_ns()
        self._stage(inode)
        return len(data)

    async def zero_range(self, ino: int, offset: int, end: int) -> None:
        """Bytes [offset, end) of the file, within its size, read as zeros from now on
        (fallocate's PUNCH_HOLE and ZERO_RANGE): whole blocks become holes."""
        inode = self._regular(ino)
        await self._blocks.zero_range(ino, offset, min(end, inode.size))
        inode.mtime_ns = inode.ctime_ns = time.time_ns()
        self._stage(inode)

    async def adopt(self, ino: int, view: memoryview) -> Inode:
        """Make `view` the file's whole content without copying it (a staged file whose
        memory the fs layer took over, sealed): the old content goes, the new bytes are
        in DRAM (borrowed blocks) and persist like written ones. OutOfMemory when they do
        not fit in the DRAM budget; nothing changes then."""
        inode = self._regular(ino)
        if len(view) > MAX_FILE_BYTES:
            raise FileTooLarge(f"{len(view)} bytes is past {MAX_FILE_BYTES}")
        await self._blocks.make_room_for(len(view))  # before anything changes
        await self._truncate(inode, 0)  # (no await inside for a cut to 0: the room stays)
        await self._blocks.adopt(ino, view)
        self._resize(inode, len(view))
        inode.mtime_ns = inode.ctime_ns = time.time_ns()
        self._stage(inode)
        return inode

    async def release_borrowed(self, ino: int) -> None:
        """The file's adopted bytes are in the log: DRAM lets go of the memory they borrow
        (unmapped in a worker thread, off the event loop)."""
        dropped = self._blocks.drop_borrowed(ino)
        if dropped:
            await trio.to_thread.run_sync(dropped.clear)

    async def flush(self, ino: int) -> None:
        """On close: the file's data goes to the log and its metadata to the database,
        so a killed daemon keeps it (not yet durable against power loss)."""
        await self._blocks.persist(ino)

    async def fsync(self, ino: int) -> None:
        """The file's data and all metadata are on the device when this returns."""
        await self._blocks.persist(ino, durable=True)

    async def persist_rows(self) -> None:
        """Every staged metadata change (a namespace change) survives a killed daemon
        when this returns: a row note, or a commit where a note cannot go."""
        await self._blocks.persist_rows()

    async def write_back(self, ino: int, full_only: bool = False) -> None:
        """Hand the file's dirty blocks to the log (all, or only full ones while it is
        still being written): *logged* once the next commit stages their rows."""
        await self._blocks.flush(ino, full_only=full_only)

    async def disk_free_bytes(self) -> int:
        """Bytes the disk under the data dir has free for the log."""
        return await trio.to_thread.run_sync(self._blocks.disk_free_bytes)

    def allocated_bytes(self, inode: Inode) -> int:
        """Bytes of `inode`'s blocks that hold data (a hole holds none), at most its size."""
        return min(inode.size, self._blocks.owner_block_count(inode.ino) * self.block_bytes)

    def dirty_bytes(self, ino: int) -> int:
        """Bytes of the file held in DRAM that the log does not have yet."""
        return self._blocks.owner_dirty_bytes(ino)

    async def commit(self, durable: bool = False) -> None:
        """Commit staged metadata (durable: the log is fsync'ed first)."""
        await self._blocks.commit(durable=durable)

    async def sync_all(self) -> None:
        await self._blocks.flush()
        await self._blocks.commit(durable=True)

    # --- xattrs -------------------------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        self.get(ino)
        value = self._xattrs.get(ino, {}).get(name)
        if value is None:
            raise NoSuchAttribute(f"no attribute {name.decode(errors='replace')!r} on inode {ino}")
        return value

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        inode = self.get(ino)
        if not name.startswith(b"user."):
            raise NotSupported(f"only user.* attributes are stored, not {name.decode(errors='replace')!r}")
        if len(name) > NAME_MAX:
            raise NameTooLong(f"attribute name of {len(name)} bytes exceeds {NAME_MAX}")
        if len(value) > XATTR_VALUE_MAX:
            raise TooBig(f"attribute value of {len(value)} bytes exceeds {XATTR_VALUE_MAX}")
        attrs = self._xattrs.setdefault(ino, {})
        old = attrs.get(name)
        names, held = self._xattr_sizes.get(ino, (0, 0))
        more_names, more = _xattr_change(name, old, value)
        if names + more_names > XATTR_NAMES_MAX:
            raise StoreFull(f"no room for another attribute name on inode {ino} ({XATTR_NAMES_MAX} bytes of names)")
        if held + more > XATTR_FILE_BYTES:
            raise StoreFull(f"no room for {len(value)} more attribute bytes on inode {ino} ({XATTR_FILE_BYTES} a file)")
        if self.xattr_bytes + more > XATTR_TOTAL_BYTES:
            raise StoreFull(
                f"extended attributes hold {self.xattr_bytes} bytes, the daemon's limit is {XATTR_TOTAL_BYTES}"
            )
        attrs[name] = value
        self._count_xattr(ino, name, old, value)
        self._meta.put("xattrs", (ino, name), (value,))
        inode.ctime_ns = time.time_ns()
        self._stage(inode)

    def _count_xattr(self, ino: int, name: bytes, old: bytes | None, new: bytes | None) -> None:
        """Account attribute `name` of `ino` going from `old` to `new` (None: absent)."""
        names, held = self._xattr_sizes.get(ino, (0, 0))
        more_names, more = _xattr_change(name, old, new)
        self.xattr_bytes += more
        if names + more_names:
            self._xattr_sizes[ino] = (names + more_names, held + more)
        else:
            self._xattr_sizes.pop(ino, None)

    def listxattr(self, ino: int) -> list[bytes]:
        self.get(ino)
        return list(self._xattrs.get(ino, {}))

    def removexattr(self, ino: int, name: bytes) -> None:
        inode = self.get(ino)
        attrs = self._xattrs.get(ino, {})
        if name not in attrs:
            raise NoSuchAttribute(f"no attribute {name.decode(errors='replace')!r} on inode {ino}")
        self._count_xattr(ino, name, attrs.pop(name), None)
        self._meta.delete("xattrs", (ino, name))
        inode.ctime_ns = time.time_ns()
        self._stage(inode)

    # --- numbers ------------------------------------------------------------------------

    def statistics(self) -> FileStatistics:
        """Counts kept as inodes come, go and change size (no walk of the inodes)."""
        files, directories, symlinks, other = self._kinds
        return FileStatistics(files, directories, symlinks, other, self._file_bytes)
