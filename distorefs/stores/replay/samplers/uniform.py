"""UniformSampler: every live item equally likely (stratified over the live slots)."""

from __future__ import annotations

import numpy as np

from distorefs.stores.replay.samplers.base import Ring, stratified_prefixes


class UniformSampler:
    name = "uniform"
    prioritized = False

    def pick(self, ring: Ring, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        slots = ring.live_tree.find(stratified_prefixes(ring.live_tree.total, count, rng))
        return slots, None
