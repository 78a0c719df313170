"""The daemon's process limits: open descriptors for a log of many segments."""

from __future__ import annotations

import resource
import subprocess
import sys


def test_the_daemon_raises_its_open_files_limit_to_the_hard_limit() -> None:
    """Started with a soft limit of 256 (a tight service manager), it takes the hard one:
    a log keeps one or two descriptors per 64 MiB segment."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import resource\n"
        "from distorefs.daemon import raise_open_files_limit\n"
        "print(raise_open_files_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )

    def tight() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, preexec_fn=tight, timeout=60
    )
    expected = 256 if hard in (256, resource.RLIM_INFINITY) else hard
    assert done.stdout.split() == [str(expected), str(expected), str(hard)]
