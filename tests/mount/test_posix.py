"""The ordinary POSIX tree through a real mount, with plain file calls."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from distorefs.daemon import KERNELS_IDLE_S
from tests.conftest import Mount, data_requests, fuse_requests

MountFactory = Callable[..., Mount]

pytestmark = pytest.mark.mount


def test_root_holds_the_reserved_directories(mounted: Mount) -> None:
    names = set(os.listdir(mounted.path))
    assert {"buffers", "weights", "checkpoints", "datasets", ".distore"} <= names
    assert sorted(os.listdir(mounted.path / ".distore")) == ["metrics", "peers", "status", "version"]


def test_peers_of_a_single_node_daemon_says_so(mounted: Mount) -> None:
    peers = json.loads((mounted.path / ".distore" / "peers").read_text())
    assert peers == {"mode": "single-node", "transport": None, "live_nodes": []}


def test_status_is_json_with_the_daemon_facts(mounted: Mount) -> None:
    status = json.loads((mounted.path / ".distore" / "status").read_text())
    assert status["pid"] == mounted.proc.pid
    assert status["data_dir"] == str(mounted.data_dir)
    for key in ("dram_used_bytes", "dram_budget_bytes", "log_bytes"):
        assert isinstance(status[key], int)
    assert status["dram_budget_bytes"] == 256 * 2**20
    assert (mounted.path / ".distore" / "version").read_text().startswith("distorefs ")


def test_the_compiled_kernels_load_at_their_first_use_not_for_files(mount_factory: MountFactory) -> None:
    """numba's import holds the GIL for up to seconds: a daemon serving files never loads
    it; the first sample of a buffer starts the loading of every kernel, in a thread."""
    mounted = mount_factory()  # a daemon of its own: nothing has used a kernel in it yet

    def kernels() -> dict[str, bool]:
        status = json.loads((mounted.path / ".distore" / "status").read_text())
        result: dict[str, bool] = status["kernels"]
        return result

    (mounted.path / "f").write_bytes(b"x" * 300_000)
    assert (mounted.path / "f").read_bytes() == b"x" * 300_000
    time.sleep(KERNELS_IDLE_S + 0.5)  # idle, but with neither a buffer nor a dataset: no preload
    assert not any(kernels().values())
    buffer = mounted.path / "buffers" / "b"
    buffer.mkdir()
    with open(buffer / "append", "wb") as f:
        f.write(b"item")
    assert (buffer / "sample.1").read_bytes()  # served at once, by the plain versions if need be
    deadline = time.monotonic() + 60  # numba is a dependency: every kernel loads
    while not all(kernels().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kernels() == {"sum_tree": True, "counts": True, "priority_pairs": True, "gather_copy": True}
    assert mounted.unmount() == 0


def test_a_daemon_that_wrote_a_big_file_loads_the_kernels_once_idle(mount_factory: MountFactory) -> None:
    """A big file's appends to the log (O_DIRECT, 4 MiB and more) compute their crcs and
    fill their staging buffers with the compiled kernels, which they never start loading
    themselves (the first big write runs plain): the daemon loads them once the mount is
    idle, as it does for a buffer."""
    mounted = mount_factory()
    payload = os.urandom(16 << 20)
    (mounted.path / "big").write_bytes(payload)
    status = json.loads((mounted.path / ".distore" / "status").read_text())
    assert status["blocks"]["log_direct_write_bytes"] > 0
    deadline = time.monotonic() + 60
    while not json.loads((mounted.path / ".distore" / "status").read_text())["kernels"]["gather_copy"]:
        assert time.monotonic() < deadline, "the kernels did not load"
        time.sleep(0.2)
    (mounted.path / "big2").write_bytes(payload[::-1])  # the compiled way now
    assert mounted.unmount() == 0
    again = mount_factory(data_dir=mounted.data_dir)
    assert (again.path / "big").read_bytes() == payload
    assert (again.path / "big2").read_bytes() == payload[::-1]
    assert again.unmount() == 0


def remounted_with_a_buffer(mount_factory: MountFactory) -> Mount:
    """A data dir holding a buffer with one item, mounted by a new daemon (one that no
    call has asked for a compiled kernel yet)."""
    mounted = mount_factory()
    buffer = mounted.path / "buffers" / "b"
    buffer.mkdir()
    with open(buffer / "append", "wb") as f:
        f.write(b"item")
    assert mounted.unmount() == 0
    return mount_factory()


def test_a_mount_polled_ten_times_a_second_still_loads_the_kernels_before_its_first_call(
    mount_factory: MountFactory,
) -> None:
    """A status poller (a readiness probe, bench_million's wait for the warm-up) never
    left the mount a second without a request, so the kernels waited for the job's first
    call; light traffic (under KERNELS_QUIET_REQUESTS a second) now counts as quiet."""
    mounted = remounted_with_a_buffer(mount_factory)
    loaded: dict[str, bool] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.1)
        loaded = json.loads((mounted.path / ".distore" / "status").read_text())["kernels"]
        if all(loaded.values()):
            break
    assert loaded == {"sum_tree": True, "counts": True, "priority_pairs": True, "gather_copy": True}
    assert mounted.unmount() == 0


def test_a_quiet_mount_with_a_buffer_loads_the_kernels_before_its_first_call(mount_factory: MountFactory) -> None:
    """A job restarted on its data dir: the daemon finds a buffer, and once no request has
    come for KERNELS_IDLE_S it loads the compiled kernels, so the job's first append does
    not wait on numba's import (it held appends up to 26 ms)."""
    mounted = remounted_with_a_buffer(mount_factory)  # a new daemon: nothing has asked for a kernel in it
    loaded: dict[str, bool] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(KERNELS_IDLE_S + 0.5)  # each look at status is a request: quiet between them
        loaded = json.loads((mounted.path / ".distore" / "status").read_text())["kernels"]
        if all(loaded.values()):
            break
    assert loaded == {"sum_tree": True, "counts": True, "priority_pairs": True, "gather_copy": True}
    buffer_requests = [
        line
        for line in (mounted.path / ".distore" / "metrics").read_text().splitlines()
        if line.startswith("distorefs_data_request_seconds_count{") and 'kind="buffers"' in line
    ]
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in buffer_requests)  # no call of the buffer's asked
    assert mounted.unmount() == 0


