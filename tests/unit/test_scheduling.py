"""scheduling: a FUSE request's checkpoints are cancel points whose schedule point waits
for the end of the request (its first DEFER_S), and trio's checkpoints everywhere else."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from distorefs import scheduling
from distorefs.errors import InvalidArgument
from tests.conftest import Ticker


async def _with_ticker(body: Callable[[Ticker], Awaitable[None]]) -> None:
    ticker = Ticker()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker.run)
        await body(ticker)
        nursery.cancel_scope.cancel()


async def test_outside_a_request_a_checkpoint_lets_other_tasks_run() -> None:
    async def body(ticker: Ticker) -> None:
        assert await ticker.runs_during(scheduling.checkpoint)
        assert await ticker.runs_during(scheduling.cancel_shielded_checkpoint)

    await _with_ticker(body)


async def test_inside_a_request_checkpoints_do_not_yield_until_it_ends() -> None:
    async def body(ticker: Ticker) -> None:
        with scheduling.deferring():
            assert not await ticker.runs_during(scheduling.checkpoint)
            assert not await ticker.runs_during(scheduling.cancel_shielded_checkpoint)
        assert await ticker.runs_during(trio.lowlevel.checkpoint)  # pyfuse3's loop, after the reply
        assert await ticker.runs_during(scheduling.checkpoint)  # and the mark is gone

    await _with_ticker(body)


async def test_inside_a_request_a_checkpoint_is_still_a_cancel_point() -> None:
    with trio.CancelScope() as scope:
        with scheduling.deferring():
            scope.cancel()
            await scheduling.cancel_shielded_checkpoint()  # shielded: no Cancelled
            await scheduling.checkpoint()
        raise AssertionError("not reached: the checkpoint raised Cancelled")  # pragma: no cover
    assert scope.cancelled_caught


async def test_a_request_longer_than_its_deferral_yields_again() -> None:
    async def body(ticker: Ticker) -> None:
        with scheduling.deferring():
            assert not await ticker.runs_during(scheduling.checkpoint)
            until = time.perf_counter() + 2 * scheduling.DEFER_S
            while time.perf_counter() < until:  # work without an await, longer than the deferral
                pass
            assert await ticker.runs_during(scheduling.checkpoint)

    await _with_ticker(body)


async def test_a_task_started_by_a_request_is_not_deferred() -> None:
    ran: list[bool] = []

    async def body(ticker: Ticker) -> None:
        async def spawned() -> None:
            ran.append(await ticker.runs_during(scheduling.checkpoint))

        async with trio.open_nursery() as inner:
            with scheduling.deferring():
                inner.start_soon(spawned)
        assert ran == [True]

    await _with_ticker(body)


async def test_the_mark_goes_with_the_request_even_when_it_fails() -> None:
    async def body(ticker: Ticker) -> None:
        with pytest.raises(ValueError, match="a failed request"), scheduling.deferring():
            raise ValueError("a failed request")
        assert not scheduling._deferring
        assert await ticker.runs_during(scheduling.checkpoint)

    await _with_ticker(body)


async def test_big_copies_go_in_slices_with_the_event_loop_let_go_between() -> None:
    data = bytearray(range(256)) * ((9 * scheduling.SLICE_BYTES + 1000) // 256)
    calls: list[tuple[int, int]] = []

    async def read(offset: int, nbytes: int) -> memoryview:
        calls.append((offset, nbytes))
        return memoryview(data)[offset : offset + nbytes]  # a view, as of a cached block

    async def body(ticker: Ticker) -> None:
        before = ticker.passes
        slices = await scheduling.read_sliced(read, 1000, len(data) - 1000)
        assert ticker.passes - before >= 5  # others ran between the slices
        assert b"".join(slices) == bytes(data[1000:])
        assert all(isinstance(s, bytes) for s in slices)  # copies, not views kept past an await
        assert max(n for _o, n in calls) == scheduling.SLICE_BYTES
        assert len(calls) == 9
        written = bytearray(len(data))

        async def write(offset: int, view: memoryview) -> None:
            assert len(view) <= scheduling.SLICE_BYTES
            written[offset : offset + len(view)] = view

        before = ticker.passes
        await scheduling.write_sliced(write, 0, memoryview(data))
        assert ticker.passes - before >= 5
        assert written == data

    await _with_ticker(body)


async def test_after_reply_runs_work_in_order_one_piece_per_key() -> None:
    """`AfterReply` (a mount's `VirtualTree.after_reply`): pieces run in the order given; a newer piece of a key
    still waiting replaces the older (to the end of the queue); a discarded one never
    runs."""
    queue = scheduling.AfterReply()
    ran: list[str] = []

    def piece(name: str) -> Callable[[], Awaitable[None]]:
        async def work() -> None:
            ran.append(name)

        return work

    queue.add("a", piece("a1"))
    queue.add("b", piece("b1"))
    queue.add("a", piece("a2"))
    queue.add("c", piece("c1"))
    queue.discard("c")
    for _ in range(2):
        await (await queue.next())[1]()
    assert ran == ["b1", "a2"]
    with trio.move_on_after(0.05) as waited:
        await queue.next()
    assert waited.cancelled_caught  # nothing left: next() waits
    queue.add("d", piece("d1"))
    queue.add("e", piece("e1"))
    taken = queue.take("e")  # a request that needs it does it itself
    assert taken is not None
    assert queue.take("e") is None
    await (await queue.next())[1]()
    await taken()
    assert ran == ["b1", "a2", "d1", "e1"]


async def test_work_after_a_reply_lets_requests_in_at_its_schedule_points() -> None:
    """`AfterReply.run` does each piece as background work: at its schedule points other
    tasks run (pyfuse3's request loop, serving the ioctl Python's open() sends right
    after the OPEN's reply), where a request's would be deferred to its end; a failing
    piece is logged and the next one runs."""

    async def body(ticker: Ticker) -> None:
        queue = scheduling.AfterReply()
        seen: list[bool] = []
        done = trio.Event()

        async def fails() -> None:
            raise InvalidArgument("an item gone")

        async def work() -> None:
            seen.append(await ticker.runs_during(scheduling.checkpoint))
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.run)
            queue.add("a", fails)
            queue.add("b", work)
            with trio.fail_after(10):
                await done.wait()
            nursery.cancel_scope.cancel()
        assert seen == [True]

    await _with_ticker(body)


async def test_a_request_settles_the_piece_it_needs_once() -> None:
    """`AfterReply.settle`: a piece still waiting is done by the request that needs it;
    one `run` is doing (it yields to requests) is waited for, not done a second time
    beside it, and a newer piece of the key runs only after it; with neither, nothing to
    wait for."""
    queue = scheduling.AfterReply()
    ran: list[str] = []
    started, go_on = trio.Event(), trio.Event()

    async def waiting() -> None:
        ran.append("waiting")

    async def slow() -> None:
        ran.append("slow begins")
        started.set()
        await go_on.wait()  # (a draw's schedule points: a request comes in meanwhile)
        ran.append("slow ends")

    queue.add("a", waiting)
    await queue.settle("a")
    assert ran == ["waiting"]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        queue.add("b", slow)
        await started.wait()
        settled = trio.Event()

        async def newer() -> None:
            ran.append("newer")

        queue.add("b", newer)  # a newer piece of the key, asked for while the first runs

        async def request() -> None:
            await queue.settle("b")
            settled.set()

        nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        assert not settled.is_set()  # it waits for the piece run is doing
        go_on.set()
        with trio.fail_after(10):
            await settled.wait()
        await queue.settle("b")  # done: nothing to wait for
        nursery.cancel_scope.cancel()
    assert ran == ["waiting", "slow begins", "slow ends", "newer"]  # never two of a key at once
