"""Sampling through shared memory (`client.Sampler(transport="shm")`) against the files
(`transport="fuse"`) and cpprb in process, in one run (issue 18).

    .venv/bin/pip install -e .[bench]      # cpprb
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_shm.py [--seconds 3] [--processes 1,2]

DESIGN.md's workloads: DQN (110 KB items, batch 32, prioritized), SAC (3 KB, batch 256,
uniform), R2D2 (10 MB, batch 4, prioritized), each filled as bench_replay.py fills it.
For the mount, blob buffers; cpprb gets one uint8 field of the item's size and the same
sampler. Then several shm sampler processes at once on one DQN buffer (total samples/s:
blob items as views, and schema batches gathered into one array as cpprb returns them),
against as many processes each sampling a cpprb buffer of its own (views also with
`prefetch=2`, where the daemon finds requests queued).
Prints JSON; docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.daemon import mounted  # noqa: E402
from distorefs import client, hugepages  # noqa: E402

WORKLOADS = {  # name: (item bytes, batch, sampler, capacity, fill, items per append)
    "DQN": (110_000, 32, "prioritized", 20_000, 3_000, 16),
    "SAC": (3_000, 256, "uniform", 200_000, 50_000, 256),
    "R2D2": (10_000_000, 4, "prioritized", 200, 60, 1),
    # DQN as a schema buffer: the sampler gathers each batch into one array, as cpprb does
    "DQN-schema": (110_000, 32, "prioritized", 20_000, 3_000, 16),
}


def timed(seconds: float, step: Any) -> float:
    """Samples per second of `step` over `seconds`, after a warm-up of a quarter of that
    (a shared-memory arena fills in the background at a session's start)."""
    started = time.perf_counter()
    while time.perf_counter() - started < seconds / 4:
        step()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        done += step()
    return done / (time.perf_counter() - started)


def cpprb_rate(item: int, batch: int, sampler: str, capacity: int, fill: int, seconds: float) -> float:
    import cpprb

    env = {"obs": {"shape": item, "dtype": np.uint8}}
    rb = cpprb.PrioritizedReplayBuffer(capacity, env) if sampler == "prioritized" else cpprb.ReplayBuffer(capacity, env)
    chunk = np.random.default_rng(0).integers(0, 256, (min(fill, 16), item), dtype=np.uint8)
    for start in range(0, fill, len(chunk)):
        rb.add(obs=chunk[: min(len(chunk), fill - start)])
    return timed(seconds, lambda: len(rb.sample(batch)["obs"]))


def sampler_rate(path: Path, transport: str, seconds: float, prefetch: int = 0, gather: bool = False) -> float:
    with client.Sampler(path, transport=transport, prefetch=prefetch) as sampler:
        assert sampler.transport == transport, f"{transport} fell back to {sampler.transport}"
        assert transport == "fuse" or sampler.shm_version == 2, f"shm version {sampler.shm_version}"
        if gather:  # what a learner does with blob views: one contiguous array, as cpprb returns
            return timed(seconds, lambda: len(stacked(sampler.sample())))
        return timed(seconds, lambda: len(sampler.sample()))


def stacked(batch: list[tuple[int, float, memoryview]]) -> np.ndarray:
    return np.stack([np.frombuffer(item, np.uint8) for _index, _weight, item in batch])


def version1_rate(path: Path, seconds: float) -> float:
    """Version 1 (the daemon copies each batch into a region of the client's)."""
    channel = client._ShmChannel(str(path / "sample.shm"))
    try:
        return timed(seconds, lambda: len(client._decode(channel.next(), copy=False)))
    finally:
        channel.close()


def _worker(path: str, seconds: float, prefetch: int, out: Any) -> None:
    out.put(sampler_rate(Path(path), "shm", seconds, prefetch=prefetch))


def _cpprb_worker(seconds: float, out: Any) -> None:
    item, batch, sampler, capacity, fill, _per_append = WORKLOADS["DQN"]
    out.put(cpprb_rate(item, batch, sampler, capacity, fill, seconds))


def in_processes(count: int, target: Any, args: tuple[Any, ...], seconds: float) -> int:
    """Total samples/s of `count` processes running `target(*args, queue)` at once."""
    context = multiprocessing.get_context("fork")
    queue: Any = context.Queue()
    procs = [context.Process(target=target, args=(*args, queue)) for _ in range(count)]
    for p in procs:
        p.start()
    rates = [queue.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return int(round(sum(rates)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    parser.add_argument("--busy-poll-us", type=int, default=None, help="the daemon's --busy-poll-us (default: its own)")
    args = parser.parse_args()
    chosen = [w for w in WORKLOADS if not args.only or w in args.only.split(",")]
    # the host's setting for huge pages in shared memory (hugepages.py): arenas ask for them
    report: dict[str, Any] = {"shmem_enabled": hugepages.shmem_setting()}
    base = Path(tempfile.mkdtemp(prefix="distorefs-shm-", dir="/var/tmp"))
    try:
        polling = [] if args.busy_poll_us is None else ["--busy-poll-us", str(args.busy_poll_us)]
        with mounted(base, "--dram-budget", "6GiB", *polling) as mnt:
            for name in chosen:
                item, batch, sampler, capacity, fill, per_append = WORKLOADS[name]
                schema = name.endswith("-schema")
                path = mnt / "buffers" / name.lower()
                path.mkdir()
                config = {"capacity": capacity, "sampler": sampler, "batch_size": batch, "sample_timeout": 30}
                if schema:
                    config["schema"] = {"obs": ["u1", [item]]}
                (path / "config").write_text(json.dumps(config))
                rng = np.random.default_rng(0)
                distinct = [rng.integers(0, 256, item, dtype=np.uint8).tobytes() for _ in range(8)]
                for start in range(0, fill, per_append):
                    items = [distinct[(start + k) % 8] for k in range(min(per_append, fill - start))]
                    if schema:
                        client.append(path, np.frombuffer(b"".join(items), dtype=[("obs", "u1", (item,))]))
                    else:
                        client.append(path, items)
                if schema:  # the sampler's arrays are what cpprb returns: no user-side gather to add
                    row = {
                        "fuse": sampler_rate(path, "fuse", args.seconds),
                        "shm": sampler_rate(path, "shm", args.seconds),
                        "shm_prefetch2": sampler_rate(path, "shm", args.seconds, prefetch=2),
                        "cpprb": cpprb_rate(item, batch, sampler, capacity, fill, args.seconds),
                    }
                    for key in ("shm", "shm_prefetch2"):
                        row[f"{key}_vs_cpprb"] = row[key] / row["cpprb"]
                    report[name] = {k: round(v, 2 if "_vs_" in k else 0) for k, v in row.items()}
                    continue
                row = {
                    "fuse": sampler_rate(path, "fuse", args.seconds),
                    "shm_v1": version1_rate(path, args.seconds),
                    "shm": sampler_rate(path, "shm", args.seconds),
                    "shm_prefetch2": sampler_rate(path, "shm", args.seconds, prefetch=2),
                    "shm_gathered": sampler_rate(path, "shm", args.seconds, gather=True),
                    "cpprb": cpprb_rate(item, batch, sampler, capacity, fill, args.seconds),
                }
                for key in ("shm", "shm_prefetch2", "shm_gathered"):
                    row[f"{key}_vs_cpprb"] = row[key] / row["cpprb"]
                row["shm_vs_fuse"] = row["shm"] / row["fuse"]
                report[name] = {k: round(v, 2 if "_vs_" in k else 0) for k, v in row.items()}
                if name != "DQN":
                    shutil.rmtree(path, ignore_errors=True)
            # several learners at once: each shm sampler process on the one shared buffer,
            # against as many processes each sampling a cpprb buffer of its own in process
            scaling: dict[str, dict[int, int]] = {}
            runs = [  # (label, workload, prefetch); no workload: cpprb
                ("DQN_shm_views", "DQN", 0),  # blob items as views: the daemon's draws alone
                ("DQN_shm_views_prefetch2", "DQN", 2),  # the same with requests queued (one event loop's bound)
                ("DQN-schema_shm_prefetch2", "DQN-schema", 2),  # each batch gathered: a learner's copy
                ("DQN_cpprb", None, 0),
            ]
            for label, workload, prefetch in runs:
                if workload is not None and workload not in chosen:
                    continue
                for count in (int(n) for n in args.processes.split(",")):
                    if workload is None:
                        rate = in_processes(count, _cpprb_worker, (args.seconds,), args.seconds)
                    else:
                        buffer_dir = str(mnt / "buffers" / workload.lower())
                        rate = in_processes(count, _worker, (buffer_dir, args.seconds, prefetch), args.seconds)
                    scaling.setdefault(label, {})[count] = rate
            report["processes_total_samples_per_s"] = scaling
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
