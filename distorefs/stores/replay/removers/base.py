"""The remover protocol: which items leave a buffer because they were sampled.

Items also leave by capacity: index i lives in ring slot i % capacity, so an append past
capacity evicts the oldest item (FIFO) and a FIFO buffer's items die in log order. That
rule is the ring's layout, not a strategy. A remover decides what else leaves, once a
draw is committed (the batch was handed out).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Remover(Protocol):
    removes: bool  # False: after_sampled never removes anything (a draw skips asking)

    def after_sampled(self, slots: np.ndarray, times_sampled: np.ndarray) -> np.ndarray:
        """Of the live `slots` just counted as sampled (with their counts after this draw),
        the slots to remove now (unique)."""
        ...
