"""Distributed DQN on CartPole, with every piece of state in distorefs and nothing but
file calls between the processes.

    python docs/examples/distributed_dqn.py run --mount /mnt/distore --actors 2 --seconds 120 --out /tmp/dqn

- `actor` processes play CartPole-v1 with an epsilon-greedy copy of the policy and append
  their transitions to a prioritized replay buffer (`np.save` to `buffers/cartpole/append`,
  16 per open). They load the policy from `weights/policy/model.pt` and learn of new
  versions by reading `weights/policy/wait`, which blocks until one is published.
- One `learner` samples batches (`np.load` of `buffers/cartpole/sample.npz`, with
  `_index` and `_weight`), trains a double DQN with importance weights, writes the new priorities
  (`np.save` to `priority`), publishes the policy every `--publish-every` steps and
  checkpoints every `--checkpoint-every` steps to `checkpoints/dqn/` (fsync'ed, with
  `user.distore.keep_last` = 3). The buffer's rate limiter (`samples_per_insert`) keeps
  the actors and the learner in step, however many actors there are.
- A learner that is killed (`run --kill-learner-at S` or `--kill-learner-after-step N`
  does it with SIGKILL) and started again resumes from the newest checkpoint whose
  `user.distore.state` is `durable`, with the same buffer: only the steps after that
  checkpoint are done again.
- `run` starts them all for a bounded time (`--seconds`), or until the policy has
  learned (`--stop-at-return R`: 20 episodes in a row average R or more), prints the
  learning curve (mean episode return per interval) and writes it as JSON, and as a plot
  where matplotlib is installed. `scripts/example.sh` mounts a fresh distorefs and runs it.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BUFFER, MODEL, CHECKPOINTS = "buffers/cartpole", "weights/policy", "checkpoints/dqn"
RECORD = np.dtype(
    [("obs", "<f4", (4,)), ("action", "<i8"), ("reward", "<f4"), ("next_obs", "<f4", (4,)), ("done", "<f4")]
)
SCHEMA = {
    "obs": {"dtype": "<f4", "shape": [4]},
    "action": "<i8",
    "reward": "<f4",
    "next_obs": {"dtype": "<f4", "shape": [4]},
    "done": "<f4",
}
PER_APPEND = 16
BATCH = 64
GAMMA = 0.99
LEARNED_OVER = 20  # episodes in a row whose mean return `--stop-at-return` compares
STOP_FILE = "stop"  # in --out: `run` makes it to end the actors and the learner early


class Clock:
    """How long an actor or the learner goes on: `seconds` from its start, or until `run`
    makes the stop file (a stat of a local file, cheap enough for every step)."""

    def __init__(self, seconds: float, out: Path) -> None:
        self.deadline = time.monotonic() + seconds
        self.stop_file = out / STOP_FILE

    def running(self) -> bool:
        return time.monotonic() < self.deadline and not self.stop_file.exists()


def q_network() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def set_up(mount: Path, samples_per_insert: float, shards: int) -> None:
    """Make the buffer (spread over `shards` nodes in a cluster), the model and the
    checkpoint directory (each once)."""
    buffer = mount / BUFFER
    if not buffer.exists():
        buffer.mkdir(parents=True)
        config = {
            "capacity": 50_000, "sampler": "prioritized", "batch_size": BATCH, "alpha": 0.6, "beta": 0.4,
            "min_size_to_sample": 1000, "samples_per_insert": samples_per_insert, "schema": SCHEMA,
            # a sample or append the rate limiter holds back gets EAGAIN after 2 s (10 by
            # default), so that a process told to stop sees it soon: its peers may be gone
            "sample_timeout": 2,
        }  # fmt: skip
        if shards > 1:
            config["shards"] = shards
        (buffer / "config").write_text(json.dumps(config))
    (mount / MODEL).mkdir(parents=True, exist_ok=True)
    checkpoints = mount / CHECKPOINTS
    if not checkpoints.exists():
        checkpoints.mkdir(parents=True)
        os.setxattr(checkpoints, "user.distore.keep_last", b"3")


# --- actor ---------------------------------------------------------------------------------


class PolicyVersions:
    """Follows `weights/policy/wait` in a thread: each line it reads is a new version."""

    def __init__(self, mount: Path) -> None:
        self.path = mount / MODEL / "wait"
        self.latest = 0
        self.changed = threading.Event()
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        while True:
            try:
                with open(self.path, "rb") as f:
                    for line in f:  # blocks until the next version is published
                        self.latest = int(line.split()[0])
                        self.changed.set()
            except OSError as exc:
                if exc.errno != errno.ETIMEDOUT:  # no new version within --wait-timeout: read on
                    raise


def load_policy(mount: Path) -> tuple[int, Any]:
    import torch

    net = q_network()
    with open(mount / MODEL / "model.pt", "rb") as f:
        saved = torch.load(f)
    net.load_state_dict(saved["net"])
    return int(saved["step"]), net


def choose_action(net: Any, obs: Any, learner_step: int, rng: np.random.Generator) -> int:
    """Epsilon-greedy, exploring less as the learner learns (1.0 down to 0.02 by step 2000)."""
    import torch

    if rng.random() < max(0.02, 1.0 - learner_step / 2000):
        return int(rng.integers(2))
    with torch.no_grad():
        return int(net(torch.as_tensor(obs)).argmax())


def actor(mount: Path, rank: int, clock: Clock, log_path: Path, seed: int) -> None:
    import gymnasium as gym
    import torch

    torch.set_num_threads(1)
    versions = PolicyVersions(mount)
    while versions.latest < 1:  # the learner publishes the first policy at its start
        if not clock.running():
            return
        versions.changed.wait(timeout=1.0)
        versions.changed.clear()
    learner_step, net = load_policy(mount)
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    pending, episode_return, steps = [], 0.0, 0
    with open(log_path, "a", encoding="utf-8") as log:
        while clock.running():
            if versions.changed.is_set():
                versions.changed.clear()
                learner_step, net = load_policy(mount)
            action = choose_action(net, obs, learner_step, rng)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            pending.append((obs, action, reward, next_obs, float(terminated)))
            episode_return += float(reward)
            steps += 1
            obs = next_obs
            if terminated or truncated:
                log.write(f"{time.time():.3f},{rank},{episode_return:.0f},{steps}\n")
                log.flush()
                obs, _ = env.reset()
                episode_return = 0.0
            if len(pending) >= PER_APPEND:
                append(mount, pending, clock)
                pending = []


def append(mount: Path, transitions: list[tuple[Any, ...]], clock: Clock) -> None:
    """One open of `append` with a .npy of records; waits out the rate limiter (EAGAIN)
    while `clock` runs."""
    records = np.array(transitions, dtype=RECORD)
    while clock.running():
        try:
            np.save(mount / BUFFER / "append", records)
            return
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise


# --- learner -------------------------------------------------------------------------------


def newest_durable_checkpoint(mount: Path) -> Path | None:
    for path in sorted((mount / CHECKPOINTS).glob("step-*.pt"), reverse=True):
        try:
            if os.getxattr(path, "user.distore.state") == b"durable":
                return path
        except OSError:
            continue
    return None


def sample(mount: Path, clock: Clock) -> dict[str, np.ndarray] | None:
    """One batch, a contiguous array per field with `_index` and `_weight` (`sample.npz`,
    so each goes into torch as it is); waits while the buffer is too small or the rate
    limiter holds the learner back (EAGAIN), while `clock` runs: None once it stops."""
    while clock.running():
        try:
            with open(mount / BUFFER / "sample.npz", "rb", buffering=0) as f:
                data = f.read()
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise
            continue
        if data is None:  # EAGAIN: Python's read() of a whole file returns None for it, not an error
            continue
        with np.load(io.BytesIO(data)) as batch:
            return {name: batch[name] for name in batch.files}
    return None


def train_step(net: Any, target: Any, optimizer: Any, batch: dict[str, np.ndarray]) -> np.ndarray:
    """One double-DQN update with importance weights; returns the |TD errors|."""
    import torch
    import torch.nn.functional as F

    obs, next_obs = torch.as_tensor(batch["obs"]), torch.as_tensor(batch["next_obs"])
    action, reward, done = (torch.as_tensor(batch[k]) for k in ("action", "reward", "done"))
    with torch.no_grad():
        best = net(next_obs).argmax(dim=1, keepdim=True)
        target_q = reward + GAMMA * (1 - done) * target(next_obs).gather(1, best).squeeze(1)
    q = net(obs).gather(1, action.unsqueeze(1)).squeeze(1)
    loss = (torch.as_tensor(batch["_weight"]) * F.smooth_l1_loss(q, target_q, reduction="none")).mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
    optimizer.step()
    errors: np.ndarray = (q - target_q).abs().detach().numpy()
    return errors


def learner(mount: Path, clock: Clock, publish_every: int, checkpoint_every: int, log_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    net, target = q_network(), q_network()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    step = 0
    resumed = newest_durable_checkpoint(mount)
    if resumed is not None:
        with open(resumed, "rb") as f:
            state = torch.load(f)
        net.load_state_dict(state["net"])
        target.load_state_dict(state["target"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    else:
        target.load_state_dict(net.state_dict())
    with open(log_path, "a", encoding="utf-8") as log:
        start = {"event": "start", "time": time.time(), "step": step, "resumed_from": str(resumed)}
        log.write(json.dumps(start) + "\n")
        log.flush()

        def publish() -> None:
            torch.save({"net": net.state_dict(), "step": step}, mount / MODEL / "model.pt")

        publish()
        while (batch := sample(mount, clock)) is not None:
            errors = train_step(net, target, optimizer, batch)
            step += 1
            pairs = np.zeros(len(batch["_index"]), dtype=[("index", "<i8"), ("priority", "<f8")])
            pairs["index"] = batch["_index"]
            pairs["priority"] = errors + 1e-3
            np.save(mount / BUFFER / "priority", pairs)
            if step % 250 == 0:
                target.load_state_dict(net.state_dict())
            if step % publish_every == 0:
                publish()
            if step % checkpoint_every == 0:
                state = {
                    "net": net.state_dict(), "target": target.state_dict(),
                    "optimizer": optimizer.state_dict(), "step": step,
                }  # fmt: skip
                with open(mount / CHECKPOINTS / f"step-{step:08d}.pt", "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())  # durable: a restart may resume from it
                log.write(json.dumps({"event": "checkpoint", "time": time.time(), "step": step}) + "\n")
                log.flush()
        log.write(json.dumps({"event": "end", "time": time.time(), "step": step}) + "\n")


# --- run -----------------------------------------------------------------------------------


def episodes(out: Path) -> list[tuple[float, float]]:
    """(time, return) of every episode the actors finished so far, in time order (each
    actor's CSV in `out`: time, rank, return, steps; a line still being written is left out)."""
    rows = []
    for path in out.glob("actor-*.csv"):
        for line in path.read_text().splitlines():
            fields = line.split(",")
            if len(fields) == 4 and fields[3]:
                rows.append((float(fields[0]), float(fields[2])))
    return sorted(rows)


def curve(out: Path, started: float, bucket_s: float) -> list[dict[str, float]]:
    """Mean episode return per `bucket_s` of wall time, over all actors."""
    buckets: dict[int, list[float]] = {}
    for at, ret in episodes(out):
        buckets.setdefault(int((at - started) // bucket_s), []).append(ret)
    return [
        {"t_s": (b + 1) * bucket_s, "episodes": len(v), "mean_return": float(np.mean(v))}
        for b, v in sorted(buckets.items())
    ]


def learned(out: Path, level: float) -> float | None:
    """The mean return of the last `LEARNED_OVER` episodes once it is `level` or more."""
    returns = [ret for _at, ret in episodes(out)[-LEARNED_OVER:]]
    if len(returns) == LEARNED_OVER and np.mean(returns) >= level:
        return float(np.mean(returns))
    return None


def learner_events(out: Path) -> list[dict[str, Any]]:
    path = out / "learner.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_until_visible(mounts: list[Path], timeout_s: float = 30.0) -> None:
    """In a cluster, the buffer and the model made on the first node appear on the others."""
    deadline = time.monotonic() + timeout_s
    for mount in mounts[1:]:
        while not ((mount / BUFFER / "config").exists() and (mount / MODEL).is_dir()):
            if time.monotonic() > deadline:
                raise SystemExit(f"{mount}: the buffer and model of the first node did not appear")
            time.sleep(0.2)


def supervise(
    args: argparse.Namespace,
    out: Path,
    started: float,
    learner: subprocess.Popen[bytes],
    start_learner: Callable[[float], subprocess.Popen[bytes]],
) -> tuple[dict[str, Any], subprocess.Popen[bytes]]:
    """Watch the run until its learner ends: kill -9 the learner and start it again when
    asked, and make the stop file once the policy has learned (`--stop-at-return`).
    Returns why the run ended, and the learner process that ran last."""
    kill_at = args.kill_learner_at or None
    killed = False
    while True:
        now = time.time() - started
        events = learner_events(out)
        if kill_at is None and args.kill_learner_after_step:
            done = [e for e in events if e["event"] == "checkpoint" and e["step"] >= args.kill_learner_after_step]
            if done:
                kill_at = done[0]["time"] - started + 1.0
        if not killed and kill_at is not None and now >= kill_at:
            learner.send_signal(signal.SIGKILL)
            learner.wait()
            print(f"killed the learner (kill -9) at {time.time() - started:.0f} s; starting it again", flush=True)
            learner = start_learner(max(1.0, args.seconds - (time.time() - started)))
            killed = True
        # a learner to be killed ends the run early only once it was killed, started again
        # and made a checkpoint after its restart
        restarted = [e["time"] for e in events if e["event"] == "start"][1:2]
        resumed = not (args.kill_learner_at or args.kill_learner_after_step) or any(
            e["event"] == "checkpoint" and e["time"] > at for e in events for at in restarted
        )
        level = learned(out, args.stop_at_return) if args.stop_at_return and resumed else None
        if level is not None:
            (out / STOP_FILE).touch()
            return {"reason": "learned", "mean_return": level, "at_s": now}, learner
        if learner.poll() is not None and (killed or kill_at is None):
            return {"reason": "time", "at_s": now}, learner
        time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    mounts = [Path(m) for m in args.mount.split(",")]
    mount, out = mounts[0], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / STOP_FILE).unlink(missing_ok=True)
    set_up(mount, args.samples_per_insert, args.shards)
    wait_until_visible(mounts)
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--mount", str(mount), "--out", str(out)]
    started = time.time()

    def start_learner(seconds: float) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*me, "learner", *common, "--seconds", str(seconds),
                                 "--publish-every", str(args.publish_every),
                                 "--checkpoint-every", str(args.checkpoint_every)])  # fmt: skip

    actors = [  # actor i on node i % len(mounts); the learner on the first
        subprocess.Popen([*me, "actor", "--mount", str(mounts[i % len(mounts)]), "--out", str(out),
                          "--rank", str(i), "--seconds", str(args.seconds)])
        for i in range(args.actors)
    ]  # fmt: skip
    learner_proc = start_learner(args.seconds)
    stop, learner_proc = supervise(args, out, started, learner_proc, start_learner)
    codes = [p.wait() for p in [learner_proc, *actors]]
    points = curve(out, started, args.bucket)
    events = learner_events(out)
    elapsed = time.time() - started
    logs = [p.read_text().splitlines() for p in out.glob("actor-*.csv")]
    env_steps = sum(int(lines[-1].split(",")[3]) for lines in logs if lines)  # up to each actor's last episode
    updates = max(e["step"] for e in events)  # the learner's step at the end (work redone after a kill not counted)
    summary = {
        "curve": points, "learner": events, "exit_codes": codes, "seconds": elapsed, "stop": stop,
        "env_steps_per_s": env_steps / elapsed, "learner_updates_per_s": updates / elapsed,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{'t (s)':>6} {'episodes':>8} {'mean return':>12}")
    for p in points:
        print(f"{p['t_s']:>6.0f} {p['episodes']:>8} {p['mean_return']:>12.1f}  {'#' * int(p['mean_return'] // 10)}")
    print(f"env steps/s {summary['env_steps_per_s']:.0f}, learner updates/s {summary['learner_updates_per_s']:.0f}")
    for event in events:
        if event["event"] == "start" and event["resumed_from"] != "None":
            print(f"learner resumed at step {event['step']} from {event['resumed_from']}")
    if stop["reason"] == "learned":
        print(f"learned: the last {LEARNED_OVER} episodes averaged {stop['mean_return']:.1f} at {stop['at_s']:.0f} s")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p["t_s"] for p in points], [p["mean_return"] for p in points], marker="o")
        if args.kill_learner_at:
            ax.axvline(args.kill_learner_at, color="red", linestyle="--", label="learner killed (kill -9)")
            ax.legend(fontsize=8)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("mean episode return")
        nodes = f", {len(mounts)} nodes" if len(mounts) > 1 else ""
        ax.set_title(f"distributed DQN on CartPole through distorefs ({args.actors} actors{nodes})")
        fig.tight_layout()
        fig.savefig(out / "curve.png", dpi=110)
        print(f"plot: {out / 'curve.png'}")
    except ImportError:
        pass
    return 0 if all(code == 0 for code in codes) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("run", "actor", "learner"))
    parser.add_argument(
        "--mount", required=True,
        help="a distorefs mount point; for run, several nodes' mount points separated by commas",
    )  # fmt: skip
    parser.add_argument("--shards", type=int, default=1, help="(run) spread the buffer over this many nodes")
    parser.add_argument("--out", required=True, help="where logs, the curve and the plot go (not the mount)")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to run")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0, help="(actor) its number")
    parser.add_argument("--publish-every", type=int, default=50, help="learner steps between published policies")
    parser.add_argument("--checkpoint-every", type=int, default=500, help="learner steps between checkpoints")
    parser.add_argument("--samples-per-insert", type=float, default=8.0, help="the buffer's rate limiter")
    parser.add_argument("--kill-learner-at", type=float, default=0.0, help="(run) kill -9 the learner after S")
    parser.add_argument(
        "--kill-learner-after-step", type=int, default=0,
        help="(run) kill -9 the learner 1 s after its checkpoint of this step or a later one",
    )  # fmt: skip
    parser.add_argument(
        "--stop-at-return", type=float, default=0.0,
        help=f"(run) end early once {LEARNED_OVER} episodes in a row average this return (after the "
        "restarted learner's first checkpoint when it is killed)",
    )  # fmt: skip
    parser.add_argument("--bucket", type=float, default=10.0, help="(run) seconds per point of the curve")
    args = parser.parse_args()
    mount, out = Path(args.mount), Path(args.out)
    if args.role == "actor":
        actor(mount, args.rank, Clock(args.seconds, out), out / f"actor-{args.rank}.csv", seed=args.rank)
    elif args.role == "learner":
        learner(mount, Clock(args.seconds, out), args.publish_every, args.checkpoint_every, out / "learner.jsonl")
    else:
        return run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
