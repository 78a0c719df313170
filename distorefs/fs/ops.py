"""FsOperations: the pyfuse3 adapter, the only place FUSEError is raised.

Owns what is FUSE-specific: file handles, kernel lookup counts, attribute timeouts,
cache flags per open, and the translation of DistorefsError into an errno. It routes each
request either to the POSIX tree (stores/tree.py: files and the policies some of them
follow, such as checkpoints/) or to a virtual node (fs/virtual.py); the reserved names
at the root (`.distore`, `buffers`, `weights`, `datasets`, `checkpoints`) cannot be
created, removed or renamed. Entries the daemon removes itself (checkpoint retention)
reach the kernel through `run_invalidations`, a task the daemon starts.

An unexpected exception is logged with its request (the handler and its arguments, never
the bytes written) and answered with EIO; it fails that request and nothing else, and is
counted in `.distore/status`. Only a broken internal invariant (an AssertionError: the
store's own state may be corrupt) turns the mount degraded: reads go on, changes get
EROFS, and `.distore/status` says why. A write that a control file refused is reported
again at every close of that open, so a writer that ignores write errors still sees it.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio
import trio.testing

from distorefs import logs, scheduling
from distorefs.errors import (
    Busy,
    CrossDevice,
    DistorefsError,
    Exists,
    InvalidArgument,
    NameTooLong,
    NotPermitted,
    NotSupported,
    ReadOnly,
)
from distorefs.fs import kernel
from distorefs.fs.metrics import Metrics
from distorefs.fs.polling import CpuRoom, PollWindow, polled_time
from distorefs.fs.shm import ADOPT_XATTR, borrow_sealed, parse_fd
from distorefs.fs.virtual import (
    KindDirectory,
    PositionListing,
    ReadReply,
    VirtualDir,
    VirtualFile,
    VirtualHandle,
    VirtualNode,
    VirtualTree,
)
from distorefs.logs import FailureLog
from distorefs.stores.files import NAME_MAX, ROOT_INODE, Inode
from distorefs.stores.tree import PosixTree
from distorefs.types import FileHandle

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

ATTR_TIMEOUT_S = 1.0


@dataclass
class Handle:
    """An open file or directory. `vhandle` serves a virtual file's reads and writes;
    `entries` is a directory's snapshot for readdir."""

    ino: int
    virtual: bool
    vhandle: VirtualHandle | None = None
    writable: bool = False
    prefix: list[tuple[bytes, int]] = field(default_factory=list)  # tree dirs: the dots (the root's kinds) ...
    entries: Sequence[tuple[bytes, int]] = ()  # ... then the listing every open of the directory shares
    listing: Sequence[tuple[bytes, int, int, int]] | None = None  # virtual dirs: name, ino, mode, size
    listing_bytes: int = 0  # of it, counted in the mount's `listings` until releasedir
    write_errno: int = 0  # a control file refused a write: reported again at every close of this open
    kind: str = "tree"  # for metrics: tree, checkpoints, or the virtual handle's kind


# A client's ordinary answers (a lookup of a name that is not there, a getxattr of an
# attribute never set, a non-blocking sample of an empty buffer): logged at DEBUG only.
ORDINARY_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENODATA, errno.EAGAIN, errno.EEXIST, errno.ENOTEMPTY, errno.EINTR, errno.ERANGE,
     errno.ENOSYS, errno.EOPNOTSUPP}
)  # fmt: skip


def _describe(args: tuple[Any, ...], op: str = "") -> str:
    """A request's arguments for the log: names and numbers, sizes instead of data (a
    write's data is never quoted, however short)."""
    parts = []
    for i, arg in enumerate(args):
        if isinstance(arg, (bytes, bytearray, memoryview)) and (len(arg) > 256 or (op == "write" and i == 2)):
            parts.append(f"<{len(arg)} bytes>")
        elif hasattr(arg, "uid") and hasattr(arg, "pid"):  # a request context
            parts.append(f"ctx(uid={arg.uid}, pid={arg.pid})")
        else:
            parts.append(repr(arg)[:300])
    return ", ".join(parts)


def _log_failure(failures: FailureLog, op: str, args: tuple[Any, ...], code: int, message: str) -> None:
    """A failed request's line: WARNING (bounded by `failures`) unless its errno is ordinary."""
    if code in ORDINARY_ERRNOS:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s(%s) -> %s: %s", op, _describe(args, op), errno.errorcode.get(code, code), message)
        return
    failures.failed(op, _describe(args, op), code, message)


