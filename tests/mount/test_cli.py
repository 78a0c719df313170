"""The distore command: background mount, status, umount, and one clear line per error."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from distorefs import cli
from distorefs.daemon import READ_AHEAD_KB, mount_device
from tests.conftest import Mount, fuse_missing, is_mounted, mounted_at, start_daemon

pytestmark = pytest.mark.mount


def distore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distorefs", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def background(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A mount point and data dir; whatever the test mounts there comes down at the end."""
    why = fuse_missing()
    if why:
        pytest.skip(why)
    mnt, data = tmp_path / "mnt", tmp_path / "data"
    mnt.mkdir()
    yield mnt, data
    if is_mounted(mnt):
        pid = None
        try:
            pid = json.loads((mnt / ".distore" / "status").read_text())["pid"]
        except (OSError, ValueError):
            pass
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        if pid is not None:
            cli.wait_pid_exit(pid, 30)


def test_background_mount_status_and_umount(background: tuple[Path, Path]) -> None:
    mnt, data = background
    result = distore("mount", str(mnt), "--data-dir", str(data), "--dram-budget", "64MiB")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"distorefs: mounted {mnt}")
    (mnt / "checkpoints" / "f").write_bytes(b"payload")

    status = distore("status", str(mnt))
    assert status.returncode == 0
    for label in ("pid", "data dir", "DRAM", "log", "files", "directories"):
        assert label in status.stdout
    assert "64.0 MiB" in status.stdout
    as_json = json.loads(distore("status", str(mnt), "--json").stdout)
    assert as_json["data_dir"] == str(data)
    assert as_json["files"] == 1
    pid = as_json["pid"]

    result = distore("umount", str(mnt))
    assert result.returncode == 0, result.stderr
    assert not is_mounted(mnt)
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()

    result = distore("mount", str(mnt), "--data-dir", str(data))
    assert result.returncode == 0, result.stderr
    assert (mnt / "checkpoints" / "f").read_bytes() == b"payload"
    assert distore("umount", str(mnt)).returncode == 0


def test_umount_of_a_busy_mount_fails_and_leaves_it_mounted(background: tuple[Path, Path]) -> None:
    mnt, data = background
    assert distore("mount", str(mnt), "--data-dir", str(data)).returncode == 0
    with open(mnt / "checkpoints" / "open", "wb"):
        result = distore("umount", str(mnt))
        assert result.returncode == 1
        assert result.stderr.startswith(f"distore umount: cannot unmount {mnt}")
        assert len(result.stderr.strip().splitlines()) == 1
        assert is_mounted(mnt)
    assert distore("umount", str(mnt)).returncode == 0


def test_a_removed_data_dir_leaves_df_status_and_umount_working(background: tuple[Path, Path]) -> None:
    """A cleaner (tmpfiles, a script) that removes the data dir under a running daemon:
    `df` and status read the disk through a descriptor the log holds, not the path, so
    they still answer, and `distore umount` (which reads status first) brings it down."""
    mnt, data = background
    assert distore("mount", str(mnt), "--data-dir", str(data)).returncode == 0
    (mnt / "f").write_bytes(b"kept in DRAM")
    pid = json.loads(distore("status", str(mnt), "--json").stdout)["pid"]
    shutil.rmtree(data)

    st = os.statvfs(mnt)
    assert st.f_blocks > 0
    assert st.f_bavail > 0
    status = json.loads(distore("status", str(mnt), "--json").stdout)
    assert status["disk_free_bytes"] > 0
    assert status["internal_errors"] == 0
    assert not status["degraded"]
    assert (mnt / "f").read_bytes() == b"kept in DRAM"

    result = distore("umount", str(mnt))
    assert "cannot read" not in result.stderr
    assert not is_mounted(mnt)
    assert cli.wait_pid_exit(pid, 30)


