"""The framework adapters against the real libraries, through a real mount."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from stable_baselines3 import DQN
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from distorefs.integrations.sb3 import DistoreReplayBuffer
from distorefs.integrations.torchrl import DistoreSampler, DistoreStorage, DistoreWriter
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


def trajectory(count: int, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "observation": torch.randn(count, 4, generator=gen),
            "action": torch.randint(0, 2, (count,), generator=gen),
            "next": {"observation": torch.randn(count, 4, generator=gen), "reward": torch.ones(count, 1)},
        },
        batch_size=[count],
    )


def extend_in_a_process(path: Path, count: int, seed: int) -> subprocess.Popen[bytes]:
    code = (
        "import sys, torch; from tests.mount.test_integrations import trajectory\n"
        "from torchrl.data import TensorDictReplayBuffer\n"
        "from distorefs.integrations.torchrl import DistoreStorage, DistoreWriter\n"
        f"rb = TensorDictReplayBuffer(storage=DistoreStorage({str(path)!r}), writer=DistoreWriter())\n"
        f"for i in range(10): rb.extend(trajectory({count // 10}, {seed} * 100 + i))\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])


def test_torchrl_prioritized_buffer_with_writers_in_several_processes(tmp_path: Path) -> None:
    with mounted_at(tmp_path / "mnt", tmp_path / "data") as mount:
        path = mount.path / "buffers" / "trl"
        storage = DistoreStorage(path, max_size=10_000, sampler="prioritized")
        rb = TensorDictReplayBuffer(storage=storage, sampler=DistoreSampler(), writer=DistoreWriter(), batch_size=32)
        rb.extend(trajectory(100, 0))  # the first write makes the schema
        writers = [extend_in_a_process(path, 200, seed) for seed in (1, 2, 3)]
        assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
        assert len(rb) == 700
        batch = rb.sample()
        assert batch["observation"].shape == (32, 4)
        assert batch["next", "reward"].shape == (32, 1)
        assert batch["_weight"].shape == (32,)
        # the batch is the daemon's: its indices name the items read back through items/<i>
        first = int(batch["index"][0])
        raw = np.frombuffer((path / "items" / str(first)).read_bytes(), dtype=storage._dtype)[0].copy()
        assert torch.equal(torch.as_tensor(raw["observation"]), batch["observation"][0])
        # priorities go to the daemon: one item with all the mass is drawn every time
        rb.update_priority(torch.arange(700), torch.full((700,), 1e-6))
        rb.update_priority(torch.tensor([first]), torch.tensor([1e6]))
        assert set(rb.sample()["index"].tolist()) == {first}


def test_torchrl_default_sampler_and_writer_and_a_new_process_continue_the_buffer(tmp_path: Path) -> None:
    with mounted_at(tmp_path / "mnt", tmp_path / "data") as mount:
        path = mount.path / "buffers" / "uniform"
        rb = TensorDictReplayBuffer(storage=DistoreStorage(path, max_size=50), batch_size=16)  # RandomSampler
        data = trajectory(80, 7)
        rb.extend(data)
        assert len(rb) == 50  # capacity: the oldest 30 left
        kept = {tuple(row.tolist()) for row in data["observation"][30:]}
        batch = rb.sample()
        assert {tuple(row.tolist()) for row in batch["observation"]} <= kept
        state = rb.state_dict()

        again = TensorDictReplayBuffer(storage=DistoreStorage(path), batch_size=16)
        again.load_state_dict(state)
        assert len(again) == 50
        with pytest.raises(ValueError, match="the state is of"):
            TensorDictReplayBuffer(storage=DistoreStorage(mount.path / "buffers" / "other")).load_state_dict(state)
