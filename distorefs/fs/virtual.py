"""Virtual nodes: `.distore/` control files and the reserved kind directories.

Owns the nodes that are not files of the POSIX tree: their inode numbers (from
VIRTUAL_BASE up, far above the tree's), their attributes and their contents. A control
file renders its bytes when it is opened, so one open reads one consistent snapshot.

This is the virtual-node framework every kind plugs into: `buffers/`, `weights/` and
`datasets/` are KindDirectory nodes that the daemon installs at their reserved root names,
each supplying its own children and control files (fs/buffers.py, fs/weights.py,
fs/datasets.py).
"""

from __future__ import annotations

import enum
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Self, TypeAlias, overload

import pyfuse3

from distorefs import __version__, scheduling
from distorefs.errors import (
    DistorefsError,
    FileTooLarge,
    InvalidArgument,
    IsADirectory,
    NoSuchAttribute,
    NotFound,
    NotPermitted,
    OutOfMemory,
    ReadOnly,
)
from distorefs.ids import VIRTUAL_BASE
from distorefs.stores.files import ROOT_INODE, FileStore
from distorefs.stores.owners import Owner, OwnerTable
from distorefs.stores.replay.formats import BlobStream, RecordStream
from distorefs.tiers.blocks import BlockStore


@dataclass(frozen=True)
class MountInfo:
    """Facts about this daemon that `.distore/status` reports."""

    pid: int
    data_dir: str
    mountpoint: str
    started_ns: int


class Access(enum.Enum):
    """What using a node inside an owned directory (a buffer's, model's or dataset's)
    means, and so which of that directory's permission bits the node shows."""

    READ = "read"  # reading shows state: the directory's r bits
    WRITE = "write"  # writing changes state: its w bits
    READ_WRITE = "read-write"  # both
    CHANGES_ON_READ = "changes-on-read"  # reading changes state (sample): readable where the directory is writable
    CHANGES_ON_READ_WRITE = "changes-on-read-write"  # the same, and written to (sample.shm): read and write bits
    DIRECTORY = "directory"  # a subdirectory (items/, records/): the directory's own bits


def derived_bits(dir_bits: int, access: Access) -> int:
    """The permission bits a node with `access` shows inside a directory with `dir_bits`."""
    read, write = dir_bits & 0o444, dir_bits & 0o222
    if access is Access.READ:
        return read
    if access is Access.WRITE:
        return write
    if access is Access.READ_WRITE:
        return read | write
    if access is Access.CHANGES_ON_READ:
        return write << 1
    if access is Access.CHANGES_ON_READ_WRITE:
        return (write << 1) | write
    return dir_bits & 0o777


class VirtualNode:
    """A node that is not a file of the POSIX tree. `size` is what stat shows.

    A node inside an owned directory follows that directory's owner and mode
    (`govern`): its uid and gid are the directory's, its permission bits derive from the
    directory's by its Access, so chmod and chown of a buffer's directory decide who may
    sample, append or read (the kernel checks, with default_permissions)."""

    # How long the kernel may cache this node's entry and attributes. Control files: 0
    # (their content changes behind the kernel's back). Kinds with stable nodes raise it.
    cache_s: float | None = None
    # How long the kernel may cache the entry naming this node, when that differs.
    entry_cache_s: float | None = None

    def __init__(self, ino: int, name: bytes, mode: int) -> None:
        self.ino = ino
        self.name = name
        self.mode = mode
        self.mtime_ns = time.time_ns()
        self.governor: VirtualDir | None = None
        self.access = Access.READ

    def govern(self, governor: VirtualDir, access: Access) -> Self:
        """Follow `governor`'s owner and mode with `access`; returns self."""
        self.governor, self.access = governor, access
        return self

    def permissions(self) -> tuple[int, int, int] | None:
        """(permission bits, uid, gid), or None: the mount root's owner and `mode`."""
        if self.governor is None:
            return None
        found = self.governor.permissions()
        if found is None:
            return None
        bits, uid, gid = found
        return derived_bits(bits, self.access), uid, gid

    def effective_mode(self) -> int:
        found = self.permissions()
        return self.mode if found is None else stat.S_IFMT(self.mode) | found[0]

    async def getxattr(self, name: bytes, uid: int) -> bytes:
        """An extended attribute (the kernel checked that `uid` may read the node);
        virtual nodes have none unless a kind says otherwise."""
        await scheduling.checkpoint()
        raise NoSuchAttribute(f"{self.name.decode(errors='replace')} has no attribute {name.decode(errors='replace')}")

    def child_bits(self, access: Access, default: int) -> int:
        """The permission bits a child with `access` shows inside this node (`default` when
        it follows no owner): for listings that make no node per entry."""
        found = self.permissions()
        return default if found is None else derived_bits(found[0], access)

    @property
    def size(self) -> int:
        return 0

    def looked_up(self, count: int) -> None:
        """The kernel took (count > 0) or dropped (forget, count < 0) lookup references.
        Nodes whose lifetime depends on them (versions of weights files) count them."""


