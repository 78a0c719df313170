"""What /proc says about the process behind a FUSE request (the kernel names its thread).

Shared by the fs layer's handles: weights writers (was the writer exiting at its
close?) and staged files (whose descriptor to take).
"""

from __future__ import annotations

PF_EXITING = 0x4


def thread_group(pid: int) -> int:
    """The process (thread group) of thread `pid`; `pid` itself if /proc cannot say."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid


def process_exiting(tgid: int) -> bool:
    """True when process `tgid` is gone or exiting (killed, crashed, or exit() with the
    file still open): its closes are not the writer's own."""
    try:
        with open(f"/proc/{tgid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return bool(int(fields[6]) & PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True
