"""The `distore` command: mount, umount, status.

Owns argument parsing, the checks a user gets one clear line for (mount point missing or
already mounted, no /dev/fuse, data dir locked, bad size), exit codes (0 ok, 1 failure,
2 bad input) and starting the daemon in the background. The daemon itself is daemon.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from distorefs import __version__, logs, progress, service
from distorefs.errors import ConfigError
from distorefs.units import SIZE_RULE, format_size, parse_size

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
READY_TIMEOUT_S = 120.0


class CliError(Exception):
    """A failure to print as one line; `code` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "distorefs")


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distore", description="distorefs: training data as files")
    parser.add_argument("--version", action="version", version=f"distorefs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    mount = sub.add_parser("mount", help="mount distorefs (single node, embedded default)")
    mount.add_argument("mountpoint", help="an empty directory to mount on")
    mount.add_argument(
        "--data-dir", default=None, help=f"where the log and metadata live (default {default_data_dir()})"
    )
    mount.add_argument(
        "--dram-budget",
        default="1GiB",
        help=f"DRAM cache size, e.g. 512MiB, 4GiB (default 1GiB; at most the machine's memory). Sizes: {SIZE_RULE}",
    )
    mount.add_argument(
        "--nonempty", action="store_true", help="mount over a directory that is not empty (hiding what is in it)"
    )
    mount.add_argument(
        "--foreground", action="store_true",
        help="stay in the foreground; log to stderr (to journald when systemd runs it) unless --log-file",
    )  # fmt: skip
    mount.add_argument(
        "--log-file", default=None, metavar="PATH",
        help="log here, one line per event (default: DATA_DIR/daemon.log, or stderr with --foreground)",
    )  # fmt: skip
    mount.add_argument(
        "--log-rotate", default="16MiB", metavar="SIZE",
        help="rotate the log file at this size, keeping 4 old ones (default 16MiB; 0: never rotate, reopen the "
        "file when logrotate moves it)",
    )  # fmt: skip
    mount.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    mount.add_argument(
        "--debug", action="store_true", help="log at DEBUG, with every failed request (also ENOENT and the like)"
    )
    mount.add_argument(
        "--flush-interval", type=_positive_float, default=1.0, metavar="S",
        help="write dirty DRAM blocks to the log at least this often (default 1 s)",
    )  # fmt: skip
    mount.add_argument(
        "--sync-interval", type=_positive_float, default=5.0, metavar="S",
        help="fsync the log this often: the most closed-but-not-fsynced data a power loss can take (default 5 s)",
    )  # fmt: skip
    mount.add_argument(
        "--compact-interval", type=_positive_float, default=5.0, metavar="S",
        help="look for sparse log segments to compact this often (default 5 s)",
    )  # fmt: skip
    mount.add_argument(
        "--snapshot-interval", type=_positive_float, default=5.0, metavar="S",
        help="how often buffer priorities are persisted (default 5 s)",
    )  # fmt: skip
    mount.add_argument("--segment-size", default="64MiB", help="log segment size (default 64MiB)")
    mount.add_argument(
        "--shm-dir", default="/dev/shm", metavar="DIR",
        help="where buffers' sample.shm makes its shared-memory regions; a missing directory turns the"
        " shared-memory path off, and clients fall back to plain reads (default /dev/shm)",
    )  # fmt: skip
    mount.add_argument(
        "--busy-poll-us", type=int, default=200, metavar="US",
        help="after each request, poll for the next one for up to this many microseconds before sleeping;"
        " the window adapts to the gaps between requests (a client in a tight loop is served without"
        " wake-ups, one that pauses turns it off). Default 200; 0: never poll",
    )  # fmt: skip
    mount.add_argument(
        "--queued-reads-us", type=int, default=300, metavar="US",
        help="read a request already queued on /dev/fuse as soon as the last is answered, without a pass of"
        " the event loop, for up to this many microseconds before the daemon yields to its other work."
        " Default 300; 0: every read waits for the event loop first",
    )  # fmt: skip
    mount.add_argument(
        "--max-waiting-requests", type=int, default=512, metavar="N",
        help="how many requests may wait at once, mount-wide, for a buffer's items or its rate limiter or"
        " a new weights version; one more gets EAGAIN at once, and the mount keeps answering everything"
        " else (default 512)",
    )  # fmt: skip
    mount.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="also serve Prometheus metrics (as .distore/metrics) over HTTP on 127.0.0.1:PORT",
    )
    mount.add_argument(
        "--compaction-reserve",
        default=None,
        help="disk held back from writes so that compaction can run on a full disk (default: 2 segments)",
    )
    mount.add_argument(
        "--wait-timeout", type=_positive_float, default=60.0, metavar="S",
        help="longest a read of weights/<model>/wait blocks before ETIMEDOUT (default 60 s)",
    )  # fmt: skip
    mount.add_argument(
        "--checkpoint-sync-close", action="store_true",
        help="close of a file under checkpoints/ returns only once it is durable (like fsync)",
    )  # fmt: skip
    mount.add_argument(
        "--prefetch-window", default=None, metavar="SIZE",
        help="how far a dataset stream reads ahead, e.g. 512MiB (default: 256MiB or a quarter of the DRAM budget)",
    )  # fmt: skip
    mount.add_argument(
        "--dataset-page-cache", default="auto", metavar="SIZE",
        help="the largest dataset a stream reads whole through the kernel's page cache (default auto: half of "
        "the memory available at the stream's open; 0: only datasets within the prefetch window)",
    )  # fmt: skip
    mount.add_argument(
        "--dataset-dram", default="auto", metavar="SIZE",
        help="the largest dataset of small records (under 4 KB) streams keep in the DRAM cache: its first stream "
        "loads it as it reads, and later epochs are served from there (default auto: half of the DRAM budget; "
        "0: none)",
    )  # fmt: skip
    cluster = mount.add_argument_group("cluster (multi-node; without --cluster the daemon is single-node)")
    cluster.add_argument("--cluster", default=None, metavar="URL", help="etcd endpoint, e.g. http://10.0.0.1:2379")
    cluster.add_argument("--node", default=None, metavar="NAME", help="this node's name (default: the host name)")
    cluster.add_argument(
        "--listen", default="127.0.0.1:0", metavar="HOST:PORT",
        help="where peers reach this daemon (default 127.0.0.1 and a free port)",
    )  # fmt: skip
    cluster.add_argument(
        "--peer-timeout", type=_positive_float, default=5.0, metavar="S",
        help="longest one operation on another node takes before EIO/EAGAIN (default 5 s)",
    )  # fmt: skip
    cluster.add_argument(
        "--lease-ttl", type=int, default=3, metavar="S",
        help="etcd lease of this node: a dead node leaves the cluster after this long (default 3 s)",
    )  # fmt: skip
    cluster.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto", help="peer data transport")
    cluster.add_argument(
        "--cluster-secret-file", default=None, metavar="PATH",
        help="the secret every peer connection proves (mode 600, the same file on every node; default: a secret "
        "kept in etcd, made by the first node)",
    )  # fmt: skip
    cluster.add_argument(
        "--lend-memory", default="0", metavar="SIZE",
        help="DRAM this node keeps for other nodes' cold buffer items, e.g. 8GiB (default 0: lends none)",
    )  # fmt: skip
    mount.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)

    umount = sub.add_parser("umount", help="persist everything, unmount, wait for the daemon to exit")
    umount.add_argument("mountpoint", help="a distorefs mount point")
    umount.add_argument(
        "--timeout", type=_positive_float, default=120.0, metavar="S",
        help="give up waiting for the daemon's persist after S (default 120 s)",
    )  # fmt: skip

    status = sub.add_parser("status", help="show the daemon's state")
    status.add_argument("mountpoint", help="a distorefs mount point")
    status.add_argument("--json", action="store_true", help="print JSON")

    top = sub.add_parser("top", help="a live view of a mount: requests/s, bytes/s, DRAM, lag, busiest buffers")
    top.add_argument("mountpoint", help="a distorefs mount point")
    top.add_argument("--interval", type=_positive_float, default=1.0, metavar="S", help="refresh every S (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame (rates over one interval) and exit")

    install = sub.add_parser(
        "install-service",
        help=f"install the systemd unit {service.UNIT_NAME} and the mount helpers for /etc/fstab (needs root)",
    )
    install.add_argument(
        "--unit-dir", default=service.DEFAULT_UNIT_DIR, help=f"where the unit goes (default {service.DEFAULT_UNIT_DIR})"
    )
    install.add_argument(
        "--sbin-dir", default=service.DEFAULT_SBIN_DIR,
        help=f"where {service.MOUNT_HELPER} and {service.UMOUNT_HELPER} are linked "
        f"(default {service.DEFAULT_SBIN_DIR})",
    )  # fmt: skip
    install.add_argument("--print", action="store_true", help="print the unit and change nothing")
    return parser


