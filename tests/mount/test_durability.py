"""What survives: clean remounts, kill -9, torn log tails; compaction and the DRAM budget."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from distorefs.stores.files import ROOT_INODE, FileStore
from distorefs.tiers.blocks import BlockStore
from distorefs.tiers.dram import DramCache
from distorefs.tiers.metadb import MetaDb
from distorefs.tiers.nvme_log import HEADER, NvmeLog, segment_name
from tests.conftest import EXIT_TIMEOUT_S, Mount

pytestmark = pytest.mark.mount

MountFactory = Callable[..., Mount]


def tree(mount: Mount) -> Path:
    """A plain directory of the POSIX tree (checkpoints/ has a policy of its own)."""
    path = mount.path / "files"
    path.mkdir(exist_ok=True)
    return path


def digest_tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """path -> (mode, size, sha256 or link target) for every entry under root."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = (st.st_mode, 0, os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = (st.st_mode, st.st_size, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                out[rel] = (st.st_mode, 0, "")
    return out


def write_tree(root: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "small.txt").write_text("small\n")
    (root / "a" / "b" / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 123))
    (root / "empty").write_bytes(b"")
    with open(root / "sparse", "wb") as f:
        f.seek(2 * 1024 * 1024)
        f.write(b"end")
    os.symlink("a/small.txt", root / "link")
    os.chmod(root / "a" / "small.txt", 0o640)
    os.setxattr(root / "a" / "small.txt", "user.tag", b"v1")


