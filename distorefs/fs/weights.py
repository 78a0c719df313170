"""The `weights/` kind: versioned models as directories of files.

Owns the FUSE side of weights: the nodes (`weights/<model>/`, its files, `version` and
`wait`), the handles of readers and writers, and how each version meets the kernel's
caches. The models themselves are stores/weights.py.

Every version of a file has bytes that never change, and a lookup of a published file
gets the version's one inode, shared by all its readers: they read through the kernel's
page cache of it (the first from the daemon, the others at memory speed), and a reader
holds the version it opened and keeps reading it after newer ones are published.
Entries of a model are never cached (entry timeout 0): each open asks the daemon which
version is current. libfuse makes the kernel cut the size and page cache of an inode
that a writer opens with O_TRUNC (atomic_o_trunc), and pyfuse3 cannot turn that off, so
a writer must never open the shared inode: its open there gets ESTALE, which makes the
kernel look the name up again once, and that lookup from the same thread gets an inode
of its own (an alias). So readers may map the file (torch.load(mmap=True), safetensors,
np.load(mmap_mode='r')) without SIGBUS or changed bytes. Writers are direct_io.

A writer publishes at its last close, unless its process was exiting at that close (it
was killed or crashed before closing): the flush that the kernel sends on close is
checked against the PF_EXITING flag of the writer's process in /proc.

Write-to-temp-then-rename (safetensors, `os.replace`, editors) publishes the target
once. A *staging name* (one that starts with `.`, or ends in `.tmp`, `.part`,
`.partial` or `~`) is never published as a file of the model: a writer under such a
name that closes leaves its bytes staged (visible to lookup, not listed, not
versioned), and a rename of a staged or still-open file onto a real name publishes that
name, at the rename if the writer has closed, else at its close. Staged files live
until renamed or unlinked, or the daemon stops.
"""

from __future__ import annotations

import os
import stat
import time

from distorefs import scheduling
from distorefs.errors import CrossDevice, Exists, NotFound, NotPermitted, NotSupported, ReadOnly, Stale
from distorefs.fs.buffers import run_waiting
from distorefs.fs.procs import process_exiting, thread_group
from distorefs.fs.shm_sessions import SampleSessions
from distorefs.fs.virtual import (
    Access,
    ControlFile,
    KindDirectory,
    VirtualDir,
    VirtualFile,
    VirtualHandle,
    VirtualNode,
    VirtualTree,
)
from distorefs.stores.files import RENAME_NOREPLACE
from distorefs.stores.weights import RESERVED_NAMES, Model, WeightFile, WeightStore, check_file_name

SHM_XATTR = b"user.distore.shm"
SHM_COPY_MAGIC = b"DSSHMW1"
FILE_ATTR_CACHE_S = 3600.0  # a version's inode never changes
WRITER_RETRY_S = 2.0  # a writer sent back from a shared inode looks up again within this
MAX_WRITER_RETRIES = 1024


# --- handles ----------------------------------------------------------------------------


class ReaderHandle(VirtualHandle):
    """Reads one version of one file through the kernel page cache, so it can be mapped
    (MAP_SHARED too: np.load(mmap_mode='r'), safetensors safe_open). Safe because the
    inode is this lookup's own alias of a version that never changes: no writer opens
    it, so nothing cuts its size or pages (see WeightsDir.alias_for)."""

    kind = "weights"

    direct_io = False
    keep_cache = True

    def __init__(self, store: WeightStore, node: FileNode) -> None:
        self._store = store
        self._node = node
        store.hold(node.wf)

    async def read(self, offset: int, size: int) -> bytes | bytearray | memoryview:
        return await self._store.read(self._node.wf, offset, size)

    async def release(self) -> None:
        await scheduling.checkpoint()
        self._store.release(self._node.wf)
        self._node.collect()


STAGING_SUFFIXES = (b".tmp", b".part", b".partial", b"~")


def is_staging(name: bytes) -> bool:
    """A temporary name of the write-then-rename pattern: never published as a version."""
    return name.startswith(b".") or name.endswith(STAGING_SUFFIXES)


