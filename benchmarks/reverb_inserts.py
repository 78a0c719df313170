"""Reverb's single-item inserts, the reference for issue 16's append rate: a local
server, one client, 3 KB items, one item at a time.

    .venv-reverb/bin/python benchmarks/reverb_inserts.py [--seconds 3] [--rounds 3]

Needs `dm-reverb` and TensorFlow, which distorefs does not depend on, in a venv of their
own: `python3 -m venv .venv-reverb && .venv-reverb/bin/pip install dm-reverb==0.14.0
"tensorflow-cpu==2.14.*"`. bench_append_scaling.py runs this with `--reverb-python` to
have both in one run. Two ways of inserting one item, as a Reverb user would:
`client.insert` (one RPC per item) and a trajectory writer that flushes after each item.
Prints JSON: items/s per round for each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import reverb


def rate(insert: object, seconds: float) -> int:
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        insert()  # type: ignore[operator]
        count += 1
    return round(count / (time.perf_counter() - started))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    table = reverb.Table(
        name="t", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
        max_size=1_000_000, rate_limiter=reverb.rate_limiters.MinSize(1),
    )  # fmt: skip
    server = reverb.Server(tables=[table])
    client = reverb.Client(f"localhost:{server.port}")
    item = np.frombuffer(os.urandom(3000), dtype=np.uint8)
    out: dict[str, list[int]] = {"client_insert": [], "writer_flush_each": []}
    with client.writer(max_sequence_length=1) as writer:

        def write_one() -> None:
            writer.append(item)
            writer.create_item("t", 1, 1.0)
            writer.flush()

        for _ in range(args.rounds):  # interleaved
            out["client_insert"].append(rate(lambda: client.insert([item], {"t": 1.0}), args.seconds))
            out["writer_flush_each"].append(rate(write_one, args.seconds))
    server.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
