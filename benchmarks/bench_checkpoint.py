"""Checkpoint and weights benchmarks: distorefs against tmpfs and the local disk, one run.

    .venv/bin/python benchmarks/bench_checkpoint.py [--sizes-gib 1 4] [--readers 32]

Checkpoints: for state dicts of float32 tensors of mixed sizes, the stall (until
`torch.save` or safetensors `save_file` returns) and the time until durable (save, then
fsync) on distorefs' checkpoints/, written through the mount and through
`client.staged_open` (shared memory, issue 18), against the same save to tmpfs and to
the local disk followed by fsync; medians of --repeats saves, the places interleaved.
Weights: publish latency of a 100 MB model file and reads/s of it by N reader processes,
against the same reads from tmpfs.

The places take turns in a rotating order (repeat r starts at place r): this VM returns
freed memory to its host at once (free page reporting, `min_free_ms` 0), and a save into
memory the host must back again ran 2-4x slower than one into memory just freed by
another process, so a fixed order let one place inherit another's memory every time
(docs/benchmarks.md, "Sixteenth session", fresh memory on this VM).

Prints Markdown tables and writes the raw numbers as JSON (--json PATH). No thresholds:
docs/benchmarks.md keeps the results and the aims they are read against.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_posix import drop_caches  # (the page cache stays where not root)


def distore(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "distorefs", *args], check=True, stdout=subprocess.DEVNULL)


def state_dict(total_bytes: int, seed: int = 0, device: str = "cpu") -> dict[str, object]:
    """float32 tensors of mixed sizes (4 KiB to 64 MiB) adding up to about `total_bytes`,
    on `device` (a GPU's state dict: each save copies it to host memory first, as a
    training loop's checkpoint does)."""
    import torch

    rng = np.random.default_rng(seed)
    out: dict[str, object] = {}
    left = total_bytes
    i = 0
    while left > 0:
        size = int(min(left, 2 ** rng.uniform(12, 26)))
        elements = max(1, size // 4)
        out[f"layer.{i}.weight"] = torch.from_numpy(rng.standard_normal(elements, dtype=np.float32)).to(device)
        left -= elements * 4
        i += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def measure_save(save: Callable[[Path], None], path: Path) -> tuple[float, float]:
    """(stall, time to durable) of one save to `path`."""
    if path.exists():
        path.unlink()
    drop_caches()
    started = time.perf_counter()
    save(path)
    stall = time.perf_counter() - started
    fsync_path(path)
    durable = time.perf_counter() - started
    return stall, durable


def bench_checkpoints(
    sizes_gib: list[float], places: dict[str, Path], repeats: int, device: str = "cpu"
) -> list[dict[str, object]]:
    """Each save `repeats` times per place, the places interleaved in a rotating order;
    medians."""
    import safetensors.torch
    import torch

    from distorefs import client

    def torch_save(sd: dict[str, object], path: Path, staged: bool) -> None:
        if staged:
            with client.staged_open(path) as f:
                torch.save(sd, f)
        else:
            torch.save(sd, path)

    def safetensors_save(sd: dict[str, object], path: Path, staged: bool) -> None:
        if staged:  # save_file writes a temporary beside its path and renames it: bytes instead
            with client.staged_open(path) as f:
                f.write(safetensors.torch.save(sd))  # type: ignore[arg-type]
        else:
            safetensors.torch.save_file(sd, path)  # type: ignore[arg-type]

    Saver = Callable[[dict[str, object], Path, bool], None]

    def save_one(saver: Saver, sd: dict[str, object], staged: bool, path: Path) -> None:
        saver(sd, path, staged)

    savers: dict[str, Saver] = {
        "torch.save": torch_save,
        "safetensors": safetensors_save,
    }
    rows = []
    for gib in sizes_gib:
        sd = state_dict(int(gib * (1 << 30)), device=device)
        for saver_name, saver in savers.items():
            row: dict[str, object] = {"size_gib": gib, "writer": saver_name, "repeats": repeats, "device": device}
            times: dict[str, list[tuple[float, float]]] = {place: [] for place in places}
            names = list(places)
            for repeat in range(repeats):
                for place in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    directory = places[place]
                    path = directory / f"ckpt-{gib}.bin"
                    times[place].append(measure_save(functools.partial(save_one, saver, sd, place == "staged"), path))
                    path.unlink()
            for place, measured in times.items():
                row[f"{place}_stall_s"] = round(float(np.median([m[0] for m in measured])), 3)
                row[f"{place}_durable_s"] = round(float(np.median([m[1] for m in measured])), 3)
                row[f"{place}_stall_samples_s"] = [round(m[0], 3) for m in measured]
            for place in ("distorefs", "staged"):
                row[f"{place}_stall_vs_tmpfs"] = round(row[f"{place}_stall_s"] / row["tmpfs_stall_s"], 2)  # type: ignore[operator]
                row[f"{place}_durable_vs_disk"] = round(row[f"{place}_durable_s"] / row["disk_durable_s"], 2)  # type: ignore[operator]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        del sd
    return rows


READER = textwrap.dedent("""
    import sys, time
    path, seconds = sys.argv[1], float(sys.argv[2])
    buf = bytearray(1 << 20)
    reads = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        reads += 1
    print(reads)
""")


def readers_per_second(path: Path, readers: int, seconds: float) -> float:
    procs = [
        subprocess.Popen([sys.executable, "-c", READER, str(path), str(seconds)], stdout=subprocess.PIPE)
        for _ in range(readers)
    ]
    total = sum(int(p.communicate()[0]) for p in procs)
    return total / seconds


def bench_weights(mnt: Path, tmpfs: Path, readers: int, seconds: float) -> dict[str, object]:
    model = mnt / "weights" / "bench"
    model.mkdir()
    payload = np.random.default_rng(1).integers(0, 255, 100_000_000, dtype=np.uint8).tobytes()
    latencies = []
    for _ in range(10):
        started = time.perf_counter()
        (model / "params.bin").write_bytes(payload)  # returns once published
        latencies.append(time.perf_counter() - started)
    tmpfs_started = time.perf_counter()
    (tmpfs / "params.bin").write_bytes(payload)
    tmpfs_write = time.perf_counter() - tmpfs_started
    result: dict[str, object] = {
        "publish_100mb_median_s": round(float(np.median(latencies)), 4),
        "tmpfs_write_100mb_s": round(tmpfs_write, 4),
        "readers": readers,
        "distorefs_reads_per_s": round(readers_per_second(model / "params.bin", readers, seconds), 1),
        "tmpfs_reads_per_s": round(readers_per_second(tmpfs / "params.bin", readers, seconds), 1),
    }
    result["reads_vs_tmpfs"] = round(result["distorefs_reads_per_s"] / result["tmpfs_reads_per_s"], 2)  # type: ignore[operator]
    print(json.dumps(result), file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--readers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3, help="saves per place and size (medians)")
    parser.add_argument("--no-weights", action="store_true", help="checkpoints only")
    parser.add_argument("--dram-budget", default="6GiB")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cpu", help="the state dict's device (cuda: to host at each save)")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="distorefs-bench-ckpt-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="distorefs-bench-ckpt-", dir="/dev/shm"))
    mnt = base / "mnt"
    mnt.mkdir()
    (base / "disk").mkdir()
    distore("mount", str(mnt), "--data-dir", str(base / "data"), "--dram-budget", args.dram_budget)
    try:
        run = mnt / "checkpoints" / "bench"
        run.mkdir()
        places = {"tmpfs": shm, "disk": base / "disk", "distorefs": run, "staged": run}
        checkpoints = bench_checkpoints(args.sizes_gib, places, args.repeats, args.device)
        weights = None if args.no_weights else bench_weights(mnt, shm, args.readers, args.seconds)
    finally:
        distore("umount", str(mnt))
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    print("| state dict | writer | tmpfs stall | mount stall | / tmpfs | staged stall | / tmpfs "
          "| disk save+fsync | mount to durable | / disk | staged to durable | / disk |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in checkpoints:
        print(
            f"| {r['size_gib']} GiB | {r['writer']} | {r['tmpfs_stall_s']} s | {r['distorefs_stall_s']} s "
            f"| {r['distorefs_stall_vs_tmpfs']}x | {r['staged_stall_s']} s | {r['staged_stall_vs_tmpfs']}x "
            f"| {r['disk_durable_s']} s | {r['distorefs_durable_s']} s | {r['distorefs_durable_vs_disk']}x "
            f"| {r['staged_durable_s']} s | {r['staged_durable_vs_disk']}x |"
        )
    if weights is not None:
        print()
        print(
            f"weights: publish of 100 MB {weights['publish_100mb_median_s']} s (tmpfs write "
            f"{weights['tmpfs_write_100mb_s']} s); {weights['readers']} readers: {weights['distorefs_reads_per_s']} "
            f"reads/s vs tmpfs {weights['tmpfs_reads_per_s']} ({weights['reads_vs_tmpfs']}x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoints": checkpoints, "weights": weights}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
