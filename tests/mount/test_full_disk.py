"""A full data-dir disk, survived in place: ENOSPC for writes and fsyncs, acknowledged data
stays readable, the mount never degrades, writes work again within seconds once space is
freed (inside the mount or outside it), and `distore umount` says so when the final
persist cannot finish. The data dir is a small tmpfs the test mounts itself."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import Mount, fuse_missing, start_daemon

TMPFS_BYTES = 48 << 20
RECOVER_S = 30.0
MIB = 1 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs for the data dir, unmounted afterwards."""
    why = fuse_missing()
    if why:
        pytest.skip(why)
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, capture_output=True)


@pytest.fixture
def full_disk_mount(small_disk: Path, tmp_path: Path) -> Iterator[Mount]:
    mount = start_daemon(
        tmp_path / "mnt", small_disk / "data",
        "--dram-budget", "128MiB", "--segment-size", "4MiB", "--compaction-reserve", "8MiB",
        "--flush-interval", "0.2", "--compact-interval", "0.5",
    )  # fmt: skip
    try:
        yield mount
    finally:
        mount.cleanup()


def write_file(path: Path, size: int, fsync: bool = True, fill: int = 7) -> None:
    """Create `path` with `size` bytes of `fill` in 1 MiB writes, fsync, close; any
    OSError (the first one) comes out, and the descriptor is closed either way."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, size, MIB):
            os.write(fd, bytes([fill]) * min(MIB, size - start))
        if fsync:
            os.fsync(fd)
    except OSError:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    os.close(fd)


def fill_outside(disk: Path) -> Path:
    """Fill the data dir's disk to the last byte from outside the mount."""
    filler = disk / "filler"
    with open(filler, "wb") as f, pytest.raises(OSError) as excinfo:  # noqa: PT012 - until the disk says no
        while True:
            f.write(b"\0" * MIB)
            f.flush()
    assert excinfo.value.errno == errno.ENOSPC
    return filler


def enospc(fn: Callable[[], object]) -> None:
    with pytest.raises(OSError) as excinfo:
        fn()
    assert excinfo.value.errno == errno.ENOSPC


def not_degraded(mount: Mount) -> None:
    assert mount.proc.poll() is None, "the daemon died"
    status = mount.status()
    assert status["degraded"] is False, status["degraded_reason"]


def writes_again(mount: Mount, name: str, size: int) -> float:
    """Seconds until a whole file of `size` bytes can be written and fsync'ed again."""
    started = time.monotonic()
    while True:
        try:
            write_file(mount.path / name, size)
            return time.monotonic() - started
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            assert time.monotonic() - started < RECOVER_S, f"still ENOSPC after {RECOVER_S} s"
            time.sleep(0.2)


def test_a_full_disk_is_enospc_keeps_acknowledged_data_and_recovers_when_files_are_removed(
    full_disk_mount: Mount,
) -> None:
    mount = full_disk_mount
    pid = mount.proc.pid
    write_file(mount.path / "kept", 12 * MIB, fill=1)  # fsync'ed: acknowledged
    enospc(lambda: write_file(mount.path / "too-big", 64 * MIB, fill=2))
    not_degraded(mount)
    assert (mount.path / "kept").read_bytes() == bytes([1]) * (12 * MIB)
    os.unlink(mount.path / "too-big")
    writes_again(mount, "after", 8 * MIB)
    assert (mount.path / "after").read_bytes() == bytes([7]) * (8 * MIB)
    assert (mount.path / "kept").read_bytes() == bytes([1]) * (12 * MIB)
    not_degraded(mount)
    assert mount.proc.pid == pid  # no restart
    assert mount.proc.poll() is None
    assert mount.unmount() == 0


def test_space_freed_outside_the_mount_is_used_again_without_a_restart(
    full_disk_mount: Mount, small_disk: Path
) -> None:
    mount = full_disk_mount
    write_file(mount.path / "kept", 4 * MIB, fill=1)
    filler = fill_outside(small_disk)
    enospc(lambda: write_file(mount.path / "blocked", 4 * MIB))
    not_degraded(mount)
    assert (mount.path / "kept").read_bytes() == bytes([1]) * (4 * MIB)
    filler.unlink()
    writes_again(mount, "after", 4 * MIB)
    assert mount.unmount() == 0


def test_umount_fails_and_says_how_much_was_not_persisted(full_disk_mount: Mount, small_disk: Path) -> None:
    mount = full_disk_mount
    fill_outside(small_disk)
    # written into DRAM; the close cannot log it (ENOSPC), so it stays held in the daemon
    with pytest.raises(OSError) as excinfo:
        write_file(mount.path / "held", 6 * MIB, fsync=False)
    assert excinfo.value.errno == errno.ENOSPC
    result = subprocess.run(
        [sys.executable, "-m", "distorefs", "umount", str(mount.path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0, result.stdout
    assert "bytes were not persisted" in result.stderr, result.stderr
    assert "the log's disk is full" in result.stderr, result.stderr  # the reason, not "unknown"
    assert "persisted everything" not in result.stdout
    assert mount.proc.wait(timeout=60) != 0
    log = (mount.data_dir.parent / f"{mount.data_dir.name}.daemon.log").read_text()
    assert "the final persist failed: the log's disk is full" in log
    assert "the daemon failed" not in log  # (a CRITICAL traceback: the error came in an ExceptionGroup)
