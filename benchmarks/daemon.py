"""A distorefs daemon for a benchmark: mounted with the CLI, unmounted however the run ends."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

DISTORE = [sys.executable, "-m", "distorefs"]


@contextlib.contextmanager
def mounted(base: Path, *options: str) -> Iterator[Path]:
    """Mount at base/mnt with its data in base/data and `options`; yields the mount point."""
    mnt = base / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run([*DISTORE, "mount", str(mnt), "--data-dir", str(base / "data"), *options], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        yield mnt
    finally:
        subprocess.run([*DISTORE, "umount", str(mnt)], check=False, stdout=subprocess.DEVNULL)
