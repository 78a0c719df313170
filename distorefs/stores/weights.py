"""WeightStore: versioned parameter-server models, published atomically.

Owns the models under `weights/`: each model is a set of files and a version number.
A writer fills a private `WeightFile` (its bytes are blocks of the block tier under an
owner of its own, from WEIGHT_OWNER_BASE up); `publish` swaps it into the model as one
new version. A version's files never change, so a reader holds the `WeightFile` it
opened and reads it complete however many versions follow. A file that is no longer
current and that no handle holds is freed with its blocks.

Shared copies: for readers in other processes (`client.map_version`), a version's file
can also be copied once into a sealed memfd (`shared_copy`), which the fs layer hands
over through the daemon's socket; readers map it at memory speed with no read through
FUSE. Where the daemon has shared memory, a published file is copied in the background
right after the publish (`run_sharing`) while such copies take at most EAGER_SHARE of
the budget for them; past that, a copy is made when a reader first asks. The copy is
reserved against the DRAM budget and closed when the file is freed; mappings readers
still hold keep their pages until they unmap (as a deleted file's open descriptors do).

Persistence: a model is one row of MetaDb's `weights` table (version, time, files), so a
publish of one file or of a group commits in one transaction, after the new files' blocks
are in the log: a killed daemon comes back with the last version whose publish returned.

Plain Python with no FUSE: the fs layer (fs/weights.py) maps files and handles here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio

from distorefs.errors import (
    Exists,
    FileTooLarge,
    InvalidArgument,
    NotEmpty,
    NotFound,
    NotSupported,
    OutOfMemory,
    TimedOut,
    TryAgain,
)
from distorefs.ids import WEIGHT_OWNER_BASE, is_weight_owner
from distorefs.news import Outbox
from distorefs.stores.files import check_name
from distorefs.stores.replay.mirror import ArenaBudget
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb

log = logging.getLogger(__name__)

MAX_WEIGHT_FILE_BYTES = 1 << 40
COPY_CHUNK = 8 << 20  # a shared copy is filled this much per trip to a thread
EAGER_SHARE = 0.5  # copies made at publish may take this fraction of the shared-memory budget
SHARED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
RESERVED_NAMES = frozenset({b"version", b"wait"})


@dataclass(eq=False)
class WeightFile:
    """One file's bytes as of one version (or a writer's pending bytes)."""

    owner: int
    size: int = 0
    mtime_ns: int = field(default_factory=time.time_ns)
    handles: int = 0  # open handles reading or writing it
    current: bool = False  # named by a model's current version
    freed: bool = False
    shared: SharedCopy | None = None  # its bytes in a sealed memfd, once a reader asked (shared_copy)
    sharing: trio.Event | None = None  # set when a copy being made is done (or failed)


@dataclass(eq=False)
class SharedCopy:
    """A sealed memfd holding one version's bytes: nothing can change them."""

    fd: int
    size: int
    reserved: int


@dataclass(eq=False)
class Model:
    name: bytes
    version: int = 0
    published_ns: int = field(default_factory=time.time_ns)
    files: dict[bytes, WeightFile] = field(default_factory=dict)
    deleted: bool = False
    lock: trio.Lock = field(default_factory=trio.Lock)
    changed: trio.Event = field(default_factory=trio.Event)

    def version_line(self) -> bytes:
        return f"{self.version} {self.published_ns / 1e9:.6f}\n".encode()


def check_file_name(name: bytes) -> None:
    check_name(name)
    if name in RESERVED_NAMES:
        raise Exists(f"{name.decode()} is a control file of every model")


