"""The remote memory tier: DRAM that peers lend each other for cold buffer items.

Two sides, one module:
  - LentMemory (the lender): the items peers spilled here, an LRU under the byte budget
    of `--lend-memory`. It may drop any item at any time (over budget, borrower gone):
    it never holds the only copy of anything.
  - RemoteMemory (the borrower): when the DRAM cache evicts a clean block of a buffer,
    the block store offers it here; a background task (`run`) copies it to a lender in
    batches, and reads that miss DRAM ask the lender before the local log.

Decision (docs/cluster.md): only blocks that are already in the log are spilled, so the
remote tier is a cache between local DRAM and the log, not a place of record. Losing a
lender, a stale or corrupt copy (each carries the crc32c taken at spill time), or a
lender that dropped the item all end the same way: the read goes to the log. Nothing
acknowledged depends on a peer's memory.

It knows blocks (BlockKey, LogLocation) and peers (PeerTransport); which owners may
spill is the block store's business, and which nodes lend is the cluster glue's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import trio

from distorefs import scheduling
from distorefs.cluster.rpc import Payload, PeerServer, PeerTransport, ints_value, meta_ints, split_payload
from distorefs.errors import DistorefsError
from distorefs.tiers.dram import add_owned
from distorefs.types import BlockKey, LogLocation

log = logging.getLogger(__name__)

SPILL_BATCH_BYTES = 4 << 20  # one mem.put carries at most this much
DEFAULT_QUEUE_BYTES = 64 << 20  # evicted blocks waiting to be sent (beyond the DRAM budget)
FAILED_NODE_PAUSE_S = 5.0  # a lender that failed gets no spills for this long

ItemKey = tuple[int, int]  # (owner, number) of a BlockKey, as it travels


def _keys_value(keys: Sequence[ItemKey]) -> bytes:
    """Keys as a frame's map value: (owner, number) int64 pairs."""
    return ints_value([number for key in keys for number in key])


def _item_keys(meta: dict[str, Any], field: str) -> list[ItemKey]:
    """A map value made by `_keys_value`, back as keys; EINVAL for anything else."""
    return [(owner, number) for owner, number in meta_ints(meta, field, 2).tolist()]


# --- the lender ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LentStatistics:
    budget_bytes: int
    used_bytes: int
    items: int
    borrowers: int
    stored: int
    served: int
    missed: int
    dropped: int


