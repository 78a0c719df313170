"""The adaptive busy-poll window (fs/polling.py): how it learns from the gaps between
requests. The polling itself is tested through a mount (tests/mount/test_polling.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distorefs.fs.polling import (
    MIN_S,
    SESSION_FACTOR,
    SESSION_MAX_S,
    START_S,
    CpuRoom,
    PollWindow,
    polled_time,
    runnable_threads,
)

MAX_S = 200e-6


def test_a_window_starts_short_and_never_exceeds_its_maximum() -> None:
    assert PollWindow(MAX_S).window_s == START_S
    assert PollWindow(20e-6).window_s == 20e-6
    with pytest.raises(ValueError, match="positive maximum"):
        PollWindow(0.0)


def test_a_gap_the_maximum_would_cover_doubles_the_window_up_to_the_maximum() -> None:
    window = PollWindow(MAX_S)
    sizes = []
    for _ in range(4):
        window.missed(window.window_s, gap_s=150e-6)
        sizes.append(window.window_s)
    assert sizes == [2 * START_S, 4 * START_S, MAX_S, MAX_S]
    assert window.misses == 4


def test_longer_gaps_halve_the_window_down_to_no_polling_and_a_short_gap_starts_it_again() -> None:
    window = PollWindow(MAX_S)
    sizes = []
    while window.window_s:
        window.missed(window.window_s, gap_s=5e-3)
        sizes.append(window.window_s)
    assert sizes == [START_S / 2, START_S / 4, 0.0]  # 6.25 us would be under MIN_S
    assert START_S / 8 < MIN_S
    window.missed(0.0, gap_s=5e-3)
    assert (window.window_s, window.misses, window.requests) == (0.0, 3, 4)  # a window of 0 polls nothing: no miss
    window.missed(0.0, gap_s=30e-6)
    assert window.window_s == START_S


def test_hits_keep_the_window_and_every_poll_is_counted() -> None:
    window = PollWindow(MAX_S)
    window.hit(10e-6)
    window.hit(20e-6)
    window.missed(START_S, gap_s=1.0)
    assert (window.window_s, window.hits, window.misses) == (START_S / 2, 2, 1)
    assert window.polled_s == pytest.approx(80e-6)
    assert window.stats() == {
        "max_us": 200, "session_max_us": 1000, "window_us": 25,
        "requests": 3, "hits": 2, "queued": 0, "misses": 1, "polled_s": 8e-05,
    }  # fmt: skip


def test_requests_that_followed_one_another_are_counted_and_leave_the_window_alone() -> None:
    window = PollWindow(MAX_S)
    window.hit(10e-6)
    window.followed(3)  # three more ended before the poller ran again
    window.followed(0)
    assert (window.requests, window.hits, window.queued, window.misses) == (4, 1, 3, 0)
    assert (window.window_s, window.polled_s) == (START_S, pytest.approx(10e-6))


def test_a_client_that_computes_between_calls_costs_a_bounded_amount_of_polling() -> None:
    """Calls 1 ms apart, a thousand of them: the window falls to 0 after three misses, so
    the polling is what those three windows took, not a window per call."""
    window = PollWindow(MAX_S)
    for _ in range(1000):
        polled = window.window_s
        window.missed(polled, gap_s=1e-3)
    assert window.misses == 3
    assert window.polled_s == pytest.approx(START_S + START_S / 2 + START_S / 4)


def test_a_sampling_sessions_draws_may_grow_the_window_past_the_maximum_and_others_stay_under_it() -> None:
    """A learner drawing through a session asks again 0.4 ms after each reply (its copy
    of the batch): the window grows to cover that, up to SESSION_FACTOR times the
    maximum; a FUSE request after it polls no longer than the maximum, and the same gap
    between FUSE requests halves the window as before."""
    window = PollWindow(MAX_S)
    sizes = []
    for _ in range(6):
        window.missed(window.length(session=True), gap_s=400e-6, session=True)
        sizes.append(window.window_s)
    assert sizes == [
        2 * START_S,
        4 * START_S,
        8 * START_S,
        16 * START_S,
        SESSION_FACTOR * MAX_S,
        SESSION_FACTOR * MAX_S,
    ]
    assert window.length(session=True) == SESSION_FACTOR * MAX_S
    assert window.length(session=False) == MAX_S
    window.missed(MAX_S, gap_s=400e-6)  # the same gap, between FUSE requests: past their maximum
    assert window.window_s == SESSION_FACTOR * MAX_S / 2
    for _ in range(10):  # a learner that computes 5 ms between its draws stops the polling
        window.missed(window.length(session=True), gap_s=5e-3, session=True)
    assert window.window_s == 0.0


def test_a_sessions_window_stays_within_the_largest_maximum_the_option_takes() -> None:
    """5x a large --busy-poll-us would spin the daemon for tens of ms after each draw: the
    session's maximum stops at SESSION_MAX_S (10 ms), and never falls below max_s."""
    assert PollWindow(200e-6).limit(session=True) == pytest.approx(1e-3)
    assert PollWindow(4e-3).limit(session=True) == SESSION_MAX_S
    assert PollWindow(10e-3).limit(session=True) == 10e-3
    assert PollWindow(20e-3).limit(session=True) == 20e-3  # (an option past the CLI's bound keeps its own)
    assert PollWindow(4e-3).limit(session=False) == 4e-3


def test_a_cpu_to_spare_is_read_from_the_runnable_threads(tmp_path: Path) -> None:
    """Longer windows after a session's draw only while no more threads are runnable
    than CPUs (the poller counted); re-read at most every CHECK_S; unreadable: none."""
    assert runnable_threads("1.11 1.51 1.73 3/412 28697\n") == 3
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.50 0.40 0.30 2/300 100\n")
    room = CpuRoom(str(loadavg), cpus=2)
    assert room.spare()  # the poller and one learner on two CPUs
    loadavg.write_text("2.50 2.40 2.30 3/300 100\n")
    assert room.spare()  # (read again only after CHECK_S)
    room._checked -= CpuRoom.CHECK_S
    assert not room.spare()  # two learners and the poller on two CPUs
    loadavg.write_text("garbage\n")
    room._checked -= CpuRoom.CHECK_S
    assert not room.spare()
    assert not CpuRoom(str(tmp_path / "missing"), cpus=64).spare()


def test_polled_time_is_the_polling_alone_not_a_handler_inside_the_window_nor_a_preemption_past_it() -> None:
    ended = 100.0
    until = ended + 50e-6
    # a request that came 30 us in, whose handler ran inside the loop until 400 us
    assert polled_time(ended, until, stopped=ended + 400e-6, arrived=ended + 30e-6) == pytest.approx(30e-6)
    # a window that ran out, its thread preempted: the loop stopped 4 ms after it began
    assert polled_time(ended, until, stopped=ended + 4e-3, arrived=ended + 5e-3) == pytest.approx(50e-6)
    # and a request that came during that preemption: polled to the window's end
    assert polled_time(ended, until, stopped=ended + 4e-3, arrived=ended + 1e-3) == pytest.approx(50e-6)
    # a window that ran out on time: all of it
    assert polled_time(ended, until, stopped=until + 1e-6, arrived=ended + 3e-3) == pytest.approx(50e-6)
    # no window, and a request that began before the last one ended: nothing polled
    assert polled_time(ended, ended, stopped=ended + 1e-6, arrived=ended + 3e-3) == 0.0
    assert polled_time(ended, until, stopped=ended + 1e-6, arrived=ended - 1e-3) == 0.0
