"""The weights store without a mount: versions, holding, group publish, persistence, waits."""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from distorefs.errors import DistorefsError
from distorefs.ids import WEIGHT_OWNER_BASE
from distorefs.stores.replay.mirror import ArenaBudget
from distorefs.stores.weights import SHARED_SEALS, WeightStore
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.metadb import MetaDb
from tests.unit.tiers import open_tiers

BLOCK = 64 * 1024


def open_store(path: Path) -> tuple[WeightStore, BlockStore, MetaDb]:
    blocks, meta = open_tiers(path, BLOCK, 64)
    return WeightStore.load(blocks, meta), blocks, meta


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[WeightStore]:
    weights, blocks, meta = open_store(tmp_path)
    yield weights
    await blocks.close()
    meta.close()


async def publish_bytes(store: WeightStore, model_name: bytes, name: bytes, data: bytes) -> int:
    pending = await store.begin_write()
    await store.write(pending, 0, data)
    version = await store.publish(store.model(model_name), {name: pending})
    store.release(pending)
    return version


async def read_all(store: WeightStore, model_name: bytes, name: bytes) -> bytes:
    wf = store.model(model_name).files[name]
    return bytes(await store.read(wf, 0, wf.size))


async def test_a_held_version_stays_whole_while_newer_ones_are_published(store: WeightStore) -> None:
    store.create_model(b"m")
    first = bytes(range(256)) * (3 * BLOCK // 256)  # spans blocks
    await publish_bytes(store, b"m", b"w", first)
    held = store.model(b"m").files[b"w"]
    store.hold(held)
    for i in range(5):
        await publish_bytes(store, b"m", b"w", bytes([i]) * BLOCK)
    assert bytes(await store.read(held, 0, held.size)) == first
    assert store.model(b"m").version == 6
    store.release(held)
    assert held.freed
    with pytest.raises(DistorefsError) as excinfo:
        await store.read(held, 0, 1)
    assert excinfo.value.errno == errno.ENOENT


async def test_unheld_old_versions_free_their_blocks(store: WeightStore) -> None:
    store.create_model(b"m")
    await publish_bytes(store, b"m", b"w", b"a" * (2 * BLOCK))
    old = store.model(b"m").files[b"w"]
    await publish_bytes(store, b"m", b"w", b"b" * (2 * BLOCK))
    assert old.freed
    assert store._blocks.owner_keys(old.owner) == []


async def test_group_publish_by_renaming_a_model_onto_another(store: WeightStore) -> None:
    store.create_model(b"policy")
    await publish_bytes(store, b"policy", b"a", b"old-a")
    await publish_bytes(store, b"policy", b"stale", b"gone after the swap")
    store.create_model(b"stage")
    await publish_bytes(store, b"stage", b"a", b"new-a")
    await publish_bytes(store, b"stage", b"b", b"new-b")
    before = store.model(b"policy").version
    await store.rename_model(b"stage", b"policy", noreplace=False)
    model = store.model(b"policy")
    assert model.version == before + 1
    assert sorted(model.files) == [b"a", b"b"]
    assert await read_all(store, b"policy", b"a") == b"new-a"
    assert b"stage" not in store.models


async def test_rename_noreplace_and_reserved_names_refused(store: WeightStore) -> None:
    store.create_model(b"a")
    store.create_model(b"b")
    with pytest.raises(DistorefsError) as excinfo:
        await store.rename_model(b"a", b"b", noreplace=True)
    assert excinfo.value.errno == errno.EEXIST
    pending = await store.begin_write()
    with pytest.raises(DistorefsError) as excinfo:
        await store.publish(store.model(b"a"), {b"version": pending})
    assert excinfo.value.errno == errno.EEXIST
    assert store.model(b"a").version == 0


async def test_copy_on_write_open_starts_from_the_current_bytes(store: WeightStore) -> None:
    store.create_model(b"m")
    await publish_bytes(store, b"m", b"w", b"0123456789")
    pending = await store.begin_write(store.model(b"m").files[b"w"])
    await store.write(pending, 2, b"ab")
    assert await read_all(store, b"m", b"w") == b"0123456789"  # unpublished
    await store.publish(store.model(b"m"), {b"w": pending})
    assert await read_all(store, b"m", b"w") == b"01ab456789"


async def test_versions_survive_a_reopen_and_orphans_are_dropped(tmp_path: Path) -> None:
    store, blocks, meta = open_store(tmp_path)
    store.create_model(b"m")
    await publish_bytes(store, b"m", b"w", b"x" * (BLOCK + 7))
    orphan = await store.begin_write()  # a writer that never published
    await store.write(orphan, 0, b"never published")
    await blocks.flush()
    await blocks.commit()
    await blocks.close()
    meta.close()

    store, blocks, meta = open_store(tmp_path)
    try:
        assert store.model(b"m").version == 1
        assert await read_all(store, b"m", b"w") == b"x" * (BLOCK + 7)
        owners = {o for o in blocks.owners() if o >= WEIGHT_OWNER_BASE}
        assert owners == {store.model(b"m").files[b"w"].owner}
    finally:
        await blocks.close()
        meta.close()


async def test_wait_newer_wakes_on_publish_and_bounds_its_wait(store: WeightStore) -> None:
    model = store.create_model(b"m")
    with pytest.raises(DistorefsError) as excinfo:
        await store.wait_newer(model, 0, 10.0, nonblocking=True)
    assert excinfo.value.errno == errno.EAGAIN
    with pytest.raises(DistorefsError) as excinfo:
        await store.wait_newer(model, 0, 0.05, nonblocking=False)
    assert excinfo.value.errno == errno.ETIMEDOUT
    got: list[int] = []
    async with trio.open_nursery() as nursery:

        async def waiter() -> None:
            got.append(await store.wait_newer(model, 0, 10.0, nonblocking=False))

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()  # the waiter is parked in wait_newer
        assert got == []
        await publish_bytes(store, b"m", b"w", b"v1")
    assert got == [1]


# --- shared copies (client.map_version's memfd) ------------------------------------------


def budget_of(store: WeightStore, limit: int) -> ArenaBudget:
    budget = ArenaBudget(lambda n: True, lambda n: None, limit)
    store.shared_budget = budget
    return budget


async def test_a_shared_copy_is_the_versions_bytes_sealed_made_once_and_freed_with_the_version(
    store: WeightStore,
) -> None:
    budget = budget_of(store, 1 << 20)
    store.create_model(b"m")
    first = bytes(range(256)) * (3 * BLOCK // 256)
    await publish_bytes(store, b"m", b"w", first)
    wf = store.model(b"m").files[b"w"]
    fd, size = await store.shared_copy(wf)
    again, _ = await store.shared_copy(wf)
    try:
        assert size == len(first)
        assert os.pread(fd, size + 1, 0) == first
        assert store.shared_copies == 1  # the second reader got the same memfd
        assert os.fstat(fd).st_ino == os.fstat(again).st_ino
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & SHARED_SEALS == SHARED_SEALS  # nobody changes the bytes, nor the seals
        with pytest.raises(OSError) as excinfo:
            os.write(fd, b"x")
        assert excinfo.value.errno == errno.EBADF  # and the descriptor is read-only
        assert budget.used_bytes == 3 * BLOCK
        await publish_bytes(store, b"m", b"w", b"next")  # the old version is freed ...
        assert budget.used_bytes == 0  # ... and its copy with it
        assert os.pread(fd, 16, 0) == first[:16]  # a descriptor held elsewhere keeps its pages
        with pytest.raises(DistorefsError) as gone:
            await store.shared_copy(wf)
        assert gone.value.errno == errno.ENOENT
    finally:
        os.close(fd)
        os.close(again)


async def test_a_shared_copy_past_the_budget_is_refused_and_reserves_nothing(store: WeightStore) -> None:
    budget = budget_of(store, 2 * BLOCK)
    store.create_model(b"m")
    await publish_bytes(store, b"m", b"w", b"x" * (3 * BLOCK))
    with pytest.raises(DistorefsError) as excinfo:
        await store.shared_copy(store.model(b"m").files[b"w"])
    assert excinfo.value.errno == errno.ENOMEM
    assert budget.used_bytes == 0
    store.shared_budget = None
    with pytest.raises(DistorefsError) as off:
        await store.shared_copy(store.model(b"m").files[b"w"])
    assert off.value.errno == errno.ENOTSUP


async def test_published_files_are_copied_in_the_background_within_their_share(store: WeightStore) -> None:
    budget = budget_of(store, 8 * BLOCK)  # eager copies: up to half of it
    store.create_model(b"m")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.run_sharing)
        await publish_bytes(store, b"m", b"small", b"s" * BLOCK)
        small = store.model(b"m").files[b"small"]
        with trio.fail_after(10):  # the copy is made from a thread
            while small.shared is None:
                await trio.sleep(0.01)
        await publish_bytes(store, b"m", b"big", b"b" * (4 * BLOCK))  # past the eager share
        await trio.testing.wait_all_tasks_blocked()
        assert store.model(b"m").files[b"big"].shared is None
        assert budget.used_bytes == BLOCK
        fd, size = await store.shared_copy(store.model(b"m").files[b"big"])  # a reader asks: made then
        os.close(fd)
        assert size == 4 * BLOCK
        assert budget.used_bytes == 5 * BLOCK
        nursery.cancel_scope.cancel()
    store.close_shared()
    assert budget.used_bytes == 0