def test_a_file_opened_as_soon_as_the_mount_is_ready_is_read_in_1_mib_requests(
    mount_factory: MountFactory,
) -> None:
    """The daemon raises the mount's read-ahead (root only) before it says it is ready: a
    file keeps the read-ahead its mount had at its open, and one opened before the raise
    was read 128 KiB a request for good."""
    if os.geteuid() != 0:
        pytest.skip("raising a mount's read-ahead needs root")
    mount = mount_factory()
    (mount.path / "f").write_bytes(os.urandom(8 << 20))
    assert mount.unmount() == 0
    mount = mount_factory()  # the page cache of the old mount is gone with it
    with open(mount.path / "f", "rb", buffering=0) as f:  # at once: nothing else has touched the mount
        while f.read(1 << 20):
            pass
    reads = data_requests(mount, "tree", "read")  # a new daemon: every READ of a file is this reader's
    assert reads <= 9, f"{reads} READ requests for 8 MiB"
    assert mount.unmount() == 0


def test_distore_dir_is_read_only(mounted: Mount) -> None:
    with pytest.raises(OSError) as excinfo:
        (mounted.path / ".distore" / "status").write_text("x")
    assert excinfo.value.errno in (errno.EACCES, errno.EROFS)
    with pytest.raises(OSError) as excinfo:
        (mounted.path / ".distore" / "new").write_text("x")
    assert excinfo.value.errno in (errno.EACCES, errno.EROFS)


def test_reserved_directories_cannot_be_removed_or_renamed(mounted: Mount) -> None:
    for name in ("checkpoints", "buffers", ".distore"):
        with pytest.raises(OSError) as excinfo:
            os.rmdir(mounted.path / name)
        assert excinfo.value.errno == errno.EBUSY
        with pytest.raises(OSError) as excinfo:
            os.rename(mounted.path / name, mounted.path / f"{name}-moved")
        assert excinfo.value.errno == errno.EBUSY
    with pytest.raises(OSError) as excinfo:
        os.mkdir(mounted.path / "weights")
    assert excinfo.value.errno == errno.EEXIST


