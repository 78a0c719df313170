"""The framework adapters against the real libraries, through a real mount."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from stable_baselines3 import DQN

from distorefs.integrations.sb3 import DistoreReplayBuffer
from tests.conftest import mounted_at

pytestmark = pytest.mark.mount


def stats(buffer: Path) -> dict[str, int]:
    result: dict[str, int] = json.loads((buffer / "stats").read_text())
    return result


def test_sb3_dqn_trains_on_a_distorefs_buffer_and_resumes_without_save_replay_buffer(tmp_path: Path) -> None:
    with mounted_at(tmp_path / "mnt", tmp_path / "data") as mount:
        buffer = mount.path / "buffers" / "sb3"
        model = DQN(
            "MlpPolicy", "CartPole-v1", replay_buffer_class=DistoreReplayBuffer,
            replay_buffer_kwargs={"path": str(buffer)}, learning_starts=100, train_freq=4, buffer_size=10_000,
            seed=0,
        )  # fmt: skip
        model.learn(600)
        assert stats(buffer)["size"] == 600  # every step's transition is in the mount
        assert stats(buffer)["samples"] == (600 - 100) // 4 * 32  # one batch of 32 per gradient step
        batch = np.load(mount.path / "buffers" / "sb3" / "sample.4")  # plain files see SB3's transitions
        assert batch["obs"].shape == (4, 4)
        assert set(np.unique(batch["action"])) <= {0, 1}
        model.save(mount.path / "checkpoints" / "dqn.zip")
        env = model.get_env()
        del model

        resumed = DQN.load(mount.path / "checkpoints" / "dqn.zip", env=env)
        assert isinstance(resumed.replay_buffer, DistoreReplayBuffer)
        assert resumed.replay_buffer.size() == 600  # the buffer outlived the model: no load_replay_buffer
        resumed.learn(200, reset_num_timesteps=False)
        assert stats(buffer)["size"] == 800


def test_sb3_buffer_pickles_as_its_path_and_refuses_another_schema(tmp_path: Path) -> None:
    with mounted_at(tmp_path / "mnt", tmp_path / "data") as mount:
        buffer = mount.path / "buffers" / "sb3"
        model = DQN(
            "MlpPolicy", "CartPole-v1", replay_buffer_class=DistoreReplayBuffer,
            replay_buffer_kwargs={"path": str(buffer), "flush_every": 8}, learning_starts=1000, buffer_size=1000,
        )  # fmt: skip
        model.learn(20)
        blob = pickle.dumps(model.replay_buffer)
        assert len(blob) < 20_000  # the path and the spaces, not the data
        assert stats(buffer)["size"] == 20  # pickling appended what was pending
        assert pickle.loads(blob).size() == 20
        with pytest.raises(ValueError, match="another schema"):
            DQN(
                "MlpPolicy", "MountainCar-v0", replay_buffer_class=DistoreReplayBuffer,
                replay_buffer_kwargs={"path": str(buffer)},
            )  # fmt: skip
