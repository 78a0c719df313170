"""MaxTimesSampledRemover: an item leaves once it was handed out `limit` times (bounded reuse)."""

from __future__ import annotations

import numpy as np


class MaxTimesSampledRemover:
    removes = True

    def __init__(self, limit: int) -> None:
        assert limit > 0
        self.limit = limit

    def after_sampled(self, slots: np.ndarray, times_sampled: np.ndarray) -> np.ndarray:
        return np.unique(slots[times_sampled >= self.limit])