def test_checkpoints_is_an_ordinary_tree(mounted: Mount) -> None:
    path = mounted.path / "checkpoints" / "run1"
    path.mkdir()
    (path / "step-100.pt").write_bytes(b"weights" * 1000)
    assert (path / "step-100.pt").read_bytes() == b"weights" * 1000
    (path / "step-100.pt").unlink()
    path.rmdir()


def test_write_at_any_offset_and_sparse_holes_read_zeros(scratch: Path) -> None:
    path = scratch / "sparse"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"tail", 5 * 1024 * 1024 + 17)
        os.pwrite(fd, b"head", 3)
        assert os.fstat(fd).st_size == 5 * 1024 * 1024 + 21
        data = os.pread(fd, 6 * 1024 * 1024, 0)
    finally:
        os.close(fd)
    expected = bytearray(5 * 1024 * 1024 + 21)
    expected[3:7] = b"head"
    expected[-4:] = b"tail"
    assert data == expected


def test_truncate_shrinks_and_extends_with_zeros(scratch: Path) -> None:
    path = scratch / "t"
    path.write_bytes(b"x" * 3_000_000)
    os.truncate(path, 1_500_001)
    assert path.stat().st_size == 1_500_001
    os.truncate(path, 2_000_000)
    data = path.read_bytes()
    assert data == b"x" * 1_500_001 + bytes(499_999)
    with open(path, "r+b") as f:
        f.truncate(0)
    assert path.read_bytes() == b""


def test_fallocate_extends_punches_and_zeroes_and_refuses_the_rest(
    mounted: Mount, scratch: Path, tmp_path: Path
) -> None:
    """fallocate(2) through the mount (scripts/pyfuse3-fallocate.patch): without it the
    kernel said EOPNOTSUPP, `fallocate -l` failed, `rsync --preallocate` printed an error
    for every file, and glibc's posix_fallocate fallback refused an O_APPEND descriptor
    (EBADF)."""
    path = scratch / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"head")
        result = subprocess.run(["fallocate", "--length", "1", str(path)], capture_output=True)
        assert result.returncode == 0, f"{result.stderr!r}: is pyfuse3 patched (setup.sh)?"
        os.posix_fallocate(fd, 0, 3 << 20)  # mode 0 on an appending descriptor
    finally:
        os.close(fd)
    assert path.stat().st_size == 3 << 20
    assert path.read_bytes() == b"head" + bytes((3 << 20) - 4)

    text = scratch / "g"
    text.write_bytes(b"hello, world: " + b"x" * (2 << 20))
    subprocess.run(["fallocate", "--punch-hole", "--offset", "2", "--length", "3", str(text)], check=True)
    subprocess.run(["fallocate", "--zero-range", "--offset", "7", "--length", str(1 << 20), str(text)], check=True)
    want = b"he\0\0\0, " + bytes(1 << 20) + b"x" * ((2 << 20) + 14 - 7 - (1 << 20))
    assert text.read_bytes() == want  # (the kernel dropped its cached pages of both ranges)
    subprocess.run(["fallocate", "--keep-size", "--length", str(8 << 20), str(text)], check=True)
    assert text.stat().st_size == len(want)
    sparse = scratch / "sparse"  # a hole punched across a TiB of holes writes nothing (it wrote zeros: a full disk)
    subprocess.run(["fallocate", "--length", str(1 << 40), str(sparse)], check=True)
    with open(sparse, "r+b") as f:
        f.seek(1 << 39)
        f.write(b"data")
    fd = os.open(scratch, os.O_RDONLY)
    os.fsync(fd)  # everything written so far in the log: what the punch adds is its own
    os.close(fd)
    before = mounted.status()
    subprocess.run(["fallocate", "--punch-hole", "--length", str(1 << 40), str(sparse)], check=True)
    with open(sparse, "rb") as f:
        f.seek(1 << 39)
        assert f.read(8) == bytes(8)
    after = mounted.status()
    assert sparse.stat().st_size == 1 << 40
    assert after["dram_used_bytes"] <= before["dram_used_bytes"]  # type: ignore[operator]
    assert after["log_bytes"] - before["log_bytes"] < 1 << 20  # type: ignore[operator]
    result = subprocess.run(["fallocate", "--collapse-range", "--length", "4096", str(text)], capture_output=True)
    assert result.returncode != 0
    assert b"not supported" in result.stderr
    buffer = mounted.path / "buffers" / "fallocate"
    buffer.mkdir()
    try:
        result = subprocess.run(["fallocate", "--length", "10", str(buffer / "append")], capture_output=True)
        assert b"not supported" in result.stderr
    finally:
        buffer.rmdir()

    source = tmp_path / "src"
    source.mkdir()
    (source / "big").write_bytes(os.urandom(5 << 20))
    result = subprocess.run(["rsync", "-a", "--preallocate", f"{source}/", f"{scratch}/copy/"], capture_output=True)
    assert result.returncode == 0
    assert result.stderr == b""  # (it said `do_fallocate ...: Operation not supported (95)`)
    assert (scratch / "copy" / "big").read_bytes() == (source / "big").read_bytes()
    assert mounted.status()["internal_errors"] == 0