class WeightStore:
    """The models and their current versions.

    Examples:
        >>> store = WeightStore.load(blocks, meta)
        >>> model = store.create_model(b"policy")
        >>> f = store.begin_write()
        >>> await store.write(f, 0, b"tensor bytes")
        >>> await store.publish(model, {b"params.bin": f})
        1
    """

    def __init__(self, blocks: BlockStore, meta: MetaDb) -> None:
        self._blocks = blocks
        self._meta = meta
        self.models: dict[bytes, Model] = {}
        self._next_owner = int(meta.get_kv("next_weight_owner", WEIGHT_OWNER_BASE))
        self.news = Outbox[tuple[str, bytes]]()  # ("created" | "published" | "deleted", model)
        self.shared_budget: ArenaBudget | None = None  # for shared copies (None: there are none)
        self.shared_copies = 0  # made since the start
        self._shared: set[WeightFile] = set()  # the files with a shared copy now
        self._to_share: list[WeightFile] = []  # published files whose copy run_sharing makes
        self._share_wanted = trio.Event()

    @classmethod
    def load(cls, blocks: BlockStore, meta: MetaDb) -> WeightStore:
        """Restore every model's last published version; drop blocks of writers that
        never published and of versions freed before the last commit."""
        self = cls(blocks, meta)
        for name, version, published_ns, files in meta.rows("weights"):
            model = Model(name, version, published_ns)
            for name_hex, owner, size, mtime_ns in json.loads(files):
                model.files[bytes.fromhex(name_hex)] = WeightFile(owner, size, mtime_ns, current=True)
            self.models[name] = model
        live = {f.owner for m in self.models.values() for f in m.files.values()}
        orphans = [o for o in blocks.owners() if is_weight_owner(o) and o not in live]
        for owner in orphans:
            blocks.delete_owner(owner)
        if orphans:
            log.info("weights: dropped the blocks of %d unpublished or freed files", len(orphans))
        return self

    # --- models -------------------------------------------------------------------------

    def model(self, name: bytes) -> Model:
        model = self.models.get(name)
        if model is None:
            raise NotFound(f"no model {name.decode(errors='replace')!r} in weights/")
        return model

    def create_model(self, name: bytes) -> Model:
        check_name(name)
        if name in self.models:
            raise Exists(f"weights/{name.decode(errors='replace')} exists")
        model = self.models[name] = Model(name)
        self._stage(model)
        self.news.post(("created", name))
        return model

    def remove_model(self, name: bytes) -> None:
        model = self.model(name)
        if model.files:
            raise NotEmpty(f"weights/{name.decode(errors='replace')} still has {len(model.files)} files")
        self._drop_model(model)

    async def commit(self) -> None:
        await self._blocks.commit()

    def _drop_model(self, model: Model) -> None:
        del self.models[model.name]
        model.deleted = True
        self._wake(model)
        self._meta.delete("weights", (model.name,))
        self.news.post(("deleted", model.name))

    def _stage(
        self,
        model: Model,
        files: dict[bytes, WeightFile] | None = None,
        version: int | None = None,
        published_ns: int | None = None,
    ) -> None:
        """Stage the model's row: as it is, or as the given next version."""
        files = model.files if files is None else files
        rows = [[name.hex(), f.owner, f.size, f.mtime_ns] for name, f in files.items()]
        self._meta.put(
            "weights",
            (model.name,),
            (model.version if version is None else version, published_ns or model.published_ns, json.dumps(rows)),
        )

    def _wake(self, model: Model) -> None:
        model.changed.set()
        model.changed = trio.Event()

    # --- writing ------------------------------------------------------------------------

    async def begin_write(self, base: WeightFile | None = None) -> WeightFile:
        """A private file for one writer, empty or (copy on write) with `base`'s bytes.
        The caller holds it (handles = 1) until `publish` or `discard`."""
        owner = self._next_owner
        self._next_owner += 1
        self._meta.put("kv", ("next_weight_owner",), (self._next_owner,))
        pending = WeightFile(owner, handles=1)
        if base is not None and base.size:
            await self._blocks.copy_owner(base.owner, owner)
            pending.size = base.size
        return pending

    async def write(self, pending: WeightFile, offset: int, data: bytes | memoryview) -> int:
        if offset + len(data) > MAX_WEIGHT_FILE_BYTES:
            raise FileTooLarge(f"write past {MAX_WEIGHT_FILE_BYTES} bytes")
        await self._blocks.write_range(pending.owner, offset, data)
        pending.size = max(pending.size, offset + len(data))
        pending.mtime_ns = time.time_ns()
        return len(data)

    async def truncate(self, pending: WeightFile, size: int) -> None:
        if size < 0 or size > MAX_WEIGHT_FILE_BYTES:
            raise InvalidArgument(f"size {size} outside 0..{MAX_WEIGHT_FILE_BYTES}")
        await self._blocks.truncate_range(pending.owner, pending.size, size)
        pending.size = size
        pending.mtime_ns = time.time_ns()

    async def read(self, wf: WeightFile, offset: int, size: int) -> bytes | bytearray | memoryview:
        if wf.freed:
            raise NotFound("this version of the file was freed")
        return await self._blocks.read_range(wf.owner, offset, size, wf.size)

    async def sync(self, pending: WeightFile) -> None:
        """fsync of a writer: its bytes so far are durable (not yet published)."""
        await self._blocks.persist(pending.owner, durable=True)

    # --- publishing ---------------------------------------------------------------------

    async def publish(
        self,
        model: Model,
        added: dict[bytes, WeightFile],
        removed: Iterable[bytes] = (),
        replace_all: bool = False,
        at_least: int = 0,
    ) -> int:
        """Make one new version of `model`: `added` files (name -> file) replace or join
        the current ones, `removed` names leave (or all others with `replace_all`).

        The new version is the next one, or `at_least` if that is higher (a version
        fetched from a peer keeps its cluster-wide number).

        Returns the new version number once its bytes and row are in the log and the
        database (a killed daemon keeps it). Readers see the old version or the new one,
        never a mix: the switch happens in one step after the commit.
        """
        for name in added:
            check_file_name(name)
        async with model.lock:
            if model.deleted:
                raise NotFound(f"weights/{model.name.decode(errors='replace')} was removed")
            files = {} if replace_all else dict(model.files)
            for name in removed:
                files.pop(name, None)
            files.update(added)
            version, published_ns = max(model.version + 1, at_least), time.time_ns()
            self._stage(model, files, version, published_ns)
            try:
                owners = [wf.owner for wf in added.values()]
                for owner in owners[:-1]:
                    await self._blocks.flush(owner)
                if owners:
                    await self._blocks.persist(owners[-1])  # its blocks, then the row, in one hop
                else:
                    await self._blocks.commit()
            except BaseException:
                self._stage(model)  # the row goes back to the version readers still see
                raise
            old = model.files
            model.files, model.version, model.published_ns = files, version, published_ns
            kept = {id(wf) for wf in files.values()}
            for wf in added.values():
                wf.current = True
            for wf in old.values():
                if id(wf) not in kept:
                    wf.current = False
                    self._free_if_unused(wf)
            self._wake(model)
            if self.shared_budget is not None and added:
                self._to_share.extend(added.values())
                self._share_wanted.set()
            self.news.post(("published", model.name))
            return version

    async def install(self, model: Model, version: int, files: Iterable[tuple[bytes, memoryview]]) -> int:
        """Publish a version fetched from another node whole, under its own number
        (every file of the version, replacing all). Returns the version now current."""
        added: dict[bytes, WeightFile] = {}
        try:
            for name, data in files:
                pending = added[name] = await self.begin_write()
                await self.write(pending, 0, data)
            return await self.install_written(model, version, added)
        finally:
            for pending in added.values():
                self.release(pending)

    async def install_written(self, model: Model, version: int, added: dict[bytes, WeightFile]) -> int:
        """`install` of files the caller wrote itself (`begin_write`, `write`: a version
        fetched in parts); the caller still releases them. Returns the version now
        current (a newer one than `version` may have arrived meanwhile)."""
        if version <= model.version:
            return model.version
        return await self.publish(model, added, replace_all=True, at_least=version)

    async def unlink(self, model: Model, name: bytes) -> int:
        if name not in model.files:
            raise NotFound(f"no file {name.decode(errors='replace')!r} in weights/{model.name.decode()}")
        return await self.publish(model, {}, removed=[name])

    async def rename_file(self, source: Model, name: bytes, target: Model, new_name: bytes, noreplace: bool) -> None:
        """Move one file: one new version of each model (one, when they are the same)."""
        check_file_name(new_name)
        wf = source.files.get(name)
        if wf is None:
            raise NotFound(f"no file {name.decode(errors='replace')!r} in weights/{source.name.decode()}")
        if noreplace and new_name in target.files:
            raise Exists(f"{new_name.decode(errors='replace')} exists in weights/{target.name.decode()}")
        wf.handles += 1  # hold it while it moves
        try:
            if source is target:
                await self.publish(source, {new_name: wf}, removed=[name])
            else:
                await self.publish(target, {new_name: wf})
                await self.publish(source, {}, removed=[name])
        finally:
            self.release(wf)

    async def rename_model(self, name: bytes, new_name: bytes, noreplace: bool) -> None:
        """Rename a model; onto an existing model, publish the source's files as the
        target's next version (a group publish) and remove the source."""
        check_name(new_name)
        source = self.model(name)
        target = self.models.get(new_name)
        if target is source:
            return
        if target is None:
            del self.models[name]
            self._meta.delete("weights", (name,))
            source.name = new_name
            self.models[new_name] = source
            self._stage(source)
            await self._blocks.commit()
            return
        if noreplace:
            raise Exists(f"weights/{new_name.decode(errors='replace')} exists")
        files = dict(source.files)
        for wf in files.values():
            wf.handles += 1
        try:
            async with source.lock:
                self._drop_model(source)
            for wf in files.values():
                wf.current = False
            await self.publish(target, files, replace_all=True)
        finally:
            for wf in files.values():
                self.release(wf)

    # --- holding ------------------------------------------------------------------------

    def hold(self, wf: WeightFile) -> None:
        if wf.freed:
            raise NotFound("this version of the file was freed")
        wf.handles += 1

    def release(self, wf: WeightFile) -> None:
        wf.handles -= 1
        self._free_if_unused(wf)

    def _free_if_unused(self, wf: WeightFile) -> None:
        if not wf.current and wf.handles <= 0 and not wf.freed:
            wf.freed = True
            self._blocks.delete_owner(wf.owner)
            self._drop_shared(wf)

    # --- shared copies ------------------------------------------------------------------

    async def shared_copy(self, wf: WeightFile) -> tuple[int, int]:
        """(a new read-only descriptor of a sealed memfd holding the file's bytes, its
        size), for a reader in another process to map. Made once per file and version,
        from a thread; later calls get the same memfd. NotSupported when this daemon has
        no shared memory, OutOfMemory when the budget for it is used up, NotFound when
        the version was freed meanwhile."""
        await self._ensure_shared(wf)
        assert wf.shared is not None
        fd = os.open(f"/proc/self/fd/{wf.shared.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return fd, wf.shared.size

    async def _ensure_shared(self, wf: WeightFile, eager: bool = False) -> None:
        if self.shared_budget is None:
            raise NotSupported("this daemon has no shared memory for weights (see --shm-dir)")
        while wf.shared is None:
            if wf.freed:
                raise NotFound("this version of the file was freed")
            if wf.sharing is not None:
                await wf.sharing.wait()  # another reader's copy; if it failed, this one tries
                continue
            wf.sharing = trio.Event()
            try:
                wf.shared = await self._make_copy(wf, self.shared_budget, eager)
            finally:
                wf.sharing.set()
                wf.sharing = None
            if wf.freed:  # freed while the copy was made
                self._drop_shared(wf)
                raise NotFound("this version of the file was freed")

    async def run_sharing(self) -> None:
        """Background task: copy each published file into shared memory soon after its
        publish (the first reader of a version then waits for nothing), while eager
        copies fit in EAGER_SHARE of the budget. A file already superseded is skipped;
        a copy that fails is left to the first reader that asks."""
        while True:
            await self._share_wanted.wait()
            self._share_wanted = trio.Event()
            files, self._to_share = self._to_share, []
            for wf in files:
                if not wf.current or wf.freed:
                    continue
                try:
                    await self._ensure_shared(wf, eager=True)
                except (OutOfMemory, NotFound):
                    pass
                except OSError as exc:  # no memfd (a full /dev/shm's memory): readers go through the mount
                    log.warning("weights: a shared copy of %d bytes failed: %s", wf.size, exc)

    async def _make_copy(self, wf: WeightFile, budget: ArenaBudget, eager: bool = False) -> SharedCopy:
        size = wf.size
        reserved = -(-size // mmap_page()) * mmap_page()
        if eager and budget.used_bytes + reserved > budget.limit_bytes * EAGER_SHARE:
            raise OutOfMemory("eager shared copies are at their share of the budget")
        if not budget.reserve(reserved):
            raise OutOfMemory(
                f"no room for a {size}-byte shared copy: shared memory may take {budget.limit_bytes} bytes"
                f" of the DRAM budget and {budget.used_bytes} are in use"
            )
        fd = -1
        try:
            fd = os.memfd_create(f"distorefs-weights-{wf.owner}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
            for offset in range(0, size, COPY_CHUNK):
                data = await self._blocks.read_range(wf.owner, offset, min(COPY_CHUNK, size - offset), size)
                if isinstance(data, memoryview) and not isinstance(data.obj, bytes):
                    data = bytes(data)  # a cached block's own memory: the thread gets a copy
                await trio.to_thread.run_sync(_pwrite_all, fd, data, offset)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARED_SEALS)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            budget.unreserve(reserved)
            raise
        self.shared_copies += 1
        self._shared.add(wf)
        return SharedCopy(fd, size, reserved)

    def _drop_shared(self, wf: WeightFile) -> None:
        copy, wf.shared = wf.shared, None
        self._shared.discard(wf)
        if copy is not None:
            os.close(copy.fd)
            assert self.shared_budget is not None
            self.shared_budget.unreserve(copy.reserved)

    def close_shared(self) -> None:
        """Close every shared copy (the daemon is stopping)."""
        for wf in list(self._shared):
            self._drop_shared(wf)

    # --- waiting ------------------------------------------------------------------------

    async def wait_newer(self, model: Model, than: int, timeout_s: float, nonblocking: bool) -> int:
        """Return the model's version once it is newer than `than`: EAGAIN at once under
        O_NONBLOCK, ETIMEDOUT after `timeout_s`, NotFound if the model goes away."""
        with trio.move_on_after(timeout_s):
            while model.version <= than:
                if model.deleted:
                    raise NotFound(f"weights/{model.name.decode(errors='replace')} was removed")
                if nonblocking:
                    raise TryAgain(f"weights/{model.name.decode(errors='replace')}: no version newer than {than}")
                await model.changed.wait()
            return model.version
        raise TimedOut(f"weights/{model.name.decode(errors='replace')}: no version newer than {than} in {timeout_s} s")

    def statistics(self) -> dict[str, int]:
        files = [f for m in self.models.values() for f in m.files.values()]
        return {
            "weight_models": len(self.models),
            "weight_files": len(files),
            "weight_bytes": sum(f.size for f in files),
            "weight_shared_bytes": sum(f.shared.reserved for f in self._shared if f.shared is not None),
            "weight_shared_copies_made": self.shared_copies,
        }


def mmap_page() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
