"""distorefs as a service, with the real tools: systemd's readiness protocol (a notify
socket the test listens on), the unit file through `systemd-analyze verify`, and an
/etc/fstab line through mount(8) and umount(8) with the installed helpers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distorefs import service
from tests.conftest import is_mounted, mounted_at

pytestmark = pytest.mark.mount

DISTORE = [sys.executable, "-m", "distorefs"]


def notify_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    return sock


def test_daemon_tells_systemd_ready_once_mounted_and_stopping_at_unmount(tmp_path: Path) -> None:
    with notify_socket(tmp_path / "notify") as sock:
        with mounted_at(tmp_path / "mnt", tmp_path / "data", env={"NOTIFY_SOCKET": str(tmp_path / "notify")}) as mount:
            message = sock.recv(4096).decode()
            assert "READY=1" in message.splitlines()
            assert is_mounted(mount.path)  # ready means the mount answers
            assert f"STATUS=distorefs: mounted {mount.path}" in message
            (mount.path / "f").write_bytes(b"served")
        stopping = sock.recv(4096).decode()
        assert "STOPPING=1" in stopping.splitlines()


def test_installed_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    assert shutil.which("systemd-analyze"), "scripts/setup.sh installs systemd for systemd-analyze"
    result = subprocess.run(
        [*DISTORE, "install-service", "--unit-dir", str(tmp_path / "units"), "--sbin-dir", str(tmp_path / "sbin")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    unit = tmp_path / "units" / service.UNIT_NAME
    assert f"installed {unit}" in result.stdout
    text = unit.read_text()
    assert "Type=notify" in text
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert os.access(exec_start.split("=", 1)[1].split()[0], os.X_OK)
    for helper in (service.MOUNT_HELPER, service.UMOUNT_HELPER):
        assert os.access(tmp_path / "sbin" / helper, os.X_OK)
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    # verify exits 0 on some bad settings (it only warns), so a clean unit prints nothing
    assert (verify.returncode, verify.stderr.strip()) == (0, "")


def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: the same unit with a bad type is reported."""
    unit = tmp_path / service.UNIT_NAME
    unit.write_text(service.unit_text(service.distore_command()).replace("Type=notify", "Type=bogus"))
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert "bogus" in verify.stderr


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie that no init reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@contextlib.contextmanager
def helpers_installed(unit_dir: Path) -> Iterator[None]:
    """The mount helpers linked into /usr/sbin for the test (where mount(8) looks), and
    removed after unless they were there before."""
    links = [Path(service.DEFAULT_SBIN_DIR) / h for h in (service.MOUNT_HELPER, service.UMOUNT_HELPER)]
    before = {link: os.readlink(link) for link in links if link.is_symlink()}
    subprocess.run([*DISTORE, "install-service", "--unit-dir", str(unit_dir)], check=True, capture_output=True)
    try:
        yield
    finally:
        for link in links:
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            if link in before:
                link.symlink_to(before[link])


@pytest.mark.skipif(os.geteuid() != 0, reason="mount(8) with an fstab line and helpers in /usr/sbin needs root")
def test_fstab_line_mounts_with_mount_and_umount_waits_for_the_persist(tmp_path: Path) -> None:
    mnt, data = tmp_path / "mnt", tmp_path / "data"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    options = "dram_budget=64MiB,noauto,nofail,x-systemd.automount"
    fstab.write_text(f"# a test fstab\n{data} {mnt} {service.FS_TYPE} {options} 0 0\n")
    with helpers_installed(tmp_path / "units"):
        try:
            for round_ in range(2):
                subprocess.run(["mount", "-T", str(fstab), str(mnt)], check=True, capture_output=True, text=True)
                assert is_mounted(mnt)
                status = json.loads((mnt / ".distore" / "status").read_text())
                assert status["dram_budget_bytes"] == 64 * 1024 * 1024
                if round_ == 0:
                    (mnt / "kept.txt").write_bytes(b"through fstab")
                else:
                    assert (mnt / "kept.txt").read_bytes() == b"through fstab"
                result = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, check=True)
                # umount ran the helper: it waited for the daemon's persist and exit
                assert "persisted everything and exited" in result.stdout
                assert not is_mounted(mnt)
                assert process_gone(int(status["pid"]))
        finally:
            if is_mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def test_mount_helper_refuses_an_unknown_option_before_mounting(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    helper = Path(sys.executable).parent / service.MOUNT_HELPER
    result = subprocess.run(
        [str(helper), str(tmp_path / "data"), str(mnt), "-o", "dram_budget=64MiB,frobnicate=3"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "unknown mount option 'frobnicate'" in result.stderr
    assert not is_mounted(mnt)
    assert not (tmp_path / "data").exists()
