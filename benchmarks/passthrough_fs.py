"""What FUSE passthrough (Linux >= 6.9) gives a reader on this kernel, against the READ
path and tmpfs, in one run: a bare FUSE server written over raw /dev/fuse (libfuse 3.14
has no passthrough API) holds one file and answers every OPEN one of three ways.

    sudo .venv/bin/python benchmarks/passthrough_fs.py [--size-mib 1024] [--rounds 4] [--json PATH]

- `passthrough`: the OPEN's reply carries FOPEN_PASSTHROUGH and a backing file (a memfd
  holding the file's bytes, registered with FUSE_DEV_IOC_BACKING_OPEN): the kernel reads
  the backing file itself, no READ reaches the server.
- `cached`: READs answered from the server's memory with keep_cache, the page cache
  dropped before each read (a hot read from a daemon's DRAM, as bench_posix's).
- `direct`: READs answered with direct_io (no page cache).
- `passthrough-disk` and `disk`: the same file on the local disk (--disk-dir), read cold
  through passthrough and directly, the page cache dropped before each read.

Each reader reads the whole file with 1 MiB `readinto` into a page-aligned buffer. The
server is Python, one request at a time: its `cached` and `direct` rows are below
ceiling_fs.py's (pyfuse3); passthrough has no server in its data path. Needs root (the
mount(2) call, and FUSE_DEV_IOC_BACKING_OPEN needs CAP_SYS_ADMIN). No thresholds here:
docs/benchmarks.md keeps the results (thirty-fifth session).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import mmap
import os
import stat
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_posix

MIB = 1 << 20
IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header
OUT = struct.Struct("<IiQ")  # fuse_out_header
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")  # fuse_init_out, protocol 7.40
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
BACKING_MAP = struct.Struct("<iIQ")  # struct fuse_backing_map
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_PASSTHROUGH = 1 << 0, 1 << 1, 1 << 7
INIT_FLAGS = (1 << 0) | (1 << 5) | (1 << 22) | (1 << 30)  # ASYNC_READ, BIG_WRITES, MAX_PAGES, INIT_EXT
INIT_FLAGS2_PASSTHROUGH = 1 << 5  # FUSE_PASSTHROUGH is bit 37: bit 5 of flags2
OP_LOOKUP, OP_FORGET, OP_GETATTR, OP_OPEN, OP_READ, OP_RELEASE = 1, 2, 3, 14, 15, 18
OP_FLUSH, OP_INIT, OP_OPENDIR, OP_RELEASEDIR, OP_INTERRUPT, OP_DESTROY, OP_BATCH_FORGET = 25, 26, 27, 29, 36, 38, 42


def serve(mountpoint: str, backing_path: str, mode: str) -> None:
    """Mount at `mountpoint` a root holding one file `f`: the bytes of `backing_path`
    (a memfd when it is empty: filled with random MiBs), served as `mode` says."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = int(os.environ["PT_SIZE"])
    if backing_path:
        backing = os.open(backing_path, os.O_RDONLY | os.O_CLOEXEC)
    else:
        backing = os.memfd_create("passthrough-probe")
        os.ftruncate(backing, size)
        chunk = os.urandom(MIB)
        for offset in range(0, size, MIB):
            os.pwrite(backing, chunk, offset)
    memory = mmap.mmap(backing, size, prot=mmap.PROT_READ)
    dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    options = f"fd={dev},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"passthrough-probe", mountpoint.encode(), b"fuse.probe", 6, options) != 0:  # nosuid, nodev
        raise OSError(ctypes.get_errno(), f"mount {mountpoint}")

    def attr(ino: int) -> bytes:
        if ino == 1:
            return ATTR.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 0)
        return ATTR.pack(2, size, size // 512, 0, 0, 0, 0, 0, 0, stat.S_IFREG | 0o644, 1, 0, 0, 0, 4096, 0)

    def reply(unique: int, body: bytes | memoryview = b"", error: int = 0) -> None:
        os.writev(dev, [OUT.pack(OUT.size + len(body), -error, unique), body])

    backing_id = -1
    buf = bytearray(MIB + 64 * 1024)
    view = memoryview(buf)
    print("ready", flush=True)
    while True:
        try:
            n = os.readv(dev, [buf])
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                continue  # an interrupted request
            if exc.errno == errno.ENODEV:
                return  # unmounted
            raise
        _length, op, unique, nodeid, _uid, _gid, _pid, _extlen, _pad = IN.unpack_from(buf)
        body = view[IN.size : n]
        if op == OP_INIT:
            _major, _minor, readahead, flags, flags2 = struct.unpack_from("<IIIII", body)
            want2 = INIT_FLAGS2_PASSTHROUGH if mode.startswith("passthrough") else 0
            if want2 and not flags2 & want2:
                print("this kernel offers no FUSE passthrough", file=sys.stderr, flush=True)
            # max_stack_depth 1: the backing files are on a file system that stacks nothing
            reply(unique, INIT_OUT.pack(7, 40, readahead, INIT_FLAGS & flags, 64, 48, MIB, 1, 256, 0,
                                        want2 & flags2, 1, 0))  # fmt: skip
        elif op == OP_LOOKUP:
            if nodeid == 1 and bytes(body).split(b"\0")[0] == b"f":
                reply(unique, struct.pack("<QQQQII", 2, 0, 60, 60, 0, 0) + attr(2))
            else:
                reply(unique, error=errno.ENOENT)
        elif op == OP_GETATTR:
            reply(unique, struct.pack("<QII", 60, 0, 0) + attr(nodeid))
        elif op == OP_OPEN:
            if mode.startswith("passthrough"):
                if backing_id < 0:
                    arg = ctypes.create_string_buffer(BACKING_MAP.pack(backing, 0, 0), BACKING_MAP.size)
                    backing_id = libc.ioctl(dev, FUSE_DEV_IOC_BACKING_OPEN, arg)
                    if backing_id < 0:
                        print(
                            "FUSE_DEV_IOC_BACKING_OPEN:", os.strerror(ctypes.get_errno()), file=sys.stderr, flush=True
                        )
                        reply(unique, error=errno.EIO)
                        continue
                reply(unique, OPEN_OUT.pack(0, FOPEN_PASSTHROUGH, backing_id))
            else:
                reply(unique, OPEN_OUT.pack(0, FOPEN_DIRECT_IO if mode == "direct" else FOPEN_KEEP_CACHE, 0))
        elif op == OP_READ:
            _fh, offset, want = struct.unpack_from("<QQI", body)
            end = max(offset, min(size, offset + want))
            os.writev(dev, [OUT.pack(OUT.size + end - offset, 0, unique), memoryview(memory)[offset:end]])
        elif op in (OP_RELEASE, OP_FLUSH, OP_RELEASEDIR):
            reply(unique)
        elif op == OP_OPENDIR:
            reply(unique, OPEN_OUT.pack(0, 0, 0))
        elif op == OP_DESTROY:
            reply(unique)
            return
        elif op not in (OP_FORGET, OP_BATCH_FORGET, OP_INTERRUPT):
            reply(unique, error=errno.ENOSYS)


def read_all(path: Path) -> tuple[float, int]:
    """GB/s and bytes of one whole read with 1 MiB readinto into a page-aligned buffer."""
    buf, total = mmap.mmap(-1, MIB), 0
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total / (time.perf_counter() - started) / 1e9, total


def drop_caches() -> None:
    """bench_posix's, which must succeed here: a cold read that found the page cache would be no cold read."""
    if not bench_posix.drop_caches():
        raise PermissionError("dropping the page cache needs root")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--disk-dir", default="/var/tmp")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve", nargs=3, metavar=("MOUNTPOINT", "BACKING", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size_mib * MIB
    if args.serve:
        serve(*args.serve)
        return 0
    work = Path(tempfile.mkdtemp(prefix="passthrough-probe-"))
    on_disk = Path(args.disk_dir) / f"passthrough-probe-{os.getpid()}.dat"
    on_tmpfs = Path("/dev/shm") / f"passthrough-probe-{os.getpid()}.dat"
    chunk = os.urandom(MIB)
    for path in (on_disk, on_tmpfs):
        with open(path, "wb") as f:
            for _ in range(args.size_mib):
                f.write(chunk)
    samples: dict[str, list[float]] = {}
    try:
        for mode, backing in (("passthrough", ""), ("cached", ""), ("direct", ""), ("passthrough-disk", str(on_disk))):
            mountpoint = work / mode
            mountpoint.mkdir()
            env = {**os.environ, "PT_SIZE": str(size)}
            server = subprocess.Popen([sys.executable, __file__, "--serve", str(mountpoint), backing, mode],
                                      stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
            try:
                assert server.stdout is not None
                assert server.stdout.readline().strip() == "ready", mode
                for _ in range(args.rounds):
                    if mode in ("cached", "passthrough-disk"):
                        drop_caches()  # cached: the daemon's memory only; disk: cold
                    rate, total = read_all(mountpoint / "f")
                    assert total == size, (mode, total)
                    samples.setdefault(mode, []).append(rate)
                    samples.setdefault("tmpfs", []).append(read_all(on_tmpfs)[0])
                    if mode == "passthrough-disk":
                        drop_caches()
                        samples.setdefault("disk", []).append(read_all(on_disk)[0])
            finally:
                subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False)
                server.wait(timeout=30)
    finally:
        on_disk.unlink(missing_ok=True)
        on_tmpfs.unlink(missing_ok=True)
        for child in work.iterdir():
            child.rmdir()
        work.rmdir()
    medians = {mode: statistics.median(rates) for mode, rates in samples.items()}
    report = {
        "GBps_rounds": {mode: [round(r, 2) for r in rates] for mode, rates in samples.items()},
        "GBps_median": {mode: round(m, 2) for mode, m in medians.items()},
        "vs_tmpfs": {mode: round(medians[mode] / medians["tmpfs"], 2) for mode in ("passthrough", "cached", "direct")},
        "passthrough_disk_vs_disk": round(medians["passthrough-disk"] / medians["disk"], 2),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