class WriterHandle(VirtualHandle):
    """Fills a private file; a close that follows writes publishes it as `name` of the
    model (the flush the kernel sends on close returns once the version is published).

    Writes after such a close (through a dup of the descriptor) go to a fresh copy, so a
    published version never changes. A handle closed without any write publishes its
    (empty or copied) file at its last close.
    """

    kind = "weights"

    direct_io = True

    def __init__(self, store: WeightStore, model_dir: ModelDir, name: bytes, pending: WeightFile, pid: int) -> None:
        self._store = store
        self._dir = model_dir
        self._name = name
        model_dir.open_writers.setdefault(name, []).append(self)
        self.pending = pending
        self._tgid = thread_group(pid)
        self._killed = False
        self._written = False  # writes since the last publish
        self._published = False

    async def read(self, offset: int, size: int) -> bytes | bytearray | memoryview:
        return await self._store.read(self.pending, offset, size)

    async def _own_copy(self) -> None:
        if self.pending.current:  # published by an earlier close of a dup
            old = self.pending
            self.pending = await self._store.begin_write(old)
            self._store.release(old)

    async def write(self, offset: int, data: bytes) -> int:
        await self._own_copy()
        written = await self._store.write(self.pending, offset, data)
        self._written = True
        return written

    async def resize(self, size: int) -> None:
        await self._own_copy()
        await self._store.truncate(self.pending, size)
        self._written = True

    async def fsync(self) -> None:
        await self._store.sync(self.pending)

    def _unregister(self) -> None:
        writers = self._dir.open_writers
        named = writers.get(self._name)
        if named is not None and self in named:
            named.remove(self)
            if not named:
                del writers[self._name]

    def retarget(self, new_name: bytes) -> None:
        """The file was renamed while open: publish it under `new_name` at its close."""
        self._unregister()
        self._name = new_name
        self._dir.open_writers.setdefault(new_name, []).append(self)

    def discard(self) -> None:
        """The file was unlinked while open: its close publishes nothing."""
        self._killed = True

    async def _publish(self) -> None:
        if is_staging(self._name):
            await scheduling.checkpoint()
            self._dir.stage(self._name, self.pending)
            self._written = False
            self._published = True
            return
        try:
            await self._store.publish(self._dir.model, {self._name: self.pending})
        except NotFound:
            self._killed = True  # the model went away (removed, or renamed onto another)
            self._dir.discarded += 1
            raise
        self._written = False
        self._published = True

    async def flush(self) -> None:
        await scheduling.checkpoint()
        if self._killed:
            return
        if process_exiting(self._tgid):
            self._killed = True
            self._dir.discarded += 1
        elif self._written:
            await self._publish()

    async def release(self) -> None:
        try:
            if not self._killed and (self._written or not self._published):
                await self._publish()
        except NotFound:
            pass
        finally:
            self._unregister()
            self._store.release(self.pending)
            self._dir.kind.node_for(self.pending).collect()


class WaitHandle(VirtualHandle):
    """Reads return lines `VERSION TIME`: the first at once, each later one when a version
    newer than the last one returned is published. A read shorter than the line returns
    its start, and the next reads the rest before waiting again (a reader that reads a
    byte at a time, as unbuffered readline does, gets whole lines). EOF once the model is
    gone."""

    kind = "weights"

    def __init__(self, store: WeightStore, model: Model, timeout_s: float, nonblocking: bool, pid: int) -> None:
        self._store = store
        self._model = model
        self._timeout_s = timeout_s
        self._nonblocking = nonblocking
        self._pid = pid
        self._last: int | None = None
        self._rest = b""  # what a short read left of the current line

    async def read(self, offset: int, size: int) -> bytes:
        if not self._rest:
            line = await self._next_line()
            if not line:
                return b""
            self._rest = line
        out, self._rest = self._rest[:size], self._rest[size:]
        return out

    async def _next_line(self) -> bytes:
        model = self._model
        if self._last is not None:
            last = self._last
            try:
                await run_waiting(
                    self._pid,
                    self._nonblocking,
                    model.version > last or model.deleted,
                    lambda nb: self._store.wait_newer(model, last, self._timeout_s, nb),
                    f"weights/{model.name.decode(errors='replace')}/wait",
                )
            except NotFound:
                return b""
        else:
            await scheduling.checkpoint()
        self._last = model.version
        return model.version_line()


# --- nodes ------------------------------------------------------------------------------