def test_random_writes_truncates_and_reads_match_a_model_of_the_file(mounted: Mount, scratch: Path) -> None:
    """fsx in small: writes at random offsets and lengths (across blocks, leaving holes),
    truncates down and up, reads checked against the same operations on a bytearray,
    through a read-write descriptor (page cache) and a write-only one (direct): holes and
    grown tails read as zeros, every byte as last written."""
    rng = np.random.default_rng(17)
    path = scratch / "fsx"
    model = bytearray()
    rw = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    wo = os.open(path, os.O_WRONLY)
    try:
        for step in range(400):
            op = rng.integers(0, 10)
            if op < 5:  # a write, sometimes far past the end (a hole before it)
                at = int(rng.integers(0, len(model) + 3 * 1024 * 1024))
                data = rng.integers(1, 256, int(rng.integers(1, 300_000)), dtype=np.uint8).tobytes()
                os.pwrite(rw if op % 2 else wo, data, at)
                if at > len(model):
                    model.extend(bytes(at - len(model)))
                model[at : at + len(data)] = data
            elif op < 7:  # truncate down or up
                size = int(rng.integers(0, len(model) + 2 * 1024 * 1024))
                os.ftruncate(rw, size)
                del model[size:]
                model.extend(bytes(size - len(model)))
            else:  # a read anywhere, past the end too
                at = int(rng.integers(0, len(model) + 1024))
                n = int(rng.integers(1, 2 * 1024 * 1024))
                assert os.pread(rw, n, at) == bytes(model[at : at + n]), f"step {step}: read {n} at {at}"
        assert os.fstat(rw).st_size == len(model)
    finally:
        os.close(wo)
        os.close(rw)
    assert path.read_bytes() == model
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:  # what the daemon holds, not the kernel's copy
            f.write("1\n")
    except PermissionError:
        return  # (not root: the reads above went through the kernel's page cache and the daemon alike)
    assert path.read_bytes() == model


def test_open_with_o_trunc_empties_the_file(scratch: Path) -> None:
    path = scratch / "t"
    path.write_bytes(b"old content that is long")
    path.write_bytes(b"new")
    assert path.read_bytes() == b"new"


def test_mkdir_rmdir_and_enotempty(scratch: Path) -> None:
    (scratch / "d" / "e").mkdir(parents=True)
    with pytest.raises(OSError) as excinfo:
        os.rmdir(scratch / "d")
    assert excinfo.value.errno == errno.ENOTEMPTY
    os.rmdir(scratch / "d" / "e")
    os.rmdir(scratch / "d")
    assert not (scratch / "d").exists()


def test_unlink_while_open_keeps_data(scratch: Path) -> None:
    path = scratch / "open"
    payload = os.urandom(3 * 1024 * 1024)
    path.write_bytes(payload)
    with open(path, "rb") as f:
        path.unlink()
        assert not path.exists()
        assert f.read() == payload
        assert os.fstat(f.fileno()).st_nlink == 0


