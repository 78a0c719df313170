"""ShardedBuffer: one replay buffer whose items live in shards on several nodes.

Owns the arithmetic that makes N shards behave as one buffer: a batch is split over the
shards in proportion to each shard's sampling mass (total scaled priority; the size for
the other samplers), IS weights are computed over the whole buffer, and a global index
carries its shard: `global = local * shards + shard`, so `global % shards` is the shard
and `global // shards` the index within it. Moving bytes to and from other nodes is the
ShardPeer's job (the cluster glue, peers/buffers.py, implements it over cluster/rpc.py);
this module has no network and no FUSE.

A sample is two phases: every chosen shard picks its part (nothing counted), and only
when all parts arrived is the batch built and each shard told to commit its part. A
shard that says EAGAIN between its state and its pick makes the whole attempt start
again with nothing counted anywhere, so a bounded-reuse item is never counted without
being handed out. A commit that a live node fails to take is logged and counted in
`stats` (`uncommitted_draws`): the batch is still handed out, so such an item may be
handed out once more than max_times_sampled allows, but is never lost.

Failure rule: a shard whose node is not a live member is left out of a draw (the batch
comes from the live shards, weights over them; `stats` counts the draw as partial); a
live node that does not answer makes the sample fail with EAGAIN; an append or a
priority update for an unreachable shard fails with EIO.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np
import trio

from distorefs import logs, scheduling
from distorefs.errors import DistorefsError, InvalidArgument, PeerUnavailable, TryAgain
from distorefs.stores.replay.buffer import ReplayBuffer
from distorefs.stores.replay.config import BufferConfig
from distorefs.stores.replay.draws import (
    Batch,
    Drawn,
    ShardState,
    check_priorities,
    encoded_batch,
    importance_weights,
    merged_payloads,
)

log = logging.getLogger(__name__)

POLL_S = 0.05
T = TypeVar("T")


async def gather(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the calls concurrently; return their results in order, or raise the first
    error as itself (not wrapped in an ExceptionGroup) once all have finished."""
    results: list[T | None] = [None] * len(calls)
    errors: list[Exception] = []

    async def one(i: int, call: Callable[[], Awaitable[T]]) -> None:
        try:
            results[i] = await call()
        except Exception as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call)
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]


class ShardPeer(Protocol):
    """What a sharded buffer needs from the cluster: who this node is, which nodes are
    live, and the shards that other nodes hold. Given to the BufferStore at construction."""

    @property
    def me(self) -> str: ...

    def alive(self, node: str) -> bool: ...

    def shard_limit(self) -> int:
        """How many shards a buffer may have now (the live nodes)."""
        ...

    async def shard_state(self, node: str, name: str) -> ShardState: ...

    async def pick(self, node: str, name: str, count: int) -> Drawn:
        """Pick `count` items of the shard on `node` (nothing counted); TryAgain if it cannot now."""
        ...

    async def commit(self, node: str, name: str, indices: np.ndarray) -> None:
        """Count these picked local indices of the shard on `node` as sampled."""
        ...

    async def append(
        self, node: str, name: str, items: Sequence[bytes | bytearray], nonblocking: bool
    ) -> list[int]: ...

    async def update_priorities(self, node: str, name: str, indices: np.ndarray, priorities: np.ndarray) -> None: ...


@dataclass
class ShardLayout:
    """Which node holds each shard (position = shard number)."""

    nodes: list[str]

    @property
    def shards(self) -> int:
        return len(self.nodes)

    def shard_of(self, node: str) -> int | None:
        return self.nodes.index(node) if node in self.nodes else None