class LentMemory:
    """Items that peers keep in this daemon's memory, under `budget_bytes` (LRU).

    Examples:
        >>> lent = LentMemory(256 << 20)
        >>> lent.put("n0", [(7, 1)], [b"item"])
        1
        >>> lent.get("n0", [(7, 1), (7, 2)])
        [b'item', None]
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._items: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self.used_bytes = 0
        self._stored = self._served = self._missed = self._dropped = 0

    def put(self, borrower: str, keys: Sequence[ItemKey], payloads: Sequence[Payload]) -> int:
        """Keep these items (replacing older copies); returns how many were kept. Items
        larger than the whole budget are refused; older items go to make room."""
        kept = 0
        for (owner, number), payload in zip(keys, payloads, strict=True):
            slot = (borrower, owner, number)
            self._remove(slot)
            size = len(payload)
            if size > self.budget_bytes:
                continue
            while self.used_bytes + size > self.budget_bytes:
                _slot, old = self._items.popitem(last=False)
                self.used_bytes -= len(old)
                self._dropped += 1
            self._items[slot] = bytes(payload)
            self.used_bytes += size
            kept += 1
        self._stored += kept
        return kept

    def get(self, borrower: str, keys: Sequence[ItemKey]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for owner, number in keys:
            slot = (borrower, owner, number)
            payload = self._items.get(slot)
            if payload is None:
                self._missed += 1
            else:
                self._served += 1
                self._items.move_to_end(slot)
            out.append(payload)
        return out

    def _remove(self, slot: tuple[str, int, int]) -> None:
        old = self._items.pop(slot, None)
        if old is not None:
            self.used_bytes -= len(old)

    def drop(self, borrower: str, keys: Sequence[ItemKey] | None = None) -> None:
        """Forget these items of `borrower`, or all of them (it left the cluster)."""
        if keys is None:
            for slot in [s for s in self._items if s[0] == borrower]:
                self._remove(slot)
        else:
            for owner, number in keys:
                self._remove((borrower, owner, number))

    def borrowers(self) -> set[str]:
        return {slot[0] for slot in self._items}

    def register(self, server: PeerServer) -> None:
        """Answer `mem.put`, `mem.get` and `mem.drop` from peers (docs/formats.md)."""
        server.register("mem.put", self._on_put)
        server.register("mem.get", self._on_get)
        server.register("mem.drop", self._on_drop)

    async def _on_put(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        await scheduling.checkpoint()
        borrower = str(meta["from"])
        self.drop(borrower, _item_keys(meta, "drop"))
        parts = split_payload(body, meta_ints(meta, "sizes").tolist())
        return {"kept": self.put(borrower, _item_keys(meta, "keys"), parts)}, ()

    async def _on_get(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        await scheduling.checkpoint()
        found = self.get(str(meta["from"]), _item_keys(meta, "keys"))
        return {"sizes": ints_value(-1 if p is None else len(p) for p in found)}, [p for p in found if p is not None]

    async def _on_drop(self, meta: dict[str, Any], body: memoryview) -> tuple[dict[str, Any], Sequence[Payload]]:
        await scheduling.checkpoint()
        self.drop(str(meta["from"]), None if meta.get("keys") is None else _item_keys(meta, "keys"))
        return {}, ()

    def statistics(self) -> LentStatistics:
        return LentStatistics(
            budget_bytes=self.budget_bytes,
            used_bytes=self.used_bytes,
            items=len(self._items),
            borrowers=len(self.borrowers()),
            stored=self._stored,
            served=self._served,
            missed=self._missed,
            dropped=self._dropped,
        )


# --- the borrower -------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteMemoryStatistics:
    remote_items: int
    remote_bytes: int
    queued_items: int
    queued_bytes: int
    spilled_items: int
    spilled_bytes: int
    spill_refused: int
    spill_skipped: int
    spill_failures: int
    hits: int
    hit_bytes: int
    queue_hits: int
    misses: int
    corrupt: int
    fetch_failures: int


@dataclass
class _Spilled:
    node: str
    location: LogLocation
    crc: int


class _SpilledIndex(dict[BlockKey, _Spilled]):
    """Spilled items by key, with their bytes kept by owner as entries come and go (a
    buffer's `stats` asks for its owner's, the metrics for the total: a walk of a million
    entries at each would hold the event loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.total_bytes = 0
        self._by_owner: dict[int, int] = {}

    def owner_bytes(self, owner: int) -> int:
        return self._by_owner.get(owner, 0)

    def _count(self, key: BlockKey, delta: int) -> None:
        self.total_bytes += delta
        add_owned(self._by_owner, key.owner, delta)

    def __setitem__(self, key: BlockKey, value: _Spilled) -> None:
        old = self.get(key)
        if old is not None:
            self._count(key, -old.location.length)
        super().__setitem__(key, value)
        self._count(key, value.location.length)

    def __delitem__(self, key: BlockKey) -> None:
        self._count(key, -self[key].location.length)
        super().__delitem__(key)

    def pop(self, key: BlockKey, default: Any = None) -> Any:
        value = super().pop(key, None)
        if value is None:
            return default
        self._count(key, -value.location.length)
        return value

    def clear(self) -> None:
        super().clear()
        self.total_bytes = 0
        self._by_owner.clear()


@dataclass
class _Queued:
    location: LogLocation
    buf: bytearray


class RemoteMemory:
    """This node's cold blocks in peers' lent memory.

    `lenders()` names the live nodes that lend memory (not this one). Blocks are placed
    on them by key, so a batch goes to few peers; the index says where each went and
    for which log record, so a block written again since is never read from a peer.

    Examples:
        >>> remote = RemoteMemory("n0", transport, lenders=lambda: ["n1"])
        >>> nursery.start_soon(remote.run)
        >>> remote.offer(key, location, block.buf)          # an evicted clean block
        >>> await remote.fetch({key: location})            # {key: bytearray} for hits
    """

    def __init__(
        self,
        me: str,
        transport: PeerTransport,
        lenders: Callable[[], Sequence[str]],
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
    ) -> None:
        self.me = me
        self._transport = transport
        self._lenders = lenders
        self.queue_bytes = queue_bytes
        self._index = _SpilledIndex()
        self._queue: OrderedDict[BlockKey, _Queued] = OrderedDict()
        self._queued_bytes = 0
        self._drops: dict[str, list[ItemKey]] = {}  # stale copies to tell each lender about
        self._paused: dict[str, float] = {}  # lender -> trio time until which it gets no spills
        self._wanted = trio.Event()
        self._spilled_items = self._spilled_bytes = 0
        self._refused = self._skipped = self._spill_failures = 0
        self._hits = self._hit_bytes = self._queue_hits = self._misses = 0
        self._corrupt = self._fetch_failures = 0

    # --- what the block store calls (sync) ---------------------------------------------

    def has(self, key: BlockKey, location: LogLocation) -> bool:
        """Whether a peer (or the spill queue) holds the block as `location` has it."""
        queued = self._queue.get(key)
        if queued is not None:
            return queued.location == location
        spilled = self._index.get(key)
        return spilled is not None and spilled.location == location

    def offer(self, key: BlockKey, location: LogLocation, buf: bytearray) -> None:
        """A clean block left DRAM: queue it for a lender. `buf` is taken over (nobody
        writes an evicted block's buffer). Skipped when a peer has it already, when no
        node lends, or when the queue is full (the log still has it)."""
        if self.has(key, location):
            return
        if not self._lenders() or self._queued_bytes + location.length > self.queue_bytes:
            self._skipped += 1
            return
        self.forget(key)
        self._queue[key] = _Queued(location, buf)
        self._queued_bytes += location.length
        self._wanted.set()

    def forget(self, key: BlockKey) -> None:
        """The block changed or went: its remote copy is stale (the lender is told later)."""
        queued = self._queue.pop(key, None)
        if queued is not None:
            self._queued_bytes -= queued.location.length
        spilled = self._index.pop(key, None)
        if spilled is not None:
            self._drops.setdefault(spilled.node, []).append((key.owner, key.number))

    def forget_node(self, node: str) -> None:
        """A lender left or failed: nothing it holds is used again."""
        for key in [k for k, s in self._index.items() if s.node == node]:
            del self._index[key]
        self._drops.pop(node, None)

    def owner_bytes(self, owner: int) -> int:
        """Bytes of `owner`'s blocks held by peers."""
        return self._index.owner_bytes(owner)

    # --- reading -----------------------------------------------------------------------

    async def fetch(self, wanted: dict[BlockKey, LogLocation]) -> dict[BlockKey, bytearray]:
        """The blocks of `wanted` that the queue or a peer has as those records; the rest
        (not there, stale, corrupt, lender unreachable) are left for the log. Never raises
        for a peer's failure."""
        got: dict[BlockKey, bytearray] = {}
        by_node: dict[str, list[BlockKey]] = {}
        for key, location in wanted.items():
            queued = self._queue.get(key)
            if queued is not None and queued.location == location:
                self._queue.pop(key)
                self._queued_bytes -= location.length
                got[key] = queued.buf if len(queued.buf) == location.length else queued.buf[: location.length]
                self._queue_hits += 1
                continue
            spilled = self._index.get(key)
            if spilled is not None and spilled.location == location:
                by_node.setdefault(spilled.node, []).append(key)
        if by_node:
            async with trio.open_nursery() as nursery:
                for node, keys in by_node.items():
                    nursery.start_soon(self._fetch_from, node, keys, wanted, got)
        return got

    async def _fetch_from(
        self, node: str, keys: list[BlockKey], wanted: dict[BlockKey, LogLocation], got: dict[BlockKey, bytearray]
    ) -> None:
        try:
            reply, payload = await self._transport.call(node, "mem.get", {"from": self.me, "keys": _keys_value(keys)})
            sizes = meta_ints(reply, "sizes").tolist()
            parts = iter(split_payload(payload, [s for s in sizes if s >= 0]))
        except (DistorefsError, KeyError, TypeError, ValueError) as exc:
            self._fetch_failures += 1
            log.warning("remote memory: %s failed, reading its items from the log: %s", node, exc)
            self.forget_node(node)
            self._paused[node] = trio.current_time() + FAILED_NODE_PAUSE_S
            return
        for key, size in zip(keys, sizes, strict=True):
            spilled = self._index.get(key)
            if size < 0:
                self._misses += 1
                self._index.pop(key, None)  # the lender let it go
                continue
            part = next(parts)
            if spilled is None or spilled.location != wanted[key]:
                continue  # changed while the call was out
            if size != spilled.location.length or crc32c.crc32c(part) != spilled.crc:
                self._corrupt += 1
                self._index.pop(key, None)
                log.warning("remote memory: %s sent a bad copy of %s; reading it from the log", node, key)
                continue
            got[key] = bytearray(part)
            self._hits += 1
            self._hit_bytes += size

    # --- spilling (background) -------------------------------------------------------------

    def _place(self, key: BlockKey, lenders: Sequence[str]) -> str:
        return lenders[hash((key.owner, key.number)) % len(lenders)]

    async def run(self) -> None:
        """Background task: send queued blocks to lenders, a batch per lender at a time."""
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            while self._queue:
                await self._spill_batch()

    async def _spill_batch(self) -> None:
        now = trio.current_time()
        lenders = [n for n in self._lenders() if self._paused.get(n, 0.0) <= now]
        if not lenders:
            self._skipped += len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            return
        batches: dict[str, list[tuple[BlockKey, _Queued]]] = {}
        size = 0
        for key, queued in list(self._queue.items()):
            if size and size + queued.location.length > SPILL_BATCH_BYTES:
                break
            batches.setdefault(self._place(key, lenders), []).append((key, queued))
            size += queued.location.length
        async with trio.open_nursery() as nursery:
            for node, batch in batches.items():
                nursery.start_soon(self._spill_to, node, batch)

    async def _spill_to(self, node: str, batch: list[tuple[BlockKey, _Queued]]) -> None:
        views = [memoryview(q.buf)[: q.location.length] for _k, q in batch]
        crcs = await trio.to_thread.run_sync(lambda: [crc32c.crc32c(v) for v in views])
        drops = self._drops.pop(node, [])
        meta = {
            "from": self.me,
            "keys": _keys_value([k for k, _q in batch]),
            "sizes": ints_value(len(v) for v in views),
            "drop": _keys_value(drops),
        }
        ok = False
        try:
            reply, _payload = await self._transport.call(node, "mem.put", meta, views)
            ok = True
            self._refused += len(batch) - int(reply.get("kept", len(batch)))
        except DistorefsError as exc:
            self._spill_failures += 1
            log.warning("remote memory: spilling to %s failed; pausing it for %g s: %s", node, FAILED_NODE_PAUSE_S, exc)
            self._paused[node] = trio.current_time() + FAILED_NODE_PAUSE_S
            self.forget_node(node)
        finally:
            for view in views:
                view.release()
        for (key, queued), crc in zip(batch, crcs, strict=True):
            if self._queue.get(key) is not queued:
                if ok:  # changed, read back or forgotten meanwhile: the copy there is stale
                    self._drops.setdefault(node, []).append((key.owner, key.number))
                continue
            del self._queue[key]
            self._queued_bytes -= queued.location.length
            if ok:  # a refused item (bigger than the lender's budget) shows up as a miss
                self._index[key] = _Spilled(node, queued.location, crc)
                self._spilled_items += 1
                self._spilled_bytes += queued.location.length

    async def release_all(self) -> None:
        """Tell every lender to drop this node's items (a clean unmount); best effort."""
        for node in {s.node for s in self._index.values()}:
            try:
                await self._transport.call(node, "mem.drop", {"from": self.me}, timeout_s=1.0)
            except DistorefsError as exc:
                log.info("remote memory: could not release %s: %s", node, exc)
        self._index.clear()

    def statistics(self) -> RemoteMemoryStatistics:
        return RemoteMemoryStatistics(
            remote_items=len(self._index),
            remote_bytes=self._index.total_bytes,
            queued_items=len(self._queue),
            queued_bytes=self._queued_bytes,
            spilled_items=self._spilled_items,
            spilled_bytes=self._spilled_bytes,
            spill_refused=self._refused,
            spill_skipped=self._skipped,
            spill_failures=self._spill_failures,
            hits=self._hits,
            hit_bytes=self._hit_bytes,
            queue_hits=self._queue_hits,
            misses=self._misses,
            corrupt=self._corrupt,
            fetch_failures=self._fetch_failures,
        )
