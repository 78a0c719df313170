"""README.md's shell blocks run as written, top to bottom, after the set-up command.

They mount at /mnt/distore, keep data in /var/lib/distorefs and start an etcd on
127.0.0.1:2379, as a new user would. The test gives them a private world to do that in:
a new mount namespace (`unshare --mount`) where /mnt and /var/lib are empty tmpfs, and a
new network namespace with its own loopback, so nothing on this machine is touched or in
the way. Blocks whose info string says `setup` (the set-up commands themselves, which
include this test suite) are not run here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fuse_missing

pytestmark = pytest.mark.mount

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```sh\n(.*?)^```", re.DOTALL | re.MULTILINE)
SETUP_BLOCK = re.compile(r"^```sh setup\n", re.MULTILINE)

# Brings up the loopback of a fresh network namespace (ioctl SIOCSIFFLAGS on "lo"), so
# that etcd and the daemons can listen on 127.0.0.1 there.
LOOPBACK_UP = (
    "import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH', b'lo', 0x1 | 0x8 | 0x40))"
)


def readme_blocks() -> list[str]:
    return BLOCK.findall((REPO / "README.md").read_text())


def test_readme_has_runnable_blocks_and_marks_its_setup_block() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 4
    assert SETUP_BLOCK.search((REPO / "README.md").read_text())
    assert not any("scripts/test.sh" in block for block in blocks)  # the suite does not run itself


@pytest.mark.skipif(os.geteuid() != 0, reason="the README's commands (mounts in /mnt, apt) are written for root")
def test_readme_shell_blocks_run_top_to_bottom(tmp_path: Path) -> None:
    why = fuse_missing()
    if why:
        pytest.skip(why)
    assert shutil.which("unshare"), "unshare comes with util-linux"
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the README sources .venv/bin/activate
    script = work / "readme.sh"
    script.write_text("set -euxo pipefail\n" + "\n".join(readme_blocks()))
    runner = work / "runner.sh"
    runner.write_text(
        f"""set -eu
{sys.executable} -c "{LOOPBACK_UP}"
mount -t tmpfs tmpfs /mnt
mount -t tmpfs tmpfs /var/lib
cleanup() {{
    for m in $(awk '$3 ~ /^fuse/ {{print $2}}' /proc/self/mounts); do fusermount3 -u -z "$m" || true; done
    kill $(jobs -p) 2>/dev/null || true
    wait || true
}}
trap cleanup EXIT
cd {work}
source {script}
"""
    )
    result = subprocess.run(
        ["unshare", "--mount", "--net", "--propagation", "private", "bash", str(runner)],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "distorefs: mounted /mnt/distore" in out
    assert "distorefs: unmounted /mnt/distore; daemon" in out
    assert "persisted everything" in out
    assert "user.distore.state=" in out
    assert "distorefs: unmounted /mnt/node-a" in out
    assert "distorefs: unmounted /mnt/node-b" in out