class FileNode(VirtualFile):
    """One version of one file (or a writer's file before it is published)."""

    writable = True
    cache_s = FILE_ATTR_CACHE_S
    entry_cache_s = 0.0

    def __init__(self, kind: WeightsDir, ino: int, name: bytes, wf: WeightFile, alias: bool = False) -> None:
        super().__init__(ino, name, stat.S_IFREG | 0o644)
        self.kind = kind
        self.wf = wf
        self.mtime_ns = wf.mtime_ns
        self.lookups = 0
        self.alias = alias  # one lookup's own inode for the version (see WeightsDir.alias_for)

    @property
    def size(self) -> int:
        return self.wf.size

    def looked_up(self, count: int) -> None:
        self.lookups += count
        self.collect()

    def collect(self) -> None:
        """Forget this node once the kernel holds no reference to it and, for the
        version's own node, the version is freed."""
        if self.lookups <= 0 and (self.alias or self.wf.freed):
            self.kind.drop_node(self)

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        store = self.kind.store
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC:
            await scheduling.checkpoint()
            if self.wf.freed:
                # Republished and freed between the reader's lookup and its open: this
                # inode's size and pages are the old version's, so the kernel looks the
                # name up again (once) and opens the version now current, never ENOENT.
                self._current_node()  # NotFound when the name is gone meanwhile
                raise Stale(f"{self.name.decode(errors='replace')}: republished since the lookup; look it up again")
            return ReaderHandle(store, self)
        model_dir = self.kind.dir_holding(self)
        model_dir.writer_landed(self.name, pid)
        if not self.alias:
            # The version's shared inode, whose pages readers share: a writer's open must
            # not land here (the kernel would cut them). Send it back to look the name
            # up again; that lookup, from this thread, gets an inode of its own.
            model_dir.send_writer_back(self.name, pid)
            raise Stale(f"{self.name.decode(errors='replace')}: a writer opens its own inode; look it up again")
        base = None if flags & os.O_TRUNC else self.wf
        if base is not None:
            store.hold(base)
        try:
            pending = await store.begin_write(base)
        finally:
            if base is not None:
                store.release(base)
        return WriterHandle(store, model_dir, self.name, pending, pid)

    async def getxattr(self, name: bytes, uid: int) -> bytes:
        """`user.distore.shm`: the current version's number and a ticket for this file's
        bytes in that version as a sealed memfd, handed over on the daemon's socket
        (`client.map_version`; docs/formats.md, "Weights through shared memory, version
        1"). The kernel has checked that `uid` may read this file; the socket checks that
        the process connecting is `uid`'s. ESTALE when the version the lookup found is
        no longer current (look the name up again)."""
        if name != SHM_XATTR:
            return await super().getxattr(name, uid)
        await scheduling.checkpoint()
        sessions = self.kind.sessions
        label = f"weights/{self.name.decode(errors='replace')}"
        if sessions is None or not sessions.available:
            raise NotSupported(f"{label}: this daemon has no shared-memory socket (--shm-dir)")
        store, wf = self.kind.store, self.wf
        versions = [m.version for m in store.models.values() if any(f is wf for f in m.files.values())]
        if not versions or wf.freed:
            raise Stale(f"{label}: republished since the lookup; look it up again")
        ticket = sessions.issue_copy(lambda: store.shared_copy(wf), uid, label)
        return b"%s %s %s %d" % (SHM_COPY_MAGIC, sessions.path.encode(), ticket, versions[0])

    def _current_node(self) -> FileNode:
        governor = self.governor
        if isinstance(governor, ModelDir):
            current = governor.model.files.get(self.name)
            if current is not None and not current.freed:
                return self.kind.node_for(current, self.name).govern(governor, Access.READ_WRITE)
        raise NotFound(f"{self.name.decode(errors='replace')} is no longer published")

    async def resize(self, size: int, handle: VirtualHandle | None) -> None:
        if isinstance(handle, WriterHandle):
            await handle.resize(size)
            return
        raise ReadOnly("a published weights file changes only when a writer closes it; truncate through a write open")


class PinnedNode(FileNode):
    """`NAME@V`: one version's bytes, read-only, one inode shared by all its readers.
    Forgotten once the kernel holds no reference to it."""

    writable = False

    def __init__(self, kind: WeightsDir, ino: int, name: bytes, wf: WeightFile) -> None:
        super().__init__(kind, ino, name, wf, alias=True)
        self.mode = stat.S_IFREG | 0o444

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        await scheduling.checkpoint()
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise ReadOnly(f"{self.name.decode(errors='replace')} is one version's bytes: read-only")
        if self.wf.freed:
            raise NotFound(f"{self.name.decode(errors='replace')}: that version is gone")
        return ReaderHandle(self.kind.store, self)

    def truncate(self) -> None:
        raise ReadOnly(f"{self.name.decode(errors='replace')} is one version's bytes: read-only")


