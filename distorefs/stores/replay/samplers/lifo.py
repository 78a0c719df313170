"""LifoSampler: the newest live items, newest first (a stack read without removal)."""

from __future__ import annotations

import numpy as np

from distorefs.stores.replay.samplers.base import Ring


class LifoSampler:
    name = "lifo"
    prioritized = False

    def pick(self, ring: Ring, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        return ring.live_indices()[::-1][:count] % ring.capacity, None