class Allowance:
    """Bytes that open virtual files hold, mount-wide, at most `limit`: batches kept for
    their opens (buffers' sample files), input not applied yet (a .npy of priorities
    arriving in pieces, a record or frame cut between writes), listings (`items/`). Past
    it, ENOMEM for the request that would pass it, with nothing applied or counted:
    without it, one process holding many descriptors could make the daemon hold any
    amount of memory."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.held = 0

    def take(self, nbytes: int, label: Callable[[], str]) -> int:
        """Count `nbytes` more, or ENOMEM (nothing counted) when they would pass the limit
        (`label()` names the holder in its message)."""
        if nbytes > 0 and self.held + nbytes > self.limit:
            raise OutOfMemory(
                f"{label()} of {nbytes} bytes: {self.what} of {self.held} bytes already, and together they may"
                f" hold {self.limit} (the DRAM budget); close some"
            )
        self.held += nbytes
        return nbytes

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


UNBOUNDED = Allowance(sys.maxsize, "unbounded")  # a handle's until the fs layer gives it the mount's

# A read's reply: one buffer, or a list of them whose bytes are the reply in order, which
# pyfuse3 built with scripts/pyfuse3-read-pieces.patch (scripts/setup.sh does) writes to
# the kernel in one writev, with no copy here (fuse_reply_iov; docs/design.md, "A stream's
# READs in pieces"). READ_PIECES is the most pieces a reply may have: 0 with stock pyfuse3,
# which takes one buffer only.
ReadReply: TypeAlias = bytes | bytearray | memoryview | list[bytes | memoryview]
READ_PIECES = int(getattr(pyfuse3, "READ_PIECES_MAX", 0)) if getattr(pyfuse3, "READ_PIECES", False) else 0


class VirtualHandle:
    """One open of a virtual file. Reads and writes go here; `direct_io` means every read
    reaches the daemon (control files have size 0 and are read to EOF)."""

    direct_io = True
    keep_cache = False  # True only where the node's bytes never change (weights versions)
    kind = "control"  # for metrics: which kind of file this opens (each kind's handles say)
    # False: a close of this open has nothing to finish or report, so the kernel is told
    # to send no FLUSH (one round trip fewer; ops._file_info)
    flushes = True
    inputs = UNBOUNDED  # input it holds not applied yet counts here (ops sets the mount's)
    _input_held = 0  # of it, this open's

    def input_label(self) -> str:
        """What its held input is, for an ENOMEM's message."""
        return "a control file's input"

    def hold_input(self, now: int, drop: Callable[[], None]) -> None:
        """This open now holds `now` bytes of input not applied yet (0: none, at its
        release). ENOMEM when more does not fit in `inputs`: then `drop()` lets the input
        go and nothing of it stays counted."""
        held = self._input_held
        if now == held:  # (the usual: nothing held before or after a write)
            return
        if now > held:
            try:
                self.inputs.take(now - held, self.input_label)
            except OutOfMemory:
                drop()
                self.inputs.give(held)
                self._input_held = 0
                raise
        else:
            self.inputs.give(held - now)
        self._input_held = now

    async def read(self, offset: int, size: int) -> ReadReply:
        await scheduling.checkpoint()
        return b""

    async def fsync(self) -> None:
        await scheduling.checkpoint()

    def opened_by(self, uid: int, gid: int) -> None:
        """Who opened it, from the FUSE request (not from anything the client says)."""

    async def write(self, offset: int, data: bytes) -> int:
        raise ReadOnly("this file is read-only")

    def truncate(self) -> None:
        """truncate(0) through this open (O_TRUNC without atomic_o_trunc): nothing by default."""

    async def flush(self) -> None:
        await scheduling.checkpoint()

    async def release(self) -> None:
        await scheduling.checkpoint()


