"""Cluster benchmarks: a real etcd and two daemons on loopback, each measurement taken on
the node that owns the data and on the other node in the same run.

    .venv/bin/python benchmarks/bench_cluster.py [--seconds 3] [--readers 8] [--model-mib 64]

- Remote sample throughput: a DQN-like buffer (110 KB items, prioritized, batch 32) owned by
  node n0, sampled through n0's mount (local) and through n1's mount (every batch drawn by
  n0 and sent over the peer protocol).
- Weights fan-out: a model published on n0; R reader processes wait on `wait`, then read
  the whole new version, on n0 (local) and on n1 (n1 fetches the version once and its
  readers read the local copy). Reported: publish-to-last-reader-done latency.
- Checkpoint replication: a file of `--checkpoint-mib` written and fsync'ed on n0 under
  `user.distore.replicas` = 2 (fsync returns once n1 holds it durably) against the same
  save into a directory of n0 without replicas, alternating; and the peak memory
  (VmHWM, reset before) each daemon reached meanwhile.
- Remote memory tier: node n2 with 64 MiB of DRAM holds a buffer of N x 110 KB items
  (220 MB by default). Every item is read once, in random order, through `items/<i>`:
  from the log with the page cache dropped (the device), from the log again (page cache
  warm), then, after n3 joins with `--lend-memory`, from n3's memory.
- Big calls across nodes (`--items N`): buffers of 2N items of 8 bytes (a schema buffer
  and a blob one), held by n0 alone, or in two shards with N on each node; `sample.2N`
  and a priority update of N pairs (the items of n1's shard) timed on n0, median of
  `--call-repeats`. A shard's part of such a call is one peer frame of N items.
`--only` runs some of these (`sample,fanout,checkpoint,spill,items`). Prints Markdown
tables; docs/benchmarks.md keeps the results.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from distorefs import client  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_etcd(base: Path) -> tuple[subprocess.Popen[bytes], str]:
    client_port, peer_port = free_port(), free_port()
    url = f"http://127.0.0.1:{client_port}"
    proc = subprocess.Popen(
        ["etcd", "--data-dir", str(base / "etcd"), "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("etcd did not start")


def mount(base: Path, name: str, url: str, *extra: str) -> Path:
    mnt = base / name / "mnt"
    mnt.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "distorefs", "mount", str(mnt), "--data-dir", str(base / name / "data"),
         "--dram-budget", "4GiB", "--cluster", url, "--node", name, "--listen", "127.0.0.1:0", *extra],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return mnt


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        return True
    except OSError:
        return False


def read_pass(buffer: Path, count: int, seed: int) -> float:
    """Seconds to read every item once, in a random order, one file each."""
    order = np.random.default_rng(seed).permutation(count)
    started = time.perf_counter()
    for i in order.tolist():
        with open(buffer / "items" / str(i), "rb") as f:
            f.read()
    return time.perf_counter() - started


def wait_for(check: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def sample_rate(buffer: Path, seconds: float) -> float:
    """Batches of 32 per second through `sample`, one reader."""
    path = buffer / "sample"
    count = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        client.read_batch(path)
        count += 1
    return count / (time.perf_counter() - started)


def has_shards(config: Path, shards: int) -> bool:
    return config.exists() and json.loads(config.read_text())["shards"] == shards


def median_s(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def big_calls(n0: Path, n1: Path, items: int, repeats: int, results: dict[str, float]) -> None:
    """`items` x 2 items of 8 bytes on n0 alone, then in two shards (one on n1): the
    whole as one sample and a priority update of `items` pairs, timed on n0."""
    for kind in ("schema", "blob"):
        for layout, shards in (("local", 1), ("sharded", 2)):
            buf = n0 / "buffers" / f"items-{kind}-{layout}"
            buf.mkdir()
            config: dict[str, object] = {"sampler": "prioritized", "capacity": 2 * items, "shards": shards}
            if kind == "schema":
                config["schema"] = {"x": "int64"}
            (buf / "config").write_text(json.dumps(config))
            other = n1 / "buffers" / buf.name / "config"
            wait_for(partial(has_shards, other, shards), f"{buf.name} on n1")
            halves = [(n0, k) for k in range(2)] if shards == 1 else [(n0, 0), (n1, 1)]
            for mnt, k in halves:
                records = (np.arange(items) + 10**6 * k).astype([("x", "<i8")])
                client.append(mnt / "buffers" / buf.name, records if kind == "schema" else [bytes(r) for r in records])
            whole = buf / f"sample.{2 * items}"
            assert len(client.read_all(whole)) > 16 * items  # warm, and whole (EAGAIN raised, not read as EOF)
            results[f"items_{kind}_{layout}_sample_s"] = median_s(partial(client.read_all, whole), repeats)
            theirs = (np.arange(items) * shards + shards - 1).tolist()  # n1's shard (or the second half)
            update = partial(client.update_priorities, buf, theirs, [1.0] * items)
            results[f"items_{kind}_{layout}_priority_s"] = median_s(update, repeats)


def reader(model: Path, versions: int, done: multiprocessing.Queue[tuple[int, float]]) -> None:
    with open(model / "wait", "rb") as wait:
        wait.readline()
        for _ in range(versions):
            version = int(wait.readline().split()[0])
            size = len((model / "params.bin").read_bytes())
            done.put((version, time.time()))
            del size


def save(path: Path, data: bytes) -> float:
    """Seconds to write `data` to a new file and fsync it."""
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[: 1 << 20]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def daemon_pid(mnt: Path) -> int:
    return int(json.loads((mnt / ".distore" / "status").read_text())["pid"])


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(pid: int) -> None:
    """The kernel's peak RSS of `pid` starts again from its RSS now (root)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def fan_out(publisher: Path, readers_on: Path, readers: int, versions: int, tensor: bytes) -> list[float]:
    """Latency from the start of each publish to the last reader having read it."""
    done: multiprocessing.Queue[tuple[int, float]] = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=reader, args=(readers_on, versions, done)) for _ in range(readers)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # readers are waiting
    latencies = []
    for _ in range(versions):
        started = time.time()
        with open(publisher / "params.bin", "wb") as f:
            f.write(tensor)
        finished = [done.get(timeout=120)[1] for _ in range(readers)]
        latencies.append(max(finished) - started)
    for p in procs:
        p.join(timeout=60)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--model-mib", type=int, default=64)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--spill-items", type=int, default=2000)
    parser.add_argument("--checkpoint-mib", type=int, default=1024)
    parser.add_argument("--checkpoint-repeats", type=int, default=3)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--call-repeats", type=int, default=3)
    parser.add_argument("--only", default="sample,fanout,checkpoint,spill,items")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    only = set(args.only.split(","))
    base = Path(tempfile.mkdtemp(prefix="distore-bench-cluster-", dir="/var/tmp"))
    etcd, url = start_etcd(base)
    mounts: list[Path] = []
    results: dict[str, float] = {}
    try:
        n0, n1 = mount(base, "n0", url), mount(base, "n1", url)
        mounts = [n0, n1]
        if "sample" in only:
            # --- remote sample throughput
            (n0 / "buffers" / "dqn").mkdir()
            config = {"sampler": "prioritized", "batch_size": 32, "capacity": 20_000}
            (n0 / "buffers" / "dqn" / "config").write_text(json.dumps(config))
            payload = os.urandom(110_000)
            for _ in range(125):
                client.append(n0 / "buffers" / "dqn", [payload] * 16)
            wait_for(lambda: (n1 / "buffers" / "dqn").is_dir(), "buffers/dqn on n1")
            results["sample_local_batches_s"] = sample_rate(n0 / "buffers" / "dqn", args.seconds)
            results["sample_remote_batches_s"] = sample_rate(n1 / "buffers" / "dqn", args.seconds)
        if "fanout" in only:
            # --- weights fan-out
            (n0 / "weights" / "policy").mkdir()
            wait_for(lambda: (n1 / "weights" / "policy").is_dir(), "weights/policy on n1")
            tensor = np.random.default_rng(0).bytes(args.model_mib << 20)
            local = fan_out(n0 / "weights" / "policy", n0 / "weights" / "policy", args.readers, args.versions, tensor)
            remote = fan_out(n0 / "weights" / "policy", n1 / "weights" / "policy", args.readers, args.versions, tensor)
            results["fanout_local_s"] = float(np.median(local))
            results["fanout_remote_s"] = float(np.median(remote))
            peers = json.loads((n1 / ".distore" / "peers").read_text())
            results["fanout_remote_fetches"] = peers["weights_fetched"]
        if "checkpoint" in only:
            # --- checkpoint replication
            replicated, alone = n0 / "checkpoints" / "replicated", n0 / "checkpoints" / "alone"
            replicated.mkdir()
            alone.mkdir()
            os.setxattr(replicated, "user.distore.replicas", b"2")
            blob = np.random.default_rng(1).bytes(args.checkpoint_mib << 20)
            pids = [daemon_pid(n0), daemon_pid(n1)]
            for pid in pids:
                reset_peak(pid)
            alone_s, replicated_s = [], []
            for i in range(args.checkpoint_repeats):
                alone_s.append(save(alone / f"step-{i}.pt", blob))
                replicated_s.append(save(replicated / f"step-{i}.pt", blob))
            results["ckpt_alone_s"] = float(np.median(alone_s))
            results["ckpt_replicated_s"] = float(np.median(replicated_s))
            results["ckpt_peak_n0_mib"], results["ckpt_peak_n1_mib"] = peak_mib(pids[0]), peak_mib(pids[1])
            copy = n1 / "checkpoints" / "replicated" / f"step-{args.checkpoint_repeats - 1}.pt"
            results["ckpt_replica_whole"] = copy.stat().st_size == len(blob)
            del blob
        if "spill" in only:
            # --- remote memory tier
            n2 = mount(base, "n2", url, "--dram-budget", "64MiB")
            mounts.append(n2)
            spill = n2 / "buffers" / "spill"
            spill.mkdir()
            (spill / "config").write_text(json.dumps({"capacity": args.spill_items}))
            for start in range(0, args.spill_items, 16):
                client.append(spill, [payload] * min(16, args.spill_items - start))
            time.sleep(2.0)  # flushed to the log
            results["cache_dropped"] = drop_page_cache()
            results["pass_log_cold_s"] = read_pass(spill, args.spill_items, 1)
            results["pass_log_warm_s"] = read_pass(spill, args.spill_items, 2)
            (spill / "config").write_text(json.dumps({"capacity": args.spill_items, "batch_size": 32}))
            results["spill_sample_log_batches_s"] = sample_rate(spill, args.seconds)
            n3 = mount(base, "n3", url, "--lend-memory", "1GiB")
            mounts.append(n3)
            wait_for(
                lambda: json.loads((n2 / ".distore" / "peers").read_text())["remote_memory"]["lenders"], "n3 lends"
            )
            read_pass(spill, args.spill_items, 3)  # loads evict: the evicted items go to n3
            wait_for(
                lambda: json.loads((n2 / ".distore" / "peers").read_text())["remote_memory"]["borrowed"]["queued_items"]
                == 0, "spills sent")  # fmt: skip
            before = json.loads((n2 / ".distore" / "peers").read_text())["remote_memory"]["borrowed"]
            results["pass_peer_memory_s"] = read_pass(spill, args.spill_items, 4)
            after = json.loads((n2 / ".distore" / "peers").read_text())["remote_memory"]["borrowed"]
            results["pass_peer_memory_hits"] = after["hits"] - before["hits"]
            results["spill_sample_peer_batches_s"] = sample_rate(spill, args.seconds)
            results["spilled_items"] = after["remote_items"]
        if "items" in only:
            big_calls(n0, n1, args.items, args.call_repeats, results)
    finally:
        for mnt in mounts:
            subprocess.run([sys.executable, "-m", "distorefs", "umount", str(mnt)], check=False)
        etcd.terminate()
        etcd.wait(timeout=20)
        if os.environ.get("KEEP"):
            print("kept", base)
        else:
            shutil.rmtree(base, ignore_errors=True)
    print_tables(results, args, only)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_tables(results: dict[str, float], args: argparse.Namespace, only: set[str]) -> None:
    mb = 32 * 110_000 / 1e6
    if only & {"sample", "fanout", "checkpoint"}:
        print("| measurement | on the owning node | on another node | ratio |")
        print("| --- | --- | --- | --- |")
    if "sample" in only:
        s_l, s_r = results["sample_local_batches_s"], results["sample_remote_batches_s"]
        print(f"| DQN sample, batch 32 x 110 KB | {s_l:.0f} batches/s ({s_l * mb:.0f} MB/s) |"
              f" {s_r:.0f} batches/s ({s_r * mb:.0f} MB/s) | {s_r / s_l:.2f}x |")  # fmt: skip
    if "fanout" in only:
        f_l, f_r = results["fanout_local_s"], results["fanout_remote_s"]
        print(f"| weights fan-out, {args.model_mib} MiB to {args.readers} readers (publish to last read) |"
              f" {f_l:.3f} s | {f_r:.3f} s (n1 fetched {results['fanout_remote_fetches']} times for"
              f" {2 * args.versions} versions)"
              f" | {f_l / f_r:.2f}x |")  # fmt: skip
    if "checkpoint" in only:
        a_s, r_s, mib = results["ckpt_alone_s"], results["ckpt_replicated_s"], args.checkpoint_mib
        print(f"| checkpoint of {mib} MiB, write + fsync (median of {args.checkpoint_repeats}) |"
              f" {a_s:.2f} s ({mib / a_s:.0f} MiB/s), no replica | {r_s:.2f} s ({mib / r_s:.0f} MiB/s), replicas = 2"
              f" (peak memory n0 {results['ckpt_peak_n0_mib']:.0f} MiB, n1 {results['ckpt_peak_n1_mib']:.0f} MiB)"
              f" | {a_s / r_s:.2f}x |")  # fmt: skip
    if "items" in only:
        n = args.items
        print()
        print("| one call on n0 | buffer on n0 alone | two shards, one on n1 | ratio |")
        print("| --- | --- | --- | --- |")
        for kind in ("schema", "blob"):
            for call, what in (("sample", f"`sample.{2 * n}`"), ("priority", f"priorities of {n} items")):
                one, two = results[f"items_{kind}_local_{call}_s"], results[f"items_{kind}_sharded_{call}_s"]
                print(f"| {kind} buffer of {2 * n} items of 8 bytes: {what} (median of {args.call_repeats}) |"
                      f" {one:.3f} s | {two:.3f} s | {one / two:.2f}x |")  # fmt: skip
    if "spill" in only:
        print_spill(results, args.spill_items, mb)


