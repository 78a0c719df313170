"""Shared fixtures: real distorefs mounts that always come down, even on failure."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import multiprocessing
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import trio

from distorefs.daemon import mount_device

READY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0


def fuse_missing() -> str | None:
    """Why a real mount cannot run here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if shutil.which("fusermount3") is None:
        return "fusermount3 not installed (Debian package fuse3)"
    return None


def is_mounted(path: Path) -> bool:
    """Whether `path` is a mount point now (mountinfo, its escapes undone: a mount point
    with a space in its name, as test_cli makes, is found too)."""
    return mount_device(str(path.resolve())) is not None


@dataclass
class Mount:
    """One running daemon in the foreground and its mount point."""

    path: Path
    data_dir: Path
    proc: subprocess.Popen[bytes]
    ready_line: str
    extra_args: list[str] = field(default_factory=list)

    def status(self) -> dict[str, object]:
        result: dict[str, object] = json.loads((self.path / ".distore" / "status").read_text())
        return result

    def unmount(self) -> int:
        """fusermount3 -u, then wait for the daemon; returns its exit status."""
        subprocess.run(["fusermount3", "-u", str(self.path)], check=True, capture_output=True)
        code = self.proc.wait(timeout=EXIT_TIMEOUT_S)
        self._close_pipe()
        return code

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def kill9(self) -> None:
        """kill -9 the daemon and remove the dead mount."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=EXIT_TIMEOUT_S)
        self._close_pipe()
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False, capture_output=True)

    def cleanup(self) -> None:
        """Force everything down (used on failure paths)."""
        if self.proc.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False, capture_output=True)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if is_mounted(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False, capture_output=True)
        self._close_pipe()


def start_daemon(path: Path, data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Mount:
    """Run `distore mount --foreground` and wait, under a deadline, for its ready line."""
    path.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"{data_dir.name}.daemon.log"
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")  # noqa: SIM115 - the daemon owns it for its lifetime
    if not any(arg.startswith("--compaction-reserve") for arg in extra):
        # pytest keeps the last runs' tmp dirs: a 4 MiB ballast per daemon instead of the
        # default 2 segments (128 MiB) keeps a run's disk use small; the mechanism is the same
        extra = ("--compaction-reserve", "4MiB", *extra)
    proc = subprocess.Popen(
        [sys.executable, "-m", "distorefs", "mount", str(path), "--foreground", "--data-dir", str(data_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=log_file,
        stdin=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )
    log_file.close()
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        readable, _, _ = select.select([proc.stdout], [], [], max(left, 0))
        if not readable:
            break
        chunk = os.read(proc.stdout.fileno(), 1)
        if not chunk:
            break
        line += chunk
    if b"mounted" not in line:
        mount = Mount(path, data_dir, proc, line.decode())
        mount.cleanup()
        pytest.fail(f"daemon did not get ready: {line!r}; log:\n{log_path.read_text()[-3000:]}")
    return Mount(path, data_dir, proc, line.decode().strip(), list(extra))


@contextlib.contextmanager
def mounted_at(path: Path, data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[Mount]:
    """A mount for the block's duration; unmounts cleanly and checks the exit status."""
    mount = start_daemon(path, data_dir, *extra, env=env)
    try:
        yield mount
    except BaseException:
        mount.cleanup()
        raise
    if mount.proc.poll() is None:
        try:
            code = mount.unmount()
        except BaseException:
            mount.cleanup()
            raise
        assert code == 0, f"daemon exited with {code}"
    else:
        mount.cleanup()


@pytest.fixture(scope="session", autouse=True)
def library_logs_in_pytest_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stable-Baselines3 makes an SB3-<time> folder in /tmp at every learn() unless told where:
    point it into pytest's own temporary tree, which pytest prunes, so runs leave nothing in /tmp."""
    before = os.environ.get("SB3_LOGDIR")
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3-logs"))
    yield
    if before is None:
        os.environ.pop("SB3_LOGDIR", None)
    else:
        os.environ["SB3_LOGDIR"] = before


@pytest.fixture(scope="module")
def mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One distorefs mount shared by a test module."""
    why = fuse_missing()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("mnt")
    with mounted_at(base / "mnt", base / "data", "--dram-budget", "256MiB") as mount:
        yield mount


@pytest.fixture
def mount_factory(tmp_path: Path) -> Iterator[object]:
    """Start daemons on demand in this test (remounts, crashes); all come down at the end."""
    why = fuse_missing()
    if why:
        pytest.skip(why)
    started: list[Mount] = []

    def start(*extra: str, data_dir: Path | None = None) -> Mount:
        mount = start_daemon(tmp_path / "mnt", data_dir or tmp_path / "data", *extra)
        started.append(mount)
        return mount

    yield start
    for mount in started:
        mount.cleanup()


@contextlib.contextmanager
def dir_for_test(parent: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A directory named after the running test under `parent`, removed afterwards."""
    path = parent / request.node.name.replace("[", "_").replace("]", "_")
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
def scratch(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory inside the shared mount for one test."""
    with dir_for_test(mounted.path / "t", request) as path:
        yield path


def wait_for(check: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> object:
    """Poll `check` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.02)