class AppendStreamHandle(VirtualHandle):
    """An open of an `append` file (a buffer's, a dataset's): its records or frames are
    parsed as they stream in (`_stream`), and what is not complete yet is held, counted
    in `inputs` until it completes or the open is released."""

    _stream: RecordStream | BlobStream

    def _follow_stream(self) -> None:
        """Count what the stream holds of records not complete yet (ENOMEM, the partial
        input dropped, when it does not fit)."""
        self.hold_input(self._stream.pending_bytes, self._stream.reset)

    async def release(self) -> None:
        await scheduling.checkpoint()
        self._stream.reset()
        self._follow_stream()


class RenderedHandle(VirtualHandle):
    """Serves bytes rendered once at open, so one open reads one consistent snapshot."""

    def __init__(self, content: bytes) -> None:
        self.content = content

    async def read(self, offset: int, size: int) -> bytes:
        await scheduling.checkpoint()
        return self.content[offset : offset + size]


CONFIG_INPUT_BYTES = 1 << 20  # a config write, whole


def json_object(label: str, pending: bytes | bytearray) -> dict[str, Any] | None:
    """The JSON object `pending` holds once it is complete, else None (wait for more).
    Parsed only when it ends with `}`, so input that never completes costs one cheap check
    per write. EINVAL for JSON that is not an object or nests too deeply."""
    text = bytes(pending).strip()
    if not text.endswith(b"}"):
        return None
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidArgument(f"{label}: the JSON nests too deeply") from None
    except ValueError:
        return None  # not complete yet (or not JSON: the close will say)
    if not isinstance(value, dict):
        raise InvalidArgument(f"{label}: a config must be a JSON object, got {type(value).__name__}")
    return value


class WholeInputHandle(RenderedHandle):
    """A control file whose writes accumulate until they form a complete input, which
    then applies whole or not at all; what is left incomplete at a close is EINVAL, and
    input beyond `max_input_bytes` that never completed is EFBIG (nothing of it applies).
    Refusals are also passed to `record` (a store's recent errors, shown in `stats`)."""

    incomplete = "input ended incomplete; not applied"
    max_input_bytes = CONFIG_INPUT_BYTES

    def __init__(self, label: str, record: Callable[[str], None], content: bytes = b"") -> None:
        super().__init__(content)
        self.label = label
        self._record = record
        self._pending = bytearray()
        self.applied = False  # an input applied since the last flush (what a flush may persist)

    def recorded(self, exc: DistorefsError) -> DistorefsError:
        self._record(exc.message)
        return exc

    async def _apply_if_complete(self, pending: bytearray) -> bool:
        """Apply `pending` if it is a complete input (raise to refuse it); False: wait."""
        raise NotImplementedError

    async def write(self, offset: int, data: bytes) -> int:
        await scheduling.checkpoint()
        if len(self._pending) + len(data) > self.max_input_bytes:
            self._drop_pending()
            raise self.recorded(
                FileTooLarge(f"{self.label}: input of more than {self.max_input_bytes} bytes; none of it applied")
            )
        self._pending += data
        try:
            complete = await self._apply_if_complete(self._pending)
        except DistorefsError as exc:
            self._drop_pending()
            raise self.recorded(exc) from None
        if complete:
            self._drop_pending()
            self.applied = True
        else:  # held until more comes: counted (a complete input, the usual case, never is)
            self.hold_input(len(self._pending), self._pending.clear)
        return len(data)

    def input_label(self) -> str:
        return f"{self.label}: input"

    def _drop_pending(self) -> None:
        self._pending.clear()
        if self._input_held:
            self.hold_input(0, self._pending.clear)

    async def flush(self) -> None:
        await scheduling.checkpoint()
        refused = self._end_of_input()
        if refused is not None:
            raise refused

    def _end_of_input(self) -> DistorefsError | None:
        """At a close: the refusal of an input left incomplete (recorded), or None; what
        was pending is let go either way."""
        size, incomplete = len(self._pending), bool(bytes(self._pending).strip())
        self._drop_pending()
        return self.recorded(InvalidArgument(f"{self.label}: {self.incomplete} ({size} bytes)")) if incomplete else None

    async def release(self) -> None:
        await scheduling.checkpoint()
        self._drop_pending()


