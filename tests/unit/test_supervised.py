"""Background tasks under `daemon.supervised`: a failure never ends the daemon."""

from __future__ import annotations

import trio
import trio.testing

from distorefs.daemon import SUPERVISOR_FIRST_PAUSE_S, supervised


class Ops:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def degrade(self, reason: str) -> None:
        self.reasons.append(reason)


async def test_a_failing_task_starts_again_after_growing_pauses_until_it_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []

    async def task() -> None:
        starts.append(trio.current_time())
        if len(starts) <= 3:
            raise KeyError("a bug")

    ops = Ops()
    await supervised("flaky", task, ops)
    assert len(starts) == 4
    pauses = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert pauses == [SUPERVISOR_FIRST_PAUSE_S, 2 * SUPERVISOR_FIRST_PAUSE_S, 4 * SUPERVISOR_FIRST_PAUSE_S]
    assert ops.reasons == []


async def test_a_broken_invariant_degrades_the_mount_and_stops_the_task(autojump_clock: trio.testing.MockClock) -> None:
    starts = 0

    async def task() -> None:
        nonlocal starts
        starts += 1
        raise AssertionError("two owners for one block")

    ops = Ops()
    await supervised("compactor", task, ops)
    assert starts == 1
    assert ops.reasons == ["compactor: broken invariant: two owners for one block"]


async def test_cancellation_goes_through(autojump_clock: trio.testing.MockClock) -> None:
    async def forever() -> None:
        await trio.sleep_forever()

    with trio.move_on_after(5) as scope:
        await supervised("idle", forever, Ops())
    assert scope.cancelled_caught
