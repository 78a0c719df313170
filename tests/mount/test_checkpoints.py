"""checkpoints/ through a real mount: background persistence, states, sync close,
retention, crashes, a full disk, and real checkpoint writers (torch, safetensors, numpy)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs.tiers import nvme_log
from tests.conftest import Mount, dir_for_test, fuse_requests

pytestmark = pytest.mark.mount

MountFactory = Callable[..., Mount]
STATE = "user.distore.state"
DURABLE_WAIT_S = 60.0


def state(path: Path) -> str:
    return os.getxattr(path, STATE).decode()


def wait_durable(path: Path) -> None:
    deadline = time.monotonic() + DURABLE_WAIT_S
    while state(path) != "durable":
        assert time.monotonic() < deadline, f"{path} still {state(path)}"
        time.sleep(0.02)


@pytest.fixture
def run_dir(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    with dir_for_test(mounted.path / "checkpoints", request) as path:
        yield path


def test_state_goes_from_dram_to_durable_and_status_counts_waiting_bytes(mounted: Mount, run_dir: Path) -> None:
    path = run_dir / "step-1.bin"
    payload = os.urandom(3 << 20)
    with open(path, "wb") as f:
        f.write(payload)
        f.write(b"tail")  # a partial block stays in DRAM while the file is open
        f.flush()
        assert state(path) == "dram"
        status = mounted.status()
        assert int(status["checkpoint_bytes_waiting"]) >= 4  # type: ignore[call-overload]
        assert int(status["checkpoint_files_waiting"]) >= 1  # type: ignore[call-overload]
    assert state(path) in ("persisting", "durable")
    wait_durable(path)
    assert path.read_bytes() == payload + b"tail"
    assert STATE in os.listxattr(path)


def test_fsync_returns_when_durable(run_dir: Path) -> None:
    path = run_dir / "step-2.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(5 << 20))
        f.flush()
        os.fsync(f.fileno())
        assert state(path) == "durable"
        f.write(b"more")
        f.flush()
        assert state(path) == "dram"


def test_sync_close_per_directory(run_dir: Path) -> None:
    os.setxattr(run_dir, "user.distore.sync_close", b"1")
    sub = run_dir / "inner"
    sub.mkdir()
    for path in (run_dir / "a.bin", sub / "b.bin"):
        path.write_bytes(os.urandom(2 << 20))
        assert state(path) == "durable"  # no waiting: close returned when durable


def test_sync_close_mount_option(mount_factory: MountFactory) -> None:
    mount = mount_factory("--checkpoint-sync-close")
    path = mount.path / "checkpoints" / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    assert state(path) == "durable"
    assert mount.unmount() == 0


def test_bad_settings_get_clear_errnos(mounted: Mount, run_dir: Path) -> None:
    (run_dir / "f").write_bytes(b"x")
    cases = [
        (run_dir, "user.distore.keep_last", b"0", errno.EINVAL),
        (run_dir, "user.distore.keep_last", b"many", errno.EINVAL),
        (run_dir, "user.distore.sync_close", b"yes", errno.EINVAL),
        (run_dir / "f", "user.distore.keep_last", b"2", errno.EINVAL),  # a file, not a directory
        (run_dir / "f", STATE, b"durable", errno.EPERM),
    ]
    for path, name, value, expected in cases:
        with pytest.raises(OSError) as excinfo:
            os.setxattr(path, name, value)
        assert excinfo.value.errno == expected, (name, value)
    outside = mounted.path / "plain"
    outside.mkdir(exist_ok=True)
    with pytest.raises(OSError) as excinfo:
        os.setxattr(outside, "user.distore.keep_last", b"2")
    assert excinfo.value.errno == errno.EINVAL
    with pytest.raises(OSError) as excinfo:
        os.getxattr(outside, STATE)
    assert excinfo.value.errno == errno.ENODATA
    assert "user.distore.keep_last" not in os.listxattr(run_dir)  # nothing half-applied


def test_retention_keeps_the_newest_durable_checkpoints(run_dir: Path) -> None:
    os.setxattr(run_dir, "user.distore.keep_last", b"2")
    (run_dir / ".notes").write_text("not a checkpoint")
    for step in range(1, 5):
        step_dir = run_dir / f"step-{step}"
        step_dir.mkdir()
        for shard in ("model.bin", "optim.bin"):
            with open(step_dir / shard, "wb") as f:
                f.write(os.urandom(256 << 10))
                os.fsync(f.fileno())
        (run_dir / f"loose-{step}.bin").write_bytes(b"loose")
        wait_durable(run_dir / f"loose-{step}.bin")
    deadline = time.monotonic() + DURABLE_WAIT_S
    # entries with the same step number are one checkpoint: step-4/ and loose-4.bin are
    # step 4, so keep_last=2 keeps steps 3 and 4 whole
    while sorted(os.listdir(run_dir)) != [".notes", "loose-3.bin", "loose-4.bin", "step-3", "step-4"]:
        assert time.monotonic() < deadline, sorted(os.listdir(run_dir))
        time.sleep(0.05)
    assert len((run_dir / "step-4" / "model.bin").read_bytes()) == 256 << 10


def test_retention_never_removes_for_a_checkpoint_that_is_not_durable(run_dir: Path) -> None:
    (run_dir / "old.bin").write_bytes(b"old")
    wait_durable(run_dir / "old.bin")
    os.setxattr(run_dir, "user.distore.keep_last", b"1")  # old.bin is the newest durable one
    with open(run_dir / "new.bin", "wb") as f:
        f.write(b"being written")
        f.flush()
        # a persist pass that made something in this directory durable has run retention
        # here while new.bin is still open (dot-files are not checkpoints: retention keeps them)
        (run_dir / ".marker").write_bytes(b"m")
        wait_durable(run_dir / ".marker")
        assert sorted(os.listdir(run_dir)) == [".marker", "new.bin", "old.bin"]
    wait_durable(run_dir / "new.bin")
    deadline = time.monotonic() + DURABLE_WAIT_S
    while (run_dir / "old.bin").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_kill_9_keeps_fsynced_checkpoints_and_drops_unfinished_ones(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    root = mount.path / "checkpoints"
    done = os.urandom(3 << 20)
    with open(root / "done.bin", "wb") as f:
        f.write(done)
        os.fsync(f.fileno())
    unfinished = open(root / "unfinished.bin", "wb")  # noqa: SIM115 - open across the crash
    unfinished.write(os.urandom(5 << 20))
    unfinished.flush()
    assert state(root / "unfinished.bin") == "dram"
    mount.kill9()
    with contextlib.suppress(OSError):
        unfinished.close()  # the dead mount answers ENOTCONN

    mount = mount_factory()
    assert (root / "done.bin").read_bytes() == done
    assert state(root / "done.bin") == "durable"
    assert not (root / "unfinished.bin").exists()  # never a half-written file
    assert mount.unmount() == 0


def test_a_checkpoint_3x_the_dram_budget_waits_for_the_log_and_reads_back(mount_factory: MountFactory) -> None:
    mount = mount_factory("--dram-budget", "16MiB")
    path = mount.path / "checkpoints" / "big.bin"
    rng = np.random.default_rng(7)
    payload = rng.integers(0, 255, size=48 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for start in range(0, len(payload), 4 << 20):
            f.write(payload[start : start + (4 << 20)])
        status = mount.status()
        assert int(status["dram_used_bytes"]) <= 16 << 20  # type: ignore[call-overload]
    wait_durable(path)
    assert path.read_bytes() == payload
    assert mount.unmount() == 0


def test_a_cold_read_after_a_remount_reads_the_log_with_o_direct_and_keeps_no_copy_of_it_cached(
    mount_factory: MountFactory, tmp_path: Path
) -> None:
    """A file of 24 MiB written, the daemon remounted, the log's pages dropped from the
    page cache (as after a while): read in order with `cat`, the bytes come back, the
    blocks came from the log with O_DIRECT (status), and the log's files have no page in
    the page cache afterwards (`fincore`)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"p" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        if nvme_log.cached_pages(fd, 0, 4096) is None:
            pytest.skip("this kernel has no cachestat (Linux 6.5): big reads go through the page cache")
        try:
            os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip("this file system refuses O_DIRECT: big reads go through the page cache")
    finally:
        os.close(fd)
    mount = mount_factory()
    path = mount.path / "checkpoints" / "cold.bin"
    payload = np.random.default_rng(11).integers(0, 255, size=24 << 20, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    wait_durable(path)
    assert mount.unmount() == 0
    segments = sorted((mount.data_dir / "log").glob("seg-*.log"))
    assert segments

    def drop_log_pages() -> None:
        for segment in segments:
            fd = os.open(segment, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def log_pages_cached() -> int:  # fincore (util-linux): bytes of each file in the page cache
        done = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, segments)],
            capture_output=True,
            text=True,
            check=True,
        )
        return sum(int(line) for line in done.stdout.split())

    mount = mount_factory()  # (its start-up scans the newest segment through the page cache)
    path = mount.path / "checkpoints" / "cold.bin"
    drop_log_pages()
    done = subprocess.run(["cat", str(path)], capture_output=True, check=True)
    assert done.stdout == payload
    blocks = mount.status()["blocks"]
    assert isinstance(blocks, dict)
    assert blocks["log_direct_read_bytes"] >= 20 << 20
    assert log_pages_cached() == 0
    assert mount.unmount() == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs for the data dir (a full disk on demand). Needs root to mount."""
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs and must run as root (scripts/test.sh does)")
    path = tmp_path / "small"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_gives_enospc_and_no_durable_claim(mount_factory: MountFactory, small_disk: Path) -> None:
    mount = mount_factory(
        "--dram-budget", "16MiB", "--segment-size", "4MiB", "--compact-interval", "0.2", data_dir=small_disk / "data"
    )  # fmt: skip
    path = mount.path / "checkpoints" / "too-big.bin"
    chunk = os.urandom(1 << 20)
    with pytest.raises(OSError) as excinfo:  # noqa: PT012 - the write or the fsync fails
        with open(path, "wb") as f:
            for _ in range(96):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    assert excinfo.value.errno == errno.ENOSPC
    assert state(path) != "durable"
    assert mount.status()["degraded"] is False
    path.unlink()  # room again once compaction drops its dead segments: the mount goes on
    small = mount.path / "checkpoints" / "small.bin"
    deadline = time.monotonic() + DURABLE_WAIT_S
    while True:
        try:
            with open(small, "wb", buffering=0) as f:
                f.write(b"fits")
                os.fsync(f.fileno())
            break
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            assert time.monotonic() < deadline, "the log never got its space back"
            time.sleep(0.2)
    assert state(small) == "durable"
    assert small.read_bytes() == b"fits"
    assert mount.unmount() == 0


def test_torch_safetensors_and_numpy_round_trip_across_remount_and_kill_9(mount_factory: MountFactory) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    state_dict = {
        "embed.weight": torch.randn(1000, 64),
        "layer.0.weight": torch.randn(256, 256),
        "layer.0.bias": torch.randn(256),
        "step": torch.tensor(1234),
    }
    arrays = {"w": np.arange(100_000, dtype=np.float32), "b": np.ones((7, 3))}

    def check(root: Path) -> None:
        loaded = torch.load(root / "model.pt", weights_only=True)
        assert loaded.keys() == state_dict.keys()
        assert all(torch.equal(loaded[k], v) for k, v in state_dict.items())
        tensors = load_file(root / "model.safetensors")
        assert all(torch.equal(tensors[k], v) for k, v in state_dict.items())
        with np.load(root / "arrays.npz") as npz:
            assert all(np.array_equal(npz[k], v) for k, v in arrays.items())

    mount = mount_factory()
    root = mount.path / "checkpoints" / "run"
    root.mkdir()
    torch.save(state_dict, root / "model.pt")
    save_file(state_dict, root / "model.safetensors")
    np.savez(root / "arrays.npz", **arrays)
    check(root)
    assert mount.unmount() == 0

    mount = mount_factory()
    check(root)
    for name in ("model.pt", "model.safetensors", "arrays.npz"):
        fd = os.open(root / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    mount.kill9()

    mount = mount_factory()
    check(root)
    assert mount.unmount() == 0


@pytest.mark.parametrize(
    ("style", "names"),
    [
        ("stable-baselines3", ["rl_model_{s}_steps.zip", "rl_model_replay_buffer_{s}_steps.pkl"]),
        ("hugging face", ["checkpoint-{s}/model.safetensors", "checkpoint-{s}/optimizer.pt"]),
        ("lightning", ["epoch={e}-step={s}.ckpt"]),
        ("plain", ["step-{s}.pt"]),
    ],
)
def test_keep_last_counts_checkpoints_made_of_several_files_by_their_step(
    run_dir: Path, style: str, names: list[str]
) -> None:
    os.setxattr(run_dir, "user.distore.keep_last", b"2")
    steps = [1000, 2000, 3000, 4000]
    for epoch, step in enumerate(steps):
        for pattern in names:
            path = run_dir / pattern.format(s=step, e=epoch)
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as f:
                f.write(os.urandom(4096))
                os.fsync(f.fileno())
    want = sorted(
        {pattern.format(s=s, e=e).split("/")[0] for e, s in enumerate(steps) if s >= 3000 for pattern in names}
    )
    deadline = time.monotonic() + DURABLE_WAIT_S
    while sorted(os.listdir(run_dir)) != want:
        assert time.monotonic() < deadline, (style, sorted(os.listdir(run_dir)))
        time.sleep(0.05)
    for pattern in names:  # every file of a kept checkpoint is there, whole
        assert (run_dir / pattern.format(s=4000, e=3)).stat().st_size == 4096


def test_stable_baselines3_checkpoint_callback_with_keep_last(run_dir: Path) -> None:
    sb3 = pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.callbacks import CheckpointCallback

    os.setxattr(run_dir, "user.distore.keep_last", b"2")
    model = sb3.DQN("MlpPolicy", "CartPole-v1", buffer_size=5000, learning_starts=100, seed=0, device="cpu")
    callback = CheckpointCallback(save_freq=250, save_path=str(run_dir), save_replay_buffer=True)
    model.learn(total_timesteps=1000, callback=callback)  # checkpoints at 250, 500, 750, 1000 steps
    want = sorted(
        [f"rl_model_{step}_steps.zip" for step in (750, 1000)]
        + [f"rl_model_replay_buffer_{step}_steps.pkl" for step in (750, 1000)]
    )
    deadline = time.monotonic() + DURABLE_WAIT_S
    while sorted(os.listdir(run_dir)) != want:
        assert time.monotonic() < deadline, sorted(os.listdir(run_dir))
        time.sleep(0.05)
    sizes = {}
    for step in (750, 1000):  # each model with the replay buffer of its own step
        restored = sb3.DQN.load(str(run_dir / f"rl_model_{step}_steps.zip"), device="cpu")
        restored.load_replay_buffer(str(run_dir / f"rl_model_replay_buffer_{step}_steps.pkl"))
        assert restored.num_timesteps == step
        assert restored.replay_buffer is not None
        sizes[step] = restored.replay_buffer.size()
    assert sizes[1000] - sizes[750] == 250


def test_an_exclusive_create_in_checkpoints_skips_the_page_cache(mounted: Mount, run_dir: Path) -> None:
    """A file created O_RDWR | O_CREAT | O_EXCL under checkpoints/ (safetensors'
    temporary, mkstemp) is direct_io (docs/design.md, "Exclusive creates in checkpoints/
    skip the page cache"): its writes go past the page cache (no GETXATTR before them),
    it reads back through the same descriptor, only that descriptor refuses a shared
    mapping, and the file renamed into place maps and reads like any other. Elsewhere
    in the tree the same open keeps the page cache and maps."""
    tmp = run_dir / ".tmp-model"
    data = os.urandom(3 << 20)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        before = fuse_requests(mounted, "getxattr")
        for at in range(0, len(data), 1 << 20):
            os.pwrite(fd, data[at : at + (1 << 20)], at)
        assert fuse_requests(mounted, "getxattr") == before
        assert os.pread(fd, len(data), 0) == data
        with pytest.raises(OSError) as refused:
            mmap.mmap(fd, len(data))
        assert refused.value.errno == errno.ENODEV
    finally:
        os.close(fd)
    final = run_dir / "model.safetensors"
    os.rename(tmp, final)
    with open(final, "r+b") as f, mmap.mmap(f.fileno(), len(data)) as mapped:
        assert mapped[:] == data
    assert final.read_bytes() == data

    elsewhere = mounted.path / f"excl-{os.getpid()}"
    fd = os.open(elsewhere, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        before = fuse_requests(mounted, "getxattr")
        os.pwrite(fd, b"x" * 4096, 0)
        assert fuse_requests(mounted, "getxattr") > before  # buffered: the kernel asked
        with mmap.mmap(fd, 4096) as mapped:
            assert mapped[:] == b"x" * 4096
    finally:
        os.close(fd)
        elsewhere.unlink()
