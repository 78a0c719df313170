"""Staged files (`client.staged_open`) through a real mount: the daemon takes a client's
sealed memfd over at close, the file shows its bytes at once and persists like any file
written through the mount, a writer killed after close loses nothing, another user's
memory and bad requests are refused (the tests as another uid are in
test_permissions.py), and the bytes go through FUSE where the daemon cannot take them."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from distorefs import client
from tests.conftest import Mount

MountFactory = Callable[..., Mount]
DURABLE_WAIT_S = 30.0
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def state(path: Path) -> str:
    return os.getxattr(path, "user.distore.state").decode()


def wait_durable(path: Path) -> None:
    deadline = time.monotonic() + DURABLE_WAIT_S
    while state(path) != "durable":
        assert time.monotonic() < deadline, f"{path} not durable after {DURABLE_WAIT_S} s: {state(path)}"
        time.sleep(0.05)


def dram_used(mount: Mount) -> int:
    return int(mount.status()["dram_used_bytes"])  # type: ignore[call-overload]


def borrowed(mount: Mount) -> int:
    blocks = mount.status()["blocks"]
    assert isinstance(blocks, dict)
    return int(blocks["dram_borrowed_bytes"])


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def staged(f: object) -> client.StagedFile:
    assert isinstance(f, client.StagedFile)
    return f


def sealed_memfd(data: bytes) -> int:
    """A memfd holding `data`, sealed as `client.staged_open` seals it."""
    fd = os.memfd_create("test-staged", os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def test_a_staged_checkpoint_reads_back_at_once_and_persists_in_the_background(mount_factory: MountFactory) -> None:
    mount = mount_factory("--dram-budget", "256MiB")
    run = mount.path / "checkpoints" / "run1"
    run.mkdir()
    path = run / "step-100.npy"
    weights = np.random.default_rng(1).standard_normal(5 * (1 << 20) // 8 + 13)
    with client.staged_open(path, "wb") as f:
        np.save(f, weights)
    assert staged(f).adopted, staged(f).fallback_reason
    # the file shows the new bytes at once, to this process and to another one
    assert np.array_equal(np.load(path), weights)
    expected_size = os.path.getsize(path)
    assert expected_size > weights.nbytes
    other = run_python(f"import os; print(os.stat({str(path)!r}).st_size)")
    assert int(other.stdout) == expected_size, other.stderr
    assert state(path) in ("dram", "persisting", "durable")
    wait_durable(path)
    # durable: DRAM let go of the borrowed memory (the log has the bytes)
    assert borrowed(mount) == 0
    assert np.array_equal(np.load(path), weights)
    metrics = (mount.path / ".distore" / "metrics").read_text()
    assert 'distorefs_bytes_total{direction="adopted",kind="checkpoints"}' in metrics
    mount.kill9()

    mount = mount_factory()
    assert np.array_equal(np.load(path), weights)
    assert state(path) == "durable"
    assert mount.unmount() == 0


def test_a_writer_killed_right_after_close_still_makes_its_checkpoint_durable(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    path = mount.path / "checkpoints" / "step-7.bin"
    result = run_python(
        f"""
        import os, signal
        from distorefs import client
        data = bytes(range(256)) * (12 * 4096 + 3)
        with client.staged_open({str(path)!r}) as f:
            f.write(data)
        assert f.adopted, f.fallback_reason
        print("closed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert result.stdout.strip() == "closed", result.stderr
    assert result.returncode == -9
    expected = bytes(range(256)) * (12 * 4096 + 3)
    wait_durable(path)
    mount.kill9()

    mount = mount_factory()
    assert path.read_bytes() == expected
    assert mount.unmount() == 0


def test_a_writer_killed_before_close_leaves_an_empty_file_and_nothing_held(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    path = mount.path / "checkpoints" / "step-8.bin"
    path.write_bytes(b"the previous content")
    used_before = dram_used(mount)
    result = run_python(
        f"""
        import os, signal
        from distorefs import client
        f = client.staged_open({str(path)!r})
        f.write(os.urandom(8 << 20))
        f.flush()
        print("written", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert result.stdout.strip() == "written", result.stderr
    # the open truncated it (through the mount, as `open(path, "wb")` does); nothing came after
    assert path.read_bytes() == b""
    assert dram_used(mount) <= used_before + (1 << 20)
    assert borrowed(mount) == 0
    assert mount.unmount() == 0


def test_a_staged_file_outside_checkpoints_is_in_the_log_when_close_returns(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    path = mount.path / "model.bin"
    data = os.urandom((3 << 20) + 5)
    with client.staged_open(path) as f:
        f.write(data)
    assert staged(f).adopted, staged(f).fallback_reason
    mount.kill9()  # a close of a tree file is *logged*: it survives a killed daemon

    mount = mount_factory()
    assert path.read_bytes() == data
    assert mount.unmount() == 0


def test_torch_save_and_safetensors_through_staged_files(mounted: Mount, scratch: Path) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    sd = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}
    with client.staged_open(scratch / "step-1.pt") as f:
        torch.save(sd, f)  # a writer that takes a file
    assert staged(f).adopted
    with client.staged_open(scratch / "step-2.pt") as g:
        torch.save(sd, client.staged_path(g))  # a writer that takes a path
    assert staged(g).adopted
    with client.staged_open(scratch / "step-1.safetensors") as h:
        h.write(safetensors_torch.save(sd))  # type: ignore[arg-type]  # save_file writes a temporary beside the path
    assert staged(h).adopted
    mapped = safetensors_torch.load_file(scratch / "step-1.safetensors")
    for loaded in (torch.load(scratch / "step-1.pt"), torch.load(scratch / "step-2.pt"), mapped):
        for name, tensor in sd.items():
            assert torch.equal(loaded[name], tensor)


def test_a_save_that_raises_leaves_the_file_empty_not_half_written(mounted: Mount, scratch: Path) -> None:
    path = scratch / "step-9.pt"
    path.write_bytes(b"the previous checkpoint")
    f = staged(client.staged_open(path))
    f.write(b"the first half of a checkpoint")
    # what `with` does when its block raises (a save that meets CUDA out of memory half-way)
    f.__exit__(RuntimeError, RuntimeError("CUDA out of memory"), None)
    assert not f.adopted
    assert f.closed
    assert path.read_bytes() == b""  # truncated by the open, as open(path, "wb") would leave it


def test_a_staged_file_into_weights_goes_through_the_mount_and_publishes(mounted: Mount) -> None:
    model = mounted.path / "weights" / "staged-model"
    model.mkdir()
    try:
        with client.staged_open(model / "params.bin") as f:
            f.write(b"v1 weights")
        assert not staged(f).adopted  # weights files are not tree files: the daemon says EROFS
        assert staged(f).fallback_reason.startswith("EROFS")
        assert (model / "params.bin").read_bytes() == b"v1 weights"
        assert (model / "version").read_text().split()[0] == "1"  # published once, at the close
    finally:
        subprocess.run(["rm", "-rf", str(model)], check=False)


def test_an_empty_staged_file(mounted: Mount, scratch: Path) -> None:
    path = scratch / "empty.bin"
    path.write_bytes(b"old")
    with client.staged_open(path) as f:
        pass
    assert staged(f).adopted
    assert path.read_bytes() == b""


def test_what_does_not_fit_the_dram_budget_goes_through_the_mount(mount_factory: MountFactory) -> None:
    mount = mount_factory("--dram-budget", "16MiB")
    path = mount.path / "checkpoints" / "big.bin"
    data = os.urandom(40 << 20)
    with client.staged_open(path) as f:
        f.write(data)
    assert not staged(f).adopted
    assert staged(f).fallback_reason.startswith("ENOMEM")
    wait_durable(path)
    assert path.read_bytes() == data
    assert mount.unmount() == 0


def test_off_a_distorefs_mount_it_is_a_plain_file(tmp_path: Path) -> None:
    path = tmp_path / "plain.bin"
    with client.staged_open(path) as f:
        f.write(b"plain bytes")
    assert not isinstance(f, client.StagedFile)
    assert path.read_bytes() == b"plain bytes"
    with pytest.raises(ValueError):
        client.staged_open(path, "rb")


@pytest.mark.parametrize(
    "what",
    ["not a number", "a closed descriptor", "an unsealed memfd", "a regular file", "a directory as the target"],
)
def test_bad_adopt_requests_get_einval_and_change_nothing(mounted: Mount, scratch: Path, what: str) -> None:
    path = scratch / "target.bin"
    path.write_bytes(b"unchanged")
    target = str(scratch) if what == "a directory as the target" else str(path)
    fds: list[int] = []
    try:
        if what == "not a number":
            value = b"12; rm -rf /"
        elif what == "a closed descriptor":
            value = b"999999"
        elif what == "an unsealed memfd":
            fds.append(os.memfd_create("unsealed", os.MFD_ALLOW_SEALING))
            os.write(fds[-1], b"changeable")
            value = str(fds[-1]).encode()
        elif what == "a regular file":
            fds.append(os.open("/etc/hostname", os.O_RDONLY))
            value = str(fds[-1]).encode()
        else:
            fds.append(sealed_memfd(b"for a directory"))
            value = str(fds[-1]).encode()
        with pytest.raises(OSError) as caught:
            os.setxattr(target, "user.distore.adopt", value)
        wanted = errno.EISDIR if what == "a directory as the target" else errno.EINVAL
        assert caught.value.errno == wanted
    finally:
        for fd in fds:
            os.close(fd)
    assert path.read_bytes() == b"unchanged"
    with pytest.raises(OSError) as missing:
        os.getxattr(path, "user.distore.adopt")
    assert missing.value.errno == errno.ENODATA  # a request, never stored
    status = json.loads((mounted.path / ".distore" / "status").read_text())
    assert not status.get("degraded")
