"""A replay buffer of a million items against one of 20,000: mount time and sampling.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_million.py [--items 1000000] [--rounds 3]

Builds two prioritized schema buffers of 8-byte records (1,000,000 and 20,000 items)
through the store in chunks of 10,000 (no mount: minutes less than a million appends
through FUSE), closes it, then `distore mount`s the data dir `--rounds` times (the first
with the page cache dropped where allowed) and times the mount. In each mounted round it
waits for the start-up warm-up to have read the items into DRAM (timed too), then
samples both buffers with the plain recipe (`np.load(io.BytesIO(open(sample, "rb",
buffering=0).read()))`, batch 32), once the compiled kernels have loaded, `--batches`
batches each after 100 to warm up, in ten turns alternating between the buffers.
Prints JSON; docs/benchmarks.md keeps the results (issue 16: the million samples
within 10% of the 20,000, and mounts in under 5 s).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon import wait_for_kernels  # noqa: E402

from distorefs.stores.replay.config import BufferConfig  # noqa: E402
from distorefs.stores.replay.store import BufferStore  # noqa: E402
from distorefs.tiers.blocks import BlockStore  # noqa: E402
from distorefs.tiers.dram import DramCache  # noqa: E402
from distorefs.tiers.metadb import MetaDb  # noqa: E402
from distorefs.tiers.nvme_log import NvmeLog  # noqa: E402

DISTORE = [sys.executable, "-m", "distorefs"]
SCHEMA = {"x": "<i8"}


async def build(data: Path, sizes: dict[str, int]) -> None:
    meta = MetaDb.open(str(data / "meta.sqlite"))
    blocks = BlockStore(NvmeLog.open(str(data / "log")), DramCache(1 << 30), meta)
    store = BufferStore.load(blocks, meta)
    for name, count in sizes.items():
        buf = store.create(name, BufferConfig.from_json(name, {"capacity": count, "sampler": "prioritized",
                                                                "schema": SCHEMA}))  # fmt: skip
        for start in range(0, count, 10_000):
            n = min(10_000, count - start)
            await buf.append([np.int64(i).tobytes() for i in range(start, start + n)])
            await blocks.flush()
        store.snapshot()
        await blocks.commit(durable=True)
    await blocks.close()
    meta.close()


def sample_batches(path: Path, batches: int) -> float:
    """Seconds to read `batches` batches of `path` with the plain recipe."""
    sample = str(path / "sample")
    started = time.perf_counter()
    for _ in range(batches):
        with open(sample, "rb", buffering=0) as f:
            np.load(io.BytesIO(f.read()))
    return time.perf_counter() - started


CHUNKS = 10  # a round's batches of each buffer, in this many turns, the buffers alternating


def sample_rates(paths: dict[str, Path], batches: int) -> dict[str, float]:
    """Samples/s of each buffer of `paths` over `batches` batches, read in CHUNKS turns
    that alternate between the buffers (the first one first in even turns, last in odd
    ones), after 100 batches each to warm up: a slow stretch of the machine weighs on
    both, where one run of each after the other put it on one (the million, first,
    measured the daemon's first moments after its warm-up; docs/benchmarks.md)."""
    for path in paths.values():
        sample_batches(path, 100)
    seconds = dict.fromkeys(paths, 0.0)
    order = list(paths)
    for turn in range(CHUNKS):
        for name in order if turn % 2 == 0 else order[::-1]:
            seconds[name] += sample_batches(paths[name], batches // CHUNKS)
    return {name: CHUNKS * (batches // CHUNKS) * 32 / elapsed for name, elapsed in seconds.items()}


def warmed(mnt: Path, items: int, timeout_s: float = 120.0) -> float:
    """Seconds until the daemon's start-up warm-up has read every item into DRAM."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if json.loads((mnt / ".distore" / "status").read_text())["blocks"]["dram_blocks"] >= items:
            break
        time.sleep(0.1)
    return time.perf_counter() - started


def full_collections(mnt: Path) -> int | None:
    """The daemon's generation-2 collections so far (None: a daemon without `gc` in status)."""
    gc = json.loads((mnt / ".distore" / "status").read_text()).get("gc")
    return None if gc is None else int(gc["collections"][2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=3000)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="distorefs-million-", dir="/var/tmp"))
    data, mnt = base / "data", base / "mnt"
    mnt.mkdir()
    data.mkdir()
    report: dict[str, list[float]] = {"mount_s": [], "million_per_s": [], "small_per_s": []}
    try:
        started = time.perf_counter()
        trio.run(build, data, {"million": args.items, "small": 20_000})
        report["build_s"] = [round(time.perf_counter() - started, 1)]
        for round_ in range(args.rounds):
            if round_ == 0:
                subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False,
                               stderr=subprocess.DEVNULL)  # fmt: skip
            started = time.perf_counter()
            subprocess.run([*DISTORE, "mount", str(mnt), "--data-dir", str(data), "--dram-budget", "2GiB"],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            report["mount_s"].append(round(time.perf_counter() - started, 2))
            try:
                report.setdefault("warm_s", []).append(round(warmed(mnt, args.items + 20_000), 1))
                # The compiled kernels load at their first use, or once the mount is quiet
                # for a second (which this benchmark's polling of status never lets it be):
                # a first sample, then wait for them, as a job's steady state has them.
                sample_batches(mnt / "buffers" / "small", 1)
                report.setdefault("kernels_wait_s", []).append(wait_for_kernels(mnt))
                before = full_collections(mnt)
                rates = sample_rates({name: mnt / "buffers" / name for name in ("million", "small")}, args.batches)
                report["million_per_s"].append(round(rates["million"]))
                report["small_per_s"].append(round(rates["small"]))
                if before is not None:  # the daemon's full (generation 2) collections while sampling
                    report.setdefault("full_collections", []).append(full_collections(mnt) - before)  # type: ignore[operator]
            finally:
                subprocess.run([*DISTORE, "umount", str(mnt)], check=False, stdout=subprocess.DEVNULL)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    million, small = statistics.median(report["million_per_s"]), statistics.median(report["small_per_s"])
    print(json.dumps({**report, "median_mount_s": statistics.median(report["mount_s"]),
                      "median_ratio": round(million / small, 2)}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
