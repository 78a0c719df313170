"""The daemon's memory under many clients: peak RSS against the DRAM budget, and RSS once
the work is over.

    .venv/bin/python benchmarks/bench_memory.py [--seconds 60] [--clients 16] [--budget-mib 512]

Mounts a daemon with `--dram-budget`, then runs `--clients` processes for `--seconds`: a
third append 100 KB blobs to a replay buffer, a third sample batches of 32 from it, and a
third read a published 64 MiB model, while a learner republishes it. The daemon's RSS is
sampled every 0.2 s from /proc; after the clients stop, the buffer is removed and the
RSS is read again after 10 s of idle. Prints the budget, the peak, the RSS at the end,
and the overhead (RSS - budget) as JSON; docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.daemon import mounted  # noqa: E402
from distorefs import client  # noqa: E402

MIB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def appender(buffer: str, stop: float) -> None:
    item = os.urandom(100_000)
    while time.monotonic() < stop:
        client.append(buffer, [item] * 16)


def sampler(buffer: str, stop: float) -> None:
    while time.monotonic() < stop:
        try:
            client.sample(buffer, 32)
        except OSError:
            time.sleep(0.01)


def reader(model: str, stop: float) -> None:
    while time.monotonic() < stop:
        try:
            with open(os.path.join(model, "m.bin"), "rb") as f:
                while f.read(MIB):
                    pass
        except FileNotFoundError:
            time.sleep(0.01)


def publisher(model: str, stop: float) -> None:
    data = os.urandom(64 * MIB)
    while time.monotonic() < stop:
        with open(os.path.join(model, "m.bin"), "wb") as f:
            f.write(data)
        time.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="distorefs-mem-"))
    with mounted(base, "--dram-budget", f"{args.budget_mib}MiB") as mnt:
        pid = int(client.read_all(mnt / ".distore" / "status").decode().split('"pid": ')[1].split(",")[0])
        buffer, model = mnt / "buffers" / "mem", mnt / "weights" / "mem"
        buffer.mkdir()
        (buffer / "config").write_text(json.dumps({"capacity": 4000}))
        model.mkdir()
        client.append(buffer, [os.urandom(100_000)] * 64)
        (model / "m.bin").write_bytes(os.urandom(64 * MIB))
        start_rss = rss_bytes(pid)
        peak = start_rss
        sampling = True

        def watch() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, rss_bytes(pid))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        stop = time.monotonic() + args.seconds
        ctx = multiprocessing.get_context("fork")
        roles = [appender, sampler, reader]
        procs = [
            ctx.Process(target=roles[i % 3], args=(str(model if roles[i % 3] is reader else buffer), stop))
            for i in range(args.clients)
        ]
        procs.append(ctx.Process(target=publisher, args=(str(model), stop)))
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(args.seconds + 120)
        busy_end = rss_bytes(pid)
        stats = json.loads(client.read_all(buffer / "stats"))
        shutil.rmtree(buffer)
        time.sleep(10)
        sampling = False
        watcher.join()
        status = json.loads(client.read_all(mnt / ".distore" / "status"))
        idle = rss_bytes(pid)
        budget = args.budget_mib * MIB
        result = {
            "clients": args.clients,
            "seconds": args.seconds,
            "budget_mib": args.budget_mib,
            "rss_start_mib": round(start_rss / MIB, 1),
            "rss_peak_mib": round(peak / MIB, 1),
            "rss_when_work_ended_mib": round(busy_end / MIB, 1),
            "rss_idle_mib": round(idle / MIB, 1),
            "peak_over_budget_mib": round((peak - budget) / MIB, 1),
            "dram_used_idle_mib": round(status["dram_used_bytes"] / MIB, 1),
            "buffer_inserts": stats["inserts"],
            "buffer_samples": stats["samples"],
        }
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
