"""Queued requests read at once (`--queued-reads-us`, scripts/pyfuse3-queued-reads.patch):
a request that is already on /dev/fuse when the one before it is answered is read
without a pass of the event loop, and one task at a time waits for /dev/fuse, another
taking over when a handler waits. `.distore/status` counts them under `queued_reads`."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from tests.conftest import Mount, end_the_waits, wait_for, wait_in_samples

MountFactory = Callable[..., Mount]

WRITERS = 4
WRITES = 1000


def record(writer: int, i: int) -> bytes:
    return b"%02d:%06d|" % (writer, i) * 51 + b"\n"  # 511 bytes, each one different


def write_at_once(root: Path) -> None:
    """WRITERS threads, each with its own write-only descriptor (a request per pwrite),
    and one more that writes and fsyncs a file of its own: while the daemon answers one
    request the others wait in /dev/fuse's queue, and an fsync's handler waits for a
    thread while other requests are read by another of pyfuse3's worker tasks."""
    errors: list[BaseException] = []

    def write(name: str, tag: int, count: int, fsync: bool) -> None:
        try:
            fd = os.open(root / name, os.O_CREAT | os.O_WRONLY, 0o644)
            try:
                for i in range(count):
                    os.pwrite(fd, record(tag, i), i * 511)
                    if fsync:
                        os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(f"w{k}", k, WRITES, False)) for k in range(WRITERS)]
    threads.append(threading.Thread(target=write, args=("synced", 99, 50, True)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a writer did not finish within 120 s"
    assert not errors, errors


def assert_written(root: Path) -> None:
    for k in range(WRITERS):
        assert (root / f"w{k}").read_bytes() == b"".join(record(k, i) for i in range(WRITES)), f"w{k}"
    assert (root / "synced").read_bytes() == b"".join(record(99, i) for i in range(50))


def test_requests_queued_behind_a_busy_daemon_are_read_at_once(mount_factory: MountFactory) -> None:
    """Five clients at once: most of their 4,050 writes and fsyncs wait in the queue
    while the daemon answers another, and are read at once after it (3,661 of them on
    an idle two-core VM, 3,471-3,705 beside two CPU hogs). Every byte lands where it
    was written."""
    mount = mount_factory()
    before = mount.status()["queued_reads"]
    assert before["window_us"] == 300, "pyfuse3 without scripts/pyfuse3-queued-reads.patch: run scripts/setup.sh"
    write_at_once(mount.path)
    after = mount.status()["queued_reads"]
    assert after["requests"] - before["requests"] >= WRITERS * WRITES // 4, after
    assert_written(mount.path)
    assert mount.unmount() == 0


def test_a_window_of_zero_waits_for_the_event_loop_before_every_read(mount_factory: MountFactory) -> None:
    """`--queued-reads-us 0`: pyfuse3's own loop, which waits for the fd before every
    read; the same writers, none read at once, the same bytes."""
    mount = mount_factory("--queued-reads-us", "0")
    write_at_once(mount.path)
    assert mount.status()["queued_reads"] == {"window_us": 0, "requests": 0}
    assert_written(mount.path)
    assert mount.unmount() == 0


def test_handlers_that_wait_leave_a_reader_behind_them(mount_factory: MountFactory) -> None:
    """Eight reads of a buffer's `sample` wait for items at once, each in a handler that
    suspends: every time one does, another task must take over reading /dev/fuse (one
    task waits for it at a time). While all eight wait, the mount still answers: 20
    small files are written and read back and the directory listed; then five appends
    end every wait, and each read returns a batch of the appended items."""
    mount = mount_factory()
    buffer = mount.path / "buffers" / "waits"
    buffer.mkdir()
    outcomes, readers = wait_in_samples(buffer, 8)
    try:
        wait_for(lambda: json.loads((buffer / "stats").read_text())["blocked_readers"] == len(readers), timeout_s=30)
        for i in range(20):  # served while eight handlers wait
            (mount.path / f"f{i}").write_bytes(b"%d" % i * 1000)
        assert all((mount.path / f"f{i}").read_bytes() == b"%d" % i * 1000 for i in range(20))
        assert {f"f{i}" for i in range(20)} <= set(os.listdir(mount.path))
        assert json.loads((buffer / "stats").read_text())["blocked_readers"] == len(readers)
    finally:
        end_the_waits(buffer, readers)
    assert len(outcomes) == len(readers)
    assert all(isinstance(batch, bytes) and b"item-" in batch for batch in outcomes), outcomes
    os.rmdir(buffer)
    assert mount.unmount() == 0
