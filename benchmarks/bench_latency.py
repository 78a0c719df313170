"""Per-call latency of the RL loop's three calls through plain files, against an
in-process numpy buffer doing the same work in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_latency.py [--calls 2000]

Through the mount (no distorefs import in the timed code): append one ~1 KB transition
(open `append`, write one record, close), sample a batch of 64 (`np.load` of
`sample.64`, straight from the file and through one `read()`), update 64 priorities
(`np.save` into memory, then open, write and close `priority`; then `priority.npy`,
whose close sends no FLUSH, and `priority` again); then the same three on descriptors
kept open (a write to `append`, a read of `sample.64.stream`, a write to `priority`),
and the last two with
each `.npy` header parsed or built once (`np.frombuffer` past the stream's constant
header, a prebuilt header before the pairs' bytes). In process: a numpy ring
with a sum of priorities doing the same. Prints p50 and p99 in microseconds as JSON;
docs/benchmarks.md keeps the results (issue 16's aims: append p50 <= 200 us, sample
<= 300 us, priority <= 150 us). The mount's calls are timed once the daemon's compiled
kernels run (`kernels_wait_s`): they load in a thread at a buffer's first call, and
numba's import stalled the first 0.3-1 s of appends (up to 26 ms a call; p99 1.9-3.5
ms with it, 0.3 ms without).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.daemon import mounted, wait_for_kernels  # noqa: E402

RECORD = np.dtype([("obs", "<f4", (128,)), ("action", "<i8"), ("reward", "<f4"), ("next_obs", "<f4", (125,))])


def percentiles(samples_s: list[float]) -> dict[str, float]:
    us = np.array(samples_s) * 1e6
    return {"p50_us": round(float(np.percentile(us, 50)), 1), "p99_us": round(float(np.percentile(us, 99)), 1)}


def timed(call: object, calls: int) -> dict[str, float]:
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        call()  # type: ignore[operator]
        out.append(time.perf_counter() - started)
    return percentiles(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--busy-poll-us", type=int, default=None, help="the daemon's --busy-poll-us (default: its own)")
    parser.add_argument(
        "--queued-reads-us", type=int, default=None, help="the daemon's --queued-reads-us (default: its own)"
    )
    args = parser.parse_args()
    record = np.zeros(1, RECORD)
    raw = record.tobytes()
    assert 900 < len(raw) < 1100
    # in process: a ring of records, priorities, a prioritized draw
    ring = np.zeros(100_000, RECORD)
    priority = np.ones(100_000)
    position = [0]
    rng = np.random.default_rng(0)

    def local_append() -> None:
        ring[position[0] % len(ring)] = record[0]
        position[0] += 1

    def local_sample() -> None:
        size = min(position[0], len(ring))
        p = priority[:size] / priority[:size].sum()
        picked = rng.choice(size, 64, p=p)
        ring[picked].copy()

    def local_priority() -> None:
        priority[rng.integers(0, min(position[0], len(ring)), 64)] = rng.random(64)

    results: dict[str, dict[str, dict[str, float]]] = {"numpy": {}, "mount": {}}
    for _ in range(1000):
        local_append()
    results["numpy"]["append"] = timed(local_append, args.calls)
    results["numpy"]["sample_64"] = timed(local_sample, args.calls)
    results["numpy"]["priority_64"] = timed(local_priority, args.calls)

    base = Path(tempfile.mkdtemp(prefix="distorefs-latency-"))
    try:
        daemon_args = [] if args.busy_poll_us is None else ["--busy-poll-us", str(args.busy_poll_us)]
        if args.queued_reads_us is not None:
            daemon_args += ["--queued-reads-us", str(args.queued_reads_us)]
        with mounted(base, "--dram-budget", "1GiB", *daemon_args) as mnt:
            b = mnt / "buffers" / "lat"
            b.mkdir()
            schema = {"obs": ["float32", [128]], "action": "int64", "reward": "float32", "next_obs": ["float32", [125]]}
            (b / "config").write_text(json.dumps({"schema": schema, "sampler": "prioritized", "capacity": 100_000}))
            append, sample, prio = str(b / "append"), str(b / "sample.64"), str(b / "priority")

            def file_append() -> None:
                fd = os.open(append, os.O_WRONLY)
                os.write(fd, raw)
                os.close(fd)

            for _ in range(1000):
                file_append()
            results["wait"] = {"kernels_wait_s": wait_for_kernels(mnt)}  # after the warm-up's appends
            pairs = np.zeros((64, 2))
            pairs[:, 0] = np.arange(64)

            def file_sample() -> None:
                with open(sample, "rb") as f:
                    np.load(f)

            def file_sample_read() -> None:
                with open(sample, "rb") as f:
                    np.load(io.BytesIO(f.read()))

            def file_priority(path: str = prio) -> None:
                pairs[:, 1] = rng.random(64) + 0.1
                out = io.BytesIO()
                np.save(out, pairs)
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, out.getvalue())
                os.close(fd)

            results["mount"]["append"] = timed(file_append, args.calls)
            results["mount"]["sample_64"] = timed(file_sample, args.calls)
            results["mount"]["sample_64_read"] = timed(file_sample_read, args.calls)

            # the same calls on descriptors kept open: one round trip each
            stream_fd = os.open(str(b / "sample.64.stream"), os.O_RDONLY)
            append_fd, priority_fd = os.open(append, os.O_WRONLY), os.open(prio, os.O_WRONLY)
            size = os.fstat(stream_fd).st_size
            try:
                results["mount"]["append_open_fd"] = timed(lambda: os.write(append_fd, raw), args.calls)
                results["mount"]["sample_64_stream"] = timed(
                    lambda: np.load(io.BytesIO(os.read(stream_fd, size))), args.calls
                )

                def priority_open_fd() -> None:
                    pairs[:, 1] = rng.random(64) + 0.1
                    out = io.BytesIO()
                    np.save(out, pairs)
                    os.write(priority_fd, out.getvalue())

                results["mount"]["priority_64_open_fd"] = timed(priority_open_fd, args.calls)

                # the same, each .npy header parsed or built once (docs/namespace.md, "The
                # fastest plain-file recipes"): every batch of the stream has the first
                # one's header, every update of 64 pairs the same one
                first = np.load(io.BytesIO(os.read(stream_fd, size)))
                dtype, offset = first.dtype, size - first.nbytes
                results["mount"]["sample_64_stream_header_once"] = timed(
                    lambda: np.frombuffer(os.read(stream_fd, size), dtype, offset=offset), args.calls
                )
                out = io.BytesIO()
                np.save(out, pairs)
                head = out.getvalue()[: -pairs.nbytes]

                def priority_header_once() -> None:
                    pairs[:, 1] = rng.random(64) + 0.1
                    os.write(priority_fd, head + pairs.tobytes())

                results["mount"]["priority_64_open_fd_header_once"] = timed(priority_header_once, args.calls)
            finally:
                for fd in (stream_fd, append_fd, priority_fd):
                    os.close(fd)
            results["mount"]["priority_64"] = timed(file_priority, args.calls)
            # priority.npy: the same pairs, and a close that sends no FLUSH (namespace.md)
            results["mount"]["priority_64_npy"] = timed(lambda: file_priority(f"{prio}.npy"), args.calls)
            results["mount"]["priority_64_again"] = timed(file_priority, args.calls)  # the order's share
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
