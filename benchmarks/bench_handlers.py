"""The daemon's own cost of a small file, without FUSE: its request handlers called in
process, against the bare filesystem's (ceiling_fs.py) doing the same work in the same run.

    .venv/bin/python benchmarks/bench_handlers.py [--files 3000] [--rounds 5] [--profile]

Each round creates --files files of 4 KiB in a fresh directory with the requests the
kernel sends for `open(O_CREAT | O_WRONLY)`, `write`, `close` through the mount
(counted on both filesystems in the sixteenth session): LOOKUP of the name (not there),
CREATE, WRITE, FLUSH, RELEASE, then the GETATTR of the directory that the next path walk
asks for. distorefs runs as its daemon does (`daemon.assemble` over a fresh data dir in
/var/tmp, its background tasks started, busy polling off), so a close puts the file in
its log as through the mount. Through the mount each request also pays a kernel round
trip, which is the same for both; this measures what is distorefs' own: where the two
differ by 50 µs a file, through the mount they differ by about as much (docs/benchmarks.md,
"Twenty-seventh session"). Reports each request's p50 in µs, the mean per file, and the
ratio ceiling / distorefs (the medians of the rounds); `--profile` prints distorefs'
functions by their own time under cProfile for one more round. No thresholds here.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceiling_fs import CeilingFs  # noqa: E402

from distorefs.daemon import DaemonConfig, assemble  # noqa: E402
from distorefs.tiers.metadb import MetaDb  # noqa: E402
from distorefs.tiers.nvme_log import NvmeLog  # noqa: E402

OPS = ("lookup", "create", "write", "flush", "release", "getattr")
PAYLOAD = b"s" * 4096
FLAGS = os.O_CREAT | os.O_WRONLY


async def one_round(ops: Any, ctx: Any, name: str, files: int) -> tuple[float, dict[str, list[float]]]:
    """Seconds a file (mean) and each request's seconds, for `files` small files."""
    made = await ops.mkdir(pyfuse3.ROOT_INODE, name.encode(), 0o755, ctx)
    parent = made.st_ino
    times: dict[str, list[float]] = {op: [] for op in OPS}
    started = time.perf_counter()
    for i in range(files):
        entry = f"s{i:06d}".encode()
        t0 = time.perf_counter()
        try:
            await ops.lookup(parent, entry, ctx)
        except pyfuse3.FUSEError:
            pass
        t1 = time.perf_counter()
        info, _attrs = await ops.create(parent, entry, 0o644, FLAGS, ctx)
        t2 = time.perf_counter()
        await ops.write(info.fh, 0, PAYLOAD)
        t3 = time.perf_counter()
        await ops.flush(info.fh)
        t4 = time.perf_counter()
        await ops.release(info.fh)
        t5 = time.perf_counter()
        await ops.getattr(parent, ctx)
        t6 = time.perf_counter()
        for op, seconds in zip(OPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
            times[op].append(seconds)
    return (time.perf_counter() - started) / files, times


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    ctx = pyfuse3.RequestContext()
    data_dir = tempfile.mkdtemp(prefix="distorefs-handlers-", dir="/var/tmp")
    config = DaemonConfig(mountpoint="/nonexistent", data_dir=data_dir, busy_poll_us=0)
    log = NvmeLog.open(os.path.join(data_dir, "log"), config.segment_bytes, config.compaction_reserve_bytes)
    meta = MetaDb.open(os.path.join(data_dir, "meta.sqlite"))
    per_file: dict[str, list[float]] = {"distorefs": [], "ceiling": []}
    per_op: dict[str, dict[str, list[float]]] = {"distorefs": {op: [] for op in OPS}, "ceiling": {op: [] for op in OPS}}
    try:
        daemon = await assemble(config, log, meta)
        ceiling = CeilingFs()
        async with trio.open_nursery() as nursery:
            daemon.start_tasks(config, nursery)
            targets: dict[str, Any] = {"distorefs": daemon.ops, "ceiling": ceiling}
            for name, ops in targets.items():  # a warm-up round each, not counted
                await one_round(ops, ctx, f"warm-{name}", min(args.files, 500))
            for rnd in range(args.rounds):  # interleaved, so drift hits both
                for name, ops in targets.items():
                    mean, times = await one_round(ops, ctx, f"r{rnd}-{name}", args.files)
                    per_file[name].append(mean)
                    for op, seconds in times.items():
                        per_op[name][op].append(statistics.median(seconds))
            if args.profile:
                await profiled(lambda: one_round(daemon.ops, ctx, "profiled", args.files))
            nursery.cancel_scope.cancel()
        await daemon.close()
    finally:
        meta.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    us = {name: statistics.median(values) * 1e6 for name, values in per_file.items()}
    return {
        "files": args.files,
        "rounds": args.rounds,
        "per_file_us": {name: round(value, 1) for name, value in us.items()},
        "per_file_rounds_us": {name: [round(v * 1e6, 1) for v in values] for name, values in per_file.items()},
        "p50_us": {
            name: {op: round(statistics.median(values) * 1e6, 1) for op, values in ops.items()}
            for name, ops in per_op.items()
        },
        "ceiling_vs_distorefs": round(us["ceiling"] / us["distorefs"], 3),
    }


async def profiled(work: Callable[[], Awaitable[object]]) -> None:
    profile = cProfile.Profile()
    profile.enable()
    await work()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    results = trio.run(measure, args)
    print("| request | distorefs p50 µs | ceiling p50 µs |")
    print("| --- | ---: | ---: |")
    for op in OPS:
        print(f"| {op} | {results['p50_us']['distorefs'][op]} | {results['p50_us']['ceiling'][op]} |")
    per_file = results["per_file_us"]
    print(f"| a file (mean, median of {args.rounds} rounds) | {per_file['distorefs']} | {per_file['ceiling']} |")
    print(f"\nceiling / distorefs: {results['ceiling_vs_distorefs']}x")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