# --- mount -------------------------------------------------------------------------------


def check_mountpoint(mountpoint: str, nonempty: bool = False) -> None:
    if not os.path.exists("/dev/fuse"):
        raise CliError("no /dev/fuse: load the fuse module (modprobe fuse) or give the container /dev/fuse")
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        raise CliError("fusermount3 not found: install the fuse3 package")
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        raise CliError(f"mount point {mountpoint} does not exist") from None
    except OSError as exc:
        raise CliError(
            f"mount point {mountpoint} is unusable ({exc.strerror}); a stale mount? try: fusermount3 -u {mountpoint}"
        ) from None
    if not os.path.isdir(mountpoint):
        raise CliError(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint) or _is_mount(mountpoint):
        raise CliError(f"mount point {mountpoint} is already mounted")
    del st
    if not nonempty and os.listdir(mountpoint):
        raise CliError(
            f"mount point {mountpoint} is not empty: its files would be hidden (use --nonempty to mount anyway)"
        )


def _is_mount(path: str) -> bool:
    from distorefs.daemon import mount_device  # (mountinfo's escapes undone, all of them)

    return mount_device(path) is not None


def _cluster_config(args: argparse.Namespace) -> Any:
    from distorefs.errors import ConfigError
    from distorefs.peers.core import ClusterConfig

    if args.cluster is None:
        if args.node is not None:
            raise ConfigError("--node needs --cluster")
        return None
    host, sep, port = args.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen must be HOST:PORT, got {args.listen!r}")
    config = ClusterConfig(
        url=args.cluster,
        node=args.node or socket.gethostname(),
        listen_host=host,
        listen_port=int(port),
        peer_timeout_s=args.peer_timeout,
        lease_ttl_s=args.lease_ttl,
        transport=args.transport,
        lend_bytes=parse_size(args.lend_memory),
        secret_file=None if args.cluster_secret_file is None else os.path.abspath(args.cluster_secret_file),
    )
    config.validate()
    return config


