"""Adaptive busy polling (fs/polling.py, `--busy-poll-us`): a client in a tight loop is
served by a polling daemon; a client that pauses between calls, or none at all, costs no
more than a few poll windows. `.distore/status` shows the poller's numbers."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from distorefs import client
from tests.conftest import Mount, daemon_cpu_s

MountFactory = Callable[..., Mount]


def poll_stats(mount: Mount) -> dict[str, float]:
    stats = mount.status()["busy_poll"]
    assert isinstance(stats, dict)
    return stats


def test_a_tight_loop_of_small_files_is_served_by_polling_by_default(mount_factory: MountFactory) -> None:
    """Six requests a file, each within the window after the one before: a hit, whether
    the idle loop was polling when it came or the daemon was still busy with the last
    one (on a VM whose wake-ups are cheap, most of them: the daemon's work after a reply
    takes longer than the client's next call), or `queued` where several ended before
    the poller counted. Either way the daemon's thread did not sleep for it."""
    mount = mount_factory()
    root = mount.path / "small"
    root.mkdir()
    before = poll_stats(mount)
    assert before["max_us"] == 200
    for i in range(300):
        fd = os.open(root / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, b"x" * 4096)
        os.close(fd)
    after = poll_stats(mount)
    assert (after["hits"] + after["queued"]) - (before["hits"] + before["queued"]) >= 900, str(after)
    assert all((root / f"f{i}").read_bytes() == b"x" * 4096 for i in (0, 150, 299))
    assert mount.unmount() == 0


def test_a_client_that_calls_again_within_the_window_finds_the_thread_awake(mount_factory: MountFactory) -> None:
    """A write every 30 us (the client spins between its calls): the event loop runs
    out of work after each reply, and the poller, polling the idle loop, catches the
    next write in its window (a hit) instead of letting the thread sleep (a miss). A
    poller made to never poll (a window of 0) counted 293 of 608 requests as misses,
    310 as queued and 2 as hits."""
    mount = mount_factory()
    fd = os.open(mount.path / "spaced", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        time.sleep(0.05)
        before = poll_stats(mount)
        for i in range(600):
            until = time.perf_counter() + 30e-6
            while time.perf_counter() < until:
                pass
            os.pwrite(fd, b"w" * 512, i * 512)  # a request each: a write-only open skips the page cache
        after = poll_stats(mount)
    finally:
        os.close(fd)
    delta = {key: after[key] - before[key] for key in ("requests", "hits", "queued", "misses")}
    assert delta["requests"] >= 600
    assert delta["hits"] + delta["queued"] >= 400, delta
    assert (mount.path / "spaced").stat().st_size == 600 * 512
    assert mount.unmount() == 0


def test_a_client_that_pauses_between_calls_turns_polling_off(mount_factory: MountFactory) -> None:
    """One write every 10 ms (a request each: a write-only open skips the page cache):
    each gap is longer than the 200 us maximum, so the window halves to nothing within
    a few calls (at most 200, 100, 50, 25 and 12.5 us: the status read before the loop
    may have grown it to the maximum, and the requests of the two status reads may each
    miss a window), where a window per call would poll 150 x 200 us = 30 ms and miss 150
    times. A window of 0 polls nothing and counts no miss.

    The pace is 10 ms because of what the daemon sees under load. Beside two CPU hogs,
    with writes 3 ms apart, the daemon's thread was sometimes off its CPU for longer than
    a gap. Two writes then waited for it, and it served them back to back: a short gap,
    which starts the window again (at 50 us, as it should for a client that calls twice
    in a row), then three misses on the way back to 0. That took the misses to 23-26 in
    3 of 10 runs. A preemption of 10 ms is rare.

    The status file's name lasts 1 s in the kernel's dentry cache. On a slow machine the
    loop took longer than that, and the final status read began with a LOOKUP whose
    OPEN (which renders the status) came right after it: a short gap, which restarts the
    window at 50 us, as it should for a client that calls twice in a row (seen once in
    a fresh clone's CI run). So the name is looked up ten paced writes before the end,
    and those writes take the window back to 0 before the status is read."""
    mount = mount_factory()
    status = mount.path / ".distore" / "status"
    fd = os.open(mount.path / "paced", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        time.sleep(0.05)  # the open's own requests are behind us
        before = poll_stats(mount)
        for i in range(150):
            if i == 140:
                os.stat(status)
            os.pwrite(fd, b"y" * 512, i * 512)
            time.sleep(0.010)
        after = poll_stats(mount)
    finally:
        os.close(fd)
    assert after["window_us"] == 0
    assert after["requests"] - before["requests"] >= 150  # every write was seen
    assert after["misses"] - before["misses"] <= 20
    assert after["polled_s"] - before["polled_s"] < 0.015
    assert (mount.path / "paced").stat().st_size == 150 * 512
    assert mount.unmount() == 0


def test_an_idle_daemon_sleeps_and_zero_turns_polling_off(mount_factory: MountFactory) -> None:
    mount = mount_factory("--busy-poll-us", "10000")  # the largest window allowed
    (mount.path / "burst").mkdir()
    for i in range(100):
        (mount.path / "burst" / str(i)).write_bytes(b"z")
    before = daemon_cpu_s(mount)
    time.sleep(1.0)
    assert daemon_cpu_s(mount) - before < 0.5  # no requests: the last window ends and the thread sleeps
    assert poll_stats(mount)["max_us"] == 10_000
    assert mount.unmount() == 0

    mount = mount_factory("--busy-poll-us", "0")
    (mount.path / "f").write_bytes(b"z")
    assert "busy_poll" not in mount.status()
    assert mount.unmount() == 0


def test_draws_of_a_shared_memory_session_are_requests_for_the_poller(mount_factory: MountFactory) -> None:
    """A sampler's draws come over the session's socket, not through FUSE: each one
    counts as a request, so the daemon polls for the next draw as for a FUSE request."""
    mount = mount_factory()
    path = mount.path / "buffers" / "polled"
    path.mkdir()
    (path / "config").write_text(json.dumps({"batch_size": 4}))
    client.append(path, [b"item-%d" % i for i in range(32)])
    with client.Sampler(path, transport="shm") as sampler:
        assert sampler.shm_version == 2
        sampler.sample()
        before = poll_stats(mount)
        for _ in range(200):
            assert len(sampler.sample()) == 4
        after = poll_stats(mount)
    # every draw is a request: one the poller polled for, or one that followed the one
    # before it on the socket before the poller ran (no window needed), and the few of
    # the two status reads
    assert 200 <= after["requests"] - before["requests"] <= 212
    assert after["hits"] > before["hits"], str({k: after[k] - before[k] for k in after})
    assert mount.unmount() == 0
