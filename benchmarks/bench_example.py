"""The distributed DQN example (docs/examples/distributed_dqn.py) through distorefs against
the same learning with an in-process buffer and a local-disk checkpoint directory, in
one run.

    .venv/bin/python benchmarks/bench_example.py [--seconds 90] [--actors 2] [--runs 1]

distorefs: the example as it ships (actor processes, a learner process, a prioritized
buffer with samples_per_insert 8, weights with wait, fsync'ed checkpoints), on a fresh
mount. In-process: one process that does the same work in the same proportions, 8 env
steps per update, the same network, loss and batch, a proportional prioritized draw
from numpy arrays, the policy "published" as a state_dict copy every 50 updates and a
checkpoint torch.save'd and fsync'ed to the local disk every 500. Reports env steps/s,
learner updates/s and the seconds until the mean return of 10 s reached 150, for each.
No thresholds: docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon import mounted  # noqa: E402 - benchmarks/ is not a package

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "distributed_dqn.py"
CAPACITY, BATCH, ALPHA, BETA, STEPS_PER_UPDATE = 50_000, 64, 0.6, 0.4, 8


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("distributed_dqn", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_to(points: list[dict[str, float]], level: float) -> float | None:
    return next((p["t_s"] for p in points if p["mean_return"] >= level), None)


def through_distorefs(seconds: float, actors: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="distorefs-bench-", dir="/var/tmp") as base:
        with mounted(Path(base), "--dram-budget", "1GiB") as mnt:
            out = Path(base) / "out"
            subprocess.run(
                [sys.executable, str(EXAMPLE), "run", "--mount", str(mnt), "--out", str(out),
                 "--seconds", str(seconds), "--actors", str(actors)],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def in_process(seconds: float) -> dict[str, Any]:
    import gymnasium as gym
    import torch

    ex = load_example()
    torch.set_num_threads(1)
    net, target = ex.q_network(), ex.q_network()
    target.load_state_dict(net.state_dict())
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    records = np.zeros(CAPACITY, dtype=ex.RECORD)
    priority = np.zeros(CAPACITY)
    size = next_index = step = env_steps = 0
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    episode_return, returns = 0.0, []
    published: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="distorefs-bench-", dir="/var/tmp") as ckpt_dir:
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            for _ in range(STEPS_PER_UPDATE):  # the actors' share of the work
                action = ex.choose_action(net, obs, step, rng)
                next_obs, reward, terminated, truncated, _ = env.step(action)
                slot = next_index % CAPACITY
                records[slot] = (obs, action, reward, next_obs, float(terminated))
                priority[slot] = priority[:size].max() if size else 1.0
                next_index, size, env_steps = next_index + 1, min(size + 1, CAPACITY), env_steps + 1
                episode_return += float(reward)
                obs = next_obs
                if terminated or truncated:
                    returns.append((time.monotonic() - started, episode_return))
                    obs, _ = env.reset()
                    episode_return = 0.0
            if size < 1000:
                continue
            scaled = priority[:size] ** ALPHA
            p = scaled / scaled.sum()
            picked = rng.choice(size, BATCH, p=p)
            weights = (size * p[picked]) ** -BETA
            batch = {name: np.ascontiguousarray(records[name][picked]) for name in ex.RECORD.names}
            batch["_weight"] = (weights / ((size * p.min()) ** -BETA)).astype(np.float32)
            errors = ex.train_step(net, target, optimizer, batch)
            priority[picked] = errors + 1e-3
            step += 1
            if step % 250 == 0:
                target.load_state_dict(net.state_dict())
            if step % 50 == 0:
                published = {k: v.clone() for k, v in net.state_dict().items()}
            if step % 500 == 0:
                with open(os.path.join(ckpt_dir, f"step-{step:08d}.pt"), "wb") as f:
                    torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, f)
                    f.flush()
                    os.fsync(f.fileno())
        elapsed = time.monotonic() - started
    del published
    buckets: dict[int, list[float]] = {}
    for at, ret in returns:
        buckets.setdefault(int(at // 10), []).append(ret)
    curve = [{"t_s": (b + 1) * 10.0, "mean_return": float(np.mean(v))} for b, v in sorted(buckets.items())]
    return {"curve": curve, "env_steps_per_s": env_steps / elapsed, "learner_updates_per_s": step / elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1, help="interleaved repetitions; medians are reported")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"distorefs": [], "in-process": []}
    for _ in range(args.runs):
        rows["distorefs"].append(through_distorefs(args.seconds, args.actors))
        rows["in-process"].append(in_process(args.seconds))
    print("| | env steps/s | learner updates/s | s to a mean return >= 150 |")
    print("| --- | ---: | ---: | ---: |")
    for name, runs in rows.items():
        steps = statistics.median(r["env_steps_per_s"] for r in runs)
        updates = statistics.median(r["learner_updates_per_s"] for r in runs)
        reached = [t for r in runs if (t := time_to(r["curve"], 150.0)) is not None]
        when = f"{statistics.median(reached):.0f}" if reached else "not reached"
        print(f"| {name} | {steps:,.0f} | {updates:,.0f} | {when} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