def test_mount_errors_are_one_line_and_nonzero(mounted: Mount, tmp_path: Path) -> None:
    cases = [
        (("mount", str(tmp_path / "missing")), 1, f"distore mount: mount point {tmp_path / 'missing'} does not exist"),
        (("mount", str(mounted.path), "--data-dir", str(tmp_path / "d")), 1,
         f"distore mount: mount point {mounted.path} is already mounted"),
        (("mount", str(tmp_path), "--dram-budget", "5XB"), 2,
         "distore mount: unknown size unit 'XB' in '5XB' (K, KB, M, MB, G, GB, T, TB are powers of 1000;"
         " Ki, KiB, Mi, MiB, Gi, GiB, Ti, TiB powers of 1024)"),
        (("mount", str(tmp_path), "--dram-budget", "1MiB"), 2,
         "distore mount: --dram-budget must be >= 8MiB, got 1048576 bytes"),
        (("umount", str(tmp_path)), 1, f"distore umount: {tmp_path} is not mounted"),
        (("status", str(tmp_path)), 1, f"distore status: {tmp_path} is not a distorefs mount"),
    ]  # fmt: skip
    for args, code, message in cases:
        result = distore(*args)
        assert (result.returncode, result.stderr.strip()) == (code, message), args
        assert result.stdout == ""


def test_a_non_empty_mount_point_and_a_budget_over_memory_are_refused(tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "left-here").write_text("x")
    result = distore("mount", str(busy), "--data-dir", str(tmp_path / "d"))
    assert (result.returncode, result.stderr.strip()) == (
        1,
        f"distore mount: mount point {busy} is not empty: its files would be hidden (use --nonempty to mount anyway)",
    )
    result = distore("mount", str(tmp_path / "d2"), "--dram-budget", "100000TiB")
    assert result.returncode == 2
    assert result.stderr.startswith(
        "distore mount: --dram-budget of 109951162777600000 bytes is more than this machine"
    )
    assert len(result.stderr.strip().splitlines()) == 1
    result = distore("mount", str(tmp_path / "d3"), "--busy-poll-us", "-5")
    assert (result.returncode, result.stderr.strip()) == (2, "distore mount: --busy-poll-us must be 0..10000, got -5")
    result = distore("mount", str(tmp_path / "d3"), "--queued-reads-us", "20000")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "distore mount: --queued-reads-us must be 0..10000, got 20000",
    )
    result = distore("mount", str(tmp_path / "d3"), "--max-waiting-requests", "0")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "distore mount: --max-waiting-requests must be 1..16384, got 0",
    )
    result = distore("mount", str(tmp_path / "d4"), "--dataset-page-cache", "most")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "distore mount: not a size: 'most' (examples: 4096, 512MiB, 4GiB)",
    )
    result = distore("mount", str(tmp_path / "d5"), "--dram-budget", "64MiB", "--dataset-dram", "65MiB")
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "distore mount: --dataset-dram must be auto or a size from 0 to the DRAM budget, got 68157440 bytes",
    )


