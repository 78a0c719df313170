"""Many threads in fsync loops at once, and another client's small files meanwhile.

    .venv/bin/python benchmarks/bench_fsyncs.py [--threads 1 8 50] [--seconds 2]

Each of `--threads` threads writes 4 KiB into its own file and fsyncs it, in a loop, for
`--seconds`; meanwhile the benchmark creates 200 small files (write + close + stat, no
fsync) and times each. Reported per thread count, on a distorefs mount and on the local
disk (the same loops in /var/tmp, the baseline of the same run): fsyncs a second, the
small files' p50 and p99 in ms, and for distorefs the durable persists and the commits
that made them durable (`.distore/status` `blocks`; design.md, "Durable persists in
groups"). No thresholds here; docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.daemon import mounted  # noqa: E402

SMALL_FILES = 200


def small_files(root: Path, tag: str) -> dict[str, float]:
    """SMALL_FILES creates of 4 KiB without fsync, each timed: p50 and p99 in ms."""
    times = []
    for i in range(SMALL_FILES):
        started = time.perf_counter()
        path = root / f"{tag}-{i}"
        path.write_bytes(b"y" * 4096)
        os.stat(path)
        times.append(time.perf_counter() - started)
    times.sort()
    return {"p50_ms": round(times[len(times) // 2] * 1e3, 2), "p99_ms": round(times[int(len(times) * 0.99)] * 1e3, 2)}


def fsync_loops(root: Path, threads: int, seconds: float) -> dict[str, float]:
    """`threads` fsync loops for `seconds`, the small files timed after the first second."""
    stop = threading.Event()
    counts = [0] * threads

    def loop(k: int) -> None:
        fd = os.open(root / f"sync-{threads}-{k}", os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            while not stop.is_set():
                os.pwrite(fd, b"x" * 4096, (counts[k] % 64) * 4096)
                os.fsync(fd)
                counts[k] += 1
        finally:
            os.close(fd)

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    time.sleep(min(1.0, seconds / 2))
    small = small_files(root, f"small-{threads}")
    time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    stop.set()
    for worker in workers:
        worker.join(timeout=60)
    return {"fsyncs_per_s": round(sum(counts) / (time.monotonic() - started)), **small}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8, 50])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("daemon_args", nargs="*", help="after --: the daemon's options")
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {"distorefs": {}, "disk": {}}
    with tempfile.TemporaryDirectory(prefix="distorefs-fsyncs-", dir="/var/tmp") as base:
        with mounted(Path(base), *args.daemon_args) as mnt:
            results["distorefs"]["idle"] = small_files(mnt, "idle")
            for threads in args.threads:
                status = mnt / ".distore" / "status"
                before = json.loads(status.read_text())["blocks"]
                row: dict[str, object] = dict(fsync_loops(mnt, threads, args.seconds))
                after = json.loads(status.read_text())["blocks"]
                for key in ("durable_persists", "durable_commits"):
                    row[key] = after.get(key, 0) - before.get(key, 0)
                results["distorefs"][str(threads)] = row
        disk = Path(base) / "disk"
        disk.mkdir()
        results["disk"]["idle"] = small_files(disk, "idle")
        for threads in args.threads:
            results["disk"][str(threads)] = fsync_loops(disk, threads, args.seconds)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
