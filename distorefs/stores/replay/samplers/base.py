"""The sampler protocol: which slots of a buffer's ring one draw picks.

A sampler sees the ring through `Ring` (read-only) and returns the slots it picked and,
when the draw is prioritized, each pick's probability within the buffer (the replay
buffer turns those into importance weights). It changes nothing: counting the items as
sampled is the buffer's commit step, after the batch is handed out.
"""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np

from distorefs.stores.replay.sumtree import SegmentTree


class Ring(Protocol):
    """What a sampler may look at."""

    @property
    def capacity(self) -> int: ...

    next_index: int  # the index the next append gets (items 0.. were appended before)

    @property
    def priority_tree(self) -> SegmentTree:
        """Scaled priorities by slot (0 for empty slots)."""

    @property
    def live_tree(self) -> SegmentTree:
        """1 for each live slot, 0 for each empty one."""

    def live_indices(self) -> np.ndarray:
        """Live item indices in append order."""


class Sampler(Protocol):
    """Picks `count` slots of a non-empty ring."""

    name: str
    prioritized: bool  # whether draws are in proportion to priority (IS weights apply)

    def pick(self, ring: Ring, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        """The slots picked, and their probabilities where the draw is prioritized."""
        ...


def stratified_prefixes(total: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """One point in each of `count` equal segments of [0, total): (k + u_k) * total / count,
    in place on the draw's random numbers (the same floats as the plain expression)."""
    prefixes = rng.random(count)
    prefixes += _segments(count)
    prefixes *= total / count
    return prefixes


@functools.lru_cache(maxsize=64)
def _segments(count: int) -> np.ndarray:
    """0, 1, ..., count - 1 as floats, made once per batch size (read-only)."""
    segments = np.arange(count, dtype=np.float64)
    segments.setflags(write=False)
    return segments
