"""Reverb on DESIGN.md's replay workloads, the reference service issue 16 names: a local
server, one client, the same items, batch sizes and samplers as bench_replay.py.

    .venv-reverb/bin/python benchmarks/reverb_replay.py --workloads JSON [--seconds 3]

Needs dm-reverb and TensorFlow in a venv of their own (see reverb_inserts.py);
bench_replay.py runs this with `--reverb-python` and passes its workloads as JSON (a
list of [name, item_bytes, batch, sampler, capacity, fill]). Per workload: inserts/s
(one `client.insert` per item while filling) and samples/s of `client.sample(table,
num_samples=batch)` consumed whole, the way a Python learner reads batches. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import reverb


def measure(name: str, item_bytes: int, batch: int, sampler: str, capacity: int, fill: int, seconds: float) -> dict:
    selector = reverb.selectors.Prioritized(0.6) if sampler == "prioritized" else reverb.selectors.Uniform()
    table = reverb.Table(
        name=name, sampler=selector, remover=reverb.selectors.Fifo(), max_size=capacity,
        rate_limiter=reverb.rate_limiters.MinSize(1),
    )  # fmt: skip
    server = reverb.Server(tables=[table])
    try:
        client = reverb.Client(f"localhost:{server.port}")
        rng = np.random.default_rng(0)
        distinct = [rng.integers(0, 256, item_bytes, dtype=np.uint8) for _ in range(8)]
        started = time.perf_counter()
        for i in range(fill):
            client.insert([distinct[i % 8]], {name: 1.0})
        inserts = fill / (time.perf_counter() - started)
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            for sample in client.sample(name, num_samples=batch):
                count += len(sample)
        samples = count / (time.perf_counter() - started)
    finally:
        server.stop()
    return {"inserts_per_s": round(inserts), "samples_per_s": round(samples)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    out = {w[0]: measure(*w, seconds=args.seconds) for w in json.loads(args.workloads)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