Entry = tuple[bytes, int, int, int]  # a listing's (name, inode, mode, size)


class PositionListing(Sequence[Entry]):
    """A directory's listing for readdir whose entries are made as readdir reaches them
    (`_entry`), for kinds with many (a dataset's records, a buffer's items): a list of
    them made at every opendir held about 100 bytes an entry per open."""

    held_bytes = 0  # memory this open's listing keeps (counted in the mount's `listings`)

    def __init__(self, count: int) -> None:
        self._count = count

    def __len__(self) -> int:
        return self._count

    def _entry(self, position: int) -> Entry:
        raise NotImplementedError

    @overload
    def __getitem__(self, position: int) -> Entry: ...
    @overload
    def __getitem__(self, position: slice) -> Sequence[Entry]: ...
    def __getitem__(self, position: int | slice) -> Entry | Sequence[Entry]:
        if isinstance(position, slice):
            return [self._entry(i) for i in range(*position.indices(self._count))]
        if not -self._count <= position < self._count:
            raise IndexError(position)
        return self._entry(position % self._count)


class VirtualFile(VirtualNode):
    """A file whose opens get handles from `open`.

    `snapshot`, where set, renders what a read of the file returns now: its length is the
    file's size, so copy tools that read `st_size` bytes (tar, rsync) take it whole.
    `acts_on_read` marks files whose reading changes state or waits (`sample`, `wait`,
    `stream`): an open with O_NOFOLLOW, which is how cp -a, tar and rsync open every
    file, is refused with EPERM, so a copy of a directory never draws a batch or hangs.
    """

    writable = False
    snapshot: Callable[[], bytes] | None = None
    acts_on_read = False

    @property
    def size(self) -> int:
        return 0 if self.snapshot is None else len(self.snapshot())

    def check_open(self, flags: int) -> None:
        """EPERM for a copy tool's open of a file that acts when read."""
        if self.acts_on_read and flags & os.O_NOFOLLOW:
            raise NotPermitted(
                f"{self.name.decode(errors='replace')} acts when read (it draws, waits or streams), and an"
                " O_NOFOLLOW open is a copy tool's (cp -a, tar, rsync): back up with the documented commands"
            )

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        raise NotImplementedError

    def truncate(self) -> None:
        """O_TRUNC or truncate(0): allowed on writable control files (a no-op there)."""
        if not self.writable:
            raise ReadOnly(f"{self.name.decode()} is read-only")

    async def resize(self, size: int, handle: VirtualHandle | None) -> None:
        """truncate/ftruncate to `size` (through `handle` when the caller has one open)."""
        await scheduling.checkpoint()
        if size != 0:
            raise ReadOnly(f"{self.name.decode()} can only be truncated to 0")
        self.truncate()
        if handle is not None:
            handle.truncate()


class ControlFile(VirtualFile):
    """A read-only file of size 0 whose content is rendered per open (like /proc)."""

    def __init__(self, ino: int, name: bytes, render: Callable[[], bytes]) -> None:
        super().__init__(ino, name, stat.S_IFREG | 0o444)
        self.render = render
        self.snapshot = render

    async def open(self, flags: int, pid: int) -> VirtualHandle:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise ReadOnly(f"{self.name.decode()} is read-only")
        await scheduling.checkpoint()
        return RenderedHandle(self.render())