def _daemon_config(args: argparse.Namespace) -> Any:
    from distorefs.daemon import DaemonConfig

    config = DaemonConfig(
        mountpoint=os.path.abspath(args.mountpoint),
        data_dir=os.path.abspath(args.data_dir or default_data_dir()),
        dram_budget_bytes=parse_size(args.dram_budget),
        allow_other=args.allow_other,
        segment_bytes=parse_size(args.segment_size),
        reserve_bytes=None if args.compaction_reserve is None else parse_size(args.compaction_reserve),
        metrics_port=args.metrics_port,
        flush_interval_s=args.flush_interval,
        sync_interval_s=args.sync_interval,
        compact_interval_s=args.compact_interval,
        snapshot_interval_s=args.snapshot_interval,
        wait_timeout_s=args.wait_timeout,
        checkpoint_sync_close=args.checkpoint_sync_close,
        prefetch_window_bytes=None if args.prefetch_window is None else parse_size(args.prefetch_window),
        dataset_page_cache_bytes=None if args.dataset_page_cache == "auto" else parse_size(args.dataset_page_cache),
        dataset_dram_bytes=None if args.dataset_dram == "auto" else parse_size(args.dataset_dram),
        busy_poll_us=args.busy_poll_us,
        queued_reads_us=args.queued_reads_us,
        max_waiting_requests=args.max_waiting_requests,
        shm_dir=os.path.abspath(args.shm_dir),
        cluster=_cluster_config(args),
    )
    config.validate()
    return config