def test_rename_replaces_the_target_atomically(scratch: Path) -> None:
    (scratch / "a").write_text("new")
    (scratch / "b").write_text("old")
    os.rename(scratch / "a", scratch / "b")
    assert (scratch / "b").read_text() == "new"
    assert not (scratch / "a").exists()


def test_rename_across_directories_moves_subtrees(scratch: Path) -> None:
    (scratch / "x" / "sub").mkdir(parents=True)
    (scratch / "x" / "sub" / "f").write_text("f")
    (scratch / "y").mkdir()
    os.rename(scratch / "x" / "sub", scratch / "y" / "sub2")
    assert (scratch / "y" / "sub2" / "f").read_text() == "f"
    assert os.listdir(scratch / "x") == []
    assert os.stat(scratch / "x").st_nlink == 2
    assert os.stat(scratch / "y").st_nlink == 3


def test_rename_errors(scratch: Path) -> None:
    (scratch / "file").write_text("f")
    (scratch / "dir").mkdir()
    (scratch / "full").mkdir()
    (scratch / "full" / "x").write_text("x")
    cases = [
        ("file", "dir", errno.EISDIR),
        ("dir", "file", errno.ENOTDIR),
        ("dir", "full", errno.ENOTEMPTY),
        ("missing", "other", errno.ENOENT),
    ]
    for old, new, code in cases:
        with pytest.raises(OSError) as excinfo:
            os.rename(scratch / old, scratch / new)
        assert excinfo.value.errno == code, (old, new)
    with pytest.raises(OSError) as excinfo:
        os.rename(scratch / "dir", scratch / "dir" / "inside")
    assert excinfo.value.errno == errno.EINVAL
    assert (scratch / "file").read_text() == "f"  # nothing half-applied


def test_rename_dir_over_empty_dir(scratch: Path) -> None:
    (scratch / "src").mkdir()
    (scratch / "src" / "f").write_text("f")
    (scratch / "dst").mkdir()
    os.rename(scratch / "src", scratch / "dst")
    assert (scratch / "dst" / "f").read_text() == "f"
    assert os.stat(scratch).st_nlink == 3


def test_symlink_and_readlink(scratch: Path) -> None:
    (scratch / "target").write_text("hi")
    os.symlink("target", scratch / "link")
    assert os.readlink(scratch / "link") == "target"
    assert (scratch / "link").read_text() == "hi"
    assert stat.S_ISLNK(os.lstat(scratch / "link").st_mode)
    os.symlink("/nowhere/at/all", scratch / "dangling")
    assert os.readlink(scratch / "dangling") == "/nowhere/at/all"


def test_hard_links_share_data_and_count(scratch: Path) -> None:
    (scratch / "a").write_text("shared")
    os.link(scratch / "a", scratch / "b")
    assert os.stat(scratch / "a").st_nlink == 2
    assert os.stat(scratch / "a").st_ino == os.stat(scratch / "b").st_ino
    (scratch / "a").unlink()
    assert (scratch / "b").read_text() == "shared"
    assert os.stat(scratch / "b").st_nlink == 1


def test_stat_reports_size_mode_owner_and_times(scratch: Path) -> None:
    before = time.time_ns()
    path = scratch / "s"
    path.write_bytes(b"12345")
    st = os.stat(path)
    assert st.st_size == 5
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o644 & ~_umask()
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    assert st.st_nlink == 1
    assert before - 10**9 <= st.st_mtime_ns <= time.time_ns() + 10**9
    assert st.st_ctime_ns >= st.st_mtime_ns - 10**9


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_chmod_chown_utimens(scratch: Path) -> None:
    path = scratch / "c"
    path.write_text("c")
    os.chmod(path, 0o600)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chown(path, 1234, 5678)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.utime(path, ns=(1_000_000_000_123, 2_000_000_000_456))
    st = os.stat(path)
    assert st.st_atime_ns == 1_000_000_000_123
    assert st.st_mtime_ns == 2_000_000_000_456


def test_statfs_reports_space_and_name_max(mounted: Mount) -> None:
    st = os.statvfs(mounted.path)
    assert st.f_bsize > 0
    assert st.f_blocks > 0
    assert 0 < st.f_bavail <= st.f_blocks
    assert st.f_namemax == 255


