"""The daemon's busy polling (`--busy-poll-us`, docs/design.md "Adaptive busy polling")
against the ceiling and against no polling, on the two kinds of client it is for.

    .venv/bin/python benchmarks/bench_polling.py [--rounds 4] [--files 2000] [--busy-poll-us N] [--json F]

- Small files: 4 KiB create + write + close into a plain directory of the tree, and
  the same on the bare pyfuse3 filesystem (ceiling_fs.py), rounds interleaved; files/s
  per round, the medians, and their ratio.
- Spaced calls: one `pwrite` of 512 bytes per call to a write-only descriptor (a
  request each), the client spinning 0-150 µs between calls; µs per call, and what the
  poller counted for them (`busy_poll` in `.distore/status`).

Also reports the daemon's CPU time per small file (utime + stime of its process): where
it equals the client's wall time per file, the daemon is the bound and polling cannot
help (docs/benchmarks.md, "Thirty-sixth session"). No thresholds here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_posix import Ceiling, Distore, small_files  # noqa: E402

GAPS_US = (0, 10, 30, 60, 100, 150)
CALLS = 600


def daemon_pid(mnt: Path) -> int:
    """The daemon's pid, as its `.distore/status` gives it."""
    return int(json.loads((mnt / ".distore" / "status").read_text())["pid"])


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def emit(results: dict[str, object], path: str | None) -> None:
    """Print a benchmark's results as JSON, and write them to `path` too if given."""
    print(json.dumps(results, indent=2))
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


def poll_stats(mnt: Path) -> dict[str, float]:
    stats = json.loads((mnt / ".distore" / "status").read_text()).get("busy_poll", {})
    return stats if isinstance(stats, dict) else {}


def spaced_calls(mnt: Path, gap_s: float) -> dict[str, float]:
    """CALLS pwrites, the client spinning `gap_s` before each: µs per call, and the
    poller's counts over them."""
    fd = os.open(mnt / f"spaced-{round(gap_s * 1e6)}", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        time.sleep(0.05)
        before = poll_stats(mnt)
        started = time.perf_counter()
        for i in range(CALLS):
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
            os.pwrite(fd, b"w" * 512, i * 512)
        out = {"us_per_call": round((time.perf_counter() - started) / CALLS * 1e6, 1)}
        after = poll_stats(mnt)
    finally:
        os.close(fd)
    for key in ("hits", "queued", "misses"):
        if key in after:
            out[key] = after[key] - before[key]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--busy-poll-us", type=int, default=None, help="the daemon's --busy-poll-us (default: its own)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    options = [] if args.busy_poll_us is None else ["--busy-poll-us", str(args.busy_poll_us)]
    rates: dict[str, list[float]] = {"distorefs": [], "ceiling": []}
    cpu_per_file: list[float] = []
    with tempfile.TemporaryDirectory(prefix="distorefs-bench-", dir="/var/tmp") as tmp:
        base = Path(tmp)
        with Distore(base, "2GiB", options) as checkpoints, Ceiling(base) as ceiling:
            tree = checkpoints.parent
            pid = daemon_pid(tree)
            for r in range(args.rounds):
                for name, root in (("distorefs", tree), ("ceiling", ceiling)):
                    d = root / f"small{r}"
                    d.mkdir()
                    used = cpu_s(pid)
                    started = time.perf_counter()
                    small_files(d, args.files)
                    rates[name].append(args.files / (time.perf_counter() - started))
                    if name == "distorefs":
                        cpu_per_file.append((cpu_s(pid) - used) / args.files * 1e6)
            spaced = {str(gap): spaced_calls(tree, gap / 1e6) for gap in GAPS_US}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    results = {
        "busy_poll_us": args.busy_poll_us,
        "small_files_per_s": {name: [round(v) for v in values] for name, values in rates.items()},
        "small_files_median_per_s": {name: round(v) for name, v in medians.items()},
        "small_files_vs_ceiling": round(medians["distorefs"] / medians["ceiling"], 3),
        "small_file_us": round(1e6 / medians["distorefs"], 1),
        "daemon_cpu_us_per_small_file": round(statistics.median(cpu_per_file), 1),
        "spaced_calls": spaced,
    }
    emit(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
