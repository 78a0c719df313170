"""scheduling: a FUSE request's checkpoints are cancel points whose schedule point waits
for the end of the request (its first DEFER_S), and trio's checkpoints everywhere else."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import pytest
import trio

from distorefs import scheduling
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
