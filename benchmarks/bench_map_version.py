"""Many readers of one published model through `client.map_version` against the same
readers mapping the same bytes on tmpfs, in one run (issue 18's weights path).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_map_version.py [--mb 100] [--readers 32] [--rounds 3]

Publishes a model file of `--mb` MB to `weights/policy/model.bin` on a fresh mount and
writes the same bytes to a tmpfs file (/dev/shm). Each round starts `--readers`
processes at once; each maps the file and sums it as float32 (every page touched,
nothing copied by the reader): `map_version(transport="shm")` (the version's shared
copy, handed over on the daemon's socket), `map_version(transport="mount")` (`NAME@V`
through the kernel's page cache), and mmap of the tmpfs file. The time is from the
start until the last reader is done. Each round publishes a new version first, so the
first reader of each path finds nothing made yet: the shared copy is made, or the page
cache filled through FUSE, inside the timed window. Prints JSON with the medians of the
aggregate GB/s and of each path's ratio to tmpfs in the same round.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.daemon import mounted  # noqa: E402
from distorefs import client  # noqa: E402


def read_shm(path: str, start: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    _version, view = client.map_version(path, transport="shm")
    float(np.frombuffer(view, dtype=np.float32).sum())


def read_mount(path: str, start: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    _version, view = client.map_version(path, transport="mount")
    float(np.frombuffer(view, dtype=np.float32).sum())


def read_tmpfs(path: str, start: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    float(np.frombuffer(view, dtype=np.float32).sum())


def round_trip(target: object, path: str, readers: int) -> float:
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=target, args=(path, start)) for _ in range(readers)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # all forked and waiting
    began = time.perf_counter()
    start.set()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--readers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    payload = np.random.default_rng(0).random(args.mb * 1_000_000 // 4, dtype=np.float32).tobytes()
    gigabytes = len(payload) * args.readers / 1e9
    rates: dict[str, list[float]] = {"shm": [], "mount": [], "tmpfs": []}
    readers = {"shm": read_shm, "mount": read_mount}
    with tempfile.TemporaryDirectory(prefix="distorefs-map-", dir="/var/tmp") as tmp:
        tmpfs = Path(tempfile.mkdtemp(prefix="distorefs-map-", dir="/dev/shm"))
        try:
            (tmpfs / "model.bin").write_bytes(payload)
            with mounted(Path(tmp), "--dram-budget", "2GiB") as mnt:
                model = mnt / "weights" / "policy"
                model.mkdir()
                for _ in range(args.rounds):  # interleaved
                    for name, target in readers.items():
                        (model / "model.bin").write_bytes(payload)  # a new version: nothing made for it yet
                        rates[name].append(gigabytes / round_trip(target, str(model / "model.bin"), args.readers))
                    rates["tmpfs"].append(gigabytes / round_trip(read_tmpfs, str(tmpfs / "model.bin"), args.readers))
        finally:
            for name in os.listdir(tmpfs):
                os.unlink(tmpfs / name)
            os.rmdir(tmpfs)
    result: dict[str, object] = {"mb": args.mb, "readers": args.readers}
    for name, values in rates.items():
        result[f"{name}_GBps"] = [round(r, 2) for r in values]
    for name in readers:
        ratios = [r / t for r, t in zip(rates[name], rates["tmpfs"], strict=True)]
        result[f"{name}_vs_tmpfs_median"] = round(statistics.median(ratios), 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
