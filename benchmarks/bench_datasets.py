"""Dataset benchmarks: a cold dataset read in a random order, against per-record reads and
the local disk, in one run.

    sudo .venv/bin/python benchmarks/bench_datasets.py [--gib 4] [--record-bytes 10000]
        [--windows 256MiB 4GiB] [--page-cache 0 auto] [--seconds 20] [--rounds 3]
        [--listing-records 10000000]

One dataset of `--gib` GiB of `--record-bytes` records is appended and sealed, with the
order `shuffle 1`. Then, each cold (remounted and the kernel's caches dropped):
- `stream` read to the end with 1 MiB reads, once per prefetch window (`--windows`; the
  DRAM budget is set to hold the window) and `--dataset-page-cache` setting (`--page-cache`:
  `0` reads a dataset larger than the window record by record, `auto` through the page
  cache where half the available memory holds it) in each of `--rounds` rounds, each round after
  sequential reads of the same bytes from one file on the local disk (bench_posix's
  `disk_read_speeds`: the best of one reader with 8 MiB reads and four readers is the
  disk's speed; one reader with 1 MiB reads moved between 0.6 and 1.6 GB/s from one run
  to the next here); each stream is divided by its own round's disk speed;
- `records/<i>` opened and read one by one in the same order (for `--seconds`);
- the same records as one file each on the local disk, read in the same order (for
  `--seconds`), and one file of the dataset's size read sequentially (the disk's speed);
- the FUSE ceiling of a stream: a file of the dataset's size in the bare pyfuse3
  filesystem (ceiling_fs.py `--direct-io`: no page cache, as a stream is read), read in
  each round with the same 1 MiB reads as the streams. A stream cannot be served faster
  than that; each stream is divided by its own round's.
`--orders` adds other orders to each window's cold stream (`sequential`: what a stream
reads at when the order costs nothing), and `--warm` reads each stream a second time
right after, with the log in the kernel's page cache: the daemon's serving alone, which
no cold stream can beat, in the same round.
`--dram-epochs N` adds a stream kept in DRAM to each round: a daemon whose DRAM budget
holds the dataset twice (so `--dataset-dram auto`, half of it, takes the dataset), the
first window, `--dataset-page-cache auto`: one cold epoch and N more in the same daemon,
the dataset loaded into the block cache as a stream reads and then served from there
(design.md, "A dataset kept in DRAM": only records under 4 KB, so use `--record-bytes`
below that; with bigger ones both sides stream through the page cache). Beside it in
each round (which goes first alternates), the same daemon and epochs with
`--dataset-dram 0`: through the page cache. Each epoch is reported apart.
`--listing-records N` also times `ls -U records/ | wc -l` of an N-record dataset.

Needs root to drop the page cache (else "cold" only means not in distorefs' DRAM).
Prints a Markdown table and writes JSON (--json PATH). No thresholds: docs/benchmarks.md
keeps the results and the aims.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from bench_posix import Ceiling, disk_read_speeds, drop_caches, read_file, write_file  # the script's directory
from daemon import wait_for_kernels

from distorefs.stores.datasets.formats import shuffled
from distorefs.units import parse_size

CHUNK_BYTES = 64 << 20


def distore(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "distorefs", *args], check=True, stdout=subprocess.DEVNULL)


def record_chunks(count: int, size: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first index, a (n, size) uint8 array of records): random bytes, each record's index
    in its first 8 bytes so a reader can tell them apart."""
    rng = np.random.default_rng(0)
    per_chunk = max(1, CHUNK_BYTES // size)
    for first in range(0, count, per_chunk):
        n = min(per_chunk, count - first)
        chunk = rng.integers(0, 256, (n, size), dtype=np.uint8)
        chunk[:, :8] = np.arange(first, first + n, dtype="<u8").view(np.uint8).reshape(n, 8)
        yield first, chunk


class Daemon:
    def __init__(self, mnt: Path, data: Path) -> None:
        self.mnt = mnt
        self.data = data

    def mount(
        self, budget: str, window: str, stream: Path | None = None, page_cache: str = "auto", dram: str = "auto"
    ) -> None:
        distore(
            "mount", str(self.mnt), "--data-dir", str(self.data), "--dram-budget", budget,
            "--prefetch-window", window, "--dataset-page-cache", page_cache, "--dataset-dram", dram,
        )  # fmt: skip
        if stream is None:
            return
        # measure the daemon as it runs once started: its compiled kernels load in a thread
        # at their first use (up to a few seconds with a cold page cache; the plain
        # versions run meanwhile), here a first byte of the stream
        with open(stream, "rb", buffering=0) as f:
            f.read(1)
        wait_for_kernels(self.mnt)

    def warm_kernels(self) -> None:
        """The compiled kernels loaded by a stream of a tiny dataset of its own (a first
        read of the bench's dataset would start loading it into DRAM)."""
        path = self.mnt / "datasets" / "kernels"
        path.mkdir()
        with open(path / "append", "wb") as f:
            f.write(b"DSITEMS1" + np.uint64(4).tobytes() + b"abcd")
        (path / "state").write_text("seal\n")
        with open(path / "stream", "rb") as f:
            f.read()
        wait_for_kernels(self.mnt)
        os.rmdir(path)

    def umount(self) -> None:
        distore("umount", str(self.mnt))


def variant_key(window: str, page_cache: str, order: str) -> str:
    """A stream's key in the results: `WINDOW PAGE_CACHE`, then the order unless it is the
    bench's first, `shuffle 1` (so earlier results files keep their keys)."""
    return f"{window} {page_cache}" + ("" if order == "shuffle 1" else f" {order}")


def read_sequential(path: Path, buf: bytearray, stats: Path, at_end: bool = False) -> tuple[int, dict[str, int]]:
    """Read `path` (a stream) to its end: (bytes, the stream's entry in the dataset's
    `stats` after its first read: `whole`, `from_dram`, ...; with `at_end`, also the
    blocks it had loaded into DRAM when it reached its end, as `loaded_blocks_at_end`)."""
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        total += os.readv(fd, [buf])
        entry: dict[str, int] = json.loads(stats.read_text())["streams"][0]
        while n := os.readv(fd, [buf]):
            total += n
        if at_end:
            entry["loaded_blocks_at_end"] = json.loads(stats.read_text())["streams"][0].get("loaded_blocks", 0)
    finally:
        os.close(fd)
    return total, entry


def read_per_file(paths: Iterator[Path], seconds: float) -> tuple[int, int, float]:
    """Open, read, close each path until `seconds` pass: (files, bytes, elapsed)."""
    files = nbytes = 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            nbytes += len(f.read())
        files += 1
        if files % 64 == 0 and time.perf_counter() - started > seconds:
            break
    return files, nbytes, time.perf_counter() - started


def kept_in_dram(
    daemon: Daemon, ds: Path, buf: bytearray, nbytes: int, window: str, epochs: int, dram: str
) -> dict[str, object]:
    """A cold `shuffle 1` stream in a daemon whose DRAM budget holds the dataset twice,
    with `--dataset-dram dram`, then `epochs` more in the same daemon: GB/s of each, and
    whether the later ones came from DRAM."""
    budget = f"{-(-(2 * nbytes + parse_size(window)) >> 20)}MiB"
    daemon.mount(budget, window, dram=dram)
    (ds / "order").write_text("shuffle 1\n")
    daemon.warm_kernels()
    drop_caches()
    rates, from_dram, loaded = [], [], []
    for _epoch in range(epochs + 1):
        started = time.perf_counter()
        total, entry = read_sequential(ds / "stream", buf, ds / "stats", at_end=True)
        rates.append(total / (time.perf_counter() - started) / 1e9)
        from_dram.append(entry.get("from_dram", 0))
        loaded.append(entry.get("loaded_blocks_at_end", 0))
    status = json.loads((daemon.mnt / ".distore" / "status").read_text())
    daemon.umount()
    return {
        "budget": budget,
        "cold_gbps": rates[0],
        "epochs_gbps": rates[1:],
        "epochs_from_dram": from_dram[1:],
        "loaded_blocks_at_end": loaded,
        "dram_used_bytes": status["dram_used_bytes"],
    }


def bench_listing(daemon: Daemon, records: int) -> dict[str, float]:
    path = daemon.mnt / "datasets" / "listing"
    path.mkdir()
    (path / "config").write_text(json.dumps({"schema": {"id": "int64"}}))
    with open(path / "append", "wb") as f:
        np.save(f, np.zeros(records, dtype=[("id", "<i8")]))
    (path / "state").write_text("seal\n")
    started = time.perf_counter()
    out = subprocess.run(f"ls -U {path / 'records'} | wc -l", shell=True, check=True, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    listed = int(out.stdout)
    assert listed == records, f"ls listed {listed} of {records}"
    subprocess.run(["rmdir", str(path)], check=True)
    return {"records": records, "ls_s": elapsed, "entries_per_s": records / elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--record-bytes", type=int, default=10_000)
    parser.add_argument("--windows", nargs="+", default=["256MiB", "4GiB"])
    parser.add_argument("--page-cache", nargs="+", default=["0", "auto"], help="--dataset-page-cache settings")
    parser.add_argument("--seconds", type=float, default=20.0, help="time limit of each per-record read")
    parser.add_argument("--listing-records", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="cold streams per window, each against the disk")
    parser.add_argument("--orders", nargs="+", default=["shuffle 1"], help="orders of the streams (`shuffle 1` first)")
    parser.add_argument("--warm", action="store_true", help="read each stream again with the log in the page cache")
    parser.add_argument("--dram-epochs", type=int, default=0, help="epochs after the cold one of a stream kept in DRAM")
    parser.add_argument("--dir", default="/var/tmp", help="local disk for the data dir and the baselines")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    size = args.record_bytes
    count = int(args.gib * (1 << 30)) // size
    order = shuffled(1, count)
    base = Path(tempfile.mkdtemp(prefix="bench-datasets-", dir=args.dir))
    daemon = Daemon(base / "mnt", base / "data")
    (base / "mnt").mkdir()
    results: dict[str, object] = {"records": count, "record_bytes": size, "bytes": count * size}
    can_drop = drop_caches()
    results["caches_dropped"] = can_drop
    buf = bytearray(1 << 20)
    stack = contextlib.ExitStack()  # the ceiling's mount, from the streams' rounds on
    try:
        # --- the local disk: one file, and one file per record ---------------------------
        disk_file = base / "disk.bin"
        per_record = base / "per-record"
        per_record.mkdir()
        with open(disk_file, "wb") as whole:
            for first, chunk in record_chunks(count, size):
                whole.write(chunk.tobytes())
                for k in range(len(chunk)):
                    (per_record / str(first + k)).write_bytes(chunk[k].tobytes())
        drop_caches()
        files, nbytes, elapsed = read_per_file((per_record / str(i) for i in order.tolist()), args.seconds)
        results["disk_per_file"] = {"files": files, "files_per_s": files / elapsed, "gbps": nbytes / elapsed / 1e9}
        shutil.rmtree(per_record)

        # --- distorefs: append, seal, order ----------------------------------------------
        daemon.mount("2GiB", "256MiB")
        ds = daemon.mnt / "datasets" / "bench"
        ds.mkdir()
        started = time.perf_counter()
        with open(ds / "append", "wb", buffering=0) as f:
            f.write(b"DSITEMS1")
            frame = np.full((1, 8), 0, np.uint8)
            frame[0] = np.frombuffer(np.uint64(size).tobytes(), np.uint8)
            for _first, chunk in record_chunks(count, size):
                f.write(np.hstack([np.repeat(frame, len(chunk), axis=0), chunk]).tobytes())
        (ds / "state").write_text("seal\n")
        results["append_gbps"] = count * size / (time.perf_counter() - started) / 1e9
        (ds / "order").write_text("shuffle 1\n")
        # the same stream at once, in the daemon that appended the dataset: served from
        # DRAM where its budget kept every record (design.md, "A stream's READs in pieces")
        started = time.perf_counter()
        total, entry = read_sequential(ds / "stream", buf, ds / "stats")
        gbps = total / (time.perf_counter() - started) / 1e9
        results["stream_after_append"] = {"gbps": gbps, "from_dram": entry.get("from_dram", 0)}
        daemon.umount()

        # --- records/<i> in the order, cold ------------------------------------------------
        daemon.mount("2GiB", "256MiB")
        drop_caches()
        files, nbytes, elapsed = read_per_file((ds / "records" / str(i) for i in order.tolist()), args.seconds)
        results["records_per_file"] = {"files": files, "files_per_s": files / elapsed, "gbps": nbytes / elapsed / 1e9}
        daemon.umount()

        # --- stream, cold, per window, against the disk in the same round ----------------
        variants = [(window, pc, order) for window in args.windows for pc in args.page_cache for order in args.orders]
        streams: dict[str, dict[str, object]] = {variant_key(*v): {"rounds": []} for v in variants}
        disk_rounds = []
        ceiling_rounds: list[float] = []
        kept_rounds: list[dict[str, object]] = []
        ceiling_file = stack.enter_context(Ceiling(base, ["--direct-io"])) / "stream"
        write_file(ceiling_file, count * size, os.urandom(1 << 20))
        for _round in range(args.rounds):
            speeds = disk_read_speeds(disk_file)
            disk_gbps = speeds["best"]
            disk_rounds.append(speeds)
            started = time.perf_counter()
            ceiling_gbps = read_file(ceiling_file) / (time.perf_counter() - started) / 1e9
            ceiling_rounds.append(ceiling_gbps)
            for window, page_cache, order in variants:
                budget = f"{max(parse_size(window) + (256 << 20), 1 << 30) >> 20}MiB"
                daemon.mount(budget, window, ds / "stream", page_cache)
                (ds / "order").write_text(f"{order}\n")
                drop_caches()
                started = time.perf_counter()
                total, entry = read_sequential(ds / "stream", buf, ds / "stats")
                elapsed = time.perf_counter() - started
                status = json.loads((daemon.mnt / ".distore" / "status").read_text())
                warm = {}
                if args.warm:  # the same stream at once: its records now in the page cache
                    started = time.perf_counter()
                    again, _entry = read_sequential(ds / "stream", buf, ds / "stats")
                    warm = {"warm_gbps": again / (time.perf_counter() - started) / 1e9}
                rounds = streams[variant_key(window, page_cache, order)]["rounds"]
                assert isinstance(rounds, list)
                rounds.append(
                    {
                        "budget": budget,
                        "seconds": elapsed,
                        "gbps": total / elapsed / 1e9,
                        "disk_gbps": disk_gbps,
                        "vs_disk": total / elapsed / 1e9 / disk_gbps,
                        "ceiling_gbps": ceiling_gbps,
                        "vs_ceiling": total / elapsed / 1e9 / ceiling_gbps,
                        "log_parts": status["blocks"]["gathered_log_parts"],
                        "log_spans": status["blocks"]["gathered_log_spans"],
                        "whole": bool(entry["whole"]),
                        **warm,
                    }
                )
                daemon.umount()
            if args.dram_epochs:
                pair = {}
                for dram in ("auto", "0") if _round % 2 == 0 else ("0", "auto"):
                    pair[dram] = kept_in_dram(daemon, ds, buf, count * size, args.windows[0], args.dram_epochs, dram)
                kept_rounds.append({**pair["auto"], "page_cache": pair["0"], "disk_gbps": disk_gbps})
        disk_file.unlink()
        results["disk_sequential_gbps"] = statistics.median(r["best"] for r in disk_rounds)
        results["disk_one_reader_gbps"] = statistics.median(r["one_1m"] for r in disk_rounds)
        results["disk_sequential_rounds"] = disk_rounds
        results["ceiling_gbps"] = statistics.median(ceiling_rounds)
        results["ceiling_rounds_gbps"] = ceiling_rounds
        for s in streams.values():
            rounds = s["rounds"]
            assert isinstance(rounds, list)
            s["budget"] = rounds[0]["budget"]
            s["gbps"] = statistics.median(r["gbps"] for r in rounds)
            s["vs_disk"] = statistics.median(r["vs_disk"] for r in rounds)
            s["vs_ceiling"] = statistics.median(r["vs_ceiling"] for r in rounds)
            if args.warm:
                s["warm_gbps"] = statistics.median(r["warm_gbps"] for r in rounds)
        results["stream"] = streams
        if kept_rounds:
            results["kept_in_dram"] = {
                "rounds": kept_rounds,
                "cold_gbps": statistics.median(float(r["cold_gbps"]) for r in kept_rounds),  # type: ignore[arg-type]
                "cold_vs_disk": statistics.median(
                    float(r["cold_gbps"]) / float(r["disk_gbps"])  # type: ignore[arg-type]
                    for r in kept_rounds
                ),
                "epochs_gbps": [
                    statistics.median(r["epochs_gbps"][k] for r in kept_rounds)  # type: ignore[index]
                    for k in range(args.dram_epochs)
                ],
                "page_cache_cold_gbps": statistics.median(r["page_cache"]["cold_gbps"] for r in kept_rounds),  # type: ignore[index]
                "page_cache_epochs_gbps": [
                    statistics.median(r["page_cache"]["epochs_gbps"][k] for r in kept_rounds)  # type: ignore[index]
                    for k in range(args.dram_epochs)
                ],
            }

        if args.listing_records:
            daemon.mount("2GiB", "256MiB")
            results["listing"] = bench_listing(daemon, args.listing_records)
            daemon.umount()
    finally:
        stack.close()
        subprocess.run(["fusermount3", "-u", "-z", str(daemon.mnt)], check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)

    disk = float(results["disk_sequential_gbps"])  # type: ignore[arg-type]
    per_rec = results["records_per_file"]["gbps"]  # type: ignore[index]
    print(f"\n{count} records of {size} bytes ({count * size / 1e9:.2f} GB), cold")
    print(f"caches dropped: {can_drop}\n")
    ceiling = float(results["ceiling_gbps"])  # type: ignore[arg-type]
    print("| reader | rate | GB/s | vs disk sequential | vs records/<i> | vs FUSE ceiling | warm GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    best = "its best: one reader 8 MiB or four readers"
    print(f"| local disk, one file, sequential ({best}) | | {disk:.2f} | 1.00x | | | |")
    print(
        f"| FUSE ceiling: ceiling_fs.py --direct-io, one file from its memory, 1 MiB reads | | {ceiling:.2f} | "
        f"{ceiling / disk:.2f}x | | 1.00x | |"
    )
    one = float(results["disk_one_reader_gbps"])  # type: ignore[arg-type]
    print(f"| local disk, one file, one reader with 1 MiB reads | | {one:.2f} | {one / disk:.2f}x | | | |")
    for label, key in (("local disk, a file per record", "disk_per_file"), ("records/<i>", "records_per_file")):
        r = results[key]
        print(f"| {label} | {r['files_per_s']:.0f} files/s | {r['gbps']:.3f} | {r['gbps'] / disk:.2f}x | | | |")  # type: ignore[index]
    for variant, s in streams.items():
        gbps, vs_disk = float(s["gbps"]), float(s["vs_disk"])  # type: ignore[arg-type]
        window, page_cache, *order = variant.split(maxsplit=2)
        rounds = s["rounds"]
        assert isinstance(rounds, list)
        how = "whole, via the page cache" if rounds[0]["whole"] else "record by record"
        label = f"stream `{order[0] if order else 'shuffle 1'}`, window {window}, --dataset-page-cache {page_cache}"
        label += f" ({how}; DRAM {s['budget']})"
        vs_ceiling = float(s["vs_ceiling"])  # type: ignore[arg-type]
        warm = f"{float(s['warm_gbps']):.2f}" if "warm_gbps" in s else ""  # type: ignore[arg-type]
        print(f"| {label} | | {gbps:.2f} | {vs_disk:.2f}x | {gbps / per_rec:.1f}x | {vs_ceiling:.2f}x | {warm} |")
    kept = results.get("kept_in_dram")
    if isinstance(kept, dict):
        first = kept["rounds"][0]
        for how, key in (("--dataset-dram auto", ""), ("--dataset-dram 0", "page_cache_")):
            label = f"stream `shuffle 1`, {how} (DRAM {first['budget']}, window {args.windows[0]})"
            cold = float(kept[key + "cold_gbps"])
            print(f"| {label}: epoch 1, cold | | {cold:.2f} | {cold / disk:.2f}x | {cold / per_rec:.1f}x | | |")
            for k, epoch in enumerate(kept[key + "epochs_gbps"]):
                print(f"| {label}: epoch {k + 2} | | | | | {epoch / ceiling:.2f}x | {epoch:.2f} |")
    print(f"\nstream, disk and ceiling: medians of {args.rounds} rounds; `vs disk` and `vs FUSE ceiling` are the")
    print("medians of each round's ratios")
    print(f"\nappend (framed, one open): {results['append_gbps']:.2f} GB/s")
    after = results["stream_after_append"]
    how = "from DRAM" if after["from_dram"] else "in batches: the DRAM budget did not keep it"  # type: ignore[index]
    print(f"stream at once after the append, in the same daemon ({how}): {after['gbps']:.2f} GB/s")  # type: ignore[index]
    if "listing" in results:
        lst = results["listing"]
        print(f"ls -U records/ | wc -l of {lst['records']} records: {lst['ls_s']:.1f} s")  # type: ignore[index]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
