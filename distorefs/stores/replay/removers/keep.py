"""KeepRemover: sampling never removes an item (max_times_sampled = 0)."""

from __future__ import annotations

import numpy as np


class KeepRemover:
    removes = False

    def after_sampled(self, slots: np.ndarray, times_sampled: np.ndarray) -> np.ndarray:
        return np.zeros(0, dtype=np.int64)