def print_spill(results: dict[str, float], n: int, mb: float) -> None:
    item_mb = 0.110
    print()
    print(f"| remote memory tier: each of {n} x 110 KB items read once at random (n2: 64 MiB DRAM) |"
          " items/s | MB/s | vs log (device) |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    cold = results["pass_log_cold_s"]
    rows = [
        ("log, page cache dropped" if results["cache_dropped"] else "log (page cache could not be dropped)", cold),
        ("log, page cache warm", results["pass_log_warm_s"]),
        (f"n3's lent memory ({results['pass_peer_memory_hits']} of {n} from the peer)", results["pass_peer_memory_s"]),
    ]
    for name, seconds in rows:
        print(f"| {name} | {n / seconds:.0f} | {n * item_mb / seconds:.0f} | {cold / seconds:.2f}x |")
    s_log, s_peer = results["spill_sample_log_batches_s"], results["spill_sample_peer_batches_s"]
    print()
    print("| remote memory tier: sample, batch 32 x 110 KB on n2 | batches/s | MB/s | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| misses from the log (page cache warm) | {s_log:.0f} | {s_log * mb:.0f} | 1.00x |")
    print(f"| misses from n3's lent memory | {s_peer:.0f} | {s_peer * mb:.0f} | {s_peer / s_log:.2f}x |")


if __name__ == "__main__":
    raise SystemExit(main())