def test_fsync_and_fdatasync_succeed_and_persist_to_the_log(mounted: Mount, scratch: Path) -> None:
    path = scratch / "synced"
    with open(path, "wb") as f:
        f.write(b"d" * 2_000_000)
        f.flush()
        os.fsync(f.fileno())
        assert mounted.status()["dram_dirty_bytes"] == 0
        f.write(b"e")
        f.flush()
        os.fdatasync(f.fileno())
    assert path.read_bytes() == b"d" * 2_000_000 + b"e"


def test_user_xattrs_round_trip_and_others_are_refused(scratch: Path) -> None:
    path = scratch / "x"
    path.write_text("x")
    os.setxattr(path, "user.origin", b"replay-7")
    assert os.getxattr(path, "user.origin") == b"replay-7"
    assert "user.origin" in os.listxattr(path)
    with pytest.raises(OSError) as excinfo:
        os.getxattr(path, "user.missing")
    assert excinfo.value.errno == errno.ENODATA
    with pytest.raises(OSError) as excinfo:
        os.setxattr(path, "trusted.secret", b"no")
    assert excinfo.value.errno == errno.ENOTSUP
    os.removexattr(path, "user.origin")
    assert os.listxattr(path) == []


def test_long_names_get_enametoolong(scratch: Path) -> None:
    with pytest.raises(OSError) as excinfo:
        (scratch / ("n" * 256)).write_text("x")
    assert excinfo.value.errno == errno.ENAMETOOLONG
    (scratch / ("n" * 255)).write_text("ok")


def test_missing_entries_get_enoent(scratch: Path) -> None:
    with pytest.raises(FileNotFoundError):
        (scratch / "nope").read_bytes()
    with pytest.raises(FileNotFoundError):
        os.unlink(scratch / "nope")


def test_create_list_remove_5000_entries(scratch: Path) -> None:
    directory = scratch / "many"
    directory.mkdir()
    count = 5000
    for i in range(count):
        os.mknod(directory / f"f{i:05d}", 0o644 | stat.S_IFREG)
    names = os.listdir(directory)
    assert sorted(names) == [f"f{i:05d}" for i in range(count)]
    for name in names:
        os.unlink(directory / name)
    assert os.listdir(directory) == []


