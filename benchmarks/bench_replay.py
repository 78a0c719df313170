"""Replay-buffer benchmarks: DESIGN.md's workloads through the mount, against an in-process
numpy buffer doing the same work in the same run.

    .venv/bin/python benchmarks/bench_replay.py [--seconds 3] [--json PATH]

For DQN (110 KB items, batch 32, prioritized), SAC (3 KB, batch 256, uniform) and R2D2
(10 MB, batch 4, prioritized) it measures adds/s, samples/s (items and MB/s) and
priority updates/s through the files (one process, as an actor or learner would), the
same through the in-process buffer, the time of a 256-index priority update inside the
store, and DQN sampling with the buffer 3x larger than the DRAM budget. With
`--reverb-python PATH` (a Python with dm-reverb, see benchmarks/reverb_replay.py) it then
runs Reverb on the same workloads in the same run and compares. Prints Markdown tables;
docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distorefs import client  # noqa: E402
from distorefs.stores.replay.buffer import ReplayBuffer  # noqa: E402
from distorefs.stores.replay.config import BufferConfig  # noqa: E402
from distorefs.stores.replay.sumtree import SegmentTree  # noqa: E402
from distorefs.tiers.blocks import BlockStore  # noqa: E402
from distorefs.tiers.dram import DramCache  # noqa: E402
from distorefs.tiers.metadb import MetaDb  # noqa: E402
from distorefs.tiers.nvme_log import NvmeLog  # noqa: E402


@dataclass(frozen=True)
class Workload:
    name: str
    item_bytes: int
    batch: int
    sampler: str
    capacity: int
    fill: int  # items appended before sampling
    append_chunk: int  # items per open of append
    need_adds: float  # DESIGN.md's rates
    need_samples: float
    aim_samples: float  # the aim through the mount


WORKLOADS = [
    Workload("DQN", 110_000, 32, "prioritized", 20_000, 3_000, 16, 400, 1_650, 8_250),
    Workload("SAC", 3_000, 256, "uniform", 200_000, 50_000, 256, 71, 138, 20_000),
    Workload("R2D2", 10_000_000, 4, "prioritized", 200, 60, 1, 3, 45, 225),
]


class NumpyBuffer:
    """The in-process baseline: a ring of fixed-size rows and a sum tree."""

    def __init__(self, capacity: int, item_bytes: int, prioritized: bool) -> None:
        self.rows = np.zeros((capacity, item_bytes), dtype=np.uint8)
        self.tree = SegmentTree(capacity, with_min_max=True)
        self.prioritized = prioritized
        self.size = 0
        self.next = 0
        self.rng = np.random.default_rng()

    def add(self, items: list[bytes]) -> None:
        for item in items:
            slot = self.next % len(self.rows)
            self.rows[slot] = np.frombuffer(item, dtype=np.uint8)
            self.tree.update(np.array([slot]), np.ones(1))
            self.next += 1
            self.size = min(self.size + 1, len(self.rows))

    def sample(self, batch: int) -> np.ndarray:
        if self.prioritized:
            total = self.tree.total
            slots = self.tree.find((np.arange(batch) + self.rng.random(batch)) * (total / batch))
        else:
            slots = self.rng.integers(0, self.size, batch)
        return self.rows[slots]  # a copy, as a batch handed to a learner is

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self.tree.update(slots, priorities)


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def summary(w: Workload, adds: float, items: int, elapsed: float, updates: int, up_elapsed: float) -> dict[str, float]:
    return {
        "adds_per_s": adds,
        "samples_per_s": rate(items, elapsed),
        "sample_MBps": rate(items, elapsed) * w.item_bytes / 1e6,
        "priority_updates_per_s": rate(updates, up_elapsed),
    }


def timed_loop(seconds: float, step: object) -> tuple[int, float]:
    """Run `step()` (returns units done) until `seconds` pass; (units, elapsed)."""
    assert callable(step)
    done = 0
    started = time.perf_counter()
    while True:
        done += step()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return done, elapsed


def bench_mount(mnt: Path, w: Workload, seconds: float, payloads: list[bytes]) -> dict[str, float]:
    path = mnt / "buffers" / w.name.lower()
    path.mkdir()
    (path / "config").write_text(
        json.dumps({"capacity": w.capacity, "sampler": w.sampler, "batch_size": w.batch, "sample_timeout": 30})
    )
    started = time.perf_counter()
    for start in range(0, w.fill, w.append_chunk):
        client.append(path, payloads[start : start + w.append_chunk])
    adds = rate(w.fill, time.perf_counter() - started)

    sampler = client.Sampler(path)  # a learner reuses its receive buffer

    def sample() -> int:
        return len(sampler.sample())

    items, elapsed = timed_loop(seconds, sample)
    indices = np.arange(min(256, w.fill))

    def update() -> int:
        client.update_priorities(path, indices, np.random.random(len(indices)) + 0.1)
        return len(indices)

    updates, up_elapsed = timed_loop(seconds / 2, update)
    return summary(w, adds, items, elapsed, updates, up_elapsed)


def bench_plain(mnt: Path, w: Workload, seconds: float, payloads: list[bytes]) -> dict[str, float]:
    """The plain-file recipes of docs/namespace.md on a schema buffer (one uint8 field of
    the item's size), no distorefs import: `np.save` of a chunk of records per open of
    `append`, then the batches of `plain_recipes`, and `client.Sampler` on the same
    buffer for the ratio; in this process and in a learner process of its own."""
    path = mnt / "buffers" / f"{w.name.lower()}-plain"
    path.mkdir()
    (path / "config").write_text(
        json.dumps(
            {
                "capacity": w.capacity, "sampler": w.sampler, "batch_size": w.batch, "sample_timeout": 30,
                "schema": {"obs": ["uint8", [w.item_bytes]]},
            }
        )
    )  # fmt: skip
    dtype = np.dtype([("obs", np.uint8, (w.item_bytes,))])
    chunk = max(w.append_chunk, 32) if w.item_bytes < 1_000_000 else 1
    records = np.frombuffer(b"".join(payloads[:chunk]), dtype=dtype)
    appended = 0
    started = time.perf_counter()
    while appended < w.fill:
        with open(path / "append", "wb") as f:
            np.save(f, records)
        appended += len(records)
    adds = rate(appended, time.perf_counter() - started)
    out = {"adds_per_s": adds}
    for name, value in recipe_rates(*plain_recipes(path), seconds).items():
        out[f"{name}_per_s"] = value
    # The same in a process of their own, as a learner is: this one holds the
    # benchmark's payloads (hundreds of MB), and its allocator's state changes what a
    # fresh batch buffer costs (docs/benchmarks.md).
    # The np.load recipes on tmpfs, for the baseline: one batch copied to /dev/shm, read
    # the same way by a learner process of its own (a fresh process's allocator hands
    # each batch new memory, which this VM makes slow on any file system).
    copy = Path("/dev/shm") / f"distorefs-bench-{os.getpid()}-{w.name.lower()}.npy"
    copy.write_bytes((path / "sample").read_bytes())
    try:
        for prefix, extra in (("fresh", {}), ("kept", KEEP_FREED_MEMORY)):
            for flag, target, label in (("--learner", path, prefix), ("--learner-file", copy, f"tmpfs_{prefix}")):
                fresh = subprocess.run(
                    [sys.executable, __file__, flag, str(target), "--seconds", str(seconds)],
                    capture_output=True, text=True, timeout=600, check=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1", **extra},
                )  # fmt: skip
                for name, value in json.loads(fresh.stdout).items():
                    out[f"{label}_{name}_per_s"] = value
    finally:
        copy.unlink()
    shutil.rmtree(path, ignore_errors=True)
    return out


# glibc gives freed memory back to the kernel past a dynamic threshold, so a learner that
# frees each batch before it reads the next one faults in fresh pages for every batch
# (docs/namespace.md, "The fastest plain-file recipes"): these keep it.
KEEP_FREED_MEMORY = {"MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_MMAP_THRESHOLD_": str(256 << 20)}

PLAIN_RECIPES = ("np_load_file", "np_load_bytes", "kept_buffer", "kept_stream")  # no distorefs import
NP_LOAD_RECIPES = PLAIN_RECIPES[:2]  # also run on a batch in tmpfs, the baseline


def np_load_recipes(sample_file: str) -> dict[str, Callable[[], int]]:
    """The two `np.load` recipes of docs/namespace.md, each a step that returns the items
    it read: of `sample_file` opened, and of its bytes read whole."""
    return {
        "np_load_file": lambda: len(np.load(open(sample_file, "rb"))),
        "np_load_bytes": lambda: len(np.load(io.BytesIO(open(sample_file, "rb").read()))),
    }


def plain_recipes(path: Path) -> tuple[dict[str, Callable[[], int]], Callable[[], None]]:
    """The plain-file recipes of docs/namespace.md for a schema buffer's batches, each a
    step that returns the items it read, then `client.Sampler` for the ratio; and a
    function that closes what they keep open. `kept_buffer` and `kept_stream` read into
    one buffer made once (a batch is `st_size` bytes): an open of `sample` per batch, or
    one kept descriptor of `sample.stream`."""
    sample_file = str(path / "sample")
    with open(sample_file, "rb") as f:
        first = np.load(f)
    size = os.stat(sample_file).st_size
    dtype, count, offset = first.dtype, len(first), size - first.nbytes  # the header, parsed once
    buf = bytearray(size)
    stream_fd = os.open(path / "sample.stream", os.O_RDONLY)
    sampler = client.Sampler(path)

    def read_into(fd: int) -> int:
        got = 0
        while got < size:  # (one readv nearly always: a read ends at the batch's end)
            n = os.readv(fd, [memoryview(buf)[got:]])
            if not n:
                raise OSError(f"{path}: a batch ended at {got} of {size} bytes")
            got += n
        return len(np.frombuffer(buf, dtype, count, offset))  # valid until the next read

    def kept_buffer() -> int:
        fd = os.open(sample_file, os.O_RDONLY)
        try:
            return read_into(fd)
        finally:
            os.close(fd)

    def close() -> None:
        os.close(stream_fd)
        sampler.close()

    recipes: dict[str, Callable[[], int]] = {
        **np_load_recipes(sample_file),
        "kept_buffer": kept_buffer,
        "kept_stream": lambda: read_into(stream_fd),
        "client": lambda: len(sampler.sample()),
    }
    return recipes, close


def learner(path: Path, seconds: float, one_file: bool) -> int:
    """`--learner`: each recipe of `plain_recipes` for `seconds`, as JSON rates;
    `--learner-file`: the `np.load` recipes on one batch's file (tmpfs)."""
    recipes, close = (np_load_recipes(str(path)), lambda: None) if one_file else plain_recipes(path)
    print(json.dumps(recipe_rates(recipes, close, seconds)))
    return 0


RECIPE_ROUNDS = 3


def recipe_rates(recipes: dict[str, Callable[[], int]], close: Callable[[], None], seconds: float) -> dict[str, float]:
    """Samples/s of each recipe: RECIPE_ROUNDS rounds of seconds / RECIPE_ROUNDS each,
    the recipes interleaved, the median round of each (one recipe's churn of new memory
    does not weigh on the next one alone); `close` at the end."""
    rounds: dict[str, list[float]] = {name: [] for name in recipes}
    try:
        for _ in range(RECIPE_ROUNDS):
            for name, step in recipes.items():
                items, elapsed = timed_loop(seconds / RECIPE_ROUNDS, step)
                rounds[name].append(rate(items, elapsed))
    finally:
        close()
    return {name: float(np.median(values)) for name, values in rounds.items()}


def bench_numpy(w: Workload, seconds: float, payloads: list[bytes]) -> dict[str, float]:
    buf = NumpyBuffer(min(w.capacity, w.fill), w.item_bytes, w.sampler == "prioritized")
    started = time.perf_counter()
    for start in range(0, w.fill, w.append_chunk):
        buf.add(payloads[start : start + w.append_chunk])
    adds = rate(w.fill, time.perf_counter() - started)
    items, elapsed = timed_loop(seconds, lambda: len(buf.sample(w.batch)))
    slots = np.arange(min(256, w.fill))

    def update() -> int:
        buf.update(slots, np.random.random(len(slots)))
        return len(slots)

    updates, up_elapsed = timed_loop(seconds / 2, update)
    return summary(w, adds, items, elapsed, updates, up_elapsed)


def store_priority_update_ms(tmp: Path) -> float:
    """Median time of one 256-index priority update inside the store (no FUSE)."""

    async def run() -> float:
        meta = MetaDb.open(str(tmp / "meta.sqlite"))
        blocks = BlockStore(NvmeLog.open(str(tmp / "log")), DramCache(256 << 20), meta)
        buf = ReplayBuffer("p", 1 << 48, BufferConfig(capacity=1_000_000, sampler="prioritized"), blocks, meta)
        await buf.append([b"x" * 16] * 20_000)
        times = []
        rng = np.random.default_rng(1)
        for _ in range(200):
            indices = rng.choice(20_000, 256, replace=False)
            started = time.perf_counter()
            buf.set_priorities(indices, rng.random(256))
            times.append(time.perf_counter() - started)
        await blocks.close()
        meta.close()
        return float(np.median(times) * 1e3)

    return trio.run(run)


def distore(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "distorefs", *args], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--reverb-python", help="a Python with dm-reverb installed (optional)")
    parser.add_argument("--learner", help=argparse.SUPPRESS)  # a buffer dir: plain_recipes in this process
    parser.add_argument("--learner-file", help=argparse.SUPPRESS)  # a batch's file: np_load_recipes
    args = parser.parse_args()
    if args.learner or args.learner_file:
        return learner(Path(args.learner or args.learner_file), args.seconds, one_file=bool(args.learner_file))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = Path(tempfile.mkdtemp(prefix="distorefs-bench-replay-", dir="/var/tmp"))
    mnt = base / "mnt"
    mnt.mkdir()
    results: dict[str, dict[str, dict[str, float]]] = {}
    plain: dict[str, dict[str, float]] = {}
    try:
        distore("mount", str(mnt), "--data-dir", str(base / "data"), "--dram-budget", "6GiB")
        try:
            for w in WORKLOADS:
                rng = np.random.default_rng(0)
                distinct = [rng.integers(0, 256, w.item_bytes, dtype=np.uint8).tobytes() for _ in range(8)]
                payloads = [distinct[i % 8] for i in range(w.fill)]
                results[w.name] = {
                    "mount": bench_mount(mnt, w, args.seconds, payloads),
                    "numpy": bench_numpy(w, args.seconds, payloads),
                }
                plain[w.name] = bench_plain(mnt, w, args.seconds, payloads)
                shutil.rmtree(mnt / "buffers" / w.name.lower(), ignore_errors=True)
        finally:
            distore("umount", str(mnt))
        # DQN with the buffer 3x larger than the DRAM budget.
        w = WORKLOADS[0]
        small = Workload(w.name, w.item_bytes, w.batch, w.sampler, w.capacity, 1_200, w.append_chunk, 0, 0, 0)
        budget_mib = small.fill * small.item_bytes // 3 // (1 << 20)
        shutil.rmtree(base / "data", ignore_errors=True)
        distore("mount", str(mnt), "--data-dir", str(base / "data"), "--dram-budget", f"{budget_mib}MiB")
        try:
            payloads = [os.urandom(w.item_bytes) for _ in range(small.fill)]
            results["DQN-3x-DRAM"] = {"mount": bench_mount(mnt, small, args.seconds, payloads)}
        finally:
            distore("umount", str(mnt))
        update_ms = store_priority_update_ms(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print("| workload | path | adds/s | samples/s | sample MB/s | priority updates/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, paths in results.items():
        for path, r in paths.items():
            print(
                f"| {name} | {path} | {r['adds_per_s']:,.0f} | {r['samples_per_s']:,.0f} |"
                f" {r['sample_MBps']:,.0f} | {r['priority_updates_per_s']:,.0f} |"
            )
    print()
    print("| workload | samples/s vs numpy | samples/s vs need | vs aim | adds/s vs need |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for w in WORKLOADS:
        m, n = results[w.name]["mount"], results[w.name]["numpy"]
        print(
            f"| {w.name} | {m['samples_per_s'] / n['samples_per_s']:.2f}x | {m['samples_per_s'] / w.need_samples:.1f}x"
            f" | {m['samples_per_s'] / w.aim_samples:.2f}x | {m['adds_per_s'] / w.need_adds:.1f}x |"
        )
    print()
    columns = (
        " np.load(file) | np.load(BytesIO(read())) | kept buffer | kept stream | client.Sampler"
        " | np.load recipes vs client (worse) | best plain vs client |"
    )
    print("| workload (schema buffer) | np.save adds/s |" + columns)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in plain.items():
        rates = [r[f"{k}_per_s"] for k in PLAIN_RECIPES]
        print(
            f"| {name} | {r['adds_per_s']:,.0f} | {' | '.join(f'{x:,.0f}' for x in rates)} | {r['client_per_s']:,.0f} |"
            f" {min(rates[:2]) / r['client_per_s']:.2f}x | {max(rates) / r['client_per_s']:.2f}x |"
        )
    print(
        "\n| workload (schema buffer), a learner process of its own |" + columns
        + " tmpfs: np.load(file) | tmpfs: np.load(BytesIO(read())) | np.load recipes vs tmpfs |"
    )  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for prefix, label in (("fresh", ""), ("kept", ", MALLOC_* keep freed memory")):
        for name, r in plain.items():
            rates = [r[f"{prefix}_{k}_per_s"] for k in PLAIN_RECIPES]
            tmpfs = [r[f"tmpfs_{prefix}_{k}_per_s"] for k in NP_LOAD_RECIPES]
            c = r[f"{prefix}_client_per_s"]
            print(
                f"| {name}{label} | {' | '.join(f'{x:,.0f}' for x in rates)} | {c:,.0f} |"
                f" {min(rates[:2]) / c:.2f}x | {max(rates) / c:.2f}x | {tmpfs[0]:,.0f} | {tmpfs[1]:,.0f} |"
                f" {rates[0] / tmpfs[0]:.2f}x, {rates[1] / tmpfs[1]:.2f}x |"
            )
    hot, cold = results["DQN"]["mount"]["samples_per_s"], results["DQN-3x-DRAM"]["mount"]["samples_per_s"]
    print(f"\nDQN sampling with the buffer 3x the DRAM budget: {cold:,.0f}/s ({cold / hot:.2f}x of in-DRAM)")
    print(f"priority update of 256 indices inside the store: {update_ms:.3f} ms (median of 200)")
    reverb = run_reverb(args.reverb_python, args.seconds) if args.reverb_python else {}
    if reverb:
        print("\n| workload | Reverb inserts/s | Reverb samples/s | mount samples/s vs Reverb |"
              " client.Sampler vs Reverb | best plain recipe vs Reverb |")  # fmt: skip
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for w in WORKLOADS:
            r, m, p = reverb[w.name], results[w.name]["mount"], plain[w.name]
            best = max(p[f"{k}_per_s"] for k in PLAIN_RECIPES)
            print(
                f"| {w.name} | {r['inserts_per_s']:,} | {r['samples_per_s']:,} |"
                f" {m['samples_per_s'] / r['samples_per_s']:.2f}x | {p['client_per_s'] / r['samples_per_s']:.2f}x |"
                f" {best / r['samples_per_s']:.2f}x |"
            )
    if args.json:
        report = {"results": results, "plain": plain, "store_update_ms": update_ms, "reverb": reverb}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def run_reverb(python: str, seconds: float) -> dict[str, dict[str, int]]:
    """Reverb on the same workloads (benchmarks/reverb_replay.py, in its own Python)."""
    workloads = [[w.name, w.item_bytes, w.batch, w.sampler, w.capacity, w.fill] for w in WORKLOADS]
    done = subprocess.run(
        [python, str(Path(__file__).with_name("reverb_replay.py")), "--seconds", str(seconds),
         "--workloads", json.dumps(workloads)],
        capture_output=True, text=True, timeout=1800, check=True,
    )  # fmt: skip
    result: dict[str, dict[str, int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    sys.exit(main())
