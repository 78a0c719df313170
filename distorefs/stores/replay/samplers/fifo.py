"""FifoSampler: the oldest live items, in append order (a queue read without removal)."""

from __future__ import annotations

import numpy as np

from distorefs.stores.replay.samplers.base import Ring


class FifoSampler:
    name = "fifo"
    prioritized = False

    def pick(self, ring: Ring, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        return ring.live_indices()[:count] % ring.capacity, None