def wait_blocked_in_read(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until process `pid` sleeps inside a read(2) (syscall 0 on x86-64 and 63 on
    arm64, as /proc/PID/syscall shows): the request has reached the daemon and waits there."""
    read_nr = {"x86_64": "0", "aarch64": "63"}[os.uname().machine]
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"/proc/{pid}/syscall", encoding="ascii") as f:
            fields = f.read().split()
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if fields and fields[0] == read_nr and state == "S":
            return
        assert time.monotonic() < deadline, f"process {pid} never blocked in read: {fields[:1]} {state}"
        time.sleep(0.01)


def blocked_read(path: str, queue: multiprocessing.Queue[str], reads_first: int = 0) -> None:
    """Child process body: after `reads_first` reads, one read that is expected to block;
    reports "reading", then how it ended: "interrupted" by SIGUSR1, "read returned", or
    "error N"."""

    class Stop(Exception):
        pass

    def on_signal(signum: int, frame: object) -> None:
        raise Stop

    signal.signal(signal.SIGUSR1, on_signal)
    fd = os.open(path, os.O_RDONLY)
    for _ in range(reads_first):
        os.read(fd, 1 << 20)
    queue.put("reading")
    try:
        os.read(fd, 1 << 20)
        queue.put("read returned")
    except Stop:
        queue.put("interrupted")
    except OSError as exc:
        queue.put(f"error {exc.errno}")
    finally:
        os.close(fd)


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm), the reference for byte-for-byte comparisons."""
    base = Path("/dev/shm")
    if not base.is_dir():
        pytest.skip("/dev/shm (tmpfs) is not available")
    path = base / f"distorefs-ref-{os.getpid()}-{tmp_path.name}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "distributed_dqn.py"


def episode_returns(out: Path) -> list[float]:
    """The returns of the episodes that the actors of docs/examples/distributed_dqn.py
    finished, in time order: the example's own reading of its actors' CSVs in `out`
    (its module imports only numpy at the top; torch and gymnasium load in its processes)."""
    spec = importlib.util.spec_from_file_location("distributed_dqn", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return [ret for _at, ret in example.episodes(out)]


def first_episodes(out: Path, count: int) -> list[float]:
    """The returns of the first `count` episodes of the example's actors."""
    returns = episode_returns(out)
    assert len(returns) >= count
    return returns[:count]


def best_run_of_episodes(out: Path, count: int) -> float:
    """The highest mean return of `count` episodes in a row of the example's actors."""
    returns = np.array(episode_returns(out))
    assert len(returns) >= count
    return float(np.convolve(returns, np.ones(count) / count, mode="valid").max())


def daemon_cpu_s(mount: Mount) -> float:
    """The CPU seconds (user and system) the mount's daemon has used so far."""
    fields = Path(f"/proc/{mount.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fuse_requests(mount: Mount, op: str) -> int:
    """FUSE requests of kind `op` ("getxattr", "read", "release" ...) the daemon has
    answered so far, whatever their outcome. The kernel asks a GETXATTR before each
    write() that goes through the page cache, none before a direct one."""
    total = 0
    for line in (mount.path / ".distore" / "metrics").read_text().splitlines():
        if line.startswith("distorefs_requests_total{") and f'op="{op}"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def data_requests(mount: Mount, kind: str, op: str) -> int:
    """READ (`op` "read") or WRITE requests of one kind of file ("buffers", "tree" ...)
    the daemon has served so far."""
    labels = (f'kind="{kind}"', f'op="{op}"')
    for line in (mount.path / ".distore" / "metrics").read_text().splitlines():
        if line.startswith("distorefs_data_request_seconds_count{") and all(label in line for label in labels):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"no data request metric for {kind} {op}")


class Ticker:
    """A task that counts its passes through the scheduler."""

    def __init__(self) -> None:
        self.passes = 0

    async def run(self) -> None:
        while True:
            self.passes += 1
            await trio.lowlevel.checkpoint()

    async def runs_during(self, call: Callable[[], Awaitable[None]], tries: int = 50) -> bool:
        """Whether this task ran while `call()` was awaited up to `tries` times. trio runs
        the tasks of one pass in either order, so one schedule point lets another task run
        with a chance of one half: 50 of them fail to with a chance of 2**-50."""
        before = self.passes
        for _ in range(tries):
            await call()
            if self.passes > before:
                return True
        return False


def wait_in_samples(buffer: Path, readers: int) -> tuple[list[object], list[threading.Thread]]:
    """`readers` threads, each in a blocking read of `buffer`'s `sample` (5 items needed,
    none there, 60 s): their outcomes (bytes, or an errno) and the threads."""
    (buffer / "config").write_text(json.dumps({"min_size_to_sample": 5, "sample_timeout": 60}))
    outcomes: list[object] = []

    def sample() -> None:
        fd = os.open(buffer / "sample", os.O_RDONLY)
        try:
            outcomes.append(os.read(fd, 1 << 20))
        except OSError as exc:
            outcomes.append(exc.errno)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=sample, daemon=True) for _ in range(readers)]
    for thread in threads:
        thread.start()
    return outcomes, threads


def end_the_waits(buffer: Path, threads: list[threading.Thread]) -> None:
    """Five appends, which end every wait of `wait_in_samples`; then its threads, joined (bounded)."""
    for i in range(5):
        (buffer / "append").write_bytes(b"item-%d" % i)
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a sample read did not return within 60 s"
