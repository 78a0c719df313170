"""CheckpointPolicy: the policy of files under `checkpoints/` (CheckFreq's two phases).

Owns what makes a checkpoint file differ from any other file of the tree: a write
returns once its bytes are in DRAM (as for every file), but a close does not wait for
the log. A background persister writes the files' blocks to the log in the order they
were first written, full blocks while a file is still open and the rest once it is
closed, then commits durably (log fsync'ed, metadata with synchronous=FULL). It also
owns each file's state (`dram`, `persisting`, `durable`), the bytes waiting to persist,
and retention (`user.distore.keep_last` on a directory keeps its newest N durable
checkpoints and removes older ones).

Crash rule: a checkpoint file that is not durable has a row in MetaDb's `ckpt_pending`
table, removed in the same durable commit that makes it durable. At start-up the files
still listed there died half-persisted (never acknowledged as durable): they are removed,
so no half-written file can claim to be durable.

Plain Python with no FUSE, and it sits behind the POSIX tree (stores/tree.py), which
reports opens, writes and closes of tree files here; it works on files only through the
FileStore, never on blocks. Entries that retention (or another node) removes are posted
to the `removed` outbox as (parent, name, inode): the fs layer follows it to tell the
kernel. In a cluster the Replicator given at construction copies files to other nodes.

Settings are xattrs on directories under checkpoints/ and apply to everything below;
the nearest directory that sets one wins. A setting is resolved once per directory and
cached until any setting or the shape of the tree under checkpoints/ changes.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import trio

from distorefs import scheduling
from distorefs.errors import (
    Busy,
    DistorefsError,
    FileTooLarge,
    InvalidArgument,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    StoreFull,
)
from distorefs.news import Outbox
from distorefs.stores.files import MAX_FILE_BYTES, ROOT_INODE, FileStore, check_name
from distorefs.tiers.metadb import MetaDb

log = logging.getLogger(__name__)

CHECKPOINTS = b"checkpoints"
STATE_XATTR = b"user.distore.state"
KEEP_XATTR = b"user.distore.keep_last"
SYNC_CLOSE_XATTR = b"user.distore.sync_close"
REPLICAS_XATTR = b"user.distore.replicas"
SETTING_XATTRS = frozenset({KEEP_XATTR, SYNC_CLOSE_XATTR, REPLICAS_XATTR})  # settings on directories
MAX_REPLICAS = 8
MAX_KEEP_LAST = 1_000_000
RETRY_S = 1.0
# Replicas travel in parts (docs/design.md, "Checkpoint replicas in parts"; the sender's
# part size is the cluster glue's, peers/core.py PART_BYTES, 32 MiB).
REPLICA_PART_MAX_BYTES = 64 << 20  # what a receiver takes
REPLICA_AHEAD_BYTES = 4 * REPLICA_PART_MAX_BYTES  # how far past the bytes received a part may start
MAX_PARTS_AHEAD = 16  # parts stored past a gap, waiting for it to fill
MAX_INCOMING_REPLICAS = 8  # transfers being received at once
REPLICA_FREE_MARGIN_BYTES = 256 << 20  # a replica may not leave its node's disk with less free
REPLICA_IDLE_S = 60.0  # a transfer with no part for this long is dropped (its sender is gone)
REPLACED_NOTICE_S = 1.0  # a commit waits this long at most for the kernel to drop the old entry (its timeout)
REPLICATE_TRIES = 3  # sends of a file that changes size while it is sent
REMEMBERED_COMMITS = 64  # commits answered again when a sender retries one


STEP_WORD = re.compile(rb"step[s]?[=_-]?(\d+)", re.IGNORECASE)
NUMBER = re.compile(rb"\d+")


def step_of(name: bytes) -> int | None:
    """The step number a checkpoint entry's name carries: the number after `step`
    (`epoch=3-step=400.ckpt` -> 400), else the last number in the name
    (`rl_model_replay_buffer_3000_steps.pkl` -> 3000, `checkpoint-500` -> 500); None
    when it has none."""
    found = STEP_WORD.search(name)
    if found is not None:
        return int(found.group(1))
    numbers = NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


ReadPart = Callable[[int, int], Awaitable[list[bytes | bytearray]]]  # a part, as slices


class Replicator(Protocol):
    """Copies a durable checkpoint file to other nodes (the daemon's cluster glue)."""

    async def replicate(self, path: bytes, mode: int, size: int, read: ReadPart, copies: int) -> None:
        """Return once `copies` other nodes hold `path` (its `size` bytes, taken part by
        part with `read(offset, nbytes)`, and its mode) durably; PeerUnavailable if not.
        `read` raises Busy when the file's size changed since the send began."""


@dataclass
class _Incoming:
    """A replica being received: its bytes go into a file in no directory until the
    commit names it (a daemon that dies first drops it at its next start)."""

    path: bytes
    ino: int
    size: int
    received: int = 0  # bytes from the start that have come with no gap
    ahead: dict[int, int] = field(default_factory=dict)  # parts stored past a gap: offset -> end
    last: float = 0.0  # trio.current_time() of the last part
    writers: int = 0  # parts being written now (or the commit's fsync)
    dropped: bool = False  # aborted, expired or failed: its file goes once no writer is left
    released: bool = False  # its file went


@dataclass
class _State:
    parent: int
    gen: int = 0  # bumps on every change
    durable_gen: int = 0  # the change the last durable commit covered
    writers: int = 0


class CheckpointPolicy:
    """Background persistence, states and retention of the files under `checkpoints/`.

    Examples:
        >>> ckpt = CheckpointPolicy.load(files, meta, sync_close=False)
        >>> ckpt.track(ino, parent)          # a file under checkpoints/ was looked up
        >>> ckpt.changed(ino)                # after each write
        >>> await ckpt.close(ino)            # returns at once; the persister takes over
        >>> ckpt.state(ino)
        'persisting'
    """

    def __init__(self, files: FileStore, meta: MetaDb, sync_close: bool, replicator: Replicator | None = None) -> None:
        self._files = files
        self._meta = meta
        self.sync_close = sync_close
        self.root = files.lookup(ROOT_INODE, CHECKPOINTS).ino
        self._states: dict[int, _State] = {}
        self._queue: dict[int, None] = {}  # files with changes to persist, in write order
        self._work = trio.Event()
        self.errors = 0
        self.last_error = ""
        self.removed_by_retention = 0
        self.removed = Outbox[tuple[int, bytes, int]]()  # (parent, name, ino) the daemon removed itself
        self.replicator = replicator
        self._settings: dict[tuple[int, bytes], tuple[int, str] | None] = {}  # resolved, see _setting
        self.replication_queue = Outbox[int]()  # closed files of replicas > 1 dirs, made durable
        self.replicated = 0
        self._incoming: dict[str, _Incoming] = {}  # transfer id -> replica being received
        self._committed: dict[str, int] = {}  # the last commits' transfer ids -> inode
        self.replicas_received = 0
        self.replicas_dropped = 0  # aborted by their sender, expired, or failed
        # directories made or removed under checkpoints/, for a cluster: ("made" | "removed", path)
        self.news = Outbox[tuple[str, bytes]]()

    @classmethod
    def load(
        cls, files: FileStore, meta: MetaDb, sync_close: bool, replicator: Replicator | None = None
    ) -> CheckpointPolicy:
        """Remove the checkpoint files that were not durable when the last daemon died."""
        try:
            files.lookup(ROOT_INODE, CHECKPOINTS)
        except DistorefsError:
            root = files.get(ROOT_INODE)
            files.mkdir(ROOT_INODE, CHECKPOINTS, 0o755, root.uid, root.gid)
        self = cls(files, meta, sync_close, replicator)
        dropped = 0
        for ino, _since in list(meta.rows("ckpt_pending")):
            meta.delete("ckpt_pending", (ino,))
            while (entry := files.find_entry(ino)) is not None:
                files.unlink(*entry)
                dropped += 1
        if dropped:
            log.warning("checkpoints: removed %d files that were not durable when the daemon stopped", dropped)
        self._track_tree(self.root)
        return self

    def _track_tree(self, directory: int) -> None:
        """Track every regular file under `directory` (start-up): each file under
        checkpoints/ answers `user.distore.state` from the first request on, whatever the
        kernel still caches about it. All survived start-up, so all are durable."""
        pending = [directory]
        while pending:
            parent = pending.pop()
            for _name, ino in self._files.entries(parent):
                inode = self._files.get(ino)
                if inode.is_dir:
                    pending.append(ino)
                elif inode.is_reg:
                    self.track(ino, parent)

    @property
    def files(self) -> FileStore:
        return self._files

    # --- what the fs layer reports ------------------------------------------------------

    def covers(self, directory: int) -> bool:
        return self._files.is_within(directory, self.root)

    def track(self, ino: int, parent: int) -> None:
        """A regular file `ino` was found in directory `parent` (lookup, create, rename)."""
        if self.covers(parent):
            state = self._states.get(ino)
            if state is None:
                self._states[ino] = _State(parent)
            else:
                state.parent = parent
        elif ino in self._states and self._states[ino].gen == self._states[ino].durable_gen:
            del self._states[ino]  # moved out of checkpoints/: an ordinary file again

    def tracks(self, ino: int) -> bool:
        return ino in self._states

    def opened(self, ino: int, writable: bool) -> None:
        """An open of a tree file (a no-op for files outside checkpoints/)."""
        state = self._states.get(ino)
        if writable and state is not None:
            state.writers += 1

    def released(self, ino: int, writable: bool) -> None:
        state = self._states.get(ino)
        if writable and state is not None:
            state.writers -= 1
            self._wake()

    def changed(self, ino: int) -> None:
        """Bytes or size of `ino` changed (in DRAM): it is not durable until persisted."""
        state = self._states[ino]
        if state.gen == state.durable_gen:
            self._mark_pending(ino)
        state.gen += 1
        self._queue[ino] = None
        self._wake()

    async def close(self, ino: int) -> None:
        """A close: at once, unless sync-close applies (mount option or the directory's
        `user.distore.sync_close`), where it returns when the file is durable."""
        if self.sync_close or self._sync_close_set(self._states[ino].parent):
            await self.fsync(ino)
        else:
            await scheduling.checkpoint()
            self._wake()

    async def fsync(self, ino: int) -> None:
        """Return once `ino`'s bytes and metadata are durable, here and, under a
        directory with `user.distore.replicas` = R > 1, on R - 1 other nodes (EIO if
        they cannot be reached within the peer timeout)."""
        await self._commit_durable([(ino, self._states[ino].gen)], lambda: self._files.fsync(ino))
        await self.replicate(ino)

    def replicas(self, ino: int) -> int:
        state = self._states.get(ino)
        found = None if state is None else self._setting(state.parent, REPLICAS_XATTR)
        return 1 if found is None else int(found[1])

    async def replicate(self, ino: int) -> None:
        """Send `ino` to the other nodes its directory's `replicas` asks for, part by
        part (two parts in memory at most, whatever the file's size). A file whose size
        changes while it is sent is sent again, up to REPLICATE_TRIES times (Busy)."""
        copies = self.replicas(ino) - 1
        if copies <= 0 or self.replicator is None:
            return
        for attempt in range(1, REPLICATE_TRIES + 1):
            if ino not in self._files:
                return  # removed meanwhile: nothing to keep
            inode = self._files.get(ino)
            try:
                await self.replicator.replicate(
                    self.path_of(ino), inode.mode, inode.size, partial(self._read_part, ino, inode.size), copies
                )
            except Busy:
                if attempt == REPLICATE_TRIES:
                    raise
                continue
            self.replicated += 1
            return

    async def _read_part(self, ino: int, size: int, offset: int, nbytes: int) -> list[bytes | bytearray]:
        if ino not in self._files or self._files.get(ino).size != size:
            raise Busy(f"inode {ino} changed size while it was being replicated")
        return await scheduling.read_sliced(partial(self._files.read, ino), offset, nbytes)

    def dir_made(self, directory: int) -> None:
        """A directory was made in the tree: one under checkpoints/ is news for a cluster."""
        if self.replicator is not None and self.covers(directory):
            self.news.post(("made", self.path_of(directory, self._files.parent_of(directory))))

    def dir_removed(self, parent: int, name: bytes) -> None:
        """Directory `name` of `parent` was removed: one under checkpoints/ is news too."""
        if self.replicator is not None and self.covers(parent):
            self.news.post(("removed", self.path_of(parent, self._files.parent_of(parent)) + b"/" + name))

    def remove_dir(self, path: bytes) -> None:
        """Remove `path` (under checkpoints/) where it is an empty directory: another node
        removed it. One that holds files here (replicas) stays. No news."""
        names = self._checked_names(path)
        parent = ROOT_INODE
        try:
            for name in names[:-1]:
                parent = self._files.lookup(parent, name).ino
            ino = self._files.lookup(parent, names[-1]).ino
            self._files.rmdir(parent, names[-1])
        except NotFound:
            return
        except (NotEmpty, NotADirectory) as exc:
            log.info("checkpoints: %s removed on another node stays here: %s", path.decode(errors="replace"), exc)
            return
        self.settings_changed()
        self.removed.post((parent, names[-1], ino))

    def make_dirs(self, path: bytes) -> None:
        """Make `path` (under checkpoints/) and its parents where missing: a directory
        another node made. No news: it is not announced back."""
        self._make_dirs(self._checked_names(path))

    def _checked_names(self, path: bytes) -> list[bytes]:
        names = path.split(b"/")
        if names[0] != CHECKPOINTS or len(names) < 2 or any(n in (b"", b".", b"..") for n in names):
            raise InvalidArgument(f"path must be under checkpoints/, got {path!r}")
        return names

    def _make_dirs(self, names: list[bytes]) -> int:
        """Walk `names` from the root, making the directories that are missing; returns
        the last one's inode."""
        parent = ROOT_INODE
        root = self._files.get(ROOT_INODE)
        for name in names:
            try:
                parent = self._files.lookup(parent, name).ino
            except NotFound:
                parent = self._files.mkdir(parent, name, 0o755, root.uid, root.gid).ino
        return parent

    def path_of(self, ino: int, parent: int | None = None) -> bytes:
        """The path from the mount root, e.g. b"checkpoints/run1/step10.pt"."""
        parts: list[bytes] = []
        parent = self._states[ino].parent if parent is None else parent
        child = ino
        while True:
            name = next((n for n, c in self._files.entries(parent) if c == child), None)
            if name is None:
                raise NotFound(f"inode {child} is no longer in directory inode {parent}")
            parts.append(name)
            if parent == ROOT_INODE:
                return b"/".join(reversed(parts))
            child, parent = parent, self._files.parent_of(parent)

    # --- replicas received ---------------------------------------------------------------

    async def begin_replica(self, path: bytes, mode: int, size: int) -> str:
        """A replica of `size` bytes for `path` (under checkpoints/) begins to come from
        another node: returns the transfer id its parts and commit name. Nothing under
        `path` changes before the commit. Busy when MAX_INCOMING_REPLICAS are coming;
        StoreFull (ENOSPC) when it and the replicas coming would leave the disk less
        than REPLICA_FREE_MARGIN_BYTES (a replica does not fill the disk this node's
        own writers need, to fail there at the end)."""
        for name in self._checked_names(path):
            check_name(name)
        if not 0 <= size <= MAX_FILE_BYTES:
            raise FileTooLarge(f"a replica of {size} bytes: outside 0..{MAX_FILE_BYTES}")
        free = await self._files.disk_free_bytes()
        # from here on no await: the checks hold for the transfer they admit
        self.expire_replicas()
        if len(self._incoming) >= MAX_INCOMING_REPLICAS:
            raise Busy(f"{len(self._incoming)} replicas are being received already (at most {MAX_INCOMING_REPLICAS})")
        coming = sum(i.size - i.received for i in self._incoming.values())
        if size + coming + REPLICA_FREE_MARGIN_BYTES > free:
            raise StoreFull(
                f"a replica of {size} bytes does not fit: the disk has {free} bytes free, {coming} more are coming"
                f" and {REPLICA_FREE_MARGIN_BYTES} stay free"
            )
        root = self._files.get(ROOT_INODE)
        inode = self._files.create_unlinked(mode, root.uid, root.gid)
        transfer = secrets.token_hex(8)
        self._incoming[transfer] = _Incoming(path, inode.ino, size, last=trio.current_time())
        return transfer

    @property
    def replicas_incoming(self) -> int:
        """Replicas being received now."""
        return len(self._incoming)

    def _incoming_of(self, transfer: str) -> _Incoming:
        incoming = self._incoming.get(transfer)
        if incoming is None:
            raise NotFound(f"no replica transfer {transfer[:32]!r} (never begun, aborted or expired)")
        return incoming

    async def write_replica(self, transfer: str, offset: int, data: memoryview) -> None:
        """One part of a replica: its bytes at `offset`, at most REPLICA_AHEAD_BYTES past
        the bytes received with no gap (a sender's parts in flight may arrive out of
        order; a part sent again is written again). The part is in the log when this
        returns, so a sender goes only as fast as this node's disk. A part that fails
        to be stored drops the transfer."""
        incoming = self._incoming_of(transfer)
        end = offset + len(data)
        if len(data) > REPLICA_PART_MAX_BYTES:
            raise InvalidArgument(f"a replica part of {len(data)} bytes (at most {REPLICA_PART_MAX_BYTES})")
        if not 0 <= offset <= incoming.received + REPLICA_AHEAD_BYTES or end > incoming.size:
            raise InvalidArgument(
                f"a replica part at {offset}..{end}: {incoming.received} of {incoming.size} bytes have come"
            )
        if offset > incoming.received and offset not in incoming.ahead and len(incoming.ahead) >= MAX_PARTS_AHEAD:
            raise InvalidArgument(f"a replica part at {offset}: {MAX_PARTS_AHEAD} parts wait past a gap already")
        incoming.writers += 1
        try:
            await scheduling.write_sliced(partial(self._files.write, incoming.ino), offset, data)
            await self._files.write_back(incoming.ino, full_only=True)
        except BaseException:
            incoming.writers -= 1
            self._drop_incoming(transfer, incoming)
            raise
        incoming.writers -= 1
        incoming.last = trio.current_time()
        if incoming.dropped:
            self._release_incoming(incoming)
            raise NotFound(f"replica transfer {transfer} was dropped while a part was written")
        incoming.ahead[offset] = max(incoming.ahead.get(offset, 0), end)
        merged = True
        while merged:  # parts that now follow the bytes received without a gap join them
            merged = False
            for start, stop in list(incoming.ahead.items()):
                if start <= incoming.received:
                    incoming.received = max(incoming.received, stop)
                    del incoming.ahead[start]
                    merged = True

    async def commit_replica(self, transfer: str) -> int:
        """The replica is whole: its bytes are made durable, then it takes its path as
        one change (a file already there is replaced, as by rename; readers that have it
        open keep it), durably. Returns its inode; a commit sent again returns it again."""
        done = self._committed.get(transfer)
        if done is not None:
            return done
        incoming = self._incoming_of(transfer)
        if incoming.writers:
            raise Busy(f"replica transfer {transfer}: a part is still being written")
        if incoming.received != incoming.size:
            raise InvalidArgument(f"replica transfer {transfer}: {incoming.received} of {incoming.size} bytes came")
        ino = incoming.ino
        incoming.writers += 1
        try:
            await self._files.fsync(ino)  # the bytes are durable before a name shows them
        finally:
            incoming.writers -= 1
        if incoming.dropped:
            self._release_incoming(incoming)
            raise NotFound(f"replica transfer {transfer} was dropped during its commit")
        try:
            names = self._checked_names(incoming.path)
            parent, name = self._make_dirs(names[:-1]), names[-1]
            replaced = self._files.link_replacing(ino, parent, name)
        except DistorefsError:
            self._drop_incoming(transfer, incoming)
            raise
        del self._incoming[transfer]
        self._files.unref(ino)
        if replaced is not None and replaced.nlink == 0:
            self._forget(replaced.ino)
        self.track(ino, parent)
        self._committed[transfer] = ino
        while len(self._committed) > REMEMBERED_COMMITS:
            del self._committed[next(iter(self._committed))]
        await self._commit_durable(
            [(ino, self._states[ino].gen)], lambda: self._files.commit(durable=True), replicate=False
        )
        if replaced is not None:
            self.removed.post((parent, name, replaced.ino))
            with trio.move_on_after(REPLACED_NOTICE_S):  # (the kernel would drop its entry by then itself)
                await self.removed.delivered()
        self.replicas_received += 1
        return ino

    def abort_replica(self, transfer: str) -> None:
        """The sender gave up: the bytes received go (unknown transfers are ignored)."""
        incoming = self._incoming.get(transfer)
        if incoming is not None:
            self._drop_incoming(transfer, incoming)

    def expire_replicas(self, idle_s: float = REPLICA_IDLE_S) -> int:
        """Drop the transfers no part has come for in `idle_s` (their sender died or
        gave up without a word); returns how many went."""
        now = trio.current_time()
        stale = [(t, i) for t, i in self._incoming.items() if not i.writers and now - i.last > idle_s]
        for transfer, incoming in stale:
            log.warning(
                "checkpoints: a replica of %s expired after %.0f s without a part (%d of %d bytes had come)",
                incoming.path.decode(errors="replace"), now - incoming.last, incoming.received, incoming.size,
            )  # fmt: skip
            self._drop_incoming(transfer, incoming)
        return len(stale)

    def _drop_incoming(self, transfer: str, incoming: _Incoming) -> None:
        """Forget a transfer; its file goes once no part is being written into it."""
        if self._incoming.get(transfer) is incoming:
            del self._incoming[transfer]
            self.replicas_dropped += 1
        incoming.dropped = True
        self._release_incoming(incoming)

    def _release_incoming(self, incoming: _Incoming) -> None:
        if incoming.dropped and not incoming.writers and not incoming.released:
            incoming.released = True
            self._files.unref(incoming.ino)

    def persisted_all(self) -> None:
        """Clean shutdown: the block tier's final durable commit covers every file, so no
        file may stay listed as pending (stage before that commit)."""
        for ino in self._states:
            self._clear_pending(ino)

    # --- state ----------------------------------------------------------------------------

    def state(self, ino: int) -> str:
        state = self._states[ino]
        if state.gen == state.durable_gen:
            return "durable"
        return "dram" if state.writers else "persisting"

    def _entry_durable(self, ino: int) -> bool:
        if ino not in self._files:
            return True
        inode = self._files.get(ino)
        if inode.is_dir:
            return all(self._entry_durable(child) for _name, child in self._files.entries(ino))
        return ino not in self._states or self.state(ino) == "durable"

    def statistics(self) -> dict[str, int]:
        waiting = [ino for ino, s in self._states.items() if s.gen != s.durable_gen]
        return {
            "checkpoint_bytes_waiting": sum(self._files.dirty_bytes(ino) for ino in waiting),
            "checkpoint_files_waiting": len(waiting),
            "checkpoint_files_tracked": len(self._states),
            "checkpoint_persist_errors": self.errors,
            "checkpoint_removed_by_retention": self.removed_by_retention,
        }

    # --- settings (xattrs on directories) -----------------------------------------------

    def check_setting(self, ino: int, name: bytes, value: bytes) -> None:
        """Refuse a bad value for one of our xattrs before it is stored."""
        if name == STATE_XATTR:
            raise NotPermitted(f"{STATE_XATTR.decode()} is computed; it cannot be set")
        if name not in SETTING_XATTRS:
            return
        inode = self._files.get(ino)
        if not inode.is_dir or not self.covers(ino):
            raise InvalidArgument(f"{name.decode()} applies to directories under checkpoints/ only")
        text = value.decode(errors="replace").strip()
        number = int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None
        if name == KEEP_XATTR and not (number is not None and 1 <= number <= MAX_KEEP_LAST):
            raise InvalidArgument(f"{KEEP_XATTR.decode()} must be a whole number 1..{MAX_KEEP_LAST}")
        if name == REPLICAS_XATTR:
            if not (number is not None and 1 <= number <= MAX_REPLICAS):
                raise InvalidArgument(f"{REPLICAS_XATTR.decode()} must be a whole number 1..{MAX_REPLICAS}")
            if int(text) > 1 and self.replicator is None:
                raise InvalidArgument(f"{REPLICAS_XATTR.decode()} > 1 needs a cluster (distore mount --cluster ...)")
        if name == SYNC_CLOSE_XATTR and text not in ("0", "1"):
            raise InvalidArgument(f"{SYNC_CLOSE_XATTR.decode()} must be 0 or 1")

    def settings_changed(self) -> None:
        """A setting was set or removed, or a directory moved or went: resolve afresh."""
        self._settings.clear()

    def _setting(self, directory: int, name: bytes) -> tuple[int, str] | None:
        """The nearest directory from `directory` up to checkpoints/ that sets `name`, and
        its value (cached per directory until `settings_changed`)."""
        key = (directory, name)
        if key in self._settings:
            return self._settings[key]
        try:
            found: tuple[int, str] | None = directory, self._files.getxattr(directory, name).decode().strip()
        except DistorefsError:
            found = None
            if directory not in (self.root, ROOT_INODE):
                try:
                    found = self._setting(self._files.parent_of(directory), name)
                except NotFound:  # removed from the tree, still referenced: no setting applies
                    return None
        self._settings[key] = found
        return found

    def _sync_close_set(self, directory: int) -> bool:
        found = self._setting(directory, SYNC_CLOSE_XATTR)
        return found is not None and found[1] == "1"

    # --- the persister --------------------------------------------------------------------

    def _wake(self) -> None:
        self._work.set()

    async def run_persister(self, idle_s: float = 1.0) -> None:
        """Background task: persist checkpoint files in write order, then make them durable."""
        while True:
            with trio.move_on_after(idle_s):
                await self._work.wait()
            self._work = trio.Event()
            try:
                await self.persist_pass()
            except Exception as exc:  # a full disk, or a bug: counted, logged, retried; never the end
                self.errors += 1
                if isinstance(exc, (DistorefsError, OSError)):
                    self.last_error = str(exc)
                    log.warning("checkpoints: persisting failed, will retry in %s s: %s", RETRY_S, exc)
                else:
                    self.last_error = f"internal error: {exc!r}"
                    log.exception("checkpoints: a persist pass failed; will retry in %s s", RETRY_S)
                await trio.sleep(RETRY_S)

    async def persist_pass(self) -> None:
        """One pass: open files give their full blocks to the log, closed files all of
        theirs; the closed ones then become durable in one durable commit."""
        closed: list[tuple[int, int]] = []
        for ino in list(self._queue):
            state = self._states.get(ino)
            if state is None or ino not in self._files:
                self._forget(ino)
                continue
            if state.writers:
                await self._files.write_back(ino, full_only=True)
            else:
                await self._files.write_back(ino)
                closed.append((ino, state.gen))
        if closed:
            await self._commit_durable(closed, lambda: self._files.commit(durable=True))

    async def _commit_durable(
        self, done: list[tuple[int, int]], commit: Callable[[], Awaitable[None]], replicate: bool = True
    ) -> None:
        """Run the durable `commit` with the pending rows of these (file, change) pairs
        deleted in it; if it fails, the rows of files still not durable come back.
        `replicate`: files under `replicas` > 1 are queued for replication (not replicas
        received from another node)."""
        for ino, _gen in done:
            self._clear_pending(ino)
        try:
            await commit()
        except BaseException:
            for ino, _gen in done:
                state = self._states.get(ino)
                if state is not None and state.gen != state.durable_gen:
                    self._mark_pending(ino)
            raise
        await self._made_durable(done, replicate)

    def _mark_pending(self, ino: int) -> None:
        self._meta.put("ckpt_pending", (ino,), (time.time_ns(),))

    def _clear_pending(self, ino: int) -> None:
        self._meta.delete("ckpt_pending", (ino,))

    def _forget(self, ino: int) -> None:
        self._queue.pop(ino, None)
        self._states.pop(ino, None)
        self._clear_pending(ino)

    async def _made_durable(self, done: list[tuple[int, int]], replicate: bool = True) -> None:
        """A durable commit covered these (file, change) pairs: the unchanged ones are
        durable now; the changed ones go back to pending. Then retention runs."""
        directories: set[int] = set()
        released: list[int] = []
        for ino, gen in done:
            state = self._states.get(ino)
            if state is None:
                continue
            if state.gen == gen and not self._files.dirty_bytes(ino):
                state.durable_gen = gen
                self._queue.pop(ino, None)
                released.append(ino)  # a staged file's memory (tree.adopt) goes back
                directories.add(state.parent)
                if replicate and not state.writers and self.replicator is not None and self.replicas(ino) > 1:
                    self.replication_queue.post(ino)
            else:
                self._mark_pending(ino)
        for ino in released:
            await self._files.release_borrowed(ino)
        removed = False
        for directory in directories:
            removed |= self.apply_retention(directory)
        if removed:
            await self._files.commit()

    # --- retention ------------------------------------------------------------------------

    def apply_retention(self, directory: int) -> bool:
        """Under the nearest directory with `keep_last` = N: keep the newest N durable
        checkpoints and remove every checkpoint older than the N-th. A checkpoint is the
        set of entries whose names carry the same step number (`step_of`): SB3's model
        and replay-buffer pair, Hugging Face's `checkpoint-500/`, Lightning's
        `epoch=3-step=400.ckpt`, `step-100.pt`; an entry without a number is one on its
        own. A checkpoint is durable when all its entries are, and its age is that of its
        newest entry (creation order). Names starting with `.` are not checkpoints and
        stay. True if any went."""
        if directory not in self._files:
            return False
        found = self._setting(directory, KEEP_XATTR)
        if found is None:
            return False
        run_dir, text = found
        keep = int(text)
        groups: dict[object, list[tuple[bytes, int]]] = {}
        for name, ino in self._files.entries(run_dir):
            if not name.startswith(b"."):
                step = step_of(name)
                groups.setdefault(("step", step) if step is not None else ("entry", ino), []).append((name, ino))
        ordered = sorted(groups.values(), key=lambda group: max(ino for _name, ino in group), reverse=True)
        durable = [i for i, group in enumerate(ordered) if all(self._entry_durable(ino) for _n, ino in group)]
        if len(durable) < keep:
            return False
        older = ordered[durable[keep - 1] + 1 :]
        for group in older:
            for name, ino in group:
                for file_ino in self._files.remove_tree(run_dir, name):
                    self._forget(file_ino)
                self.removed.post((run_dir, name, ino))
                self.removed_by_retention += 1
                log.info("checkpoints: retention removed %s (keep_last=%d)", name.decode(errors="replace"), keep)
        if older:
            self.settings_changed()
        return bool(older)
