"""Queued requests read at once (`--queued-reads-us`, docs/design.md "Queued requests read
at once"): distorefs with it (the default) and without it (`--queued-reads-us 0`),
against the bare pyfuse3 filesystem with pyfuse3's own request loop (the ceiling of
issue 17) and with the same patch (`ceiling_fs.py --queued-reads`), all four mounted at
once and measured in turn, round after round.

    .venv/bin/python benchmarks/bench_queued_reads.py [--rounds 6] [--files 3000] [--json F]

- Small files: 4 KiB create + write + close, files/s per round, and the process's CPU
  time (user + system, from /proc) per file.
- Writers at once: four threads, each with its own write-only descriptor, 1,000
  `pwrite`s of 512 bytes each (a request per call): writes/s, all four together.
- `pwrite` alone: one thread, 2,000 calls back to back, p50 and p99 in µs.
- Dataset records as a data loader's workers read them (distorefs only): a sealed
  dataset of `--records` 10,000-byte records in DRAM, `records/<i>` opened and read
  whole at random by one and by four processes for `--seconds`: records/s.

Medians over the rounds, and each mount's ratio to the stock ceiling. No thresholds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_polling import cpu_s, daemon_pid, emit  # noqa: E402
from bench_posix import Ceiling, Distore, small_files  # noqa: E402

MOUNTS = ("distorefs", "distorefs-0", "ceiling", "ceiling-queued")
WRITERS = 4
WRITES = 1000
SOLO_CALLS = 2000
RECORD_BYTES = 10_000
LOADER_PROCESSES = (1, 4)


def writers_at_once(root: Path) -> float:
    """WRITERS threads of WRITES pwrites each: writes/s, all together."""

    def write(k: int) -> None:
        fd = os.open(root / f"w{k}", os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            for i in range(WRITES):
                os.pwrite(fd, b"w" * 512, i * 512)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(WRITERS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return WRITERS * WRITES / (time.perf_counter() - started)


def pwrite_alone(root: Path) -> tuple[float, float]:
    """SOLO_CALLS pwrites back to back: p50 and p99 in µs."""
    fd = os.open(root / "solo", os.O_CREAT | os.O_WRONLY, 0o644)
    times = []
    try:
        for i in range(SOLO_CALLS):
            started = time.perf_counter()
            os.pwrite(fd, b"s" * 512, i * 512)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def make_dataset(ds: Path, records: int) -> None:
    """A sealed dataset of `records` random records of RECORD_BYTES (namespace.md)."""
    ds.mkdir()
    length = np.frombuffer(np.uint64(RECORD_BYTES).tobytes(), np.uint8)
    with open(ds / "append", "wb", buffering=0) as f:
        f.write(b"DSITEMS1")
        for first in range(0, records, 1000):
            count = min(1000, records - first)
            body = np.random.default_rng(first).integers(0, 255, (count, RECORD_BYTES), dtype=np.uint8)
            f.write(np.hstack([np.repeat(length[None], count, axis=0), body]).tobytes())
    (ds / "state").write_text("seal\n")


def load_records(ds: Path, records: int, seed: int, seconds: float, done: multiprocessing.Queue[int]) -> None:
    """One loader process: random `records/<i>`, each opened and read whole."""
    rng = np.random.default_rng(seed)
    count, until = 0, time.perf_counter() + seconds
    while time.perf_counter() < until:
        for i in rng.integers(0, records, 50).tolist():
            with open(ds / "records" / str(i), "rb") as f:
                if len(f.read()) != RECORD_BYTES:
                    raise AssertionError(f"records/{i} is not {RECORD_BYTES} bytes")
            count += 1
    done.put(count)


def loaders(ds: Path, records: int, processes: int, seconds: float) -> float:
    """`processes` loaders at once: records/s, all together."""
    done: multiprocessing.Queue[int] = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(target=load_records, args=(ds, records, k, seconds, done)) for k in range(processes)
    ]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    total = sum(done.get(timeout=seconds + 60) for _ in procs)
    for proc in procs:
        proc.join()
    return total / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--records", type=int, default=20_000, help="records of the loaders' dataset")
    parser.add_argument("--seconds", type=float, default=2.0, help="each loaders' measurement")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    series: dict[str, dict[str, list[float]]] = {
        name: {"files_per_s": [], "cpu_us_per_file": [], "writers_per_s": [], "pwrite_p50_us": [], "pwrite_p99_us": []}
        for name in MOUNTS
    }
    with tempfile.TemporaryDirectory(prefix="distorefs-bench-", dir="/var/tmp") as tmp, ExitStack() as stack:
        base = Path(tmp)
        for name in ("c", "cq"):
            (base / name).mkdir()
        roots = {
            "distorefs": stack.enter_context(Distore(base / "d", "1GiB")).parent,
            "distorefs-0": stack.enter_context(Distore(base / "d0", "1GiB", ["--queued-reads-us", "0"])).parent,
        }
        ceilings = {"ceiling": Ceiling(base / "c"), "ceiling-queued": Ceiling(base / "cq", ["--queued-reads"])}
        roots |= {name: stack.enter_context(ceiling) for name, ceiling in ceilings.items()}
        datasets = {name: roots[name] / "datasets" / "loader" for name in ("distorefs", "distorefs-0")}
        for name, ds in datasets.items():
            make_dataset(ds, args.records)
            series[name] |= {f"loaders_{n}_per_s": [] for n in LOADER_PROCESSES}
            loaders(ds, args.records, 1, 0.5)  # the first reads, untimed
        pids = {name: daemon_pid(roots[name]) for name in ("distorefs", "distorefs-0")}
        pids |= {name: ceiling.proc.pid for name, ceiling in ceilings.items() if ceiling.proc is not None}
        for r in range(args.rounds):
            for name in MOUNTS if r % 2 == 0 else MOUNTS[::-1]:
                d = roots[name] / f"round{r}"
                d.mkdir()
                used = cpu_s(pids[name])
                started = time.perf_counter()
                small_files(d, args.files)
                series[name]["files_per_s"].append(args.files / (time.perf_counter() - started))
                series[name]["cpu_us_per_file"].append((cpu_s(pids[name]) - used) / args.files * 1e6)
                series[name]["writers_per_s"].append(writers_at_once(d))
                p50, p99 = pwrite_alone(d)
                series[name]["pwrite_p50_us"].append(p50)
                series[name]["pwrite_p99_us"].append(p99)
                if name in datasets:
                    for n in LOADER_PROCESSES:
                        series[name][f"loaders_{n}_per_s"].append(
                            loaders(datasets[name], args.records, n, args.seconds)
                        )
        counted = {
            name: json.loads((roots[name] / ".distore" / "status").read_text())["queued_reads"]
            for name in ("distorefs", "distorefs-0")
        }
    medians = {name: {key: statistics.median(values) for key, values in s.items()} for name, s in series.items()}
    ceiling = medians["ceiling"]
    results = {
        "rounds": {name: {key: [round(v, 1) for v in vs] for key, vs in s.items()} for name, s in series.items()},
        "medians": {name: {key: round(v, 1) for key, v in m.items()} for name, m in medians.items()},
        "vs_ceiling": {
            name: {key: round(m[key] / ceiling[key], 3) for key in ("files_per_s", "writers_per_s")}
            for name, m in medians.items()
        },
        "queued_reads": counted,
    }
    emit(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
