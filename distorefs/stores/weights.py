"""WeightStore: versioned parameter-server models, published atomically.

Owns the models under `weights/`: each model is a set of files and a version number.
A writer fills a private `WeightFile` (its bytes are blocks of the block tier under an
owner of its own, from WEIGHT_OWNER_BASE up); `publish` swaps it into the model as one
new version. A version's files never change, so a reader holds the `WeightFile` it
opened and reads it complete however many versions follow. A file that is no longer
current and that no handle holds is freed with its blocks.

Persistence: a model is one row of MetaDb's `weights` table (version, time, files), so a
publish of one file or of a group commits in one transaction, after the new files' blocks
are in the log: a killed daemon comes back with the last version whose publish returned.

Plain Python with no FUSE: the fs layer (fs/weights.py) maps files and handles here.
"""

from __future__ import annotations

import json
import logging
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
    TimedOut,
    TryAgain,
)
from distorefs.ids import WEIGHT_OWNER_BASE, is_weight_owner
from distorefs.news import Outbox
from distorefs.stores.files import check_name
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb

log = logging.getLogger(__name__)

MAX_WEIGHT_FILE_BYTES = 1 << 40
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
            if version <= model.version:
                return model.version  # a newer one arrived meanwhile
            return await self.publish(model, added, replace_all=True, at_least=version)
        finally:
            for pending in added.values():
                self.release(pending)

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
        }
