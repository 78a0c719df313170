"""A learner that works between batches: samples/s through the mount against the same
loop over an in-process numpy buffer, in one run.

    .venv/bin/python benchmarks/bench_learner.py [--seconds 3] [--work-ms 0 0.5 1] [--json PATH]

For DQN (110 KB records, batch 32, prioritized) and SAC (3 KB, batch 256, uniform) schema
buffers, a learner process of its own reads whole batches and then spends `--work-ms`
busy (its training step), three ways: `np.load(io.BytesIO(open(sample).read()))` per
batch, one kept descriptor of `sample.stream` read into one buffer, and
`NumpyBuffer.sample` of bench_replay.py in process (the baseline). The daemon draws a
file's next batch while the learner works on the one before (design.md, "The next batch
drawn while the client reads"): with work between batches, the mount's share of each
step is what it cannot hide. Prints a Markdown table of samples/s and ratios to the
baseline; docs/benchmarks.md keeps the results.
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import WORKLOADS, NumpyBuffer, Workload  # noqa: E402
from daemon import mounted  # noqa: E402

RECIPES = ("bytesio", "stream", "numpy")


def busy(seconds: float) -> None:
    """The learner's step: the CPU busy for `seconds` (a sleep would let the core go)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def steps(path: Path, w: Workload) -> dict[str, Callable[[], int]]:
    """Each recipe as a step that reads one batch and returns its items."""
    sample, stream = str(path / "sample"), str(path / "sample.stream")
    size = os.stat(stream).st_size
    buf = bytearray(size)
    fd = os.open(stream, os.O_RDONLY)

    def from_stream() -> int:
        got = 0
        while got < size:
            got += os.readv(fd, [memoryview(buf)[got:]])
        return w.batch

    local = NumpyBuffer(w.capacity, w.item_bytes, w.sampler == "prioritized")
    local.add([bytes(w.item_bytes)] * min(w.fill, w.capacity))
    return {
        "bytesio": lambda: len(np.load(io.BytesIO(open(sample, "rb").read()))),
        "stream": from_stream,
        "numpy": lambda: len(local.sample(w.batch)),
    }


def learner(path: Path, name: str, seconds: float, works_ms: list[float]) -> int:
    """`--learner`: each recipe at each amount of work, rounds interleaved, as JSON."""
    w = next(w for w in WORKLOADS if w.name == name)
    recipes = steps(path, w)
    rounds: dict[str, list[float]] = {}
    for _ in range(3):
        for work_ms in works_ms:
            for recipe, step in recipes.items():
                items, started = 0, time.perf_counter()
                while time.perf_counter() - started < seconds / 3:
                    items += step()
                    busy(work_ms / 1000)
                rounds.setdefault(f"{recipe}@{work_ms}", []).append(items / (time.perf_counter() - started))
    print(json.dumps({key: float(np.median(values)) for key, values in rounds.items()}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="per recipe and amount of work")
    parser.add_argument("--work-ms", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--learner", help=argparse.SUPPRESS)  # a buffer dir: run the loops here
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learner:
        return learner(Path(args.learner), args.workload, args.seconds, args.work_ms)
    base = Path(tempfile.mkdtemp(prefix="distorefs-bench-learner-", dir="/var/tmp"))
    results: dict[str, dict[str, float]] = {}
    try:
        with mounted(base, "--dram-budget", "6GiB") as mnt:
            for w in (w for w in WORKLOADS if w.name in ("DQN", "SAC")):
                path = mnt / "buffers" / w.name.lower()
                path.mkdir()
                config = {
                    "capacity": w.capacity, "sampler": w.sampler, "batch_size": w.batch,
                    "schema": {"obs": ["uint8", [w.item_bytes]]},
                }  # fmt: skip
                (path / "config").write_text(json.dumps(config))
                records = np.zeros(256, np.dtype([("obs", np.uint8, (w.item_bytes,))]))
                for _ in range(-(-w.fill // len(records))):
                    with open(path / "append", "wb") as f:
                        np.save(f, records)
                out = subprocess.run(
                    [sys.executable, __file__, "--learner", str(path), "--workload", w.name,
                     "--seconds", str(args.seconds), "--work-ms", *map(str, args.work_ms)],
                    capture_output=True, text=True, timeout=900, check=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )  # fmt: skip
                results[w.name] = json.loads(out.stdout)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("| workload | learner's work per batch | np.load(BytesIO) | sample.stream | numpy in process |"
          " BytesIO / numpy | stream / numpy |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        for work_ms in args.work_ms:
            b, s, n = (r[f"{recipe}@{work_ms}"] for recipe in RECIPES)
            print(f"| {name} | {work_ms} ms | {b:,.0f} | {s:,.0f} | {n:,.0f} | {b / n:.2f}x | {s / n:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
