"""ShardedBuffer without a network: three real ReplayBuffers as shards, reached through an
in-memory ShardPeer (the real one is tested over loopback in tests/cluster)."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from distorefs.errors import FileTooLarge, InvalidArgument, TryAgain
from distorefs.stores.replay.buffer import ReplayBuffer
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.draws import Drawn, ShardState, merged_payloads
from distorefs.stores.replay.sharded import ShardedBuffer, ShardLayout
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from tests.unit.tiers import open_tiers

NODES = ["a", "b", "c"]
SCHEMA = {"x": "int64"}


class InMemoryPeer:
    """Answers for the shards on other 'nodes' by calling their buffers directly.
    `refuse` makes a node answer EAGAIN to its first N picks (its limiter said no
    between its state and its pick)."""

    def __init__(
        self, shards: dict[str, ReplayBuffer], me: str, live: set[str], refuse: dict[str, int] | None = None
    ) -> None:
        self.shards = shards
        self.me = me
        self.live = live
        self.refuse = dict(refuse or {})
        self.calls = 0

    def alive(self, node: str) -> bool:
        return node in self.live

    def shard_limit(self) -> int:
        return len(self.live)

    async def shard_state(self, node: str, name: str) -> ShardState:
        self.calls += 1
        return self.shards[node].shard_state()

    async def pick(self, node: str, name: str, count: int) -> Drawn:
        self.calls += 1
        if self.refuse.get(node, 0) > 0:
            self.refuse[node] -= 1
            raise TryAgain(f"{node}: rate limited")
        return await self.shards[node].pick(count, nonblocking=True)

    async def commit(self, node: str, name: str, indices: np.ndarray) -> None:
        self.shards[node].commit(indices)

    async def append(self, node: str, name: str, items: Sequence[bytes | bytearray], nonblocking: bool) -> list[int]:
        return await self.shards[node].append_local(items, nonblocking=nonblocking)

    async def update_priorities(self, node: str, name: str, indices: np.ndarray, priorities: np.ndarray) -> None:
        self.shards[node].set_priorities(indices, priorities)


@pytest.fixture
async def shards(tmp_path: Path) -> AsyncIterator[dict[str, ReplayBuffer]]:
    tiers: list[tuple[BlockStore, MetaDb]] = []
    out = {}
    for i, node in enumerate(NODES):
        path = tmp_path / node
        path.mkdir()
        tiers.append(open_tiers(path, 1 << 16, 256))
        config = BufferConfig().updated(
            "t", {"sampler": "prioritized", "alpha": 1.0, "beta": 1.0, "epsilon": 0.0, "schema": SCHEMA,
                  "capacity": 1000, "shards": 3}, has_items=False,
        )  # fmt: skip
        out[node] = ReplayBuffer("t", (1 << 48) + i, config, *tiers[-1])
    yield out
    for blocks, _meta in tiers:
        await blocks.close()


def view(shards: dict[str, ReplayBuffer], me: str, alive: set[str] | None = None) -> ShardedBuffer:
    live = set(NODES) if alive is None else alive
    return ShardedBuffer("t", shards[me].config, ShardLayout(NODES), shards[me], InMemoryPeer(shards, me, live))


def records(values: range) -> list[bytes]:
    return [np.int64(v).tobytes() for v in values]


async def test_appends_go_to_the_local_shard_and_indices_carry_it(shards: dict[str, ReplayBuffer]) -> None:
    assert await view(shards, "b").append(records(range(3))) == [1, 4, 7]  # local 0..2, shard 1
    assert shards["b"].size == 3
    assert shards["a"].size == 0


async def test_sample_splits_by_shard_priority_and_weighs_over_the_whole_buffer(
    shards: dict[str, ReplayBuffer],
) -> None:
    # 100 items on a (value 0..99), 200 on b (100..299), 100 on c (300..399)
    for node, values in zip(NODES, (range(0, 100), range(100, 300), range(300, 400)), strict=True):
        await view(shards, node).append(records(values))
    sharded = view(shards, "a")
    c_indices = np.arange(100) * 3 + 2
    await sharded.update_priorities(c_indices, np.full(100, 3.0))  # routed to c: mass 100:200:300
    counts = np.zeros(3)
    for _ in range(60):
        batch = await sharded.sample(100)
        array = np.load(io.BytesIO(bytes(batch.data)))
        shard = array["_index"] % 3
        counts += np.bincount(shard, minlength=3)
        # the value tells which node stored it; the global index says the same shard
        assert (np.searchsorted([100, 300], array["x"], side="right") == shard).all()
        # P = p / 600 for p in {1, 3}; w = (N P)^-1 / (N * 1/600)^-1 = 1/p
        assert np.allclose(array["_weight"], np.where(shard == 2, 1 / 3, 1.0), rtol=1e-5)
    fractions = counts / counts.sum()
    assert np.allclose(fractions, [1 / 6, 2 / 6, 3 / 6], atol=0.03), fractions


async def test_a_shard_on_a_dead_node_is_left_out_of_draws(shards: dict[str, ReplayBuffer]) -> None:
    for node in NODES:
        await view(shards, node).append(records(range(10)))
    sharded = view(shards, "a", alive={"a", "b"})
    batch = await sharded.sample(64)
    assert set((batch.indices % 3).tolist()) <= {0, 1}
    assert sharded.partial_draws == 1


async def test_no_live_shard_is_eagain_at_once(shards: dict[str, ReplayBuffer]) -> None:
    sharded = ShardedBuffer("t", shards["a"].config, ShardLayout(["b", "c"]), None, InMemoryPeer(shards, "a", set()))
    with pytest.raises(TryAgain, match="no shard is on a live node"):
        await sharded.sample(4)


async def test_bad_priority_applies_to_no_shard(shards: dict[str, ReplayBuffer]) -> None:
    for node in NODES:
        await view(shards, node).append(records(range(2)))
    sharded = view(shards, "a")
    with pytest.raises(InvalidArgument, match="finite and >= 0"):
        await sharded.update_priorities(np.array([0, 1, 2]), np.array([2.0, 2.0, -1.0]))
    assert all(s.shard_state().mass == 2.0 for s in shards.values())  # still the default 1.0 each


async def test_a_shard_saying_eagain_counts_nothing_so_every_item_is_delivered_as_often_as_counted(
    shards: dict[str, ReplayBuffer],
) -> None:
    for node in NODES:
        shards[node].reconfigure({"max_times_sampled": 1})
        await view(shards, node).append(records(range(10)))
    peer = InMemoryPeer(shards, "a", set(NODES), refuse={"c": 3})
    sharded = ShardedBuffer("t", shards["a"].config, ShardLayout(NODES), shards["a"], peer)
    delivered: Counter[int] = Counter()
    eagain = 0
    for _ in range(200):
        if not any(shard.size for shard in shards.values()):
            break
        try:
            batch = await sharded.sample(3, nonblocking=True)
        except TryAgain:
            eagain += 1
            continue
        got = np.load(io.BytesIO(bytes(batch.data)))
        delivered.update(got["_index"].tolist())
    assert eagain >= 1
    assert peer.refuse == {"c": 0}
    assert not any(shard.size for shard in shards.values())
    for shard_number, node in enumerate(NODES):
        from_shard = sum(n for index, n in delivered.items() if index % 3 == shard_number)
        assert shards[node].samples == from_shard, node
        assert shards[node].removed == len([i for i in delivered if i % 3 == shard_number]) == 10, node


async def test_the_node_that_joins_a_schema_batch_checks_the_whole_before_any_shard_draws(tmp_path: Path) -> None:
    """Each shard checks its part against its own bound; the joining node's whole batch
    (count x record size, known before the draw) must fit its bound too: half the DRAM
    budget, 16 KiB here (2,048 records of 8 bytes)."""
    shards = {}
    opened = []
    for i, node in enumerate(NODES):
        (tmp_path / node).mkdir()
        opened.append(open_tiers(tmp_path / node, 4096, 8))  # a 32 KiB budget
        config = BufferConfig().updated("t", {"schema": SCHEMA, "capacity": 100, "shards": 3}, has_items=False)
        shards[node] = ReplayBuffer("t", (1 << 48) + i, config, *opened[-1])
    try:
        for node in NODES:
            await view(shards, node).append(records(range(10)))
        joined = shards["a"]
        joined.spread_over(view(shards, "a"))
        with pytest.raises(FileTooLarge):
            await joined.sample(2049)
        assert all(s.samples == 0 for s in shards.values())  # no shard drew or counted anything
        batch = await joined.sample(2048)
        assert len(np.load(io.BytesIO(bytes(batch.data)))) == 2048
    finally:
        for blocks, _meta in opened:
            await blocks.close()


async def test_the_node_that_joins_a_blob_batch_checks_the_whole_before_anything_is_counted(tmp_path: Path) -> None:
    """A blob buffer's batch has no size until its items are drawn: each shard checks its
    own part, and the joining node checks the parts together once they have come, before
    it joins them and before any shard counts its part (it checked nothing before: three
    shards could hand one node three times its bound). 1,000-byte items, a bound of 16 KiB."""
    shards = {}
    opened = []
    for i, node in enumerate(NODES):
        (tmp_path / node).mkdir()
        opened.append(open_tiers(tmp_path / node, 4096, 8))  # a 32 KiB budget
        config = BufferConfig().updated("t", {"capacity": 100, "shards": 3}, has_items=False)
        shards[node] = ReplayBuffer("t", (1 << 48) + i, config, *opened[-1])
    try:
        for node in NODES:
            await view(shards, node).append([bytes([i]) * 1000 for i in range(10)])
        joined = shards["a"]
        joined.spread_over(view(shards, "a"))
        with pytest.raises(FileTooLarge, match="a batch of 24 items is 24000 bytes"):
            await joined.sample(24)  # 8 or so from each shard: each part within its shard's bound
        assert all(s.samples == 0 for s in shards.values())  # no shard counted its part
        batch = await joined.sample(16)
        assert len(batch.indices) == 16
        assert sum(s.samples for s in shards.values()) == 16
    finally:
        for blocks, _meta in opened:
            await blocks.close()


async def test_a_shard_whose_config_differs_makes_eagain_with_its_reason_and_counts_nothing(tmp_path: Path) -> None:
    """Configs reach the other nodes a moment later: a shard can still hold blobs when
    the joining node's buffer has a schema. Its part used to reach the schema batch's
    encoder as records (an internal error, EIO, on every such draw); now the draw is set
    aside with nothing counted, tried again, and EAGAIN says why."""
    shards = {}
    opened = []
    for i, node in enumerate(NODES[:2]):
        (tmp_path / node).mkdir()
        opened.append(open_tiers(tmp_path / node, 1 << 16, 256))
        settings: dict[str, object] = {"capacity": 100, "shards": 2, "sample_timeout": 0.2}
        if node == "a":
            settings["schema"] = SCHEMA
        config = BufferConfig().updated("t", settings, has_items=False)
        shards[node] = ReplayBuffer("t", (1 << 48) + i, config, *opened[-1])
    try:
        await shards["a"].append_local(records(range(10)))
        await shards["b"].append_local([b"abc"] * 10)
        sharded = ShardedBuffer("t", shards["a"].config, ShardLayout(NODES[:2]), shards["a"],
                                InMemoryPeer(shards, "a", set(NODES[:2])))  # fmt: skip
        with pytest.raises(TryAgain, match=r"shard 1 \(node b\) holds items that are not records of 8 bytes"):
            await sharded.sample(64)  # both shards are drawn from, every time
        assert sharded.mismatched_draws >= 1
        assert shards["a"].samples == 0
        assert shards["b"].samples == 0
    finally:
        for blocks, _meta in opened:
            await blocks.close()


def test_a_batch_in_parts_keeps_its_records_as_one_array_in_shard_order() -> None:
    """A schema buffer's shard picks its records as one array (a view per record cost 0.2
    s for 100,000); parts that came as lists (a shard without rows) join them in place."""
    first = np.arange(16, dtype=np.uint8).reshape(2, 8)
    listed = [bytes([100 + i] * 8) for i in range(3)]
    last = np.full((1, 8), 7, dtype=np.uint8)
    merged = merged_payloads([first, listed, last])
    assert isinstance(merged, np.ndarray)
    assert merged.shape == (6, 8)
    assert [bytes(row) for row in merged] == [bytes(first[0]), bytes(first[1]), *listed, bytes(last[0])]
    assert merged_payloads([first]) is first  # one part: no copy
    blobs = merged_payloads([[b"a", b"bc"], [], [b"def"]])
    assert blobs == [b"a", b"bc", b"def"]
