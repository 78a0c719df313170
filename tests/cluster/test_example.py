"""The distributed DQN example in its cluster form: three daemons on a local etcd, the
buffer sharded over them, an actor on each node and the learner on the first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.cluster.conftest import NodeFactory
from tests.conftest import EXAMPLE, best_run_of_episodes, first_episodes, wait_for

RANDOM_RETURN = 22


def test_distributed_dqn_learns_with_its_buffer_sharded_over_three_nodes(
    cluster_node: NodeFactory, tmp_path: Path
) -> None:
    nodes = [cluster_node(f"n{i}") for i in range(3)]
    wait_for(lambda: len(json.loads((nodes[0].path / ".distore" / "peers").read_text())["live_nodes"]) == 3)
    out = tmp_path / "out"
    result = subprocess.run(  # until 20 episodes in a row average 80 (19-30 s here), 120 s at most
        [sys.executable, str(EXAMPLE), "run", "--mount", ",".join(str(n.path) for n in nodes), "--shards", "3",
         "--out", str(out), "--seconds", "120", "--actors", "3", "--stop-at-return", "80"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert np.mean(first_episodes(out, 20)) < 2 * RANDOM_RETURN  # it starts near random (tests/mount/test_example.py)
    # a clear rise above random on 2 cores shared by 3 daemons: 20 episodes in a row
    assert best_run_of_episodes(out, 20) >= 80, summary["curve"]
    assert summary["stop"]["reason"] == "learned"
    stats = json.loads((nodes[0].path / "buffers" / "cartpole" / "stats").read_text())
    shards = stats["cluster"]["shards"]
    assert sorted(s["node"] for s in shards) == ["n0", "n1", "n2"]
    assert all(s["size"] > 0 for s in shards)  # each node's actor appended to its own shard
    assert stats["cluster"]["remote_draws"] > 0  # the learner drew from the other nodes' shards
    for i in range(3):
        assert (out / f"actor-{i}.csv").read_text().count("\n") > 0