def test_clean_remount_brings_back_the_whole_tree(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    write_tree(tree(mount))
    before = digest_tree(tree(mount))
    assert mount.unmount() == 0
    mount = mount_factory()
    assert digest_tree(tree(mount)) == before
    assert os.getxattr(tree(mount) / "a" / "small.txt", "user.tag") == b"v1"
    assert mount.unmount() == 0


def test_a_remount_freezes_the_loaded_tree_for_the_garbage_collector(mount_factory: MountFactory) -> None:
    """A full collection visits every tracked object with the daemon answering nothing;
    the tree loaded at start-up (an inode object per file) is frozen out of them. Its
    files still go when unlinked and new ones come as before."""
    mount = mount_factory()
    fresh_frozen = mount.status()["gc"]["frozen_objects"]  # type: ignore[index]
    root = tree(mount)
    (root / "many").mkdir()
    for i in range(3000):
        (root / "many" / f"f{i}").write_bytes(b"%d" % i)
    assert mount.unmount() == 0

    mount = mount_factory()
    gc_status = mount.status()["gc"]
    assert isinstance(gc_status, dict)
    # the 3,001 inodes among them (the rest of start-up's objects differ by a few between
    # a new data dir and one loaded: 2,998 more in all, measured)
    assert gc_status["frozen_objects"] - fresh_frozen >= 2900, (fresh_frozen, gc_status)
    assert len(gc_status["collections"]) == 3
    root = tree(mount)
    for i in range(0, 3000, 2):
        os.unlink(root / "many" / f"f{i}")
        (root / "many" / f"g{i}").write_bytes(b"new %d" % i)
    assert mount.unmount() == 0
    mount = mount_factory()
    names = set(os.listdir(tree(mount) / "many"))
    assert names == {f"f{i}" for i in range(1, 3000, 2)} | {f"g{i}" for i in range(0, 3000, 2)}
    assert (tree(mount) / "many" / "f2999").read_bytes() == b"2999"
    assert (tree(mount) / "many" / "g2998").read_bytes() == b"new 2998"
    assert mount.unmount() == 0


def test_kill_9_keeps_every_fsynced_and_closed_file(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    root = tree(mount)
    synced = {f"synced-{i}": os.urandom(700_000 + i) for i in range(5)}
    for name, payload in synced.items():
        with open(root / name, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    closed = os.urandom(2_500_000)
    (root / "closed").write_bytes(closed)
    (root / "dir").mkdir()
    (root / "dir" / "synced-in-dir").write_bytes(b"in dir")
    fd = os.open(root / "dir" / "synced-in-dir", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    mount.kill9()

    mount = mount_factory()
    for name, payload in synced.items():
        assert (tree(mount) / name).read_bytes() == payload
    assert (tree(mount) / "dir" / "synced-in-dir").read_bytes() == b"in dir"
    # A killed daemon's closed files are in the OS page cache and the WAL: they survive too.
    assert (tree(mount) / "closed").read_bytes() == closed
    assert mount.unmount() == 0


def test_fsyncs_of_many_threads_at_once_share_commits_and_each_survives_kill_9(mount_factory: MountFactory) -> None:
    """16 threads, each writing and fsyncing its own file 10 times: fsyncs that come while
    a durable commit runs share the next one (`durable_commits` well under
    `durable_persists` in `.distore/status`), and after a kill -9 each file holds what
    its last fsync covered."""
    mount = mount_factory()
    root = tree(mount)
    errors: list[BaseException] = []

    def fsync_loop(k: int) -> None:
        try:
            fd = os.open(root / f"t{k}", os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                for i in range(10):
                    os.pwrite(fd, b"%02d:%02d|" % (k, i) * 512, 0)
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    before = mount.status()["blocks"]
    threads = [threading.Thread(target=fsync_loop, args=(k,)) for k in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "an fsync loop did not end within 120 s"
    assert not errors, errors
    after = mount.status()["blocks"]
    persists = after["durable_persists"] - before["durable_persists"]
    commits = after["durable_commits"] - before["durable_commits"]
    assert persists >= 160
    assert commits <= persists // 2, (persists, commits)
    mount.kill9()

    mount = mount_factory()
    for k in range(16):
        assert (tree(mount) / f"t{k}").read_bytes() == b"%02d:09|" % k * 512
    assert mount.unmount() == 0


def test_a_big_file_goes_to_the_log_while_written_and_a_kill_9_after_its_close_keeps_it(
    mount_factory: MountFactory,
) -> None:
    mount = mount_factory("--dram-budget", "256MiB", "--flush-interval", "60")  # no flusher pass meanwhile
    root = tree(mount)
    chunk = 1 << 20
    data = bytearray(os.urandom(40 * chunk + 12_345))
    fd = os.open(root / "big", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, 32 * chunk, chunk):
            os.write(fd, data[start : start + chunk])
        blocks = mount.status()["blocks"]
        assert isinstance(blocks, dict)
        deadline = time.monotonic() + 10
        while blocks["written_behind_bytes"] < 16 * chunk and time.monotonic() < deadline:
            time.sleep(0.02)
            blocks = mount.status()["blocks"]
            assert isinstance(blocks, dict)
        assert blocks["written_behind_bytes"] >= 16 * chunk  # in the log while the file is still open
        os.pwrite(fd, b"changed after it was written behind", 3 * chunk + 5)
        data[3 * chunk + 5 : 3 * chunk + 5 + 35] = b"changed after it was written behind"
        for start in range(32 * chunk, len(data), chunk):
            os.write(fd, data[start : start + chunk])
    finally:
        os.close(fd)
    mount.kill9()

    mount = mount_factory()
    assert (tree(mount) / "big").read_bytes() == data
    assert mount.unmount() == 0


def test_kill_9_after_closes_acknowledged_by_row_notes_brings_back_the_tree_as_the_last_close_left_it(
    mount_factory: MountFactory,
) -> None:
    """Small closes write a row note to the log instead of committing (docs/design.md,
    "Closes acknowledged by row notes"). With the background commits pushed out of the
    test's way, a kill -9 after the last close must bring back everything staged before
    it: files, overwrites, renames, removals, modes, attributes, links, directories."""
    mount = mount_factory("--flush-interval", "600", "--sync-interval", "600", "--snapshot-interval", "600")
    root = tree(mount)
    write_tree(root)  # (its 3 MiB file is too big for a note: that close commits)
    many = root / "many"
    many.mkdir()
    for i in range(300):
        (many / f"f{i}").write_bytes(os.urandom(i * 13))
    for i in range(0, 300, 7):
        os.rename(many / f"f{i}", root / "a" / f"moved{i}")
    for i in range(1, 300, 11):
        if i % 7:  # (the others moved)
            os.unlink(many / f"f{i}")
    (many / "f2").write_bytes(b"shorter")
    os.truncate(many / "f3", 1)
    os.chmod(many / "f4", 0o600)
    os.setxattr(many / "f5", "user.k", b"v")
    (root / "deep" / "er").mkdir(parents=True)
    os.symlink("../many/f2", root / "deep" / "link")
    blocks = mount.status()["blocks"]
    assert isinstance(blocks, dict)
    notes_before = blocks["row_notes"]
    (root / "deep" / "er" / "last").write_bytes(b"the last close")
    blocks = mount.status()["blocks"]
    assert isinstance(blocks, dict)
    assert blocks["row_notes"] == notes_before + 1  # the last close wrote a note, no commit
    before = digest_tree(root)
    mount.kill9()

    mount = mount_factory()
    assert digest_tree(tree(mount)) == before
    assert os.getxattr(tree(mount) / "many" / "f5", "user.k") == b"v"
    (tree(mount) / "after").write_bytes(b"writes go on")
    assert mount.unmount() == 0
    mount = mount_factory()
    assert digest_tree(tree(mount))["deep/er/last"] == before["deep/er/last"]
    assert (tree(mount) / "after").read_bytes() == b"writes go on"
    assert mount.unmount() == 0


def test_kill_9_right_after_namespace_changes_keeps_every_one_that_was_answered(mount_factory: MountFactory) -> None:
    """A namespace change writes no data, so no close carries it: each one (mkdir,
    rename, unlink, rmdir, link, symlink, chmod, truncate, xattrs, a buffer's rmdir)
    is logged before its reply (docs/design.md, "Namespace changes logged before the
    reply"). With the background commits out of the way, a kill -9 right after the
    last of them must keep them all; the atomic save (write a temporary, rename it over
    the real name) is the case a trainer relies on."""
    mount = mount_factory("--flush-interval", "600", "--sync-interval", "600", "--snapshot-interval", "600")
    root = tree(mount)
    write_tree(root)
    (root / "ckpt").write_bytes(b"old checkpoint")
    (root / "gone").mkdir()
    (root / "doomed").write_bytes(b"x")
    (mount.path / "buffers" / "old").mkdir()
    fd = os.open(mount.path, os.O_RDONLY)
    os.fsync(fd)  # everything so far durable: what follows is only in notes
    os.close(fd)

    (mount.path / "buffers" / "new").mkdir()  # (a buffer's mkdir commits: first, then)
    os.rmdir(mount.path / "buffers" / "old")
    (root / "ckpt.tmp").write_bytes(b"new checkpoint")
    os.replace(root / "ckpt.tmp", root / "ckpt")
    (root / "made").mkdir()
    os.rmdir(root / "gone")
    os.unlink(root / "doomed")
    os.rename(root / "a" / "b", root / "moved")
    os.link(root / "empty", root / "made" / "hard")
    os.symlink("../ckpt", root / "made" / "soft")
    os.chmod(root / "sparse", 0o600)
    os.truncate(root / "sparse", 5)
    os.setxattr(root / "empty", "user.k", b"v")
    os.removexattr(root / "a" / "small.txt", "user.tag")
    before = digest_tree(root)
    mount.kill9()

    mount = mount_factory()
    root = tree(mount)
    assert digest_tree(root) == before
    assert (root / "ckpt").read_bytes() == b"new checkpoint"
    assert os.getxattr(root / "empty", "user.k") == b"v"
    assert os.listxattr(root / "a" / "small.txt") == []
    assert os.stat(root / "empty").st_nlink == 2
    assert sorted(os.listdir(mount.path / "buffers")) == ["new"]
    assert mount.unmount() == 0


def test_kill_9_amid_concurrent_closes_keeps_every_acknowledged_file(mount_factory: MountFactory) -> None:
    """Four writers make files of 0-300 KiB (small ones acknowledged by row notes, big
    ones by commits) while the flusher commits every 100 ms; the daemon is killed in the
    middle. Every file whose close returned comes back whole."""
    mount = mount_factory("--flush-interval", "0.1")
    root = tree(mount)
    acked: dict[str, str] = {}
    stop = threading.Event()

    def writer(w: int) -> None:
        i = 0
        while not stop.is_set():
            name = f"w{w}-{i}"
            payload = os.urandom([0, 100, 4096, 70_000, 300_000][i % 5] + w)
            try:
                with open(root / name, "wb") as f:
                    f.write(payload)
            except OSError:
                return  # the daemon is gone: this close was not acknowledged
            acked[name] = hashlib.sha256(payload).hexdigest()
            i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(acked) < 400 and time.monotonic() < deadline:
            time.sleep(0.05)
        blocks = mount.status()["blocks"]
        assert isinstance(blocks, dict)
        assert blocks["row_notes"] > 0
        mount.kill9()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert len(acked) >= 400

    mount = mount_factory()
    for name, digest in acked.items():
        assert hashlib.sha256((tree(mount) / name).read_bytes()).hexdigest() == digest, name
    assert mount.unmount() == 0


def test_torn_record_at_the_log_tail_is_dropped_and_the_mount_comes_up(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    payload = os.urandom(1_500_000)
    with open(tree(mount) / "kept", "wb") as f:
        f.write(payload)
        os.fsync(f.fileno())
    mount.kill9()
    log_dir = mount.data_dir / "log"
    segments = sorted(p for p in log_dir.iterdir() if p.stat().st_size > 0)
    newest = segments[-1]
    # A crash mid-append: a valid header whose payload never fully reached the disk.
    with open(newest, "rb") as f:
        header = f.read(HEADER.size)
    with open(newest, "ab") as f:
        f.write(header + b"\xab" * 100)
    size_with_tear = newest.stat().st_size

    mount = mount_factory()
    assert (tree(mount) / "kept").read_bytes() == payload
    assert newest.stat().st_size == size_with_tear - HEADER.size - 100
    log_text = (mount.data_dir.parent / "data.daemon.log").read_text()
    assert f"dropped a torn tail of {HEADER.size + 100} bytes" in log_text
    (tree(mount) / "after").write_bytes(b"writes go on")
    assert mount.unmount() == 0
    mount = mount_factory()
    assert (tree(mount) / "after").read_bytes() == b"writes go on"
    assert mount.unmount() == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_persist_everything_and_unmount(mount_factory: MountFactory, signum: int) -> None:
    mount = mount_factory()
    payload = os.urandom(4_000_000)
    (tree(mount) / "f").write_bytes(payload)
    mount.proc.send_signal(signum)
    assert mount.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert not os.path.ismount(mount.path)
    mount = mount_factory()
    assert (tree(mount) / "f").read_bytes() == payload
    assert mount.unmount() == 0


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def test_compaction_reclaims_space_of_deleted_and_overwritten_files(mount_factory: MountFactory) -> None:
    mount = mount_factory("--segment-size", "4MiB", "--compact-interval", "0.2")
    root = tree(mount)
    keep = {}
    for i in range(40):
        payload = os.urandom(1024 * 1024)
        (root / f"f{i}").write_bytes(payload)
        if i % 10 == 0:
            keep[f"f{i}"] = payload
    for i in range(40):
        if f"f{i}" not in keep:
            (root / f"f{i}").unlink()
    # Overwrites leave dead records too.
    for name, payload in keep.items():
        (root / name).write_bytes(payload)
    wait_for(lambda: int(mount.status()["log_bytes"]) < 12 * 1024 * 1024, 30, "compaction to shrink the log")
    after = mount.status()
    assert float(after["log_live_ratio"]) > 0.3
    # 44 MiB went into the log (each close appends its file) and under 12 MiB is left:
    # compaction took the rest, whether it ran after the writes or (under load) between
    # them, which the log's size at the end of the writes did not tell apart
    assert int(after["blocks"]["reclaimed_bytes"]) > 32 * 1024 * 1024
    for name, payload in keep.items():
        assert (root / name).read_bytes() == payload
    assert mount.unmount() == 0
    mount = mount_factory("--segment-size", "4MiB")
    for name, payload in keep.items():
        assert (tree(mount) / name).read_bytes() == payload
    assert mount.unmount() == 0


def test_dram_budget_holds_under_a_working_set_three_times_larger(mount_factory: MountFactory) -> None:
    budget = 16 * 1024 * 1024
    mount = mount_factory("--dram-budget", "16MiB")
    root = tree(mount)
    files = {f"w{i}": os.urandom(4 * 1024 * 1024) for i in range(12)}  # 48 MiB
    peak = 0
    for name, payload in files.items():
        (root / name).write_bytes(payload)
        peak = max(peak, int(mount.status()["dram_used_bytes"]))
    assert peak <= budget
    assert mount.unmount() == 0

    mount = mount_factory("--dram-budget", "16MiB")  # fresh kernel cache and empty DRAM
    for name, payload in files.items():
        assert (tree(mount) / name).read_bytes() == payload
        status = mount.status()
        peak = max(peak, int(status["dram_used_bytes"]))
    blocks = status["blocks"]
    assert isinstance(blocks, dict)
    assert peak <= budget
    assert blocks["dram_misses"] >= 48  # every 1 MiB block came from the log
    assert blocks["dram_evictions"] > 0
    assert mount.unmount() == 0


def populate_directory(data_dir: Path, name: bytes, count: int) -> None:
    """Create `count` empty files in /name through the store layer (no mount)."""

    data_dir.mkdir(parents=True, exist_ok=True)

    async def build() -> None:
        log = NvmeLog.open(str(data_dir / "log"))
        meta = MetaDb.open(str(data_dir / "meta.sqlite"))
        blocks = BlockStore(log, DramCache(64 * 1024 * 1024), meta)
        files = FileStore.load(blocks, meta)
        directory = files.mkdir(ROOT_INODE, name, 0o755, os.getuid(), os.getgid())
        for i in range(count):
            files.mknod(directory.ino, b"f%06d" % i, 0o100644, 0, os.getuid(), os.getgid())
        await blocks.close()
        meta.close()

    trio.run(build)


def test_readdir_lists_100k_entries_completely(mount_factory: MountFactory, tmp_path: Path) -> None:
    count = 100_000
    populate_directory(tmp_path / "data", b"big", count)
    assert segment_name(1) in os.listdir(tmp_path / "data" / "log")
    mount = mount_factory()
    started = time.monotonic()
    names = os.listdir(mount.path / "big")
    listed_s = time.monotonic() - started
    assert len(names) == count
    assert set(names) == {f"f{i:06d}" for i in range(count)}
    print(f"listed {count} entries in {listed_s:.2f} s")
    assert mount.unmount() == 0


def test_a_corrupted_record_reads_as_eio_and_is_never_served(mount_factory: MountFactory) -> None:
    mount = mount_factory()
    good, bad = os.urandom(1024 * 1024), os.urandom(1024 * 1024)
    (tree(mount) / "good").write_bytes(good)
    (tree(mount) / "bad").write_bytes(bad)
    assert mount.unmount() == 0
    log_dir = mount.data_dir / "log"
    flipped = 0
    for segment in sorted(log_dir.iterdir()):
        data = bytearray(segment.read_bytes())
        at = data.find(bad[1000:1064])
        if at >= 0:
            data[at] ^= 0xFF
            segment.write_bytes(bytes(data))
            flipped += 1
    assert flipped == 1

    mount = mount_factory()
    with pytest.raises(OSError) as excinfo:
        (tree(mount) / "bad").read_bytes()
    assert excinfo.value.errno == errno.EIO
    assert (tree(mount) / "good").read_bytes() == good
    assert mount.status()["degraded"] is False  # a bad record is an I/O error, not a bug
    (tree(mount) / "new").write_bytes(b"writes still work")
    assert mount.unmount() == 0
