"""What a draw is: picked items, an encoded batch, one shard's numbers for splitting a
batch, and the arithmetic they share (importance weights, priority checks, encoding).

Shared by a local buffer (buffer.py) and a buffer spread over nodes (sharded.py); no
state lives here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

from distorefs.errors import InvalidArgument
from distorefs.stores.replay import sumtree
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.formats import ScatteredBytes, encode_blob_batch, encode_npy_batch
from distorefs.stores.replay.sumtree_walks import FLOAT32_MAX


@dataclass
class Batch:
    """One drawn batch: the encoded bytes a `sample` handle reads, and what is in it."""

    data: bytearray | ScatteredBytes
    indices: np.ndarray
    weights: np.ndarray


@dataclass
class Drawn:
    """Items picked from one buffer (or shard), not yet encoded and not yet counted as
    sampled: the buffer's `commit` counts them once the whole batch is handed out."""

    indices: np.ndarray  # int64
    probabilities: np.ndarray | None  # float64 within this buffer; None: not prioritized
    payloads: list[bytes | memoryview] | np.ndarray  # or a schema buffer's records, (count, itemsize) uint8

    @property
    def nbytes(self) -> int:
        if isinstance(self.payloads, np.ndarray):
            return self.payloads.nbytes
        return sum(len(payload) for payload in self.payloads)

    def fits(self, itemsize: int | None) -> bool:
        """Whether the items are what a buffer with records of `itemsize` bytes (None:
        blobs) holds: a shard on another node whose config has not caught up with this
        one's (a schema set or removed, the buffer made again) sends other items."""
        payloads = self.payloads
        if isinstance(payloads, np.ndarray):
            return itemsize is not None and payloads.ndim == 2 and payloads.shape[1] == itemsize
        return itemsize is None or all(len(payload) == itemsize for payload in payloads)


def merged_payloads(parts: Sequence[list[bytes | memoryview] | np.ndarray]) -> list[bytes | memoryview] | np.ndarray:
    """The items of a batch drawn in parts (shards), in order: one (count, itemsize)
    array of records where a part came as one (a schema buffer's rows, here or on a
    peer; the other parts' records joined into it), else one list of the items."""
    arrays = [part for part in parts if isinstance(part, np.ndarray)]
    if not arrays:
        return [payload for part in parts for payload in part]
    itemsize = arrays[0].shape[1]
    rows = [
        part if isinstance(part, np.ndarray) else np.frombuffer(b"".join(part), np.uint8).reshape(len(part), itemsize)
        for part in parts
    ]
    return rows[0] if len(rows) == 1 else np.concatenate(rows)


@dataclass(frozen=True)
class ShardState:
    """One shard's numbers for splitting a batch: `mass` is what sampling is in
    proportion to (total scaled priority, or the size), `min_mass` the smallest item's."""

    size: int
    mass: float
    min_mass: float
    can_sample: bool


@functools.lru_cache(maxsize=64)
def uniform_weights(count: int) -> np.ndarray:
    """The weights of a draw that was not prioritized: `count` ones, made once per batch
    size and read-only (a batch's weights are only read: encoded, sent, copied)."""
    ones = np.ones(count, dtype=np.float32)
    ones.setflags(write=False)
    return ones


def importance_weights(
    probabilities: np.ndarray | None, count: int, size: int, min_probability: float, beta: float
) -> np.ndarray:
    """(N * P)^-beta normalised by the largest possible weight, (N * P_min)^-beta, over a
    buffer of N items; all ones where the draw was not prioritized.

    Computed as (P / P_min)^-beta, the same number, which cannot overflow: each ratio is
    at least 1 (P_min is the smallest probability), so each weight is in [0, 1] whatever
    beta is. (N * P_min)^-beta itself overflowed for a large beta or a tiny P_min, and a
    sample failed with EIO.) A ratio of 0/0 (two probabilities that underflowed to 0:
    both of the least likely items) weighs 1, as the rarest item does."""
    if probabilities is None:
        return uniform_weights(count)
    jit = sumtree.KERNELS.module
    if jit is not None and min_probability > 0:  # (compiled: one call; sumtree_walks.py)
        compiled = np.empty(len(probabilities), dtype=np.float32)
        jit.importance_weights(np.ascontiguousarray(probabilities, dtype=np.float64), min_probability, beta, compiled)
        return compiled
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        raw = np.power(probabilities / min_probability, -beta) if min_probability > 0 else np.zeros(count)
        weights = raw.astype(np.float32)
    # what np.nan_to_num(weights, nan=1.0) gives (NaN -> 1, inf -> the largest float32),
    # without its 5 µs of Python checks on every prioritized draw
    weights[weights != weights] = 1.0
    np.minimum(weights, FLOAT32_MAX, out=weights)
    return weights