class ShardedBuffer:
    """A buffer spread over `layout`; `local` is this node's shard (None if it has none).

    Examples:
        >>> sharded = ShardedBuffer("atari", config, ShardLayout(["a", "b"]), local, peer)
        >>> await sharded.append([b"x"])             # to this node's shard: global index 0
        [0]
        >>> batch = await sharded.sample(32)           # drawn over both shards
    """

    def __init__(
        self,
        name: str,
        config: BufferConfig,
        layout: ShardLayout,
        local: ReplayBuffer | None,
        peer: ShardPeer,
    ) -> None:
        self.name = name
        self.config = config
        self.layout = layout
        self.me = peer.me
        self.local = local
        self._peer = peer
        self._alive = peer.alive
        self.partial_draws = 0
        self.remote_draws = 0
        self.uncommitted_draws = 0
        self.mismatched_draws = 0  # picks whose items did not fit this node's config: nothing counted
        self._refusal = ""  # why the last such pick was set aside (said with the EAGAIN)
        self.last_states: dict[int, dict[str, Any]] = {}

    # --- indices --------------------------------------------------------------------

    def to_global(self, shard: int, local: np.ndarray) -> np.ndarray:
        return local.astype(np.int64) * self.layout.shards + shard

    def split(self, indices: np.ndarray) -> dict[int, np.ndarray]:
        """Positions of `indices` by shard (the caller maps them to local indices)."""
        if (indices < 0).any():
            raise InvalidArgument(f"buffers/{self.name}: index {int(indices[indices < 0][0])} is negative")
        shard_of = indices % self.layout.shards
        return {int(s): np.flatnonzero(shard_of == s) for s in np.unique(shard_of)}

    # --- one shard, wherever it is ----------------------------------------------------

    async def _state(self, shard: int) -> ShardState:
        node = self.layout.nodes[shard]
        if node == self.me and self.local is not None:
            await scheduling.checkpoint()
            return self.local.shard_state()
        return await self._peer.shard_state(node, self.name)

    async def _pick(self, shard: int, count: int) -> Drawn:
        node = self.layout.nodes[shard]
        if node == self.me and self.local is not None:
            return await self.local.pick(count, nonblocking=True)
        self.remote_draws += 1
        return await self._peer.pick(node, self.name, count)

    async def _commit(self, shard: int, indices: np.ndarray) -> None:
        node = self.layout.nodes[shard]
        if node == self.me and self.local is not None:
            self.local.commit(indices)
            await scheduling.checkpoint()
            return
        try:
            await self._peer.commit(node, self.name, indices)
        except DistorefsError as exc:
            self.uncommitted_draws += 1
            log.warning("buffers/%s: shard %d on %s did not count its part of a batch: %s", self.name, shard, node, exc)

    # --- sampling ---------------------------------------------------------------------

    async def sample(
        self, count: int | None = None, nonblocking: bool = False, check_bytes: Callable[[int, int], None] | None = None
    ) -> Batch:
        """One batch over the live shards; waits (polling) up to sample_timeout while
        none can serve, then EAGAIN (at once under O_NONBLOCK). `check_bytes(count,
        nbytes)` sees the size of the parts once they have come, before this node joins
        them into one batch and before any is counted, and may refuse it (raise)."""
        count = count or self.config.batch_size
        with trio.move_on_after(self.config.sample_timeout):
            while True:
                batch = await self._try_sample(count, check_bytes)
                if batch is not None:
                    return batch
                if nonblocking:
                    break
                await trio.sleep(POLL_S)
        why = f" ({self._refusal})" if self._refusal else ""
        raise TryAgain(f"buffers/{self.name}: no live shard can serve a sample of {count} yet{why}")

    async def _try_sample(self, count: int, check_bytes: Callable[[int, int], None] | None) -> Batch | None:
        live = [s for s, node in enumerate(self.layout.nodes) if node == self.me or self._alive(node)]
        if not live:
            raise TryAgain(
                f"buffers/{self.name}: no shard is on a live node (shards on {', '.join(self.layout.nodes)})"
            )
        if len(live) < self.layout.shards:
            self.partial_draws += 1
        try:
            found = await gather([partial(self._state, s) for s in live])
        except PeerUnavailable as exc:
            raise TryAgain(f"buffers/{self.name}: {exc}") from None
        states = dict(zip(live, found, strict=True))
        for shard, state in states.items():
            self.last_states[shard] = {"size": state.size, "mass": state.mass}
        ready = [s for s in live if states[s].can_sample and states[s].size > 0]
        if not ready:
            return None
        mass = np.array([states[s].mass for s in ready], dtype=np.float64)
        counts = np.random.default_rng().multinomial(count, mass / mass.sum())
        chosen = [(shard, k) for shard, k in zip(ready, counts.tolist(), strict=True) if k]
        try:
            parts = await gather([partial(self._pick, s, k) for s, k in chosen])
        except PeerUnavailable as exc:
            raise TryAgain(f"buffers/{self.name}: {exc}") from None
        except TryAgain:
            return None  # a shard's limiter said no between its state and its pick: nothing counted
        drawn = {shard: part for (shard, _k), part in zip(chosen, parts, strict=True)}
        itemsize = self.config.itemsize
        unfit = [shard for shard, part in drawn.items() if not part.fits(itemsize)]
        if unfit:  # nothing counted; tried again until the configs agree (or EAGAIN)
            self.mismatched_draws += 1
            expected = f"records of {itemsize} bytes" if itemsize else "blobs"
            self._refusal = (
                f"shard {unfit[0]} (node {self.layout.nodes[unfit[0]]}) holds items that are not {expected}"
                " (its config differs from this node's)"
            )
            if logs.at_doubling(self.mismatched_draws):
                log.warning("buffers/%s: %s; %d such draws", self.name, self._refusal, self.mismatched_draws)
            return None
        if check_bytes is not None:  # (a blob buffer's: its size is known only now)
            check_bytes(count, sum(part.nbytes for part in parts))
        batch = await self._combine(ready, states, drawn)
        await gather([partial(self._commit, shard, part.indices) for shard, part in drawn.items()])
        return batch

    async def _combine(self, ready: list[int], states: dict[int, ShardState], drawn: dict[int, Drawn]) -> Batch:
        """One batch: global indices, and IS weights over the whole (live) buffer:
        P(item) = P(item | shard) * mass(shard) / total mass."""
        total_mass = sum(states[s].mass for s in ready)
        size = sum(states[s].size for s in ready)
        prioritized = any(d.probabilities is not None for d in drawn.values())
        indices, probabilities = [], []
        for shard, part in sorted(drawn.items()):
            indices.append(self.to_global(shard, part.indices))
            local = (
                part.probabilities
                if part.probabilities is not None
                else np.full(len(part.indices), 1 / states[shard].size)
            )
            probabilities.append(local * states[shard].mass / total_mass)
        payloads = merged_payloads([part.payloads for _shard, part in sorted(drawn.items())])
        all_indices = np.concatenate(indices)
        min_probability = min(states[s].min_mass for s in ready) / total_mass
        weights = importance_weights(
            np.concatenate(probabilities) if prioritized else None, len(all_indices), size, min_probability,
            self.config.beta,
        )  # fmt: skip
        return await encoded_batch(self.config, payloads, all_indices, weights)

    # --- appending and priorities --------------------------------------------------------

    def append_shard(self) -> int:
        """This node's shard, or (for a node without one) a fixed shard chosen by node name."""
        mine = self.layout.shard_of(self.me)
        if mine is not None:
            return mine
        return sum(self.me.encode()) % self.layout.shards

    async def append(self, items: Sequence[bytes | bytearray], nonblocking: bool = False) -> list[int]:
        """Append to this node's shard (or forward to one); returns global indices."""
        shard = self.append_shard()
        node = self.layout.nodes[shard]
        if node == self.me and self.local is not None:
            local = await self.local.append_local(items, nonblocking=nonblocking)
        else:
            local = await self._peer.append(node, self.name, items, nonblocking)
        indices: list[int] = self.to_global(shard, np.asarray(local, dtype=np.int64)).tolist()
        return indices

    async def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Route each pair to the shard its index names. Every pair is checked first
        (EINVAL applies none); each shard then applies its part whole."""
        check_priorities(self.name, indices, priorities)
        parts = self.split(indices)
        for shard, positions in parts.items():
            local, values = indices[positions] // self.layout.shards, priorities[positions]
            node = self.layout.nodes[shard]
            if node == self.me and self.local is not None:
                await self.local.apply_priorities(local, values)
            else:
                await self._peer.update_priorities(node, self.name, local, values)

    def stats_now(self) -> dict[str, Any]:
        """Layout and counters, with each shard's numbers as of the last draw (no network:
        `stats` is rendered at open)."""
        return {
            "shards": [
                {
                    "shard": shard,
                    "node": node,
                    "live": node == self.me or self._alive(node),
                    **self.last_states.get(shard, {}),
                }
                for shard, node in enumerate(self.layout.nodes)
            ],
            "this_node_shard": self.layout.shard_of(self.me),
            "partial_draws": self.partial_draws,
            "mismatched_draws": self.mismatched_draws,
            "remote_draws": self.remote_draws,
            "uncommitted_draws": self.uncommitted_draws,
        }
