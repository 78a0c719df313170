"""The daemon: builds the tiers, stores and fs layer from a DaemonConfig, mounts, runs the
background tasks in one nursery, and on unmount or SIGTERM/SIGINT flushes everything to
the log, commits durably and exits.

Owns the data dir lock (`lock`, flock'ed for the daemon's life) and the order of start-up
and teardown; everything it starts is named. It does not parse the command line
(`cli.py` does) and serves no request itself (`fs/ops.py` does).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import resource
import signal
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import pyfuse3
import trio

from distorefs import compiled, progress, service
from distorefs.errors import ConfigError, DistorefsError
from distorefs.fs import kernel
from distorefs.fs.buffers import MAX_WAITING_REQUESTS, WAITING, BuffersDir
from distorefs.fs.datasets import DatasetsDir
from distorefs.fs.ops import FsOperations
from distorefs.fs.polling import PollWindow
from distorefs.fs.shm import SharedMemory, sweep_stale
from distorefs.fs.shm_sessions import SampleSessions
from distorefs.fs.virtual import MountInfo, VirtualTree
from distorefs.fs.weights import WeightsDir
from distorefs.memory import (
    freeze_loaded_objects,
    full_collections_held,
    gc_statistics,
    keep_freed_memory,
    run_memory_trim,
)
from distorefs.peers.buffers import BufferPeers, BufferSync
from distorefs.peers.checkpoints import CheckpointReplicas, CheckpointSync
from distorefs.peers.core import ClusterConfig, ClusterNode
from distorefs.peers.datasets import DatasetSync
from distorefs.peers.weights import WeightSync
from distorefs.stores.checkpoints import CheckpointPolicy
from distorefs.stores.datasets.dataset import MIN_WINDOW_BYTES
from distorefs.stores.datasets.store import DatasetStore
from distorefs.stores.files import FileStore
from distorefs.stores.owners import OwnerTable
from distorefs.stores.replay import formats, mirror, sumtree
from distorefs.stores.replay.mirror import ArenaBudget
from distorefs.stores.replay.store import BufferStore
from distorefs.stores.tree import PosixTree
from distorefs.stores.weights import WeightStore
from distorefs.tiers import copy_ranges
from distorefs.tiers.blocks import DEFAULT_BLOCK_BYTES, BlockStore
from distorefs.tiers.dram import DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import DEFAULT_SEGMENT_BYTES, NvmeLog

log = logging.getLogger(__name__)

MIN_DRAM_BUDGET_BYTES = 8 * 1024 * 1024
DEFAULT_WINDOW_BYTES = 256 * 1024 * 1024
READ_AHEAD_KB = 1024


MAX_BUSY_POLL_US = 10_000
MAX_QUEUED_READS_US = 10_000
MAX_WAITING_LIMIT = 16_384
MIN_REQUEST_TASKS = 128


def request_tasks(max_waiting: int) -> int:
    """pyfuse3's most worker tasks: each request in progress holds one, also while it
    waits; room for the waits `--max-waiting-requests` allows and as many more for
    everything else. pyfuse3's default of 99 let 99 waiting samples stop the mount
    (design.md, "Requests that wait, bounded"). A task costs a few KiB until its request
    buffer is touched."""
    return max(MIN_REQUEST_TASKS, 2 * max_waiting)


@dataclass(frozen=True)
class DaemonConfig:
    mountpoint: str
    data_dir: str
    dram_budget_bytes: int = 1024**3
    allow_other: bool = False
    block_bytes: int = DEFAULT_BLOCK_BYTES
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    reserve_bytes: int | None = None  # None: two segments (room for compaction on a full disk)
    metrics_port: int | None = None  # also serve Prometheus metrics over HTTP on 127.0.0.1
    flush_interval_s: float = 1.0
    sync_interval_s: float = 5.0
    compact_interval_s: float = 5.0
    compact_min_dead_ratio: float = 0.5
    snapshot_interval_s: float = 5.0
    wait_timeout_s: float = 60.0
    checkpoint_sync_close: bool = False
    prefetch_window_bytes: int | None = None  # None: min(256 MiB, a quarter of the DRAM budget)
    dataset_page_cache_bytes: int | None = None  # streamed whole via the page cache up to this; None: auto
    dataset_dram_bytes: int | None = None  # loaded into the DRAM cache by its streams up to this; None: auto
    busy_poll_us: int = 200  # the most the daemon polls for the next request after one (0: off; fs/polling.py)
    queued_reads_us: int = 300  # a queued request is read without a pass of the event loop for this long (0: off)
    max_waiting_requests: int = MAX_WAITING_REQUESTS  # requests that may wait for items, the rate limiter, a version
    shm_dir: str = "/dev/shm"  # where sample.shm makes its regions (missing: the shm path is off)
    cluster: ClusterConfig | None = None  # None: the single-node embedded default

    def __post_init__(self) -> None:
        object.__setattr__(self, "mountpoint", os.path.abspath(self.mountpoint))
        object.__setattr__(self, "data_dir", os.path.abspath(self.data_dir))

    @property
    def compaction_reserve_bytes(self) -> int:
        return 2 * self.segment_bytes if self.reserve_bytes is None else self.reserve_bytes

    @property
    def window_bytes(self) -> int:
        """How far ahead a dataset stream prefetches (unless its config says otherwise)."""
        if self.prefetch_window_bytes is not None:
            return self.prefetch_window_bytes
        return max(MIN_WINDOW_BYTES, min(DEFAULT_WINDOW_BYTES, self.dram_budget_bytes // 4))

    def validate(self) -> None:
        if self.dram_budget_bytes < MIN_DRAM_BUDGET_BYTES:
            raise ConfigError(f"--dram-budget must be >= 8MiB, got {self.dram_budget_bytes} bytes")
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if self.dram_budget_bytes > memory:
            raise ConfigError(
                f"--dram-budget of {self.dram_budget_bytes} bytes is more than this machine's memory ({memory} bytes)"
            )
        for name in (
            "flush_interval_s",
            "sync_interval_s",
            "compact_interval_s",
            "snapshot_interval_s",
            "wait_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        window = self.prefetch_window_bytes
        if window is not None and not MIN_WINDOW_BYTES <= window <= self.dram_budget_bytes:
            raise ConfigError(f"--prefetch-window must be between 4MiB and the DRAM budget, got {window} bytes")
        if self.dataset_page_cache_bytes is not None and self.dataset_page_cache_bytes < 0:
            raise ConfigError(f"--dataset-page-cache must be auto or a size >= 0, got {self.dataset_page_cache_bytes}")
        if self.dataset_dram_bytes is not None and not 0 <= self.dataset_dram_bytes <= self.dram_budget_bytes:
            raise ConfigError(
                f"--dataset-dram must be auto or a size from 0 to the DRAM budget, got {self.dataset_dram_bytes} bytes"
            )
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 1..65535, got {self.metrics_port}")
        if not 0 <= self.busy_poll_us <= MAX_BUSY_POLL_US:
            raise ConfigError(f"--busy-poll-us must be 0..{MAX_BUSY_POLL_US}, got {self.busy_poll_us}")
        if not 0 <= self.queued_reads_us <= MAX_QUEUED_READS_US:
            raise ConfigError(f"--queued-reads-us must be 0..{MAX_QUEUED_READS_US}, got {self.queued_reads_us}")
        if not 1 <= self.max_waiting_requests <= MAX_WAITING_LIMIT:
            raise ConfigError(f"--max-waiting-requests must be 1..{MAX_WAITING_LIMIT}, got {self.max_waiting_requests}")
        if not 0.0 < self.compact_min_dead_ratio <= 1.0:
            raise ConfigError(f"compact_min_dead_ratio must be in (0, 1], got {self.compact_min_dead_ratio}")


def secure_data_dir(data_dir: str) -> None:
    """Make the data dir private to the daemon's user: the directory 0700 and everything
    in it (metadata database, log, daemon.log) 0600, also when the user made it
    beforehand; files made later are private too (umask 077). ConfigError when the
    directory belongs to another user."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    os.umask(0o077)
    st = os.stat(data_dir)
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"data dir {data_dir} belongs to uid {st.st_uid}, not to this daemon's uid {os.geteuid()}: "
            "choose a directory of your own (its files must be private to the daemon)"
        )
    for root, dirs, files in os.walk(data_dir):
        for name in dirs:
            _restrict(os.path.join(root, name), 0o700)
        for name in files:
            _restrict(os.path.join(root, name), 0o600)
    _restrict(data_dir, 0o700)