SCALED_PRIORITY_MAX = 1e290  # (priority + epsilon) ** alpha: 2**28 slots of it still sum to a finite float


def highest_priority(alpha: float, epsilon: float) -> float:
    """The largest priority p whose scaled value (p + epsilon) ** alpha stays within
    SCALED_PRIORITY_MAX, past which the sum tree's total could overflow to infinity and
    no draw could be made (inf: any priority; below 0: none)."""
    if alpha == 0:
        return math.inf
    try:
        return math.pow(SCALED_PRIORITY_MAX, 1.0 / alpha) - epsilon
    except OverflowError:  # alpha below 1 takes past the float range whatever it can hold
        return math.inf


def too_high(what: str, priority: float, alpha: float, epsilon: float, outcome: str) -> InvalidArgument:
    return InvalidArgument(
        f"{what}: priority {priority:g} scales past {SCALED_PRIORITY_MAX:g} with alpha {alpha:g} and epsilon"
        f" {epsilon:g} ((priority + epsilon) ** alpha); {outcome}"
    )


def check_scalable(
    what: str, priorities: np.ndarray, highest: float, alpha: float, epsilon: float, outcome: str = "none applied"
) -> None:
    """EINVAL unless every priority of `priorities` is at most `highest` (the
    `highest_priority` of `alpha` and `epsilon`). (NaN and negative priorities are
    `check_priorities`' to refuse.)"""
    above = priorities > highest
    if above.any():
        raise too_high(what, float(priorities[int(np.argmax(above))]), alpha, epsilon, outcome)


def check_priorities(name: str, indices: np.ndarray, priorities: np.ndarray) -> None:
    """EINVAL, naming the first bad pair, unless every priority is finite and >= 0 and
    there is one per index."""
    if len(indices) != len(priorities):
        raise InvalidArgument(f"buffers/{name}: {len(indices)} indices but {len(priorities)} priorities")
    bad = ~np.isfinite(priorities) | (priorities < 0)
    if bad.any():
        at = int(np.argmax(bad))
        raise InvalidArgument(
            f"buffers/{name}: priority must be finite and >= 0, got {priorities[at]} for index {indices[at]}"
        )


def encode_batch(
    config: BufferConfig, payloads: list[bytes | memoryview] | np.ndarray, indices: np.ndarray, weights: np.ndarray
) -> bytearray | ScatteredBytes:
    """A batch in the buffer's format: a .npy with `_index`/`_weight` under a schema,
    the framed blob format without one. `payloads` is the items' bytes, or a schema
    buffer's records as one (count, itemsize) uint8 array."""
    if config.dtype is not None:
        return encode_npy_batch(config.dtype, payloads, indices, weights)
    assert not isinstance(payloads, np.ndarray), "records in rows are a schema buffer's"
    return encode_blob_batch(payloads, indices, weights)


# A batch of this many items or more is encoded in a worker thread: a blob batch of a
# million small items took 0.35 s of Python, every other request of the mount waiting.
THREAD_ENCODE_ITEMS = 16_384


async def encoded_batch(
    config: BufferConfig, payloads: list[bytes | memoryview] | np.ndarray, indices: np.ndarray, weights: np.ndarray
) -> Batch:
    """`encode_batch` as a Batch; a big one in a worker thread (the items are views or
    copies that nothing changes: a changed item gets a new block). The thread holds the
    GIL for most of it, but hands it back every switch interval (5 ms), so the event
    loop keeps serving other requests meanwhile."""
    if len(indices) < THREAD_ENCODE_ITEMS:
        data = encode_batch(config, payloads, indices, weights)
    else:
        data = await trio.to_thread.run_sync(encode_batch, config, payloads, indices, weights)
    return Batch(data, indices, weights)


class Spread(Protocol):
    """A buffer spread over nodes (stores/replay/sharded.py): where the whole buffer's
    appends, samples and priority updates go when its store placed it on several nodes."""

    async def sample(
        self, count: int | None = None, nonblocking: bool = False, check_bytes: Callable[[int, int], None] | None = None
    ) -> Batch: ...

    async def append(self, items: Sequence[bytes | bytearray], nonblocking: bool = False) -> list[int]: ...

    async def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None: ...

    def stats_now(self) -> dict[str, Any]: ...
