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

    def post(self, item: T) -> None:
        if self.followed:
            self._items.append(item)
            self._posted.set()

    async def next(self) -> T:
        """The oldest news, waiting for one."""
        self.followed = True
        while not self._items:
            await self._posted.wait()
            self._posted = trio.Event()
        return self._items.popleft()
