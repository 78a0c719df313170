"""Stable-Baselines3: a ReplayBuffer whose storage is a distorefs buffer.

    model = DQN("MlpPolicy", env, replay_buffer_class=DistoreReplayBuffer,
                replay_buffer_kwargs={"path": "/mnt/distore/buffers/dqn"})

Owns the mapping of SB3's transitions onto a schema buffer (fields `obs`, `next_obs`,
`action`, `reward`, `done`, `timeout`, one record per environment per step) and back
into `ReplayBufferSamples`. The buffer outlives the process: a new model (or one made
by `DQN.load`) with the same `path` continues with the transitions already there, so
`save_replay_buffer`/`load_replay_buffer` are not needed to resume (they still work:
they pickle the path, not the data). Sampling is the daemon's (uniform, or prioritized
with the config's `sampler`); several processes may add to one buffer.

`add` keeps up to `flush_every` steps in memory and appends them in one open of
`append`; `sample` appends what is pending first, so a learner sees every transition it
added. Transitions not yet appended are lost if the process dies (at most
`flush_every - 1` steps); with `flush_every=1` every step is acknowledged at once.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from distorefs import client
from distorefs.stores.replay.config import parse_schema, schema_to_json


class DistoreReplayBuffer(ReplayBuffer):
    """SB3's ReplayBuffer over the distorefs buffer at `path` (made if missing).
    Raises ValueError when `path` holds a buffer of another schema."""

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        path: str,
        sampler: str = "uniform",
        flush_every: int = 1,
    ) -> None:
        if optimize_memory_usage:
            raise ValueError("DistoreReplayBuffer keeps next_obs per transition: use optimize_memory_usage=False")
        # BaseBuffer's set-up only: the storage is the mount's, no arrays here
        super(ReplayBuffer, self).__init__(buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = handle_timeout_termination
        self.path = str(path)
        self.flush_every = max(1, flush_every)
        self._pending: list[np.ndarray] = []
        action_dtype = self._maybe_cast_dtype(action_space.dtype)
        self.record_dtype = np.dtype(
            [
                ("obs", observation_space.dtype, self.obs_shape),
                ("next_obs", observation_space.dtype, self.obs_shape),
                ("action", action_dtype, (self.action_dim,)),
                ("reward", np.float32),
                ("done", np.float32),
                ("timeout", np.float32),
            ]
        )
        self._connect(buffer_size, sampler)

    def _connect(self, capacity: int, sampler: str) -> None:
        """Make the buffer, or check that the one at `path` has this schema."""
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, "config"), encoding="utf-8") as f:
            config = json.load(f)
        have = parse_schema(self.path, config.get("schema"))
        if have is not None:
            if have != self.record_dtype:
                raise ValueError(f"{self.path} holds a buffer of another schema ({have}, not {self.record_dtype})")
            return
        with open(os.path.join(self.path, "config"), "w", encoding="utf-8") as f:
            config = {"capacity": int(capacity), "sampler": sampler, "schema": schema_to_json(self.record_dtype)}
            f.write(json.dumps(config))

    def __getstate__(self) -> dict[str, Any]:
        self.flush()
        state = dict(self.__dict__)
        state["_pending"] = []
        return state

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        records = np.zeros(self.n_envs, dtype=self.record_dtype)
        records["obs"] = np.asarray(obs).reshape((self.n_envs, *self.obs_shape))
        records["next_obs"] = np.asarray(next_obs).reshape((self.n_envs, *self.obs_shape))
        records["action"] = np.asarray(action).reshape((self.n_envs, self.action_dim))
        records["reward"] = np.asarray(reward).reshape(self.n_envs)
        records["done"] = np.asarray(done).reshape(self.n_envs)
        if self.handle_timeout_termination:
            records["timeout"] = [info.get("TimeLimit.truncated", False) for info in infos]
        self._pending.append(records)
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Append the transitions kept in memory (one open of `append`)."""
        if self._pending:
            records = np.concatenate(self._pending)
            self._pending = []
            client.append(self.path, records)

    def size(self) -> int:
        with open(os.path.join(self.path, "stats"), encoding="utf-8") as f:
            return int(json.load(f)["size"]) + sum(len(r) for r in self._pending)

    def reset(self) -> None:
        """Forget pending transitions; the buffer's items stay (remove them with rm -r)."""
        self._pending = []

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        self.flush()
        batch = client.sample(self.path, batch_size)
        self.last_indices = batch["_index"].copy()
        self.last_weights = batch["_weight"].copy()
        data = (
            self._normalize_obs(batch["obs"], env),
            batch["action"],
            self._normalize_obs(batch["next_obs"], env),
            (batch["done"] * (1 - batch["timeout"])).reshape(-1, 1),
            self._normalize_reward(batch["reward"].reshape(-1, 1), env),
        )
        return ReplayBufferSamples(*tuple(self.to_torch(np.ascontiguousarray(a)) for a in data))

    def update_priorities(self, priorities: np.ndarray) -> None:
        """Set the priorities of the last sampled batch (a prioritized buffer)."""
        client.update_priorities(self.path, self.last_indices, np.asarray(priorities, dtype=np.float64))
