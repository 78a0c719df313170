"""A DQN loop on CartPole with its replay buffer in distorefs through plain file calls,
against the same loop with an in-memory numpy buffer, in one run (issue 16).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cartpole.py [--steps 8000] [--runs 3] [--busy-poll-us 200]

The loop is the textbook one: every env step appends its transition (one record per
open of `append`, written with `os.write`), and from `--learning-starts` on every env
step also trains once: a prioritized batch of 64 (`np.load` of the bytes of
`sample.64`), a double-DQN loss with importance weights, and the 64 new priorities
(`np.save` to `priority`). The numpy loop does the same with a ring of records and the
same sum tree in process. A third loop keeps the three descriptors open (a write to
`append`, a read of `sample.64.stream`, a write to `priority`: one round trip each), and
a fourth does the same with each `.npy` header made once (the first batch parsed by
`np.load`, the rest `np.frombuffer` past the same header). No distorefs import in the
timed code. All use the same
seeds, network and step count; the report gives wall seconds, the ratio, where the
file loop's extra time went (append, sample, priority), and the mean return of the last
20 episodes of each (learning is not the point here, but it shows the loops are alike).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon import mounted  # noqa: E402 - benchmarks/ is not a package

RECORD = np.dtype(
    [("obs", "<f4", (4,)), ("action", "<i8"), ("reward", "<f4"), ("next_obs", "<f4", (4,)), ("done", "<f4")]
)
SCHEMA = {
    "obs": {"dtype": "<f4", "shape": [4]}, "action": "<i8", "reward": "<f4",
    "next_obs": {"dtype": "<f4", "shape": [4]}, "done": "<f4",
}  # fmt: skip
CAPACITY, BATCH, ALPHA, BETA, GAMMA = 50_000, 64, 0.6, 0.4, 0.99


class NumpyBuffer:
    """The in-memory baseline: a ring of records and a sum tree of priority^alpha."""

    def __init__(self) -> None:
        self.rows = np.zeros(CAPACITY, RECORD)
        self.priority = np.zeros(CAPACITY)
        self.size = self.next = 0
        self.max_priority = 1.0
        self.rng = np.random.default_rng(0)

    def append(self, record: np.ndarray) -> None:
        slot = self.next % CAPACITY
        self.rows[slot] = record[0]
        self.priority[slot] = self.max_priority**ALPHA
        self.next += 1
        self.size = min(self.size + 1, CAPACITY)

    def sample(self) -> np.ndarray:
        p = self.priority[: self.size] / self.priority[: self.size].sum()
        slots = self.rng.choice(self.size, BATCH, p=p)
        batch = np.zeros(BATCH, [*RECORD.descr, ("_index", "<i8"), ("_weight", "<f4")])
        for name in RECORD.names or ():
            batch[name] = self.rows[name][slots]
        weights = (self.size * p[slots]) ** -BETA
        batch["_index"], batch["_weight"] = slots, weights / weights.max()
        return batch

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        self.priority[indices % CAPACITY] = priorities**ALPHA
        self.max_priority = max(self.max_priority, float(priorities.max()))


def priority_npy(indices: np.ndarray, priorities: np.ndarray) -> bytes:
    """The bytes of one write to `priority`: a .npy of (index, priority) pairs."""
    out = io.BytesIO()
    np.save(out, np.stack([indices.astype(np.float64), priorities], axis=1))
    return out.getvalue()


class FileBuffer:
    """The same through the mount with plain file calls (the docs/namespace.md recipes)."""

    def __init__(self, path: Path) -> None:
        path.mkdir()
        config = {"capacity": CAPACITY, "sampler": "prioritized", "batch_size": BATCH, "alpha": ALPHA, "beta": BETA,
                  "schema": SCHEMA}  # fmt: skip
        (path / "config").write_text(json.dumps(config))
        self.append_path, self.sample_path = str(path / "append"), str(path / "sample.64")
        self.priority_path = str(path / "priority")
        self.seconds = {"append": 0.0, "sample": 0.0, "priority": 0.0}

    def close(self) -> None:
        """Nothing stays open between calls here."""

    def append(self, record: np.ndarray) -> None:
        started = time.perf_counter()
        fd = os.open(self.append_path, os.O_WRONLY)
        try:
            os.write(fd, record.tobytes())
        finally:
            os.close(fd)
        self.seconds["append"] += time.perf_counter() - started

    def sample(self) -> np.ndarray:
        started = time.perf_counter()
        with open(self.sample_path, "rb") as f:
            batch = np.load(io.BytesIO(f.read()))
        self.seconds["sample"] += time.perf_counter() - started
        return batch

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        started = time.perf_counter()
        fd = os.open(self.priority_path, os.O_WRONLY)
        try:
            os.write(fd, priority_npy(indices, priorities))
        finally:
            os.close(fd)
        self.seconds["priority"] += time.perf_counter() - started


class OpenFileBuffer(FileBuffer):
    """The same with descriptors kept open: a write to `append` per transition, a read of
    `sample.64.stream` per batch, a write to `priority` per update (one round trip each)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.append_fd = os.open(path / "append", os.O_WRONLY)
        self.stream_fd = os.open(path / "sample.64.stream", os.O_RDONLY)
        self.priority_fd = os.open(path / "priority", os.O_WRONLY)
        self.batch_bytes = os.fstat(self.stream_fd).st_size

    def close(self) -> None:
        for fd in (self.append_fd, self.stream_fd, self.priority_fd):
            os.close(fd)

    def append(self, record: np.ndarray) -> None:
        started = time.perf_counter()
        os.write(self.append_fd, record.tobytes())
        self.seconds["append"] += time.perf_counter() - started

    def sample(self) -> np.ndarray:
        started = time.perf_counter()
        batch = np.load(io.BytesIO(os.read(self.stream_fd, self.batch_bytes)))
        self.seconds["sample"] += time.perf_counter() - started
        return batch

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        started = time.perf_counter()
        os.write(self.priority_fd, priority_npy(indices, priorities))
        self.seconds["priority"] += time.perf_counter() - started