def test_open_directories_share_one_listing_until_the_directory_changes(mounted: Mount, scratch: Path) -> None:
    """Each opendir made its own copy of the entries (about 64 bytes each): 400
    descriptors open on a directory of 10,000 names held 256 MB in the daemon. Now every
    open of an unchanged directory shares one listing; an open keeps the entries it began
    with (a name made after it is not in its listing, and is in a new open's)."""
    directory = scratch / "shared"
    directory.mkdir()
    for i in range(10_000):
        os.mknod(directory / f"f{i:05d}", 0o644 | stat.S_IFREG)

    def resident() -> int:
        with open(f"/proc/{mounted.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    fds = [os.open(directory, os.O_RDONLY | os.O_DIRECTORY) for _ in range(400)]
    try:
        grown = resident() - before
        (directory / "late").touch()
        late = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert "late" in os.listdir(late)
        finally:
            os.close(late)
        assert "late" not in os.listdir(fds[0])
        assert len(os.listdir(fds[-1])) == 10_000
    finally:
        for fd in fds:
            os.close(fd)
    assert grown < 32 << 20, f"the daemon grew {grown >> 20} MiB for 400 opens of one directory"
    shutil.rmtree(directory)


def test_a_read_only_close_sends_no_flush_and_a_writing_one_does(mounted: Mount, scratch: Path) -> None:
    """A read-only open replies FOPEN_NOFLUSH (pyfuse3 built with
    scripts/pyfuse3-noflush.patch, docs/design.md "Read-only closes send no FLUSH"):
    its closes, a dup's included, cost no round trip. A close of an open that could
    write still sends its FLUSH, which is what puts the file in the log."""
    path = scratch / "f"
    path.write_bytes(b"x" * 10_000)
    flushes = fuse_requests(mounted, "flush")
    for _ in range(3):
        with open(path, "rb") as f:
            os.close(os.dup(f.fileno()))
            assert f.read() == b"x" * 10_000
    assert subprocess.run(["cat", str(path)], capture_output=True, check=True).stdout == b"x" * 10_000
    assert fuse_requests(mounted, "flush") == flushes, "a read-only close sent FLUSH: is pyfuse3 patched (setup.sh)?"
    with open(path, "r+b") as f:  # could write: its close flushes, even with nothing written
        assert f.read(1) == b"x"
    assert fuse_requests(mounted, "flush") == flushes + 1
    with open(path, "ab") as f:
        f.write(b"y")
    assert fuse_requests(mounted, "flush") == flushes + 2
    assert path.read_bytes() == b"x" * 10_000 + b"y"


def test_a_write_only_open_writes_past_the_page_cache_and_every_reader_sees_it(mounted: Mount, scratch: Path) -> None:
    """Write-only opens are direct_io (docs/design.md, "Write-only opens skip the page
    cache"): no GETXATTR before each write, and the kernel drops what other opens cache
    of the range written, so a reader's descriptor, a new open and a shared mapping all
    see the new bytes."""
    path = scratch / "f"
    path.write_bytes(b"A" * 8192)
    reader = os.open(path, os.O_RDONLY)
    both = os.open(path, os.O_RDWR)
    mapped = mmap.mmap(both, 8192)
    try:
        assert os.pread(reader, 8192, 0) == b"A" * 8192  # cached by the kernel now
        assert mapped[:8192] == b"A" * 8192

        before = fuse_requests(mounted, "getxattr")
        writer = os.open(path, os.O_WRONLY)
        for i in range(20):
            os.pwrite(writer, b"B" * 100, i * 100)
        os.close(writer)
        assert fuse_requests(mounted, "getxattr") == before  # none asked before the writes

        expected = b"B" * 2000 + b"A" * 6192
        assert os.pread(reader, 8192, 0) == expected
        assert mapped[:8192] == expected
        assert path.read_bytes() == expected

        appender = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.write(appender, b"C" * 100)
        os.close(appender)
        assert os.stat(path).st_size == 8292
        assert os.pread(reader, 200, 8192) == b"C" * 100

        before = fuse_requests(mounted, "getxattr")
        os.pwrite(both, b"D", 0)  # a read-write open stays buffered: the kernel asks again
        assert fuse_requests(mounted, "getxattr") > before
    finally:
        mapped.close()
        os.close(both)
        os.close(reader)


def test_a_new_file_reuses_a_deleted_files_memory_and_never_shows_its_bytes(mounted: Mount, scratch: Path) -> None:
    """The DRAM cache keeps a deleted file's 1 MiB block buffers for the next new blocks
    (docs/design.md, "Block buffers are reused"). What a new file did not write reads as
    zeros through every way in: a short write into a block, a hole left by a truncate
    up, a read through the page cache and one past it."""
    old = scratch / "old"
    old.write_bytes(b"\xaa" * (8 << 20))
    old.unlink()
    # The blocks go when the file's last open goes: the kernel sends that RELEASE after
    # close() has returned, so the unlink may come first.
    deadline = time.monotonic() + 10
    while True:
        blocks = mounted.status()["blocks"]
        assert isinstance(blocks, dict)
        if blocks["dram_spare_bytes"] >= 4 << 20 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert blocks["dram_spare_bytes"] >= 4 << 20
    reused_before = blocks["dram_reused_buffers"]

    new = scratch / "new"
    fd = os.open(new, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.ftruncate(fd, 8 << 20)
        for i in range(8):
            os.pwrite(fd, b"new", (i << 20) + 500_000)  # far enough in for a whole block's buffer
    finally:
        os.close(fd)
    blocks = mounted.status()["blocks"]
    assert isinstance(blocks, dict)
    assert blocks["dram_reused_buffers"] >= reused_before + 4

    expected = bytearray(8 << 20)
    for i in range(8):
        expected[(i << 20) + 500_000 : (i << 20) + 500_003] = b"new"
    assert new.read_bytes() == expected
    direct = os.open(new, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 8 << 20)
        assert os.preadv(direct, [buf], 0) == 8 << 20
        assert buf[:] == expected
        buf.close()
    finally:
        os.close(direct)