def test_a_failure_inside_the_daemons_nursery_is_one_line_too(tmp_path: Path) -> None:
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = distore(
        "mount", str(mount_point), "--data-dir", str(tmp_path / "d"),
        "--cluster", "http://127.0.0.1:9", "--node", "n1", "--peer-timeout", "1",
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.startswith("distore mount: cannot join the cluster at http://127.0.0.1:9: ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "ExceptionGroup" not in result.stderr
    assert not os.path.ismount(mount_point)


def test_data_dir_locked_by_another_daemon(mounted: Mount, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    result = distore("mount", str(other), "--data-dir", str(mounted.data_dir))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"distore mount: data dir {mounted.data_dir} is locked by another daemon (pid {mounted.proc.pid})"
    )
    assert not is_mounted(other)


def test_missing_dev_fuse_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # /dev/fuse cannot be taken away from a running machine; hide it from this check only.
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if p == "/dev/fuse" else real_exists(p))
    assert cli.main(["mount", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        "distore mount: no /dev/fuse: load the fuse module (modprobe fuse) or give the container /dev/fuse"
    )


def read_as_nobody(path: Path) -> int:
    """Read `path` in a child running as nobody; return 0 (read), 13 (EACCES) or 1 (other)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            path.read_bytes()
            code = 0
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A world-traversable directory (pytest's tmp dirs are 0700, closed to other users)."""
    path = Path(tempfile.mkdtemp(prefix="distorefs-allow-other-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_allow_other_lets_other_users_in_and_the_kernel_checks_modes(open_dir: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to switch to another user")
    why = fuse_missing()
    if why:
        pytest.skip(why)
    with mounted_at(open_dir / "mnt", open_dir / "data", "--allow-other") as mount:
        public, private = mount.path / "checkpoints" / "public", mount.path / "checkpoints" / "private"
        public.write_text("for everyone")
        private.write_text("secret")
        os.chmod(public, 0o644)
        os.chmod(private, 0o600)
        assert read_as_nobody(public) == 0
        assert read_as_nobody(private) == 13
    # Without --allow-other, FUSE keeps every other user out, whatever the modes say.
    with mounted_at(open_dir / "mnt", open_dir / "data") as mount:
        assert read_as_nobody(mount.path / "checkpoints" / "public") == 13


def test_background_daemon_logs_a_failed_request_as_one_line_without_the_data(background: tuple[Path, Path]) -> None:
    mnt, data = background
    assert distore("mount", str(mnt), "--data-dir", str(data), "--log-rotate", "64KiB").returncode == 0
    (mnt / "buffers" / "b").mkdir()
    with pytest.raises(OSError) as refused:
        (mnt / "buffers" / "b" / "config").write_text('{"capacity": "SECRET-VALUE"')
    assert refused.value.errno == errno.EINVAL
    assert distore("umount", str(mnt)).returncode == 0
    lines = (data / "daemon.log").read_text().splitlines()
    failed = [line for line in lines if "request failed:" in line]
    assert len(failed) >= 1
    assert " WARNING distorefs.fs.ops: request failed: " in failed[0]
    assert "-> EINVAL (Invalid argument)" in failed[0]
    assert "SECRET-VALUE" not in (data / "daemon.log").read_text()
    assert any("recovered" in line for line in lines)  # the daemon's own lines go to daemon.log ...
    assert "recovered" not in (data / "daemon.out").read_text()  # ... and only a crash to daemon.out


def test_top_once_shows_requests_bytes_and_the_busiest_buffer(background: tuple[Path, Path]) -> None:
    mnt, data = background
    assert distore("mount", str(mnt), "--data-dir", str(data)).returncode == 0
    buffer = mnt / "buffers" / "busy"
    buffer.mkdir()
    # The writer appends until told to stop (at most 60 s), so that it is still appending
    # during top's interval whatever the two processes' start-up times: a fixed 400
    # appends could all land before top's first reading (0.1 s of appends).
    stop = data.parent / "stop-writer"
    writer = subprocess.Popen(
        [sys.executable, "-c",
         "import os, time\nfrom distorefs import client\nend = time.monotonic() + 60\n"
         f"while not os.path.exists({str(stop)!r}) and time.monotonic() < end:\n"
         f"    client.append({str(buffer)!r}, [b'x' * 100] * 4)\n"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while json.loads((buffer / "stats").read_text())["inserts"] == 0:  # until the writer has begun
            assert writer.poll() is None, "the writer ended before appending"
            assert time.monotonic() < deadline, "the writer never appended"
            time.sleep(0.01)
        result = distore("top", str(mnt), "--once", "--interval", "1")
    finally:
        stop.touch()
        writer.wait(timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("DRAM", "log", "lag", "requests/s", "bytes/s", "busiest buffers"):
        assert label in out
    row = next(line for line in out.splitlines() if " busy " in line)
    inserts = int(row.split("│")[3].strip().replace(",", ""))
    assert inserts > 0
    assert distore("umount", str(mnt)).returncode == 0


def test_top_of_a_directory_that_is_not_a_mount_says_so(tmp_path: Path) -> None:
    result = distore("top", str(tmp_path), "--once")
    assert result.returncode == 1
    assert result.stderr.strip() == f"distore top: {tmp_path} is not a distorefs mount"


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a mount's read-ahead in /sys needs root")
def test_read_ahead_is_raised_before_the_mount_is_ready_and_a_quick_umount_is_never_busy(tmp_path: Path) -> None:
    for round_ in range(5):  # the daemon never touches its own mount: an unmount at once goes through
        mount = start_daemon(tmp_path / f"mnt {round_}", tmp_path / f"data{round_}")  # (a space: mountinfo's \\040)
        try:
            if round_ == 0:  # raised once the ready line is out, before any request of ours
                device = mount_device(str(mount.path))
                assert device is not None
                assert Path(f"/sys/class/bdi/{device}/read_ahead_kb").read_text().strip() == str(READ_AHEAD_KB)
            assert mount.unmount() == 0
        finally:
            mount.cleanup()