class VirtualDir(VirtualNode):
    """A directory of virtual nodes. Kinds override lookup/entries and the changes."""

    # Cache time readdir gives the entries it lists (0: control files).
    child_cache_s: float = 0.0
    # Names that reach another entry, not listed (np.save adds .npy to a path that lacks it)
    aliases: dict[bytes, bytes] = {}
    # Whether readdir replies hand the kernel lookup references the children count.
    counts_lookups = False

    def __init__(self, ino: int, name: bytes, mode: int = stat.S_IFDIR | 0o555) -> None:
        super().__init__(ino, name, mode)
        self.children: dict[bytes, VirtualNode] = {}
        self._owned: tuple[OwnerTable, bytes, Owner] | None = None  # table, kind, default owner

    def own(self, owners: OwnerTable, kind: bytes, default: Owner) -> None:
        """This directory is a named object of `kind`: chmod and chown apply to it, kept
        in `owners` under its name (`default` until someone sets one)."""
        self._owned = (owners, kind, default)

    @property
    def owned(self) -> bool:
        return self._owned is not None

    def owner(self) -> Owner:
        assert self._owned is not None
        owners, kind, default = self._owned
        return owners.get(kind, self.name) or default

    def set_owner(self, uid: int | None, gid: int | None, mode: int | None) -> None:
        """chown / chmod of an owned directory (the kernel checked who may)."""
        assert self._owned is not None
        owners, kind, _default = self._owned
        now = self.owner()
        owners.set(
            kind,
            self.name,
            Owner(
                now.uid if uid is None else uid,
                now.gid if gid is None else gid,
                now.mode if mode is None else stat.S_IMODE(mode),
            ),
        )

    def permissions(self) -> tuple[int, int, int] | None:
        if self._owned is None:
            return super().permissions()
        owner = self.owner()
        return owner.mode, owner.uid, owner.gid

    def lookup(self, name: bytes) -> VirtualNode:
        node = self.children.get(self.aliases.get(name, name))
        if node is None:
            raise NotFound(f"no entry {name.decode(errors='replace')!r} in {self.name.decode()}/")
        return node

    def lookup_from(self, name: bytes, pid: int) -> VirtualNode:
        """A LOOKUP from the kernel on behalf of thread `pid` (a directory may answer a
        process it asked to look again differently: weights/<model>/)."""
        return self.lookup(name)

    def entries(self) -> list[tuple[bytes, int]]:
        """(name, inode) of each entry."""
        return [(name, node.ino) for name, node in self.children.items()]

    def listing(self) -> Sequence[tuple[bytes, int, int, int]]:
        """(name, inode, mode, size) of each entry, for readdir: kinds with many entries
        compute these in bulk (or per position, on demand) instead of one node at a time."""
        out = []
        for name, ino in self.entries():
            node = self.children.get(name)
            if node is not None:
                out.append((name, ino, node.effective_mode(), node.size))
        return out

    def refuse(self, what: str) -> ReadOnly:
        """EROFS for a change this directory does not take, with the real cause: it holds
        only the files its kind defines (the mount itself stays writable)."""
        names = ", ".join(name.decode(errors="replace") for name in list(self.children)[:8])
        holds = f" (it holds {names})" if names else ""
        return ReadOnly(f"{self.name.decode(errors='replace')}/ cannot {what}{holds}; the mount is not read-only")

    async def mkdir(self, name: bytes, mode: int) -> VirtualNode:
        raise self.refuse("create directories")

    async def rmdir(self, name: bytes) -> None:
        raise self.refuse("remove directories")

    async def unlink(self, name: bytes) -> None:
        raise self.refuse("remove files")

    async def create(self, name: bytes, mode: int, flags: int, pid: int) -> tuple[VirtualNode, VirtualHandle]:
        raise self.refuse("create files")

    async def rename(self, name: bytes, new_parent: VirtualDir, new_name: bytes, flags: int) -> None:
        raise self.refuse("rename entries")


class KindDirectory(VirtualDir):
    """A reserved top-level directory whose contents a store kind supplies. Its mode is
    1777, as /tmp's: any user may make a buffer, model or dataset there, owns what they
    make, and only its owner (or root) may remove it."""

    KIND_MODE = stat.S_IFDIR | 0o1777


class NamedDir(VirtualDir):
    """The directory of one named store object (a buffer, a dataset)."""

    def forget_nodes(self) -> None:
        """Unregister this directory and every node made under it."""
        raise NotImplementedError


