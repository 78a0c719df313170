"""PrioritizedSampler: items in proportion to their scaled priority (PER).

Stratified: one draw in each of `count` equal segments of the priority mass. When every
live priority is zero, the draw falls back to uniform and is not prioritized.
"""

from __future__ import annotations

import numpy as np

from distorefs.stores.replay.samplers.base import Ring, stratified_prefixes
from distorefs.stores.replay.samplers.uniform import UniformSampler


class PrioritizedSampler:
    name = "prioritized"
    prioritized = True

    def pick(self, ring: Ring, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        tree = ring.priority_tree
        total = tree.total
        if total <= 0:
            return UniformSampler().pick(ring, count, rng)
        drawn = tree.find_stratified(count, rng)  # (compiled: one call)
        if drawn is not None:
            return drawn
        slots = tree.find(stratified_prefixes(total, count, rng))
        return slots, tree.leaves()[slots] / total