class ModelDir(VirtualDir):
    """`weights/<model>/`: the current version's files, `version` and `wait`."""

    counts_lookups = True
    entry_cache_s = 0.0  # a rename onto the model replaces its node

    def __init__(self, kind: WeightsDir, model: Model) -> None:
        super().__init__(kind.tree.new_ino(), model.name, stat.S_IFDIR | 0o755)
        self.own(kind.tree.owners, b"weights", kind.tree.default_owner())
        self.kind = kind
        self.model = model
        self.discarded = 0  # writers that closed without publishing
        self.open_writers: dict[bytes, list[WriterHandle]] = {}  # by the name they will publish
        self.staged: dict[bytes, WeightFile] = {}  # closed files under staging names, held
        self._writers_back: dict[tuple[bytes, int], float] = {}  # (name, thread) sent to look up again
        version = ControlFile(kind.tree.new_ino(), b"version", model.version_line)
        self.children[b"version"] = version.govern(self, Access.READ)
        self.children[b"wait"] = WaitFile(kind, model, kind.tree.new_ino()).govern(self, Access.READ)
        for node in self.children.values():
            kind.tree.register(node)

    def stage(self, name: bytes, wf: WeightFile) -> None:
        """Keep a closed file under a staging name until it is renamed or unlinked."""
        self.kind.store.hold(wf)
        old = self.staged.get(name)
        self.staged[name] = wf
        if old is not None:
            self.kind.store.release(old)

    def send_writer_back(self, name: bytes, pid: int) -> None:
        """A writer's open (thread `pid`) met the shared inode of `name`: its lookups of
        `name` get inodes of their own until its open lands on one (within
        WRITER_RETRY_S; at most MAX_WRITER_RETRIES remembered, the oldest dropped)."""
        now = time.monotonic()
        self._writers_back[(name, pid)] = now
        if len(self._writers_back) > MAX_WRITER_RETRIES:
            for key in list(self._writers_back)[: len(self._writers_back) - MAX_WRITER_RETRIES]:
                del self._writers_back[key]

    def writer_landed(self, name: bytes, pid: int) -> None:
        self._writers_back.pop((name, pid), None)

    def lookup_from(self, name: bytes, pid: int) -> VirtualNode:
        # The kernel's retry looks the name up twice (the revalidation of its cached entry,
        # then a fresh lookup): both get an alias, until the writer's open lands on one.
        sent = self._writers_back.get((name, pid))
        if sent is not None and time.monotonic() - sent < WRITER_RETRY_S:
            wf = self.model.files.get(name)
            if wf is not None:
                return self.kind.alias_for(wf, name).govern(self, Access.READ_WRITE)
        return self.lookup(name)

    def lookup(self, name: bytes) -> VirtualNode:
        control = self.children.get(name)
        if control is not None:
            return control
        published = self.model.files.get(name)
        if published is not None:
            # One inode per version, shared by every reader: the kernel's page cache of
            # it serves them all. Writers are sent on to an inode of their own (open).
            return self.kind.node_for(published, name).govern(self, Access.READ_WRITE)
        wf = self.staged.get(name)
        if wf is None and name in self.open_writers:
            wf = self.open_writers[name][-1].pending  # created, not closed yet
        base, at, number = name.rpartition(b"@")
        if wf is None and at and base and number.isdigit():
            return self._pinned(base, int(number), name)  # a file of that very name wins
        if wf is None:
            raise NotFound(f"no file {name.decode(errors='replace')!r} in weights/{self.model.name.decode()}")
        return self.kind.alias_for(wf, name).govern(self, Access.READ_WRITE)

    def _pinned(self, base: bytes, version: int, name: bytes) -> VirtualNode:
        """`NAME@V`: the file NAME as of version V, which must be the current version (not
        listed). Read-only, and one inode for every reader of those bytes, so readers
        share the kernel's page cache (`client.map_version`); no writer can open it, so
        nothing cuts its pages."""
        wf = self.model.files.get(base)
        if wf is None or version != self.model.version:
            raise NotFound(
                f"weights/{self.model.name.decode()}: no {name.decode(errors='replace')!r}"
                f" (the current version is {self.model.version})"
            )
        return self.kind.pinned_for(wf, name).govern(self, Access.READ)

    def entries(self) -> list[tuple[bytes, int]]:
        return [(n, c.ino) for n, c in self.children.items()] + [
            (n, self.kind.node_for(wf, n).ino) for n, wf in self.model.files.items()
        ]

    def listing(self) -> list[tuple[bytes, int, int, int]]:
        out = [(n, c.ino, c.effective_mode(), 0) for n, c in self.children.items()]
        file_mode = stat.S_IFREG | self.child_bits(Access.READ_WRITE, 0o644)
        for name, wf in self.model.files.items():
            out.append((name, self.kind.node_for(wf, name).govern(self, Access.READ_WRITE).ino, file_mode, wf.size))
        return out

    async def create(self, name: bytes, mode: int, flags: int, pid: int) -> tuple[VirtualNode, VirtualHandle]:
        check_file_name(name)
        pending = await self.kind.store.begin_write()
        node = self.kind.node_for(pending, name).govern(self, Access.READ_WRITE)
        return node, WriterHandle(self.kind.store, self, name, pending, pid)

    async def unlink(self, name: bytes) -> None:
        if name in RESERVED_NAMES:
            await scheduling.checkpoint()
            return  # control files come back: a no-op, so `rm -r` works
        staged = self.staged.pop(name, None)
        writers = self.open_writers.get(name, [])
        for writer in writers:
            writer.discard()
        if staged is not None:
            self.kind.store.release(staged)
        if staged is not None or (writers and name not in self.model.files):
            await scheduling.checkpoint()
            return
        await self.kind.store.unlink(self.model, name)

    async def rename(self, name: bytes, new_parent: VirtualDir, new_name: bytes, flags: int) -> None:
        if not isinstance(new_parent, ModelDir):
            raise CrossDevice("weights files move only between models")
        if name in RESERVED_NAMES:
            raise NotPermitted(f"{name.decode()} is a control file")
        if new_parent is self and (name in self.staged or name in self.open_writers):
            await self._rename_pending(name, new_name, noreplace=bool(flags & RENAME_NOREPLACE))
            return
        await self.kind.store.rename_file(
            self.model, name, new_parent.model, new_name, noreplace=bool(flags & RENAME_NOREPLACE)
        )

    async def _rename_pending(self, name: bytes, new_name: bytes, noreplace: bool) -> None:
        """A staged or still-open file renamed within the model: the write-then-rename
        pattern. A staged file publishes `new_name` now; open writers publish it at
        their close (or stay staged, if `new_name` is a staging name too)."""
        check_file_name(new_name)
        if noreplace and (new_name in self.model.files or new_name in self.staged):
            raise Exists(f"{new_name.decode(errors='replace')} exists in weights/{self.model.name.decode()}")
        for writer in list(self.open_writers.get(name, [])):
            writer.retarget(new_name)
        staged = self.staged.pop(name, None)
        if staged is None:
            await scheduling.checkpoint()
            return
        try:
            if is_staging(new_name):
                self.stage(new_name, staged)
            else:
                await self.kind.store.publish(self.model, {new_name: staged})
        finally:
            self.kind.store.release(staged)

    async def mkdir(self, name: bytes, mode: int) -> VirtualNode:
        raise NotPermitted("a model holds files only; stage a group in a model of its own and rename it onto this one")

    def forget_nodes(self) -> None:
        for wf in self.staged.values():
            self.kind.store.release(wf)
        self.staged.clear()
        for node in [*self.children.values(), self]:
            self.kind.tree.unregister(node.ino)


