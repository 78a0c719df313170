"""distorefs as a system service: systemd readiness, the unit file, and the mount(8) and
umount(8) helpers that make `mount -t fuse.distorefs` and an /etc/fstab line work.

Owns the sd_notify protocol (a datagram to $NOTIFY_SOCKET), the text of the template unit
`distore@.service` (one instance per mount point, named by `systemd-escape --path`), the
translation of mount(8)'s `-o` options into `distore mount` arguments, and
`distore install-service`. Mounting itself, and the helper commands' entry points, are
cli.py's; the daemon is daemon.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Sequence

FS_TYPE = "fuse.distorefs"
UNIT_NAME = "distore@.service"
MOUNT_HELPER = f"mount.{FS_TYPE}"
UMOUNT_HELPER = f"umount.{FS_TYPE}"
DEFAULT_UNIT_DIR = "/etc/systemd/system"
DEFAULT_SBIN_DIR = "/usr/sbin"

# `distore mount` options a mount(8) -o option may set: name=value ones and flags
VALUE_OPTIONS = frozenset(
    {"dram_budget", "segment_size", "compaction_reserve", "metrics_port", "flush_interval", "sync_interval",
     "compact_interval", "snapshot_interval", "wait_timeout", "prefetch_window", "dataset_page_cache", "dataset_dram",
     "log_file", "log_rotate", "cluster", "node", "listen", "peer_timeout", "lease_ttl", "transport", "lend_memory"}
)  # fmt: skip
FLAG_OPTIONS = frozenset({"allow_other", "nonempty", "checkpoint_sync_close", "debug"})
# generic options mount(8), fstab or the kernel's FUSE defaults pass that distorefs need not act on
IGNORED_OPTIONS = frozenset(
    {"rw", "defaults", "auto", "noauto", "user", "users", "nouser", "owner", "group", "nofail", "_netdev",
     "dev", "nodev", "suid", "nosuid", "exec", "noexec", "async", "atime", "noatime", "relatime"}
)  # fmt: skip


class UsageError(Exception):
    """A mount(8) command line or -o option distorefs cannot honour."""


def notify(state: str) -> bool:
    """Tell systemd `state` ("READY=1", "STOPPING=1", "STATUS=..."); False when the
    process was not started by systemd with Type=notify (no $NOTIFY_SOCKET)."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def unit_text(distore: str) -> str:
    """The template unit; `distore` is the absolute path of the `distore` command."""
    return f"""\
# distorefs: one instance per mount point, named by `systemd-escape --path`:
#   systemctl enable --now distore@$(systemd-escape --path /mnt/distore)
# Options (--dram-budget 8GiB, --allow-other, --cluster ...) go in
# /etc/distorefs/<instance>.env as DISTORE_OPTS="...".
[Unit]
Description=distorefs FUSE filesystem at %f
Documentation=file://{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}/docs/operations.md
After=network-online.target local-fs.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
Environment=DISTORE_OPTS=
EnvironmentFile=-/etc/distorefs/%i.env
StateDirectory=distorefs/%i
StateDirectoryMode=0700
ExecStartPre=/bin/mkdir -p %f
ExecStart={distore} mount %f --foreground --data-dir /var/lib/distorefs/%i $DISTORE_OPTS
# SIGTERM unmounts and persists everything before the daemon exits; a persist of a full
# DRAM cache may take minutes, recovery of a large log too
KillMode=mixed
TimeoutStartSec=600
TimeoutStopSec=900
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


def distore_command() -> str:
    """The absolute path of the `distore` command this package installed."""
    here = os.path.join(os.path.dirname(sys.executable), "distore")
    found = here if os.access(here, os.X_OK) else shutil.which("distore")
    if found is None:
        raise UsageError("cannot find the distore command (is the package installed?)")
    return os.path.abspath(found)


def install(unit_dir: str, sbin_dir: str) -> list[str]:
    """Write the unit into `unit_dir` and link the mount helpers into `sbin_dir`; returns
    what was written. Raises OSError when a directory is not writable."""
    distore = distore_command()
    bin_dir = os.path.dirname(distore)
    written = []
    os.makedirs(unit_dir, exist_ok=True)
    unit_path = os.path.join(unit_dir, UNIT_NAME)
    with open(unit_path, "w", encoding="utf-8") as f:
        f.write(unit_text(distore))
    written.append(unit_path)
    os.makedirs(sbin_dir, exist_ok=True)
    for helper in (MOUNT_HELPER, UMOUNT_HELPER):
        target, link = os.path.join(bin_dir, helper), os.path.join(sbin_dir, helper)
        if not os.path.exists(target):
            raise UsageError(f"{target} is missing: reinstall the package (pip install -e .)")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(target, link)
        written.append(link)
    return written


def mount_arguments(argv: Sequence[str]) -> list[str] | None:
    """`distore` arguments for mount(8)'s `mount.fuse.distorefs DATA_DIR MOUNTPOINT [-sfnv]
    [-N NS] [-o OPTIONS] [-t TYPE]`; None for a fake mount (-f). Raises UsageError."""
    positional: list[str] = []
    options: list[str] = []
    fake = False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-o", "-t", "-N"):
            if not args:
                raise UsageError(f"{arg} needs a value")
            value = args.pop(0)
            if arg == "-o":
                options += [option for option in value.split(",") if option]
            elif arg == "-t" and value not in (FS_TYPE, "distorefs"):
                raise UsageError(f"type {value} is not {FS_TYPE}")
        elif arg.startswith("-o") and len(arg) > 2:
            options += [option for option in arg[2:].split(",") if option]
        elif arg.startswith("-") and len(arg) > 1:
            fake = fake or "f" in arg[1:]
            if "r" in arg[1:]:
                raise UsageError("distorefs mounts read-write only (-r asks for read-only)")
            if set(arg[1:]) - set("sfnvw"):
                raise UsageError(f"unknown flag {arg}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise UsageError("usage: mount.fuse.distorefs DATA_DIR MOUNTPOINT [-o OPTIONS]")
    data_dir, mountpoint = positional
    result = ["mount", mountpoint, "--data-dir", data_dir]
    for option in options:
        name, eq, value = option.partition("=")
        if name in IGNORED_OPTIONS or name == "comment" or name.startswith("x-"):
            continue
        if name == "ro":
            raise UsageError("distorefs mounts read-write only (drop the ro option)")
        if name in FLAG_OPTIONS and not eq:
            result.append("--" + name.replace("_", "-"))
        elif name in VALUE_OPTIONS and eq and value:
            result += ["--" + name.replace("_", "-"), value]
        else:
            raise UsageError(f"unknown mount option {name!r} (see `distore mount --help`; write dram_budget=4GiB)")
    return None if fake else result
