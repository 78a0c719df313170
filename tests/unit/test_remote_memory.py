"""The remote memory tier without a mount: a real block store whose DRAM is full spills
cold items to a LentMemory served by a real PeerServer on loopback, and reads them back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio
import trio.testing

from distorefs.cluster.rpc import PeerServer, PeerTransport
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.dram import DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import NvmeLog
from distorefs.tiers.remote_memory import LentMemory, RemoteMemory
from distorefs.types import BlockKey

SECRET = b"the remote memory tests' cluster secret"

BLOCK = 64 * 1024
OWNER = 7
ITEM = 30_000


def item(i: int, generation: int = 0) -> bytes:
    return (f"item {i} gen {generation} ".encode() * (ITEM // 8))[:ITEM]


def test_lent_memory_keeps_the_newest_items_under_its_budget() -> None:
    lent = LentMemory(budget_bytes=250)
    assert lent.put("a", [(1, n) for n in range(3)], [bytes([n]) * 100 for n in range(3)]) == 3
    assert lent.used_bytes == 200  # item 0 went to make room for item 2
    assert lent.get("a", [(1, 0), (1, 1), (1, 2)]) == [None, b"\1" * 100, b"\2" * 100]
    assert lent.put("a", [(1, 9)], [b"x" * 251]) == 0  # bigger than the whole budget: refused
    assert lent.get("b", [(1, 1)]) == [None]  # items are per borrower
    lent.put("b", [(1, 1)], [b"b"])
    lent.drop("a")
    assert lent.borrowers() == {"b"}
    assert lent.used_bytes == 1
    stats = lent.statistics()
    assert (stats.stored, stats.served, stats.missed, stats.dropped) == (4, 2, 2, 1)


@dataclass
class Pair:
    blocks: BlockStore
    remote: RemoteMemory
    lent: LentMemory
    stop_lender: Callable[[], None]

    async def drain(self) -> None:
        with trio.fail_after(10):
            while self.remote.statistics().queued_items:
                await trio.sleep(0.01)

    async def read_all(self, count: int) -> list[bytes]:
        blocks = await self.blocks.get_many([BlockKey(OWNER, i) for i in range(count)])
        return [bytes(b.buf[: b.length]) for b in blocks if b is not None]


@asynccontextmanager
async def borrower_and_lender(tmp_path: Path, lend_bytes: int = 64 << 20) -> AsyncIterator[Pair]:
    """A block store with 8 blocks of DRAM spilling owner 7 to a lender on loopback."""
    log = NvmeLog.open(str(tmp_path / "log"), segment_bytes=16 * BLOCK)
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    lent = LentMemory(lend_bytes)
    server = PeerServer(SECRET)
    lent.register(server)
    async with trio.open_nursery() as nursery:
        lender_scope = trio.CancelScope()

        async def serve(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
            with lender_scope:
                await server.serve("127.0.0.1", 0, task_status=task_status)

        port = await nursery.start(serve)
        transport = PeerTransport(lambda node: ("127.0.0.1", port), timeout_s=2.0, secret=SECRET)
        remote = RemoteMemory("n0", transport, lenders=lambda: ["n1"])
        blocks = BlockStore(log, DramCache(8 * BLOCK), meta, block_bytes=BLOCK, remote=remote)
        blocks.spill(OWNER)
        nursery.start_soon(remote.run)
        try:
            yield Pair(blocks, remote, lent, lender_scope.cancel)
        finally:
            transport.close()
            nursery.cancel_scope.cancel()
    await blocks.close()
    meta.close()


async def fill(pair: Pair, count: int, generation: int = 0) -> None:
    for i in range(count):
        await pair.blocks.put(BlockKey(OWNER, i), item(i, generation))
    await pair.blocks.flush()
    await pair.blocks.commit()


async def test_cold_items_go_to_the_lender_and_come_back_from_it(tmp_path: Path) -> None:
    async with borrower_and_lender(tmp_path) as pair:
        await fill(pair, 60)  # 1.8 MB into 512 KiB of DRAM
        await pair.read_all(60)  # evicts clean items: they are offered to the lender
        await pair.drain()
        spilled = pair.remote.statistics()
        assert spilled.spilled_items >= 40
        assert pair.lent.statistics().items == spilled.remote_items
        assert pair.blocks.remote_bytes(OWNER) == spilled.remote_items * ITEM

        assert await pair.read_all(60) == [item(i) for i in range(60)]
        after = pair.remote.statistics()
        assert after.hits >= 40  # most cold items came from the lender, not the log
        assert after.hit_bytes == after.hits * ITEM
        assert pair.lent.statistics().served == after.hits
        assert pair.blocks.statistics().remote_loaded_blocks == after.hits + after.queue_hits


async def test_an_item_written_again_is_never_read_stale_from_the_lender(tmp_path: Path) -> None:
    async with borrower_and_lender(tmp_path) as pair:
        await fill(pair, 60)
        await pair.read_all(60)
        await pair.drain()
        assert pair.remote.statistics().remote_items >= 40
        await fill(pair, 60, generation=1)  # new log records: every remote copy is stale
        assert await pair.read_all(60) == [item(i, 1) for i in range(60)]
        await pair.drain()
        await pair.read_all(60)  # the second pass spills the new generation; stale drops ride along
        await pair.drain()
        assert await pair.read_all(60) == [item(i, 1) for i in range(60)]
        assert pair.lent.statistics().items == pair.remote.statistics().remote_items
        # the bytes held by peers are kept as copies come and go stale, not walked
        assert pair.blocks.remote_bytes(OWNER) == pair.remote.statistics().remote_items * ITEM
        assert pair.remote.statistics().remote_bytes == pair.remote.statistics().remote_items * ITEM


async def test_a_corrupt_copy_is_refused_and_the_log_answers(tmp_path: Path) -> None:
    async with borrower_and_lender(tmp_path) as pair:
        await fill(pair, 60)
        await pair.read_all(60)
        await pair.drain()
        victims = [key for key in pair.lent._items if key[0] == "n0"][:3]
        for slot in victims:
            pair.lent._items[slot] = b"\0" * ITEM  # a lender's memory went bad
        assert await pair.read_all(60) == [item(i) for i in range(60)]
        assert pair.remote.statistics().corrupt == 3


async def test_a_dead_lender_costs_one_failed_call_and_no_data(tmp_path: Path) -> None:
    async with borrower_and_lender(tmp_path) as pair:
        await fill(pair, 60)
        await pair.read_all(60)
        await pair.drain()
        assert pair.remote.statistics().remote_items >= 40
        pair.stop_lender()
        await trio.testing.wait_all_tasks_blocked()  # the lender's server has exited
        with trio.fail_after(5):  # bounded by the peer timeout (2 s), not stuck
            assert await pair.read_all(60) == [item(i) for i in range(60)]
        stats = pair.remote.statistics()
        assert stats.fetch_failures == 1
        assert stats.remote_items == 0  # nothing it held is asked for again
        assert (stats.remote_bytes, pair.blocks.remote_bytes(OWNER)) == (0, 0)
        assert await pair.read_all(60) == [item(i) for i in range(60)]
        assert pair.remote.statistics().fetch_failures == 1


async def test_without_lenders_nothing_is_queued(tmp_path: Path) -> None:
    log = NvmeLog.open(str(tmp_path / "log"), segment_bytes=16 * BLOCK)
    meta = MetaDb.open(str(tmp_path / "meta.sqlite"))
    remote = RemoteMemory("n0", PeerTransport(lambda node: None, secret=SECRET), lenders=lambda: [])
    blocks = BlockStore(log, DramCache(8 * BLOCK), meta, block_bytes=BLOCK, remote=remote)
    blocks.spill(OWNER)
    for i in range(40):
        await blocks.put(BlockKey(OWNER, i), item(i))
    await blocks.flush()
    got = await blocks.get_many([BlockKey(OWNER, i) for i in range(40)])
    assert [bytes(b.buf[: b.length]) for b in got if b is not None] == [item(i) for i in range(40)]
    stats = remote.statistics()
    assert stats.queued_items == 0
    assert stats.spill_skipped > 0
    await blocks.close()
    meta.close()


async def test_only_spillable_owners_are_offered(tmp_path: Path) -> None:
    owner = OWNER + 1  # a file's blocks, say
    async with borrower_and_lender(tmp_path) as pair:
        for i in range(40):
            await pair.blocks.put(BlockKey(owner, i), item(i))
        await pair.blocks.flush()
        await pair.blocks.get_many([BlockKey(owner, i) for i in range(40)])
        await pair.drain()
        assert pair.remote.statistics().spilled_items == 0