class WaitFile(VirtualFile):
    acts_on_read = True  # a read waits for the next version

    def __init__(self, kind: WeightsDir, model: Model, ino: int) -> None:
        super().__init__(ino, b"wait", stat.S_IFREG | 0o444)
        self._kind = kind
        self._model = model

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        await scheduling.checkpoint()
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise ReadOnly("wait is read-only")
        nonblocking = bool(flags & os.O_NONBLOCK)
        return WaitHandle(self._kind.store, self._model, self._kind.wait_timeout_s, nonblocking, pid)


class WeightsDir(KindDirectory):
    """`weights/`: mkdir creates a model; rename of a model onto another publishes the
    source's files as the target's next version (a group publish)."""

    child_cache_s = 0.0

    def __init__(
        self, tree: VirtualTree, store: WeightStore, wait_timeout_s: float, sessions: SampleSessions | None = None
    ) -> None:
        super().__init__(tree.new_ino(), b"weights", self.KIND_MODE)
        self.tree = tree
        self.store = store
        self.sessions = sessions  # the daemon's shared-memory socket (hands over shared copies)
        self.wait_timeout_s = wait_timeout_s
        self._dirs: dict[int, ModelDir] = {}  # id(model) -> its directory node
        self._files: dict[int, FileNode] = {}  # owner -> node
        self._pinned: dict[int, FileNode] = {}  # owner -> the read-only node of NAME@V lookups

    def dir_for(self, model: Model) -> ModelDir:
        node = self._dirs.get(id(model))
        if node is None:
            node = self._dirs[id(model)] = ModelDir(self, model)
            self.tree.register(node)
        return node

    def dir_holding(self, node: FileNode) -> ModelDir:
        for model in self.store.models.values():
            if model.files.get(node.name) is node.wf:
                return self.dir_for(model)
        raise NotFound(f"{node.name.decode(errors='replace')} is no longer published; open it again")

    def node_for(self, wf: WeightFile, name: bytes = b"") -> FileNode:
        node = self._files.get(wf.owner)
        if node is None or (name and node.name != name):
            lookups = node.lookups if node is not None else 0
            node = FileNode(self, self.tree.new_ino() if node is None else node.ino, name, wf)
            node.lookups = lookups
            self._files[wf.owner] = node
            self.tree.register(node)
        return node

    def pinned_for(self, wf: WeightFile, name: bytes) -> FileNode:
        """The one read-only inode of a version's file that `NAME@V` lookups share."""
        node = self._pinned.get(wf.owner)
        if node is None:
            node = self._pinned[wf.owner] = PinnedNode(self, self.tree.new_ino(), name, wf)
            self.tree.register(node)
        return node

    def alias_for(self, wf: WeightFile, name: bytes) -> FileNode:
        """A fresh inode for one lookup of a version. libfuse makes the kernel cut the
        size and page cache of the inode a writer opens with O_TRUNC (atomic_o_trunc,
        which pyfuse3 cannot turn off); every lookup getting its own inode means a
        writer's open never lands on the inode a reader opened or mapped, so mapped
        readers (torch.load(mmap=True), safetensors safe_open, np.load(mmap_mode='r'))
        never see SIGBUS. Dropped once the kernel forgets it."""
        node = FileNode(self, self.tree.new_ino(), name, wf, alias=True)
        self.tree.register(node)
        return node

    def drop_node(self, node: FileNode) -> None:
        if self._files.get(node.wf.owner) is node:
            del self._files[node.wf.owner]
        if self._pinned.get(node.wf.owner) is node:
            del self._pinned[node.wf.owner]
        self.tree.unregister(node.ino)

    def lookup(self, name: bytes) -> VirtualNode:
        return self.dir_for(self.store.model(name))

    def entries(self) -> list[tuple[bytes, int]]:
        return [(name, self.dir_for(model).ino) for name, model in self.store.models.items()]

    def listing(self) -> list[tuple[bytes, int, int, int]]:
        out = []
        for name, model in self.store.models.items():
            node = self.dir_for(model)
            out.append((name, node.ino, node.effective_mode(), 0))
        return out

    async def mkdir(self, name: bytes, mode: int) -> VirtualNode:
        await scheduling.checkpoint()
        return self.dir_for(self.store.create_model(name))

    async def rmdir(self, name: bytes) -> None:
        model = self.store.model(name)
        self.store.remove_model(name)
        self._forget_dir(model)
        self.tree.owners.delete(self.name, name)
        await self.store.commit()

    async def unlink(self, name: bytes) -> None:
        await scheduling.checkpoint()
        raise NotPermitted(f"weights/{name.decode(errors='replace')} is a model directory: use rmdir or rm -r")

    async def rename(self, name: bytes, new_parent: VirtualDir, new_name: bytes, flags: int) -> None:
        if new_parent is not self:
            raise CrossDevice("a model stays directly under weights/")
        source = self.store.model(name)
        target = self.store.models.get(new_name)
        await self.store.rename_model(name, new_name, noreplace=bool(flags & RENAME_NOREPLACE))
        if target is None:
            self.tree.owners.rename(self.name, name, new_name)  # the model moved: its owner with it
        else:
            self.tree.owners.delete(self.name, name)  # published into the target, which keeps its own
        self._forget_dir(source)
        if target is not None and target is not source:
            # The kernel marks a directory replaced by rename as dead: the target model
            # continues under a node with a fresh inode.
            self._forget_dir(target)

    def _forget_dir(self, model: Model) -> None:
        node = self._dirs.pop(id(model), None)
        if node is not None:
            node.forget_nodes()
