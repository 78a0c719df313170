"""Outbox: news from a store to whoever follows it (the cluster glue), without a
callback upward and without blocking the store.

A store posts from sync code; one consumer task drains in order. The outbox is bounded
only by how fast the consumer runs: news are small tuples, posted on namespace changes
and publishes (a few per second), and the consumer is a single etcd put each.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._posted = trio.Event()
        self.followed = False  # nothing is kept until a consumer follows
        self._count = 0  # items posted
        self._done = 0  # items the consumer said it handled (`handled`)
        self._handled = trio.Event()

    def post(self, item: T) -> None:
        if self.followed:
            self._items.append(item)
            self._count += 1
            self._posted.set()

    def handled(self) -> None:
        """The consumer is done with the item `next` gave it last (for `delivered`)."""
        self._done += 1
        self._handled.set()
        self._handled = trio.Event()

    async def delivered(self) -> None:
        """Wait until the consumer has handled every item posted so far (a consumer
        that says so with `handled`); at once when nobody follows. Bound it."""
        posted = self._count
        while self.followed and self._done < posted:
            await self._handled.wait()
        await trio.lowlevel.checkpoint()

    async def next(self) -> T:
        """The oldest news, waiting for one."""
        self.followed = True
        while not self._items:
            await self._posted.wait()
            self._posted = trio.Event()
        return self._items.popleft()