def cmd_mount(args: argparse.Namespace) -> int:
    try:
        config = _daemon_config(args)
        parse_size(args.log_rotate)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    check_mountpoint(args.mountpoint, args.nonempty)
    if args.foreground:
        return run_foreground(config, args)
    return start_background(config, args)


def run_foreground(config: Any, args: argparse.Namespace) -> int:
    import trio

    from distorefs.daemon import serve

    try:
        logs.setup(debug=args.debug, log_file=args.log_file, rotate_bytes=parse_size(args.log_rotate))
    except OSError as exc:
        raise CliError(f"cannot open the log file {args.log_file}: {exc.strerror}") from None
    ready_fd = args.ready_fd

    def ready(message: str) -> None:
        print(message, flush=True)
        service.notify(f"READY=1\nSTATUS={message}")
        if ready_fd is not None:
            os.write(ready_fd, f"READY {message}\n".encode())
            os.close(ready_fd)

    from distorefs.daemon import ShutdownIncomplete

    try:
        trio.run(serve, config, ready)
    except BaseException as exc:
        # Start-up and shutdown failures are one line, also when they come out of the
        # daemon's nursery wrapped in an ExceptionGroup.
        found = _first_of(exc, (ConfigError, ShutdownIncomplete))
        if found is None:
            if not isinstance(exc, KeyboardInterrupt):
                logging.getLogger("distorefs.daemon").critical("the daemon failed", exc_info=exc)
            raise
        if ready_fd is not None and isinstance(found, ConfigError):
            with contextlib.suppress(OSError):
                os.write(ready_fd, f"ERROR {found}\n".encode())
        raise CliError(str(found)) from None
    return EXIT_OK