def _restrict(path: str, mode: int) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        return
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077 & mode)
        log.info("data dir: %s made private (mode %o)", path, stat.S_IMODE(st.st_mode) & ~0o077 & mode)


@contextlib.contextmanager
def data_dir_lock(data_dir: str) -> Iterator[None]:
    """Hold `data_dir/lock` exclusively; raise ConfigError naming the holder if taken."""
    secure_data_dir(data_dir)
    path = os.path.join(data_dir, "lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"data dir {data_dir} is locked by another daemon (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def mount_device(mountpoint: str) -> str | None:
    """The `major:minor` of the mount at `mountpoint`, read from /proc (no FUSE request)."""
    target = os.path.abspath(mountpoint)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        found = None
        for line in f:
            parts = line.split()
            if len(parts) > 4 and mountinfo_path(parts[4]) == target:
                found = parts[2]
        return found


def mountinfo_path(field: str) -> str:
    """A path as /proc/self/mountinfo writes it, with its escapes (space, tab, newline
    and backslash as `\\ooo`) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def raise_open_files_limit() -> int:
    """Raise this process's limit of open descriptors to its hard limit, and return it.
    The log keeps a descriptor open per segment (two for one its big records are read
    from with O_DIRECT), so a data dir of a terabyte (16,000 segments of 64 MiB) needs
    far more than the usual soft limit of 1,024; the hard limit (524,288 under systemd,
    often 1,048,576) is what an unprivileged process may take."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def raise_read_ahead(mountpoint: str) -> None:
    """Ask the kernel for 1 MiB read-ahead on this mount (needs root; optional: a failure
    is logged, and the mount works at the kernel's default)."""
    try:
        device = mount_device(mountpoint)
        if device is None:
            log.info("read-ahead stays at the kernel default (%s not found in mountinfo)", mountpoint)
            return
        with open(f"/sys/class/bdi/{device}/read_ahead_kb", "w", encoding="ascii") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as exc:
        log.info("read-ahead stays at the kernel default (%s)", exc)


SUPERVISOR_FIRST_PAUSE_S = 1.0
SUPERVISOR_MAX_PAUSE_S = 60.0


class Degradable(Protocol):
    def degrade(self, reason: str) -> None: ...


def load_kernels() -> None:
    """Load the compiled kernels (compiled.py): the sum tree's walks, a batch's counts,
    a priority update's pairs and the gather's copy."""
    sumtree.load_compiled()
    mirror.load_compiled()
    formats.load_compiled()
    copy_ranges.load_compiled()


KERNELS_IDLE_S = 1.0  # a mount this quiet, with a buffer or a dataset in it, loads the compiled kernels
KERNELS_QUIET_REQUESTS = 100  # fewer requests than this in KERNELS_IDLE_S count as quiet


async def load_kernels_when_idle(ops: FsOperations, wanted: Callable[[], bool], idle_s: float = KERNELS_IDLE_S) -> None:
    """Background task: once the mount is up, start the compiled kernels' loading (as
    their first use would) as soon as no request has come for `idle_s` while `wanted()`
    (the data dir holds a replay buffer or a dataset, or a big file has been written to
    the log: its crcs and staging copies then run compiled). A job restarted on its data dir
    (its trainer importing torch meanwhile) then finds them loaded at its first append,
    which otherwise started numba's import and waited on it: appends of up to 26 ms for
    0.3-1 s (benchmarks.md, "Nineteenth session"). Fewer than KERNELS_QUIET_REQUESTS
    requests a KERNELS_IDLE_S count as quiet too: a status poller (bench_million's, a
    readiness probe's) kept the load off for good before. A daemon with only small files
    never loads them; one busy from its start (a cold read right after the mount) loads
    them at their first use, or when it goes quiet."""
    await ops.initialized.wait()
    ready = time.perf_counter()
    seen, since = ops.requests, ready
    while not compiled.loading_started():
        now = time.perf_counter()
        quiet = now - max(ready, ops.request_started)
        # A monitor that reads status ten times a second is light traffic, not a job at
        # work: it must not keep the load away until the job's first sample meets it.
        light = now - since >= idle_s and ops.requests - seen < KERNELS_QUIET_REQUESTS * (now - since) / idle_s
        if (quiet >= idle_s or light) and wanted():
            compiled.start_loading()
            return
        if now - since >= idle_s:
            seen, since = ops.requests, now
        await trio.sleep(idle_s - quiet if quiet < idle_s else idle_s)


def kernels_status() -> dict[str, Any]:
    """`kernels` in `.distore/status`: which compiled kernels run yet (false: their plain
    versions, until the start-up's thread has loaded them, or for good without numba)."""
    return {
        "kernels": {
            "sum_tree": sumtree.KERNELS.loaded,
            "counts": mirror.COUNTS.loaded,
            "priority_pairs": formats.PAIRS.loaded,
            "gather_copy": copy_ranges.KERNELS.loaded,
        }
    }


async def supervised(name: str, task: Callable[[], Awaitable[object]], ops: Degradable) -> None:
    """Run background task `task` so that its failure never ends the daemon: an error is
    logged and the task starts again after a pause (1 s, doubling up to 60 s while it
    keeps failing); a broken invariant (AssertionError) makes the mount read-only
    (degraded, as a request's does) and the task stays stopped. A task that returns is
    done. Cancellation (the daemon stopping) goes through."""
    pause = SUPERVISOR_FIRST_PAUSE_S
    while True:
        started = trio.current_time()
        try:
            await task()
            return
        except AssertionError as exc:
            log.exception("background task %r broke an invariant; the mount is now degraded", name)
            ops.degrade(f"{name}: broken invariant: {exc}")
            return
        except Exception:
            log.exception("background task %r failed; it starts again in %.0f s", name, pause)
        if trio.current_time() - started > 10 * SUPERVISOR_MAX_PAUSE_S:
            pause = SUPERVISOR_FIRST_PAUSE_S  # it had run well for a long while
        await trio.sleep(pause)
        pause = min(2 * pause, SUPERVISOR_MAX_PAUSE_S)


@dataclass
class Daemon:
    """Everything one daemon is made of, built by `assemble` (no mount, no task started)."""

    blocks: BlockStore
    buffers: BufferStore
    weights: WeightStore
    datasets: DatasetStore
    checkpoints: CheckpointPolicy
    ops: FsOperations
    node: ClusterNode | None
    shared: SharedMemory

    def start_tasks(self, config: DaemonConfig, nursery: trio.Nursery) -> None:
        """Start the background tasks, each named and supervised (the cluster node's start
        first): a task that fails never ends the daemon (`supervised`)."""
        blocks = self.blocks

        def start(name: str, fn: Callable[..., Awaitable[object]], *args: object) -> None:
            nursery.start_soon(supervised, name, functools.partial(fn, *args), self.ops, name=name)

        start("flusher", blocks.run_flusher, config.flush_interval_s)
        start("write-behind", blocks.run_write_behind)
        start("syncer", blocks.run_syncer, config.sync_interval_s)
        start("dirty page watch", blocks.run_dirty_watch)
        start("compactor", blocks.run_compactor, config.compact_interval_s, config.compact_min_dead_ratio)
        start("prefetcher", blocks.run_prefetcher)
        start("checkpoint persister", self.checkpoints.run_persister)
        start("kernel invalidations", self.ops.run_invalidations)
        start("after replies", self.ops.run_after_reply)
        if config.busy_poll_us:
            if self.shared.sessions is not None:
                self.shared.sessions.served = self.ops.request_served
            start("busy poll", self.ops.run_busy_poll, PollWindow(config.busy_poll_us / 1e6))
        start("snapshots", self.buffers.run_snapshots, config.snapshot_interval_s)
        start("buffer warm-up", self.buffers.warm_up, config.dram_budget_bytes)
        start("dataset streams", self.datasets.run_streams)
        start(
            "kernels when idle",
            load_kernels_when_idle,
            self.ops,
            lambda: bool(self.buffers.names() or self.datasets.names()) or self.blocks.logged_directly,
        )
        if self.shared.sessions is not None:
            start("shm sampling sessions", self.shared.sessions.serve)
            start("weights' shared copies", self.weights.run_sharing)
        start("memory trim", run_memory_trim, self._accounted_bytes, self.blocks.shed_spares)

    def _accounted_bytes(self) -> int:
        """Memory the daemon holds on purpose: the DRAM cache's, and the log's kept buffers."""
        stats = self.blocks.statistics()
        return stats.dram_used_bytes + stats.dram_reserved_bytes + stats.log_buffer_bytes

    async def close(self, report_fd: int | None = None) -> ShutdownReport:
        """Leave the cluster, stage the last snapshots and persist everything durably,
        showing progress (and writing it to the shutdown report at `report_fd`, where
        `distore umount` follows it). Never raises for a failed persist (a full disk):
        the report says what was left."""
        if self.node is not None:
            await self.node.stop()
        self.shared.close_all()  # regions of opens still held: their clients see the mount go
        if self.shared.sessions is not None:
            self.shared.sessions.close()
        self.weights.close_shared()
        self.buffers.snapshot()
        self.checkpoints.persisted_all()
        error = ""

        def left_now(left: int) -> None:
            if report_fd is not None:
                _write_report(report_fd, ShutdownReport(os.getpid(), False, left, "persisting"), close=False)

        try:
            await progress.watch("persisting", lambda: self.blocks.dirty_bytes, self.blocks.close, log, left_now)
        except (DistorefsError, OSError) as exc:
            error = str(exc)
            log.error("the final persist failed: %s", exc)
        left = self.blocks.dirty_bytes
        return ShutdownReport(os.getpid(), not error and left == 0, left, error)


@dataclass(frozen=True)
class ShutdownReport:
    """How the last shutdown went, for `distore umount` (data_dir/SHUTDOWN_REPORT)."""

    pid: int
    persisted: bool
    unpersisted_bytes: int
    error: str

    def render(self) -> bytes:
        """JSON padded to REPORT_BYTES: written over its own placeholder, it needs no new
        disk space, so it can be written on a full disk."""
        text = json.dumps(asdict(self))[: REPORT_BYTES - 1].encode()
        return text + b" " * (REPORT_BYTES - 1 - len(text)) + b"\n"


REPORT_BYTES = 4096
SHUTDOWN_REPORT = "shutdown.json"


class ShutdownIncomplete(Exception):
    """The daemon unmounted but could not persist everything (the report has the numbers)."""


def _report_fd(data_dir: str) -> int:
    """Open the shutdown report and fill it with a placeholder now, while there is room."""
    fd = os.open(os.path.join(data_dir, SHUTDOWN_REPORT), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.pwrite(fd, ShutdownReport(os.getpid(), False, -1, "running").render(), 0)
    os.fsync(fd)
    return fd


def _write_report(fd: int, report: ShutdownReport, close: bool = True) -> None:
    """Write `report` over the placeholder; the final one (`close`) is fsync'ed and closes `fd`."""
    try:
        os.pwrite(fd, report.render(), 0)
        if close:
            os.fsync(fd)
    except OSError as exc:
        log.error("could not write the shutdown report: %s", exc)
    finally:
        if close:
            os.close(fd)


async def assemble(config: DaemonConfig, nvme_log: NvmeLog, meta: MetaDb, freeze_loaded: bool = False) -> Daemon:
    """Build the tiers, stores, fs adapter and (with --cluster) the cluster node over an
    open log and metadata database, as the daemon runs them; nothing is mounted or started.
    `freeze_loaded` (the daemon's own process): the tree and the block index, once loaded,
    are frozen out of the garbage collector's collections (`memory.freeze_loaded_objects`).

    In a cluster the node comes first: the tiers and stores get what they need from it
    (remote memory, shard peers, replicas) at construction; the kinds are added to it last.
    """
    node = ClusterNode(config.cluster) if config.cluster is not None else None
    replicas = CheckpointReplicas(node) if node is not None else None
    blocks = BlockStore(
        nvme_log, DramCache(config.dram_budget_bytes), meta, config.block_bytes,
        remote=node.remote_memory if node is not None else None,
    )  # fmt: skip
    await blocks.read_tail()  # records persisted log-only after the last commit
    files = FileStore.load(blocks, meta)
    if freeze_loaded:
        log.info("start-up: %d objects frozen for the garbage collector", freeze_loaded_objects())
    buffers = BufferStore.load(blocks, meta, BufferPeers(node) if node is not None else None)
    weights = WeightStore.load(blocks, meta)
    datasets = DatasetStore.load(
        blocks, meta, config.window_bytes, config.dataset_page_cache_bytes, config.dataset_dram_bytes
    )
    blocks.forget_tail()
    await datasets.load_indexes()
    checkpoints = CheckpointPolicy.load(files, meta, config.checkpoint_sync_close, replicas)
    info = MountInfo(os.getpid(), config.data_dir, config.mountpoint, time.time_ns())
    virtual = VirtualTree(info, files, blocks, OwnerTable.load(meta))
    shared = SharedMemory(config.shm_dir, blocks.reserve, blocks.unreserve, config.dram_budget_bytes // 4)
    sweep_stale(config.shm_dir)
    if shared.available:  # buffers' arenas for version 2 sessions: at most half the DRAM budget
        arenas = ArenaBudget(blocks.reserve, blocks.unreserve, config.dram_budget_bytes // 2)
        shared.sessions = SampleSessions(config.shm_dir, arenas)
        if shared.sessions.listen():
            weights.shared_budget = arenas  # weights' shared copies share the arenas' half
    virtual.install(BuffersDir(virtual, buffers, shared))
    virtual.install(WeightsDir(virtual, weights, config.wait_timeout_s, shared.sessions))
    virtual.install(DatasetsDir(virtual, datasets))
    virtual.add_status(weights.statistics)
    virtual.add_status(kernels_status)
    virtual.add_status(gc_statistics)
    virtual.add_status(checkpoints.statistics)
    virtual.add_status(kernel.statistics)
    WAITING.limit = config.max_waiting_requests
    virtual.add_status(WAITING.statistics)
    ops = FsOperations(PosixTree(files, checkpoints), virtual, blocks.disk_stats, config.block_bytes)
    ops.metrics.watch(virtual.status, buffers, weights, node.peers_report if node is not None else None)
    virtual.add_control(b"metrics", ops.metrics.render)
    if node is not None and replicas is not None:
        node.add(BufferSync(node, buffers))
        node.add(WeightSync(node, weights))
        node.add(CheckpointSync(node, checkpoints, replicas))
        node.add(DatasetSync(node, datasets))
        cluster = node
        virtual.add_control(b"peers", lambda: _render(cluster.peers_report()))
    else:
        virtual.add_control(b"peers", lambda: _render(SINGLE_NODE_PEERS))
    return Daemon(blocks, buffers, weights, datasets, checkpoints, ops, node, shared)


def read_queued_requests(ops: FsOperations, window_us: int) -> None:
    """After `pyfuse3.init`: a request already queued on /dev/fuse is read as soon as the
    one before it is answered, without the two passes of the event loop that pyfuse3's
    request loop makes before every read (its read lock, then the wait for the fd), for
    up to `window_us` after the loop last waited for the fd; then it waits (a schedule
    point) as before. One task at a time waits for the fd then, another taking over when
    a handler suspends. `.distore/status` shows it under `queued_reads` (docs/design.md,
    "Queued requests read at once, one reader at a time"). pyfuse3 without
    scripts/pyfuse3-queued-reads.patch cannot: then, or with 0, every read waits first."""
    on = window_us > 0 and hasattr(pyfuse3, "set_queued_reads")
    if on:
        pyfuse3.set_queued_reads(window_us / 1e6)
    elif window_us > 0:
        log.warning("pyfuse3 lacks set_queued_reads (scripts/pyfuse3-queued-reads.patch): every read waits first")

    def status() -> dict[str, object]:
        return {"queued_reads": {"window_us": window_us if on else 0, "requests": pyfuse3.queued_reads() if on else 0}}

    ops.virtual.add_status(status)


async def serve(config: DaemonConfig, ready: Callable[[str], None]) -> None:
    """Mount, serve until unmounted or signalled, then persist everything and return.

    `ready` is called with a one-line message once the mount is up.
    """
    config.validate()
    data_dir = config.data_dir
    log.info("open descriptors: up to %d", raise_open_files_limit())
    if not keep_freed_memory():
        log.info("memory: this libc has no mallopt; freed heap memory may go back to the system at once")
    with data_dir_lock(data_dir):
        started = time.monotonic()
        nvme_log = await trio.to_thread.run_sync(
            NvmeLog.open, os.path.join(data_dir, "log"), config.segment_bytes, config.compaction_reserve_bytes
        )
        meta = MetaDb.open(os.path.join(data_dir, "meta.sqlite"))
        report_fd = _report_fd(data_dir)
        try:
            with progress.Progress("recovery: metadata rows", meta.count_rows(), "rows", log) as loading:
                meta.progress = loading.advance
                with full_collections_held():  # the tree, the index, the buffers' arrays
                    daemon = await assemble(config, nvme_log, meta, freeze_loaded=True)
                meta.progress = None
            await daemon.blocks.commit(durable=True)
            log.info(
                "recovered %s in %.2f s (torn tail dropped: %d bytes)",
                data_dir, time.monotonic() - started, nvme_log.dropped_tail_bytes,
            )  # fmt: skip
            options = set(pyfuse3.default_options) | {"fsname=distorefs", "subtype=distorefs", "noatime"}
            if config.allow_other:
                options.add("allow_other")
            try:
                pyfuse3.init(daemon.ops, config.mountpoint, options)
            except RuntimeError as exc:
                raise ConfigError(f"cannot mount {config.mountpoint}: {exc}") from None
            read_queued_requests(daemon.ops, config.queued_reads_us)
            try:
                async with trio.open_nursery() as nursery:
                    if daemon.node is not None:
                        await daemon.node.start(nursery)
                    daemon.start_tasks(config, nursery)
                    nursery.start_soon(_stop_on_signal, name="signals")
                    if config.metrics_port is not None:
                        daemon.ops.metrics.serve(config.metrics_port)
                    message = f"distorefs: mounted {config.mountpoint} (pid {os.getpid()}, data dir {data_dir})"
                    nursery.start_soon(_ready_after_init, config.mountpoint, daemon.ops.initialized, message, ready)
                    # the compiled kernels load when first asked for (compiled.py: numba's
                    # import holds the GIL for 0.4-2 s); their plain versions run until then
                    compiled.load_on_first_use(load_kernels)
                    await pyfuse3.main(max_tasks=request_tasks(config.max_waiting_requests))
                    service.notify("STOPPING=1\nSTATUS=unmounted; persisting")
                    nursery.cancel_scope.cancel()
            finally:
                pyfuse3.close(unmount=True)
                kernel.detach()
                log.info("unmounted %s; persisting", config.mountpoint)
                with trio.CancelScope(shield=True):
                    report = await daemon.close(report_fd)
                _write_report(report_fd, report)
                report_fd = -1
        finally:
            if report_fd >= 0:
                os.close(report_fd)
            meta.close()
    if not report.persisted:
        raise ShutdownIncomplete(
            f"unmounted, but {report.unpersisted_bytes} bytes were not persisted ({report.error or 'unknown'})"
        )
    log.info("daemon exits cleanly")


SINGLE_NODE_PEERS: dict[str, Any] = {"mode": "single-node", "transport": None, "live_nodes": []}


def _render(report: dict[str, Any]) -> bytes:
    return (json.dumps(report, indent=2) + "\n").encode()


async def _ready_after_init(
    mountpoint: str, initialized: trio.Event, message: str, ready: Callable[[str], None]
) -> None:
    """Raise read-ahead once the kernel has applied FUSE INIT (whose reply sets it no
    higher than 128 KiB), then say the mount is ready. A file keeps the read-ahead its
    mount had when it was opened, so a reader that opened a file before the raise read
    it with 128 KiB read-ahead for good (a cold read right after a mount ran at 750-900
    MB/s, 1.1-1.4 GB/s later); now `distore mount` returns after the raise. The daemon
    never touches its own mount for this: a stat of the mount point in flight (from a
    thread the GIL may hold back) made a quick `fusermount3 -u` fail with EBUSY."""
    await initialized.wait()  # set during INIT; this runs once the reply is written
    await trio.to_thread.run_sync(raise_read_ahead, mountpoint)
    ready(message)


async def _stop_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("got %s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return
