"""Single-record appends into a buffer as it grows: the cost of an append must not grow
with the number of items held.

    .venv/bin/python benchmarks/bench_append_scaling.py [--sizes 1000,100000] [--seconds 3]

Mounts a daemon, fills one blob buffer (3 KB items, SAC-sized) to each size in turn,
waits for a snapshot pass, then measures appends of one item for `--seconds` each way:
open-write-close (`distorefs.client.append`), and one write each to a kept descriptor
(`distorefs.client.Appender`, acknowledged at the write), in alternating rounds. With
`--reverb-python PATH` (a Python with dm-reverb, see benchmarks/reverb_inserts.py) it
then measures Reverb's single inserts of the same items in the same run. Prints
appends/s per size as JSON; docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.daemon import mounted  # noqa: E402
from distorefs import client  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each way per size (medians)")
    parser.add_argument("--reverb-python", help="a Python with dm-reverb installed (optional)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="distorefs-append-"))
    results: dict[int, int] = {}
    kept: dict[int, int] = {}
    rounds: dict[int, dict[str, list[float]]] = {}
    try:
        with mounted(base, "--dram-budget", "2GiB") as mnt:
            buffer = mnt / "buffers" / "scaling"
            buffer.mkdir()
            (buffer / "config").write_text(json.dumps({"capacity": max(sizes) * 2}))
            item = os.urandom(3000)
            for held in sizes:
                need = held - json.loads(client.read_all(buffer / "stats"))["size"]
                for start in range(0, need, 10_000):
                    client.append(buffer, [item] * min(10_000, need - start))
                time.sleep(6)  # a snapshot pass (every 5 s) so the snapshot holds them all
                rates: dict[str, list[float]] = {"append": [], "appender": []}
                with client.Appender(buffer) as appender:
                    for _ in range(args.rounds):
                        for way, call in (("append", client.append), ("appender", lambda b, i: appender.append(i))):
                            started, count = time.monotonic(), 0
                            while time.monotonic() - started < args.seconds:
                                call(buffer, [item])
                                count += 1
                            rates[way].append(round(count / (time.monotonic() - started)))
                results[held] = round(statistics.median(rates["append"]))
                kept[held] = round(statistics.median(rates["appender"]))
                rounds[held] = rates
        report: dict[str, object] = {
            "single_appends_per_s_by_items_held": results,
            "appender_per_s_by_items_held": kept,
            "rounds": rounds,
        }
        if args.reverb_python:
            script = str(Path(__file__).with_name("reverb_inserts.py"))
            done = subprocess.run(
                [args.reverb_python, script, "--seconds", str(args.seconds)],
                capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            reverb = json.loads(done.stdout.strip().splitlines()[-1])
            report["reverb"] = reverb
            best = statistics.median(reverb["client_insert"])
            report["vs_reverb_client_insert"] = {held: round(rate / best, 2) for held, rate in results.items()}
            report["appender_vs_reverb_client_insert"] = {held: round(rate / best, 2) for held, rate in kept.items()}
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