def _first_of(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """`exc` itself if it is one of `kinds`, else the first such inside its exception groups."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_of(inner, kinds)
            if found is not None:
                return found
    return None


def start_background(config: Any, args: argparse.Namespace) -> int:
    os.makedirs(config.data_dir, mode=0o700, exist_ok=True)
    log_path = args.log_file or os.path.join(config.data_dir, "daemon.log")
    # the daemon logs to log_path itself (rotating it); its stdout and stderr (a crash
    # that logging never saw) go next to it
    out_path = os.path.join(config.data_dir, "daemon.out")
    read_fd, write_fd = os.pipe()
    argv = [
        sys.executable, "-m", "distorefs", "mount", config.mountpoint, "--foreground",
        "--data-dir", config.data_dir, "--dram-budget", str(config.dram_budget_bytes),
        "--segment-size", str(config.segment_bytes),
        "--compaction-reserve", str(config.compaction_reserve_bytes),
        "--flush-interval", str(config.flush_interval_s), "--sync-interval", str(config.sync_interval_s),
        "--compact-interval", str(config.compact_interval_s),
        "--snapshot-interval", str(config.snapshot_interval_s), "--ready-fd", str(write_fd),
        "--log-file", log_path, "--log-rotate", args.log_rotate,
    ]  # fmt: skip
    argv += ["--wait-timeout", str(config.wait_timeout_s), "--busy-poll-us", str(config.busy_poll_us)]
    argv += ["--queued-reads-us", str(config.queued_reads_us)]
    argv += ["--max-waiting-requests", str(config.max_waiting_requests)]
    argv += ["--shm-dir", config.shm_dir]
    if config.checkpoint_sync_close:
        argv.append("--checkpoint-sync-close")
    if config.prefetch_window_bytes is not None:
        argv += ["--prefetch-window", str(config.prefetch_window_bytes)]
    if config.dataset_page_cache_bytes is not None:
        argv += ["--dataset-page-cache", str(config.dataset_page_cache_bytes)]
    if config.dataset_dram_bytes is not None:
        argv += ["--dataset-dram", str(config.dataset_dram_bytes)]
    cluster = config.cluster
    if cluster is not None:
        argv += [
            "--cluster", cluster.url, "--node", cluster.node,
            "--listen", f"{cluster.listen_host}:{cluster.listen_port}",
            "--peer-timeout", str(cluster.peer_timeout_s), "--lease-ttl", str(cluster.lease_ttl_s),
            "--transport", cluster.transport, "--lend-memory", str(cluster.lend_bytes),
        ]  # fmt: skip
        if cluster.secret_file is not None:
            argv += ["--cluster-secret-file", cluster.secret_file]
    if config.allow_other:
        argv.append("--allow-other")
    if args.nonempty:
        argv.append("--nonempty")
    if config.metrics_port is not None:
        argv += ["--metrics-port", str(config.metrics_port)]
    if args.debug:
        argv.append("--debug")
    log_fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with os.fdopen(log_fd, "ab") as log_file:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            pass_fds=(write_fd,), start_new_session=True,
        )  # fmt: skip
    os.close(write_fd)
    line = _read_line(read_fd, READY_TIMEOUT_S)
    os.close(read_fd)
    if line.startswith("READY "):
        print(line[len("READY ") :])
        return EXIT_OK
    if line.startswith("ERROR "):
        proc.wait(timeout=30)
        raise CliError(line[len("ERROR ") :])
    code = proc.poll()
    if code is None:
        proc.terminate()
        raise CliError(f"the daemon did not report ready within {READY_TIMEOUT_S:.0f} s; see {log_path}")
    raise CliError(f"the daemon exited with status {code} before mounting; see {log_path}")


def _read_line(fd: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").split("\n", 1)[0]


# --- umount and status -------------------------------------------------------------------


def read_status(mountpoint: str) -> dict[str, Any]:
    path = os.path.join(mountpoint, ".distore", "status")
    try:
        with open(path, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
            return result
    except FileNotFoundError:
        raise CliError(f"{mountpoint} is not a distorefs mount") from None
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CliError(f"{path} is not valid JSON: {exc}") from None


def wait_pid_exit(pid: int, timeout_s: float, while_waiting: Callable[[], None] | None = None) -> bool:
    """Wait until process `pid` has exited; False on timeout. `while_waiting` is called
    every half second of the wait."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            readable, _, _ = select.select([pidfd], [], [], min(left, 0.5))
            if readable:
                return True
            if while_waiting is not None:
                while_waiting()
    finally:
        os.close(pidfd)


class PersistProgress:
    """What `distore umount` shows while the daemon persists: the bytes left, as the
    daemon writes them into its shutdown report (a bar on a terminal, lines otherwise)."""

    def __init__(self, data_dir: str, pid: int) -> None:
        self._data_dir, self._pid = data_dir, pid
        self._progress: progress.Progress | None = None
        self._out = logging.getLogger(f"distorefs.umount.{pid}")
        self._handler: logging.Handler | None = None

    def __call__(self) -> None:
        report = read_shutdown_report(self._data_dir, self._pid)
        left = report.get("unpersisted_bytes")
        if report.get("error") != "persisting" or not isinstance(left, int) or left <= 0:
            return
        if self._progress is None:
            self._handler = logging.StreamHandler(sys.stderr)
            self._handler.setFormatter(logging.Formatter("distore umount: %(message)s"))
            self._out.addHandler(self._handler)
            self._out.setLevel(logging.INFO)
            self._out.propagate = False
            self._progress = progress.Progress(f"daemon {self._pid} persisting", left, "bytes", self._out, every_s=1.0)
        self._progress.update(self._progress.total - left)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.finish()
        if self._handler is not None:
            self._out.removeHandler(self._handler)


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    if not _is_mount(mountpoint):
        raise CliError(f"{mountpoint} is not mounted")
    status = read_status(mountpoint)
    pid = int(status["pid"])
    result = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "unknown error"
        raise CliError(f"cannot unmount {mountpoint}: {reason}")
    shown = PersistProgress(str(status["data_dir"]), pid)
    try:
        exited = wait_pid_exit(pid, args.timeout, shown)
    finally:
        shown.finish()
    if not exited:
        raise CliError(f"unmounted, but daemon {pid} is still persisting after {args.timeout:.0f} s")
    report = read_shutdown_report(str(status["data_dir"]), pid)
    if not report.get("persisted"):
        left = report.get("unpersisted_bytes", -1)
        what = (
            f"{left} bytes were not persisted"
            if isinstance(left, int) and left >= 0
            else "it left no report of a complete persist"
        )
        raise CliError(f"unmounted, but {what} ({report.get('error') or 'no reason given'}); see the daemon log")
    print(f"distorefs: unmounted {mountpoint}; daemon {pid} persisted everything and exited")
    return EXIT_OK


def read_shutdown_report(data_dir: str, pid: int) -> dict[str, Any]:
    """The report the daemon `pid` wrote as it exited; an empty dict if it wrote none."""
    from distorefs.daemon import SHUTDOWN_REPORT

    try:
        with open(os.path.join(data_dir, SHUTDOWN_REPORT), encoding="utf-8") as f:
            report: dict[str, Any] = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    return report if report.get("pid") == pid else {}


def format_status(status: dict[str, Any]) -> str:
    rows = [
        ("pid", str(status["pid"])),
        ("mountpoint", status["mountpoint"]),
        ("data dir", status["data_dir"]),
        ("DRAM", f"{format_size(status['dram_used_bytes'])} used of {format_size(status['dram_budget_bytes'])}"
                 f" ({format_size(status['dram_dirty_bytes'])} not yet in the log)"),
        ("log", f"{format_size(status['log_bytes'])} in {status['log_segments']} segments,"
                f" {status['log_live_ratio'] * 100:.1f}% live"),
        ("files", f"{status['files']} ({format_size(status['file_bytes'])})"),
        ("directories", str(status["directories"])),
        ("symlinks", str(status["symlinks"])),
        ("uptime", f"{status['uptime_s']:.0f} s"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def cmd_status(args: argparse.Namespace) -> int:
    status = read_status(os.path.abspath(args.mountpoint))
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return EXIT_OK


def cmd_top(args: argparse.Namespace) -> int:
    from distorefs import top

    try:
        top.run(os.path.abspath(args.mountpoint), args.interval, args.once)
    except FileNotFoundError:
        raise CliError(f"{args.mountpoint} is not a distorefs mount") from None
    except OSError as exc:
        raise CliError(f"cannot read the metrics of {args.mountpoint}: {exc.strerror}") from None
    return EXIT_OK


def cmd_install_service(args: argparse.Namespace) -> int:
    try:
        if args.print:
            print(service.unit_text(service.distore_command()), end="")
            return EXIT_OK
        written = service.install(args.unit_dir, args.sbin_dir)
    except service.UsageError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot install into {exc.filename}: {exc.strerror} (run as root?)") from None
    for path in written:
        print(f"installed {path}")
    print(
        "next: systemctl daemon-reload && systemctl enable --now distore@$(systemd-escape --path /mnt/distore)\n"
        f"  or an /etc/fstab line: /var/lib/distorefs/main /mnt/distore {service.FS_TYPE} dram_budget=4GiB,nofail 0 0"
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "mount": cmd_mount, "umount": cmd_umount, "status": cmd_status, "top": cmd_top,
        "install-service": cmd_install_service,
    }  # fmt: skip
    try:
        return handlers[args.command](args)
    except CliError as exc:
        print(f"distore {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


def mount_helper() -> int:
    """The `mount.fuse.distorefs` command that mount(8) runs."""
    try:
        args = service.mount_arguments(sys.argv[1:])
    except service.UsageError as exc:
        print(f"{service.MOUNT_HELPER}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0 if args is None else main(args)


def umount_helper() -> int:
    """The `umount.fuse.distorefs MOUNTPOINT [-flnrv] [-t TYPE]` command that umount(8)
    runs: persist everything and wait for the daemon, like `distore umount`; `-l` (lazy)
    detaches at once and leaves the daemon to persist on its own."""
    args = sys.argv[1:]
    flags = "".join(arg[1:] for arg in args if arg.startswith("-") and arg != "-t")
    positional = [arg for i, arg in enumerate(args) if not arg.startswith("-") and (i == 0 or args[i - 1] != "-t")]
    if len(positional) != 1:
        print(f"usage: {service.UMOUNT_HELPER} MOUNTPOINT [-l]", file=sys.stderr)
        return EXIT_USAGE
    if "l" in flags:
        return subprocess.run(["fusermount3", "-u", "-z", positional[0]], check=False).returncode
    return main(["umount", positional[0]])


if __name__ == "__main__":
    sys.exit(main())