class NamedKindDirectory(KindDirectory):
    """A kind directory of named store objects (`buffers/`, `datasets/`): a NamedDir per
    object, made at first lookup, and made again when the store holds another object
    under the name (another node removed and made it again). Subclasses say how to
    list, get (NotFound once gone) and present an object, and do mkdir and rmdir."""

    child_cache_s = 1.0  # the objects' directories

    def __init__(self, tree: VirtualTree, name: bytes) -> None:
        super().__init__(tree.new_ino(), name, self.KIND_MODE)
        self._tree = tree
        self._dirs: dict[str, tuple[object, NamedDir]] = {}

    def _names(self) -> list[str]:
        raise NotImplementedError

    def _object(self, name: str) -> object:
        raise NotImplementedError

    def _make_dir(self, obj: Any) -> NamedDir:
        raise NotImplementedError

    def _dir(self, name: str) -> NamedDir:
        obj = self._object(name)  # NotFound once gone (also when another node removed it)
        held = self._dirs.get(name)
        if held is not None and held[0] is obj:
            return held[1]
        if held is not None:
            held[1].forget_nodes()
        node = self._make_dir(obj)
        self._dirs[name] = (obj, node)
        self._tree.register(node)
        return node

    def _forget(self, name: str) -> None:
        """The object `name` was removed here: drop its nodes."""
        held = self._dirs.pop(name, None)
        if held is not None:
            held[1].forget_nodes()

    def lookup(self, name: bytes) -> VirtualNode:
        return self._dir(name.decode(errors="surrogateescape"))

    def entries(self) -> list[tuple[bytes, int]]:
        return [(name.encode(errors="surrogateescape"), self._dir(name).ino) for name in self._names()]

    def listing(self) -> list[tuple[bytes, int, int, int]]:
        names = self._names()
        return [(n.encode(errors="surrogateescape"), (d := self._dir(n)).ino, d.effective_mode(), 0) for n in names]

    async def unlink(self, name: bytes) -> None:
        await scheduling.checkpoint()
        kind = self.name.decode()
        raise IsADirectory(f"{kind}/{name.decode(errors='replace')} is a directory: use rmdir or rm -r")


