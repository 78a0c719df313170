"""Outbox: news from a store, and `delivered` for a poster that must wait until the
consumer has handled what it posted (a replica's commit, until the kernel dropped the
old entry)."""

from __future__ import annotations

import trio
import trio.testing

from distorefs.news import Outbox


async def test_delivered_waits_for_the_consumer_to_handle_what_was_posted_before_it() -> None:
    outbox = Outbox[int]()
    outbox.post(0)  # nobody follows yet: not kept
    with trio.fail_after(1):
        await outbox.delivered()  # nothing to wait for
    handled: list[int] = []
    release = trio.Event()

    async def consumer() -> None:
        while True:
            item = await outbox.next()
            await release.wait()
            handled.append(item)
            outbox.handled()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        outbox.post(1)
        outbox.post(2)
        waited = False
        with trio.move_on_after(0.2):
            await outbox.delivered()
            waited = True
        assert not waited  # the consumer has not handled them
        release.set()
        with trio.fail_after(1):
            await outbox.delivered()
        assert handled == [1, 2]
        outbox.post(3)  # posted after: a later `delivered` waits for it, not this one
        with trio.fail_after(1):
            await outbox.delivered()
        assert handled == [1, 2, 3]
        nursery.cancel_scope.cancel()
