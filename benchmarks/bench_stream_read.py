"""A kept `sample.64.stream` descriptor read in a loop, the read timed apart from what
the client does between reads, with the busy poller's counts for each kind of gap.

    .venv/bin/python benchmarks/bench_stream_read.py [--reads 3000] [--gaps-us 0 170 250] [--npload]

The stream read of `bench_latency.py` (`np.load(io.BytesIO(os.read(fd, size)))`) times
the read and the client's own parsing of the batch together, and on the two-core VM the
two spread by 1.5x from run to run. Here each round times `os.read` alone, then spins
for `--gaps-us` (or, with `--npload`, parses the batch as that recipe does) before the
next read, and reports the read's p50 and p99, the whole call's p50, and what the
daemon's poller (`.distore/status` `busy_poll`) did meanwhile: a read that comes while
the poller still polls is a hit, one that finds the daemon asleep waits for it to wake.
Extra arguments after `--` go to the daemon (e.g. `-- --queued-reads-us 0`). No
thresholds here; docs/benchmarks.md, "Thirty-eighth session", has what it showed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_latency import RECORD, percentiles  # noqa: E402
from benchmarks.daemon import mounted, wait_for_kernels  # noqa: E402

POLLER_COUNTS = ("requests", "hits", "misses", "queued", "polled_s")


def busy_poll(mnt: Path) -> dict[str, float]:
    polled: dict[str, float] = json.loads((mnt / ".distore" / "status").read_text()).get("busy_poll", {})
    return {key: polled.get(key, 0) for key in POLLER_COUNTS}


def rounds(mnt: Path, args: argparse.Namespace) -> dict[str, object]:
    b = mnt / "buffers" / "stream"
    b.mkdir()
    schema = {"obs": ["float32", [128]], "action": "int64", "reward": "float32", "next_obs": ["float32", [125]]}
    (b / "config").write_text(json.dumps({"schema": schema, "sampler": "prioritized", "capacity": 100_000}))
    out = io.BytesIO()
    np.save(out, np.zeros(1, RECORD))
    raw = out.getvalue()
    for _ in range(1000):
        fd = os.open(b / "append", os.O_WRONLY)
        os.write(fd, raw)
        os.close(fd)
    results: dict[str, object] = {"kernels_wait_s": wait_for_kernels(mnt)}
    fd = os.open(b / "sample.64.stream", os.O_RDONLY)
    size = os.fstat(fd).st_size
    try:
        for gap_us in ["npload"] if args.npload else args.gaps_us:
            before = busy_poll(mnt)
            reads, calls = [], []
            for _ in range(args.reads):
                started = time.perf_counter()
                data = os.read(fd, size)
                read = time.perf_counter()
                if gap_us == "npload":
                    np.load(io.BytesIO(data))
                else:
                    while time.perf_counter() - read < int(gap_us) * 1e-6:
                        pass
                reads.append(read - started)
                calls.append(time.perf_counter() - started)
            after = busy_poll(mnt)
            results[f"gap_{gap_us}"] = {
                "read": percentiles(reads),
                "call_p50_us": percentiles(calls)["p50_us"],
                "busy_poll": {key: round(after[key] - before[key], 3) for key in POLLER_COUNTS},
            }
    finally:
        os.close(fd)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=3000)
    parser.add_argument("--gaps-us", nargs="+", default=["0", "170", "250"], help="client spin between reads, µs")
    parser.add_argument("--npload", action="store_true", help="parse each batch with np.load instead of spinning")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("daemon_args", nargs="*", help="after --: the daemon's options")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distorefs-stream-", dir="/var/tmp") as base:
        with mounted(Path(base), "--dram-budget", "1GiB", *args.daemon_args) as mnt:
            results = rounds(mnt, args)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