class HeaderOnceBuffer(OpenFileBuffer):
    """Descriptors kept open, and each .npy header made once (docs/namespace.md, "The
    fastest plain-file recipes"): every batch a stream of a schema buffer serves has the
    same header, so only the first is parsed with `np.load` (numpy's header parser, an
    `ast.literal_eval`, took 55 of a 142 µs sample of 64 in `bench_latency`) and the rest
    are `np.frombuffer` past it; every update of 64 pairs has the same header too."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._batch: tuple[np.dtype[Any], int] | None = None  # (dtype, offset of the records)
        self._pair_headers: dict[int, bytes] = {}

    def sample(self) -> np.ndarray:
        started = time.perf_counter()
        data = os.read(self.stream_fd, self.batch_bytes)
        if self._batch is None:
            batch = np.load(io.BytesIO(data))
            self._batch = (batch.dtype, len(data) - batch.nbytes)
        else:
            batch = np.frombuffer(data, self._batch[0], offset=self._batch[1])
        self.seconds["sample"] += time.perf_counter() - started
        return batch

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        started = time.perf_counter()
        pairs = np.empty((len(indices), 2))
        pairs[:, 0], pairs[:, 1] = indices, priorities
        header = self._pair_headers.get(len(indices))
        if header is None:
            whole = priority_npy(indices, priorities)
            header = self._pair_headers[len(indices)] = whole[: len(whole) - pairs.nbytes]
        os.write(self.priority_fd, header + pairs.tobytes())
        self.seconds["priority"] += time.perf_counter() - started


def columns(batch: np.ndarray) -> Any:
    """A batch's fields as tensors (packed records have strided fields: made contiguous)."""
    import torch

    return lambda name: torch.as_tensor(np.ascontiguousarray(batch[name]))


def run_loop(buffer: Any, steps: int, learning_starts: int) -> dict[str, Any]:
    import gymnasium as gym
    import torch
    import torch.nn as nn

    torch.manual_seed(0)

    def q_network() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    net, target = q_network(), q_network()
    target.load_state_dict(net.state_dict())
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    record = np.zeros(1, RECORD)
    returns: list[float] = []
    episode = 0.0
    started = time.perf_counter()
    for step in range(steps):
        epsilon = max(0.05, 1.0 - step / (steps * 0.4))
        if rng.random() < epsilon:
            action = int(rng.integers(2))
        else:
            with torch.no_grad():
                action = int(net(torch.as_tensor(obs)).argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        record["obs"], record["action"], record["reward"] = obs, action, reward
        record["next_obs"], record["done"] = next_obs, float(terminated)
        buffer.append(record)
        episode += float(reward)
        obs = next_obs
        if terminated or truncated:
            returns.append(episode)
            episode = 0.0
            obs, _ = env.reset()
        if step < learning_starts:
            continue
        batch = buffer.sample()
        field = columns(batch)
        states, next_states, actions = field("obs"), field("next_obs"), field("action")
        q = net(states).gather(1, actions[:, None]).squeeze(1)
        with torch.no_grad():
            best = net(next_states).argmax(1, keepdim=True)
            value = target(next_states).gather(1, best).squeeze(1)
            goal = field("reward") + GAMMA * (1 - field("done")) * value
        errors = goal - q
        loss = (field("_weight") * errors.pow(2)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        buffer.update(batch["_index"], errors.detach().abs().numpy().astype(np.float64) + 1e-3)
        if step % 500 == 0:
            target.load_state_dict(net.state_dict())
    wall = time.perf_counter() - started
    return {"wall_s": wall, "last_20_mean_return": statistics.fmean(returns[-20:]) if returns else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--learning-starts", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy-poll-us", type=int, default=200, help="the daemon's --busy-poll-us (its default: 200)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    runs: list[dict[str, Any]] = []
    for _ in range(args.runs):  # interleaved, so drift on the machine hits both alike
        in_memory = run_loop(NumpyBuffer(), args.steps, args.learning_starts)
        with (
            tempfile.TemporaryDirectory(prefix="distorefs-cartpole-") as tmp,
            mounted(Path(tmp), "--busy-poll-us", str(args.busy_poll_us)) as mnt,
        ):
            loops = {"files": FileBuffer, "open_files": OpenFileBuffer, "headers_once": HeaderOnceBuffer}
            run: dict[str, Any] = {"numpy": in_memory}
            for name, kind in loops.items():
                buffer = kind(mnt / "buffers" / f"cartpole-{name}")
                try:
                    run[name] = run_loop(buffer, args.steps, args.learning_starts)
                finally:
                    buffer.close()
                run[name]["buffer_s"] = {k: round(v, 2) for k, v in buffer.seconds.items()}
        runs.append(run)

    def median(path: str, key: str = "wall_s") -> float:
        return round(statistics.median(r[path][key] for r in runs), 2)

    def ratio(path: str) -> float:
        return round(statistics.median(r[path]["wall_s"] / r["numpy"]["wall_s"] for r in runs), 2)

    report = {
        "steps": args.steps,
        "busy_poll_us": args.busy_poll_us,
        "runs": runs,
        "median_numpy_wall_s": median("numpy"),
        "median_files_wall_s": median("files"),
        "median_open_files_wall_s": median("open_files"),
        "median_headers_once_wall_s": median("headers_once"),
        "median_ratio": ratio("files"),
        "median_ratio_open_files": ratio("open_files"),
        "median_ratio_headers_once": ratio("headers_once"),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
