"""UniformSampler: every live item equally likely (stratified over the live slots)."""

from __future__ import annotations

import numpy as np

from distorefs.stores.replay.samplers.base import Ring, stratified_prefixes


class UniformSampler:
    name = "uniform"
    prioritized = False

    def pick(self, ring: Ring, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        size = round(ring.live_tree.total)
        if size == min(ring.next_index, ring.capacity):
            # no holes: the live slots are exactly 0..size-1, where the tree walk would land
            # a prefix in [k, k+1) on slot k; so take k without the walk (a third of a draw)
            slots = stratified_prefixes(float(size), count, rng).astype(np.int64)
            return np.minimum(slots, size - 1, out=slots), None
        slots = ring.live_tree.find(stratified_prefixes(ring.live_tree.total, count, rng))
        return slots, None