def _translate(
    mutates: bool, logs_change: bool = False
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Wrap an operation: DistorefsError -> its errno; a broken invariant -> EIO and
    degraded; anything else -> EIO for this request only. `logs_change`: a namespace
    change (mkdir, rename, unlink, chmod ...) whose metadata is *logged* before the
    reply (`FsOperations._log_change`), so a killed daemon keeps what was answered."""

    def wrap(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            self = args[0]
            assert isinstance(self, FsOperations)
            if mutates and self.degraded:
                raise pyfuse3.FUSEError(errno.EROFS)
            started, failed = time.perf_counter(), 0
            self.request_started = started
            self.session_request = False
            self.requests += 1
            op = fn.__name__
            serving = scheduling.deferring_since(started)  # its schedule points come after the reply
            try:
                result = await fn(*args, **kwargs)
                if logs_change:
                    await self._log_change(op)
                return result
            except pyfuse3.FUSEError as exc:
                failed = exc.errno
                _log_failure(self.failures, op, args[1:], failed, "")
                raise
            except DistorefsError as exc:
                failed = exc.errno
                _log_failure(self.failures, op, args[1:], failed, exc.message)
                raise pyfuse3.FUSEError(exc.errno) from None
            except AssertionError as exc:
                failed = errno.EIO
                log.exception("broken invariant in %s(%s); the mount is now degraded", op, _describe(args[1:], op))
                self.degrade(f"{fn.__name__}: broken invariant: {exc}")
                raise pyfuse3.FUSEError(errno.EIO) from None
            except Exception as exc:
                failed = errno.EIO
                log.exception("unexpected error in %s(%s); the request fails with EIO", op, _describe(args[1:], op))
                self._count_internal_error(fn.__name__, exc)
                raise pyfuse3.FUSEError(errno.EIO) from None
            finally:
                scheduling.done(serving)
                self.metrics.observe(fn.__name__, started, failed)
                self.requests_ended += 1
                self.request_done.set()

        return wrapper

    return wrap


def _write_only(flags: int) -> bool:
    """A tree file opened write-only goes without the kernel's page cache (direct_io):
    each write() reaches the daemon straight from the writer's memory, with no copy into
    page cache pages and no GETXATTR of `security.capability` before it (the kernel asks
    that before every buffered write). Such an open can be neither read nor mapped, and
    the kernel drops the pages other opens cache for the range it writes (docs/design.md,
    "Write-only opens skip the page cache")."""
    return (flags & os.O_ACCMODE) == os.O_WRONLY


def _created_direct(flags: int, kind: str) -> bool:
    """A file created under checkpoints/ goes without the page cache when it is opened
    write-only (as any open, `_write_only`) and also when it is created exclusively
    (O_CREAT | O_EXCL), whatever its access mode: the temporary file that safetensors'
    `save_file`, `tempfile.mkstemp` and atomic-write helpers write whole and then
    rename. Through the page cache the kernel first copies each write into new cache
    pages: 1 GiB in one write() took 1.2-6.8 s that way against 0.3-0.9 s direct.
    The price, that descriptor alone cannot be mapped shared (ENODEV: libfuse 3.14
    cannot allow mmap of a direct_io file); a new open of the file can (docs/design.md,
    "Exclusive creates in checkpoints/ skip the page cache")."""
    return _write_only(flags) or (kind == "checkpoints" and flags & os.O_EXCL != 0)


# pyfuse3 built with scripts/pyfuse3-noflush.patch (scripts/setup.sh does) can reply
# FOPEN_NOFLUSH; stock pyfuse3 3.5 cannot, and then every close sends its FLUSH as before.
NOFLUSH = hasattr(pyfuse3.FileInfo(), "noflush")

# fallocate(2)'s modes (linux/falloc.h) that `FsOperations.fallocate` serves
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
FALLOCATE_MODES = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE


def _file_info(fh: FileHandle, direct_io: bool, keep_cache: bool, no_flush: bool) -> pyfuse3.FileInfo:
    """The reply to an OPEN. An open that can only read (O_RDONLY, no O_TRUNC) has
    nothing for a close to finish (every flush here acts on what an open wrote), nor
    has a handle that says so (`flushes`: priority.npy), so its closes send no FLUSH
    request where pyfuse3 can say so (FOPEN_NOFLUSH; Linux >= 5.15): such a close costs
    no round trip (docs/design.md, "Read-only closes send no FLUSH")."""
    info = pyfuse3.FileInfo(fh=fh, direct_io=direct_io, keep_cache=keep_cache)
    if NOFLUSH and no_flush:
        setattr(info, "noflush", True)  # noqa: B010 (stock pyfuse3's stubs lack it)
    return info


def _reads_only(flags: int) -> bool:
    return flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC


class FsOperations(pyfuse3.Operations):
    """Routes kernel requests to the POSIX tree and the virtual nodes."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(
        self, tree: PosixTree, virtual: VirtualTree, disk_stats: Callable[[], os.statvfs_result], block_bytes: int
    ) -> None:
        super().__init__()
        self.tree = tree
        self.virtual = virtual
        self.metrics = Metrics()
        self.failures = FailureLog(log)  # this mount's failed-request lines, bounded per operation
        self.disk_stats = disk_stats  # the log's disk, for statfs
        self.block_bytes = block_bytes
        self.degraded = False
        self.unlogged_changes = 0  # namespace changes whose rows could not be logged before the reply
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self.request_done = trio.Event()  # set at the end of every request (busy polling)
        self.requests_ended = 0  # FUSE requests and session draws, counted where request_done is set
        self._poll_seen = 0  # requests_ended when the busy poller last counted them
        self.request_started = 0.0  # time.perf_counter() at the start of the latest request
        self.session_request = False  # the latest request was a sampling session's draw
        self.requests = 0  # requests begun since the start
        self.initialized = trio.Event()  # set during the kernel's INIT (see init)

    def init(self) -> None:
        """pyfuse3 calls this while it handles the kernel's INIT, before libfuse writes the
        reply: what waits on `initialized` runs once the reply is written (the event loop
        gets control back only then), which is when the kernel has applied INIT's
        settings (read-ahead among them). The mount's /dev/fuse descriptor exists by now:
        `kernel.attach` finds it."""
        kernel.attach()
        self.initialized.set()

    def _count_internal_error(self, op: str, exc: Exception) -> None:
        """An unexpected error failed one request: `.distore/status` counts it."""
        self.virtual.internal_errors += 1
        self.virtual.last_internal_error = f"{op}: {type(exc).__name__}"

    async def _log_change(self, op: str) -> None:
        """After a namespace change was applied: its staged rows to the log before the
        reply (a row note, or a commit). The change is applied already, so a failure here
        (a full disk) is not the request's: it is logged and the flusher commits the rows
        at its next pass, as every change went before (docs/design.md, "Namespace changes
        logged before the reply")."""
        try:
            await self.tree.persist_rows()
        except (DistorefsError, OSError) as exc:
            self.unlogged_changes += 1
            if logs.at_doubling(self.unlogged_changes):
                log.warning(
                    "%s: applied, but not yet in the log (the flusher retries; %d such changes so far): %s",
                    op, self.unlogged_changes, exc,
                )  # fmt: skip

    def degrade(self, reason: str) -> None:
        """Reads go on, changes get EROFS until a restart."""
        self.degraded = self.virtual.degraded = True
        self.virtual.degraded_reason = reason

    async def run_invalidations(self) -> None:
        """Background task: entries the daemon removed or replaced itself (retention,
        another node's rmdir, a checkpoint replica's new version) are dropped from the
        kernel's cache too, before the outbox says they are delivered (a replica's
        commit answers its sender only then: a read on this node right after the
        writer's fsync sees the new file, not the cached entry of the old)."""
        removed = self.tree.removed
        while True:
            parent, name, ino = await removed.next()
            try:  # from a thread: the kernel takes the directory's lock, which a request may hold
                # (abandoned at unmount: the kernel may wait there for requests no one serves)
                await trio.to_thread.run_sync(kernel.forget_entry, parent, name, ino, abandon_on_cancel=True)
            finally:
                removed.handled()

    async def run_after_reply(self) -> None:
        """Background task: the work handlers leave for after their replies
        (`VirtualTree.after_reply`: a sample file's next batch drawn while the client
        reads this one), yielding to requests at its schedule points
        (`scheduling.AfterReply.run`). It fails alone: an error of its own is for whoever
        asks next."""
        await self.virtual.after_reply.run()

    def request_served(self, started: float) -> None:
        """A request served outside FUSE (a draw of a sampling session) that began at
        `started` (time.perf_counter): the busy poller counts it as a request, whose
        window may be longer (fs/polling.py)."""
        self.request_started = started
        self.session_request = True
        self.requests_ended += 1
        self.request_done.set()

    async def run_busy_poll(self, window: PollWindow) -> None:
        """Background task (`--busy-poll-us`, fs/polling.py): after each request, once
        the event loop has nothing else to run, keep it polling /dev/fuse without
        sleeping for `window`'s current length, so the next request of a client in a
        tight loop is picked up at once instead of after a wake-up of the daemon's
        thread. The window adapts to the gaps between requests: an idle daemon, or a
        client that computes between its calls, costs no polling beyond a few windows.
        A request that comes before the loop runs out of work is a hit that cost no
        polling (design.md, "Polling only an idle loop")."""
        self.virtual.add_status(lambda: {"busy_poll": self._poll_stats(window)})
        room = CpuRoom()
        self._poll_seen = self.requests_ended
        await self.request_done.wait()  # the first request
        window.followed(self.requests_ended - self._poll_seen - 1)  # it woke the poller; any others followed it
        self._poll_seen = self.requests_ended
        ended, idle = time.perf_counter(), False
        while True:
            # (a session's longer window only on a CPU nobody else wants: fs/polling.py)
            until = ended + window.length(self.session_request and room.spare())
            if not idle:
                await trio.testing.wait_all_tasks_blocked()  # nothing runnable, nothing ready
            started, at_idle = time.perf_counter(), True
            if self.requests_ended == self._poll_seen and started < until:
                at_idle = False
                while time.perf_counter() < until and self.requests_ended == self._poll_seen:
                    await trio.lowlevel.checkpoint()  # trio polls its I/O without blocking here
            stopped = time.perf_counter()
            slept = self.requests_ended == self._poll_seen
            if slept:
                self.request_done = trio.Event()
                await self.request_done.wait()  # the thread sleeps until a request ends
            # (up to the next request's arrival where it came while polling: not its handler)
            polled = 0.0 if at_idle else polled_time(started, until, stopped, self.request_started)
            if self.request_started <= stopped:
                window.hit(polled)  # it came within the window (and may have ended after)
            else:
                window.missed(polled, self.request_started - ended, self.session_request and room.spare())
            window.followed(self.requests_ended - self._poll_seen - 1)  # the others ended before this pass
            self._poll_seen = self.requests_ended
            # a new window from now; where the loop is idle now, it polls at once
            ended, idle = time.perf_counter(), at_idle and not slept

    def _poll_stats(self, window: PollWindow) -> dict[str, float | int]:
        """`window.stats()` with the requests the poller has not counted yet (it counts
        them when the loop next runs out of work) as `queued`; the first of them will
        count as a hit or a miss instead."""
        stats = window.stats()
        pending = self.requests_ended - self._poll_seen
        if pending > 0:
            stats["requests"] += pending
            stats["queued"] += pending
        return stats

    async def _stale_attrs(self, directory: VirtualDir) -> None:
        """The kernel caches some nodes' attributes (weights versions, a buffer's control
        files): after a chmod or chown of `directory`, drop those of the nodes that follow
        it before the chmod returns, so the next stat sees the change (computed item
        inodes are cached at most ITEM_CACHE_S). Attributes only: this takes no lock the
        kernel holds for the chmod."""
        inos = []
        for node in list(self.virtual.nodes.values()):
            governor = node.governor
            while governor is not None and governor is not directory:
                governor = governor.governor
            if governor is directory:
                inos.append(node.ino)

        def drop() -> None:
            for ino in inos:
                kernel.invalidate(ino, attr_only=True)

        await trio.to_thread.run_sync(drop)

    # --- helpers ------------------------------------------------------------------------

    def _attrs(self, inode: Inode) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode.ino
        attr.generation = 0
        attr.entry_timeout = ATTR_TIMEOUT_S
        attr.attr_timeout = ATTR_TIMEOUT_S
        attr.st_mode = inode.mode
        attr.st_nlink = inode.nlink
        attr.st_uid = inode.uid
        attr.st_gid = inode.gid
        attr.st_rdev = inode.rdev
        attr.st_size = inode.size
        attr.st_blksize = self.block_bytes
        attr.st_blocks = self.tree.allocated_bytes(inode) // 512  # a sparse file's real use
        attr.st_atime_ns = inode.atime_ns
        attr.st_mtime_ns = inode.mtime_ns
        attr.st_ctime_ns = inode.ctime_ns
        return attr

    def _virtual_attrs(self, node: VirtualNode) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        root = self.tree.get(ROOT_INODE)
        attr.st_ino = node.ino
        default = 0 if isinstance(node, VirtualFile) else ATTR_TIMEOUT_S
        attr.entry_timeout = ATTR_TIMEOUT_S if node.cache_s is None else node.cache_s
        if node.entry_cache_s is not None:
            attr.entry_timeout = node.entry_cache_s
        attr.attr_timeout = default if node.cache_s is None else node.cache_s
        attr.st_mode = node.mode
        attr.st_nlink = 2 if isinstance(node, VirtualDir) else 1
        attr.st_uid = root.uid
        attr.st_gid = root.gid
        found = node.permissions()  # inside a buffer's, model's or dataset's directory
        if found is not None:
            attr.st_mode = stat.S_IFMT(node.mode) | found[0]
            attr.st_uid, attr.st_gid = found[1], found[2]
        attr.st_size = node.size
        attr.st_blocks = (attr.st_size + 511) // 512  # items, records, weights: dense (du counts them)
        attr.st_blksize = 4096
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = node.mtime_ns
        return attr

    def _virtual_entry(self, node: VirtualNode) -> pyfuse3.EntryAttributes:
        """Attributes for a reply that hands the kernel a lookup reference to `node`."""
        node.looked_up(1)
        return self._virtual_attrs(node)

    def _entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        """Attributes for a reply that hands the kernel a new lookup reference."""
        self.tree.ref(inode.ino)
        return self._attrs(inode)

    def _new_fh(self, handle: Handle) -> FileHandle:
        fh = FileHandle(self._next_fh)
        self._next_fh += 1
        self._handles[fh] = handle
        return fh

    def _virtual_dir(self, ino: int) -> VirtualDir | None:
        if ino in self.virtual:
            node = self.virtual.get(ino)
            if isinstance(node, VirtualDir):
                return node
            raise NotPermitted("not a directory")
        return None

    @staticmethod
    def _named(*names: bytes) -> None:
        """ENAMETOOLONG for a name component of more than NAME_MAX bytes, on every operation."""
        for name in names:
            if len(name) > NAME_MAX:
                raise NameTooLong(f"a name of {len(name)} bytes: at most {NAME_MAX}")

    def _is_reserved(self, parent: int, name: bytes) -> bool:
        return parent == ROOT_INODE and (name in self.virtual.root_nodes or name in self.tree.reserved_names)

    def _guard_reserved(self, parent: int, name: bytes, what: str) -> None:
        if self._is_reserved(parent, name):
            raise Busy(f"{name.decode()}/ is a reserved directory: cannot {what}")

    def _guard_virtual_parent(self, parent: int, what: str) -> None:
        vdir = self._virtual_dir(parent)
        if vdir is not None:
            raise vdir.refuse(what)

    # --- lookups and attributes ---------------------------------------------------------

    @_translate(mutates=False)
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        self._named(name)
        vdir = self._virtual_dir(parent_inode)
        if vdir is not None:
            if name == b".":
                return self._virtual_attrs(vdir)
            if name == b"..":
                return self._entry(self.tree.get(ROOT_INODE))
            return self._virtual_entry(vdir.lookup_from(name, ctx.pid))
        if parent_inode == ROOT_INODE and name in self.virtual.root_nodes:
            return self._virtual_attrs(self.virtual.root_nodes[name])
        return self._entry(self.tree.lookup(parent_inode, name))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """FORGET has no reply, so nothing may escape: a failure is logged and counted."""
        for ino, nlookup in inode_list:
            try:
                if ino not in self.virtual:
                    self.tree.unref(ino, nlookup)
                else:
                    node = self.virtual.nodes.get(ino)
                    if node is not None:
                        node.looked_up(-nlookup)
            except Exception as exc:
                log.exception("unexpected error in forget(%d, %d)", ino, nlookup)
                self._count_internal_error("forget", exc)

    @_translate(mutates=False)
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode in self.virtual:
            return self._virtual_attrs(self.virtual.get(inode))
        return self._attrs(self.tree.get(inode))

    @_translate(mutates=True, logs_change=True)
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        if inode in self.virtual:
            node = self.virtual.get(inode)
            if fields.update_mode or fields.update_uid or fields.update_gid:
                if not (isinstance(node, VirtualDir) and node.owned):
                    raise NotPermitted(f"{node.name.decode(errors='replace')} follows its directory's owner and mode")
                node.set_owner(
                    attr.st_uid if fields.update_uid else None,
                    attr.st_gid if fields.update_gid else None,
                    attr.st_mode if fields.update_mode else None,
                )
                await self._stale_attrs(node)
                return self._virtual_attrs(node)
            if isinstance(node, VirtualFile) and fields.update_size:
                handle = self._handles.get(fh) if fh is not None else None
                await node.resize(attr.st_size, handle.vhandle if handle is not None else None)
                return self._virtual_attrs(node)
            if fields.update_atime or fields.update_mtime:
                return self._virtual_attrs(node)  # touch: accepted, not kept
            raise NotPermitted("virtual nodes cannot change their owner or mode")
        changed = await self.tree.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return self._attrs(changed)

    @_translate(mutates=False)
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return self.tree.readlink(inode)

    @_translate(mutates=False)
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = self.disk_stats()
        stats = self.tree.statistics()
        out = pyfuse3.StatvfsData()
        out.f_bsize = 4096
        out.f_frsize = 4096
        scale = st.f_frsize / 4096
        out.f_blocks = int(st.f_blocks * scale)
        out.f_bfree = int(st.f_bfree * scale)
        out.f_bavail = int(st.f_bavail * scale)
        used = stats.files + stats.directories + stats.symlinks + stats.other
        out.f_files = used + (1 << 32)
        out.f_ffree = 1 << 32
        out.f_favail = 1 << 32
        out.f_namemax = 255
        return out

    # --- creating and removing ----------------------------------------------------------

    @_translate(mutates=True, logs_change=True)
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._named(name)
        self._guard_virtual_parent(parent_inode, "create files")
        self._guard_reserved(parent_inode, name, "create it")
        return self._entry(self.tree.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @_translate(mutates=True, logs_change=True)
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._named(name)
        vdir = self._virtual_dir(parent_inode)
        if vdir is not None:
            made = await vdir.mkdir(name, mode)
            if isinstance(made, VirtualDir) and made.owned:  # a buffer, model or dataset: its maker owns it
                made.set_owner(ctx.uid, ctx.gid, mode)
            return self._virtual_attrs(made)
        if self._is_reserved(parent_inode, name):
            raise Exists(f"{name.decode()}/ exists (reserved)")
        return self._entry(self.tree.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_translate(mutates=True, logs_change=True)
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._named(name)
        self._guard_virtual_parent(parent_inode, "create symlinks")
        self._guard_reserved(parent_inode, name, "create it")
        return self._entry(self.tree.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_translate(mutates=True, logs_change=True)
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._named(new_name)
        if inode in self.virtual:
            raise NotPermitted("cannot hard-link a virtual node")
        self._guard_virtual_parent(new_parent_inode, "create links")
        self._guard_reserved(new_parent_inode, new_name, "create it")
        return self._entry(self.tree.link(inode, new_parent_inode, new_name))

    @_translate(mutates=True, logs_change=True)
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._named(name)
        vdir = self._virtual_dir(parent_inode)
        if vdir is not None:
            await vdir.unlink(name)
            return
        self._guard_reserved(parent_inode, name, "remove it")
        self.tree.unlink(parent_inode, name)

    @_translate(mutates=True, logs_change=True)
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._named(name)
        vdir = self._virtual_dir(parent_inode)
        if vdir is not None:
            await vdir.rmdir(name)
            return
        self._guard_reserved(parent_inode, name, "remove it")
        self.tree.rmdir(parent_inode, name)

    @_translate(mutates=True, logs_change=True)
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        self._named(name_old, name_new)
        vdir_old, vdir_new = self._virtual_dir(parent_inode_old), self._virtual_dir(parent_inode_new)
        if vdir_old is not None and vdir_new is not None:
            await vdir_old.rename(name_old, vdir_new, name_new, flags)
            return
        if vdir_old is not None or vdir_new is not None:
            raise CrossDevice("rename between a kind directory and the POSIX tree: copy instead")
        self._guard_reserved(parent_inode_old, name_old, "rename it")
        self._guard_reserved(parent_inode_new, name_new, "replace it")
        self.tree.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # --- files --------------------------------------------------------------------------

    @_translate(mutates=False)
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode in self.virtual:
            node = self.virtual.get(inode)
            if not isinstance(node, VirtualFile):
                raise NotPermitted("not a file")
            node.check_open(flags)
            vhandle = await node.open(flags, ctx.pid)
            vhandle.opened_by(ctx.uid, ctx.gid)
            vhandle.inputs = self.virtual.inputs
            fh = self._new_fh(Handle(inode, virtual=True, vhandle=vhandle, kind=vhandle.kind))
            return _file_info(fh, vhandle.direct_io, vhandle.keep_cache, _reads_only(flags) or not vhandle.flushes)
        if flags & os.O_TRUNC and self.degraded:
            raise ReadOnly("the mount is degraded (read-only) after an internal error")
        writable = await self.tree.open(inode, flags)
        fh = self._new_fh(Handle(inode, virtual=False, writable=writable, kind=self.tree.kind_of(inode)))
        # The kernel page cache stays valid across opens: every change to a tree file
        # passes through this kernel, which updates or drops its pages itself.
        return _file_info(fh, _write_only(flags), True, _reads_only(flags) and not writable)

    @_translate(mutates=True)
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._named(name)
        vdir = self._virtual_dir(parent_inode)
        if vdir is not None:
            node, vhandle = await vdir.create(name, mode, flags, ctx.pid)
            vhandle.inputs = self.virtual.inputs
            fh = self._new_fh(Handle(node.ino, virtual=True, vhandle=vhandle, kind=vhandle.kind))
            info = pyfuse3.FileInfo(fh=fh, direct_io=vhandle.direct_io, keep_cache=vhandle.keep_cache)
            return info, self._virtual_entry(node)
        self._guard_reserved(parent_inode, name, "create it")
        inode = self.tree.create(parent_inode, name, mode, ctx.uid, ctx.gid)
        kind = self.tree.kind_of(inode.ino)
        fh = self._new_fh(Handle(inode.ino, virtual=False, writable=True, kind=kind))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=_created_direct(flags, kind)), self._entry(inode)

    @_translate(mutates=False)
    async def read(self, fh: int, off: int, size: int) -> ReadReply:  # type: ignore[override]
        handle = self._handles[fh]
        started = time.perf_counter()
        data: ReadReply
        if handle.vhandle is not None:
            data = await handle.vhandle.read(off, size)  # a list of pieces only where READ_PIECES allows
        else:
            data = await self.tree.read(handle.ino, off, size)
        nbytes = sum(map(len, data)) if isinstance(data, list) else len(data)
        self.metrics.transferred(handle.kind, "read", nbytes, started)
        return data

    @_translate(mutates=True)
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handles[fh]
        started = time.perf_counter()
        if handle.vhandle is None:
            written = await self.tree.write(handle.ino, off, buf)  # close and fsync report what the log holds
        else:
            try:
                written = await handle.vhandle.write(off, buf)
            except DistorefsError as exc:
                handle.write_errno = exc.errno  # refused input: reported again at every close of this open
                raise
        self.metrics.transferred(handle.kind, "write", written, started)
        return written

    @_translate(mutates=True)
    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) on a tree file (pyfuse3 built with scripts/pyfuse3-fallocate.patch;
        stock pyfuse3 never calls it, and the kernel answers EOPNOTSUPP). Mode 0 (what
        `posix_fallocate`, `fallocate -l` and `rsync --preallocate` use) makes the file at
        least `offset + length` long; KEEP_SIZE alone changes nothing; PUNCH_HOLE (with
        KEEP_SIZE, as Linux requires) and ZERO_RANGE make the range within the file read
        as zeros (whole blocks become holes), the kernel dropping its cached pages of it.
        The bytes are not reserved on the disk (a log has no place to reserve them in): a
        later write can still get ENOSPC. Other modes (COLLAPSE_RANGE, INSERT_RANGE,
        UNSHARE_RANGE) are EOPNOTSUPP; docs/design.md, "fallocate"."""
        handle = self._handles[fh]
        if handle.virtual:
            raise NotSupported("fallocate: control files and kinds' files hold no bytes to allocate")
        if mode & ~FALLOCATE_MODES or (mode & FALLOC_FL_PUNCH_HOLE and mode & FALLOC_FL_ZERO_RANGE):
            raise NotSupported(f"fallocate mode {mode:#x}: supported are 0, KEEP_SIZE, PUNCH_HOLE and ZERO_RANGE")
        if offset < 0 or length <= 0:
            raise InvalidArgument(f"fallocate of {length} bytes at {offset}")
        end = offset + length
        if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
            await self.tree.zero_range(handle.ino, offset, end)
        if not mode & FALLOC_FL_KEEP_SIZE and end > self.tree.get(handle.ino).size:
            await self.tree.setattr(handle.ino, size=end)
        await scheduling.checkpoint()

    @_translate(mutates=False)
    async def flush(self, fh: int) -> None:
        handle = self._handles[fh]
        if handle.vhandle is not None:
            await handle.vhandle.flush()
        elif not self.degraded:
            await self.tree.close(handle.ino, handle.writable)
        if handle.write_errno:  # sticky: numpy writes through a dup and ignores that close
            raise pyfuse3.FUSEError(handle.write_errno)

    @_translate(mutates=False)
    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handles[fh]
        if handle.vhandle is not None:
            await handle.vhandle.fsync()
        elif not handle.virtual:
            await self.tree.fsync(handle.ino)

    @_translate(mutates=False)
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        if handle.vhandle is not None:
            await handle.vhandle.release()
        else:
            self.tree.release(handle.ino, handle.writable)

    # --- directories --------------------------------------------------------------------

    @_translate(mutates=False)
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> FileHandle:
        vdir = self._virtual_dir(inode)
        if vdir is not None:
            listing = vdir.listing()
            held = listing.held_bytes if isinstance(listing, PositionListing) else 0  # items/: 16 bytes an item
            self.virtual.listings.take(held, lambda: f"a listing of {vdir.name.decode(errors='replace')}/")
            return self._new_fh(Handle(inode, virtual=True, listing=listing, listing_bytes=held))
        prefix = [(b".", inode), (b"..", self.tree.parent_of(inode))]  # `ls -a` shows them
        if inode == ROOT_INODE:
            prefix += [(name, node.ino) for name, node in self.virtual.root_nodes.items()]
        # (the tree's listing is shared, not copied: readdir skips a tree entry that a kind
        # of the root would shadow)
        return self._new_fh(Handle(inode, virtual=False, prefix=prefix, entries=self.tree.entries(inode)))

    @_translate(mutates=False)
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._handles[fh]
        if handle.listing is not None:
            self._readdir_virtual(handle.ino, handle.listing, start_id, token)
            return
        prefix, entries = handle.prefix, handle.entries
        shadowed = self.virtual.root_nodes if handle.ino == ROOT_INODE else {}
        for position in range(start_id, len(prefix) + len(entries)):
            name, ino = prefix[position] if position < len(prefix) else entries[position - len(prefix)]
            if position >= len(prefix) and name in shadowed:
                continue
            if ino in self.virtual:
                try:
                    attrs = self._virtual_attrs(self.virtual.get(ino))
                except DistorefsError:
                    continue  # left since opendir (an item sampled away)
                if not pyfuse3.readdir_reply(token, name, attrs, position + 1):
                    return
                continue
            if ino not in self.tree:
                continue  # removed since opendir
            if not pyfuse3.readdir_reply(token, name, self._attrs(self.tree.get(ino)), position + 1):
                return
            if name not in (b".", b".."):  # the kernel takes no lookup reference for the dots
                self.tree.ref(ino)  # readdirplus hands the kernel a lookup reference

    def _readdir_virtual(
        self, dir_ino: int, listing: Sequence[tuple[bytes, int, int, int]], start_id: int, token: pyfuse3.ReaddirToken
    ) -> None:
        # One attributes object (owner, times, cache times from the directory's kind),
        # refilled per entry: readdir_reply copies it at once, so a million items list
        # without a million node lookups.
        vdir = self.virtual.get(dir_ino)
        attr = self._virtual_attrs(vdir)
        counts = False
        if isinstance(vdir, VirtualDir):
            attr.entry_timeout = attr.attr_timeout = vdir.child_cache_s
            counts = vdir.counts_lookups
        owners_vary = isinstance(vdir, KindDirectory)  # each buffer, model, dataset has its own
        base_owner = attr.st_uid, attr.st_gid
        for position in range(start_id, len(listing)):
            name, ino, mode, size = listing[position]
            if owners_vary:
                node = self.virtual.nodes.get(ino)
                found = node.permissions() if node is not None else None
                attr.st_uid, attr.st_gid = base_owner if found is None else (found[1], found[2])
            attr.st_ino = ino
            attr.st_mode = mode
            attr.st_size = size
            attr.st_blocks = (size + 511) // 512
            attr.st_nlink = 2 if stat.S_ISDIR(mode) else 1
            if not pyfuse3.readdir_reply(token, name, attr, position + 1):
                return
            if counts:
                node = self.virtual.nodes.get(ino)
                if node is not None:
                    node.looked_up(1)

    @_translate(mutates=False)
    async def releasedir(self, fh: int) -> None:
        self.virtual.listings.give(self._handles.pop(fh).listing_bytes)

    @_translate(mutates=False)
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.tree.sync_all()

    # --- xattrs -------------------------------------------------------------------------

    @_translate(mutates=True, logs_change=True)
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        if inode in self.virtual:
            raise ReadOnly("virtual nodes take no attributes")
        if name == ADOPT_XATTR:
            await self._adopt(inode, value, ctx)
            return
        await self.tree.setxattr(inode, name, value)

    async def _adopt(self, ino: int, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        """A staged file's close (`client.staged_open`): the caller's sealed memfd becomes
        the file's content. The kernel has checked that the caller may write the file
        (user.* attributes need write permission); the memfd must be the caller's own."""
        started = time.perf_counter()
        view = borrow_sealed(ctx.pid, parse_fd(value), ctx.uid)
        await self.tree.adopt(ino, view)
        self.metrics.transferred(self.tree.kind_of(ino), "adopt", len(view), started)

        # the kernel's size and pages of the file are stale now
        await trio.to_thread.run_sync(kernel.invalidate, ino, False)

    @_translate(mutates=False)
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode in self.virtual:
            return await self.virtual.get(inode).getxattr(name, ctx.uid)
        return self.tree.getxattr(inode, name)

    @_translate(mutates=False)
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        if inode in self.virtual:
            return []
        return self.tree.listxattr(inode)

    @_translate(mutates=True, logs_change=True)
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        if inode in self.virtual:
            raise ReadOnly("virtual nodes take no attributes")
        self.tree.removexattr(inode, name)
