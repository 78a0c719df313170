"""docs/examples/distributed_dqn.py through a real mount, until it has learned: actors and
a learner that talk only through files learn CartPole, and a learner killed with kill -9
resumes from the newest durable checkpoint with the same buffer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import EXAMPLE, best_run_of_episodes, first_episodes, mounted_at

pytestmark = pytest.mark.mount

RANDOM_RETURN = 22  # CartPole-v1 with a random policy: about 22 per episode


def test_distributed_dqn_learns_and_a_killed_learner_resumes_from_its_durable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with mounted_at(tmp_path / "mnt", tmp_path / "data", "--dram-budget", "512MiB") as mount:
        # It runs until 20 episodes in a row average 100 or more, after the restarted
        # learner's first checkpoint (17-22 s on a quiet 2-core VM, 31-49 s beside two CPU hogs), 120 s at most
        result = subprocess.run(
            [sys.executable, str(EXAMPLE), "run", "--mount", str(mount.path), "--out", str(out),
             "--seconds", "120", "--actors", "2", "--kill-learner-after-step", "1000", "--stop-at-return", "100"],
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        # It starts near random: the first 20 episodes of the actors (about 450 steps),
        # played before the buffer holds the 1,000 items the learner waits for.
        assert np.mean(first_episodes(out, 20)) < 2 * RANDOM_RETURN
        # and learns: 20 episodes in a row well above random, by the actors' own logs
        assert best_run_of_episodes(out, 20) >= 100, summary["curve"]
        assert summary["stop"]["reason"] == "learned"

        starts = [e for e in summary["learner"] if e["event"] == "start"]
        checkpoints_before_kill = [
            e["step"] for e in summary["learner"] if e["event"] == "checkpoint" and e["time"] < starts[1]["time"]
        ]
        assert starts[0]["resumed_from"] == "None"
        assert checkpoints_before_kill, "the learner checkpointed before it was killed"
        # resumed from the newest checkpoint made before the kill: only later steps are redone
        assert starts[1]["step"] == max(checkpoints_before_kill)
        assert starts[1]["resumed_from"].endswith(f"step-{max(checkpoints_before_kill):08d}.pt")

        kept = sorted(os.listdir(mount.path / "checkpoints" / "dqn"))
        assert 1 <= len(kept) <= 3  # keep_last = 3
        assert int((mount.path / "weights" / "policy" / "version").read_text().split()[0]) > 1
        stats = json.loads((mount.path / "buffers" / "cartpole" / "stats").read_text())
        assert stats["inserts"] > 5000
        assert "learner resumed at step" in result.stdout