class VirtualTree:
    """The virtual nodes by inode, and the names they reserve at the root."""

    def __init__(self, info: MountInfo, files: FileStore, blocks: BlockStore, owners: OwnerTable) -> None:
        self.owners = owners
        self._next = VIRTUAL_BASE
        self._resolvers: list[tuple[int, int, Callable[[int], VirtualNode]]] = []
        # Set by the fs layer: degraded only after an internal invariant broke (the store's
        # state may be corrupt); other unexpected errors fail their request and are counted.
        self.degraded = False
        self.degraded_reason = ""
        self.internal_errors = 0
        self.last_internal_error = ""
        self.nodes: dict[int, VirtualNode] = {}
        self.root_nodes: dict[bytes, VirtualNode] = {}
        self._info = info
        self._status_parts: list[Callable[[], dict[str, Any]]] = []
        self._files = files
        self._blocks = blocks
        # What open descriptors hold, each kind bounded by the DRAM budget: input not
        # applied yet, batches kept for their opens (the kernel may drop the pages it was
        # given, and a read must then find the same batch), listings of many entries
        self.inputs = Allowance(blocks.dram_budget_bytes, "open control files hold input not applied yet")
        self.batches = Allowance(blocks.dram_budget_bytes, "open sample files hold batches")
        self.listings = Allowance(blocks.dram_budget_bytes, "open directories hold listings")
        # batches drawn for opens still to come (fs/buffers.py): an eighth of the budget,
        # apart, so that they never take the room of batches open files hold
        self.aheads = Allowance(blocks.dram_budget_bytes // 8, "batches drawn ahead")
        self.after_reply = scheduling.AfterReply()  # (fs/ops.py runs it)
        control = self._add_root(VirtualDir(self.new_ino(), b".distore"))
        assert isinstance(control, VirtualDir)
        self._add_child(control, ControlFile(self.new_ino(), b"status", self.render_status))
        self._add_child(control, ControlFile(self.new_ino(), b"version", self.render_version))

    def default_owner(self) -> Owner:
        """The owner of a named object nobody chowned: the mount root's, mode 0755."""
        root = self._files.get(ROOT_INODE)
        return Owner(root.uid, root.gid, 0o755)

    def new_ino(self) -> int:
        """A fresh inode number for a node that a kind creates (kept until unregistered)."""
        self._next += 1
        return self._next

    def register(self, node: VirtualNode) -> VirtualNode:
        self.nodes[node.ino] = node
        return node

    def unregister(self, ino: int) -> None:
        self.nodes.pop(ino, None)

    def add_resolver(self, low: int, high: int, resolve: Callable[[int], VirtualNode]) -> None:
        """Inodes in [low, high) are computed by `resolve` (nodes too many to keep, like items)."""
        self._resolvers.append((low, high, resolve))

    def add_control(self, name: bytes, render: Callable[[], bytes]) -> None:
        """A read-only file under `.distore/` rendered at each open."""
        control = self.root_nodes[b".distore"]
        assert isinstance(control, VirtualDir)
        self._add_child(control, ControlFile(self.new_ino(), name, render))

    def add_status(self, part: Callable[[], dict[str, Any]]) -> None:
        """Numbers a store adds to `.distore/status`."""
        self._status_parts.append(part)

    def install(self, kind: KindDirectory) -> None:
        """Put a kind at its reserved root name (each name once)."""
        assert kind.name not in self.root_nodes, f"{kind.name!r} is installed already"
        self._add_root(kind)

    def _add_root(self, node: VirtualNode) -> VirtualNode:
        self.nodes[node.ino] = node
        self.root_nodes[node.name] = node
        return node

    def _add_child(self, parent: VirtualDir, node: VirtualNode) -> None:
        self.nodes[node.ino] = node
        parent.children[node.name] = node

    def __contains__(self, ino: int) -> bool:
        return ino >= VIRTUAL_BASE

    def get(self, ino: int) -> VirtualNode:
        node = self.nodes.get(ino)
        if node is not None:
            return node
        for low, high, resolve in self._resolvers:
            if low <= ino < high:
                return resolve(ino)
        raise NotFound(f"no virtual inode {ino}")

    # --- renderers ----------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        blocks = self._blocks.statistics()
        files = self._files.statistics()
        st = self._blocks.disk_stats()
        parts: dict[str, int] = {}
        for part in self._status_parts:
            parts.update(part())
        return {
            "pid": self._info.pid,
            "version": __version__,
            "mountpoint": self._info.mountpoint,
            "data_dir": self._info.data_dir,
            "uptime_s": round((time.time_ns() - self._info.started_ns) / 1e9, 3),
            "dram_used_bytes": blocks.dram_used_bytes,
            "dram_budget_bytes": blocks.dram_budget_bytes,
            "dram_dirty_bytes": blocks.dram_dirty_bytes,
            "log_bytes": blocks.log_bytes,
            "log_live_bytes": blocks.log_live_bytes,
            "log_live_ratio": round(blocks.log_live_ratio, 4),
            "log_segments": blocks.log_segments,
            "files": files.files,
            "directories": files.directories,
            "symlinks": files.symlinks,
            "file_bytes": files.file_bytes,
            "disk_free_bytes": st.f_bavail * st.f_frsize,
            "degraded": self.degraded,
            "degraded_reason": self.degraded_reason,
            "internal_errors": self.internal_errors,
            "last_internal_error": self.last_internal_error,
            "held_input_bytes": self.inputs.held,  # input that open control files hold, not applied yet
            "held_batch_bytes": self.batches.held,  # batches that open sample files keep
            "held_ahead_bytes": self.aheads.held,  # batches drawn for the next opens of sample files
            "held_listing_bytes": self.listings.held,  # what open directories of many entries (items/) hold
            **parts,
            "blocks": asdict(blocks),
        }

    def render_status(self) -> bytes:
        return (json.dumps(self.status(), indent=2) + "\n").encode()

    def render_version(self) -> bytes:
        return f"distorefs {__version__}\n".encode()
