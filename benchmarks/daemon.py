"""A distorefs daemon for a benchmark: mounted with the CLI, unmounted however the run ends."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
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


def wait_for_kernels(mnt: Path, timeout_s: float = 60.0) -> float:
    """Seconds until `.distore/status` says every compiled kernel runs (at most
    `timeout_s`; a daemon that shows no `kernels` counts as never). They load in a thread
    at their first use: a benchmark that measures the daemon as it runs once started
    makes that use, then waits here."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        kernels = json.loads((mnt / ".distore" / "status").read_text()).get("kernels", {})
        if kernels and all(kernels.values()):
            break
        time.sleep(0.05)
    return round(time.monotonic() - started, 2)
