"""mount(8)'s command line and -o options turned into `distore mount` arguments, and the
systemd notify message, without a mount."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from distorefs import service


def test_fstab_options_become_distore_mount_arguments() -> None:
    args = service.mount_arguments(
        ["/var/lib/distorefs/main", "/mnt/distore", "-o", "rw,noauto,nofail,_netdev,x-systemd.automount,"
         "dram_budget=4GiB,allow_other,metrics_port=9100,cluster=http://10.0.0.1:2379", "-t", "fuse.distorefs"]
    )  # fmt: skip
    assert args == [
        "mount", "/mnt/distore", "--data-dir", "/var/lib/distorefs/main", "--dram-budget", "4GiB", "--allow-other",
        "--metrics-port", "9100", "--cluster", "http://10.0.0.1:2379",
    ]  # fmt: skip


def test_a_fake_mount_runs_nothing() -> None:
    assert service.mount_arguments(["/d", "/m", "-f", "-o", "dram_budget=1GiB"]) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/d", "/m", "-o", "frobnicate"], "unknown mount option 'frobnicate'"),
        (["/d", "/m", "-o", "allow_other=1"], "unknown mount option 'allow_other'"),
        (["/d", "/m", "-o", "dram_budget"], "unknown mount option 'dram_budget'"),
        (["/d", "/m", "-o", "ro"], "read-write only"),
        (["/d", "/m", "-t", "fuse.sshfs"], "is not fuse.distorefs"),
        (["/m"], "usage"),
        (["/d", "/m", "-o"], "-o needs a value"),
        (["/d", "/m", "-x"], "unknown flag -x"),
        (["/d", "/m", "-r"], "read-write only"),
    ],
)
def test_a_bad_mount_command_line_is_refused_with_its_reason(argv: list[str], message: str) -> None:
    with pytest.raises(service.UsageError, match=message):
        service.mount_arguments(argv)


def test_notify_sends_one_datagram_to_the_notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "n"))
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n"))
        assert service.notify("READY=1\nSTATUS=up")
        assert sock.recv(100) == b"READY=1\nSTATUS=up"


def test_notify_without_systemd_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not service.notify("READY=1")


def test_every_option_of_every_command_has_help_text() -> None:
    import argparse

    from distorefs.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {action.dest}"
        for name, sub in subcommands.choices.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert missing == []
    assert sorted(subcommands.choices) == ["install-service", "mount", "status", "top", "umount"]
