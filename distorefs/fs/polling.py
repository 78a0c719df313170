"""Adaptive busy polling of /dev/fuse (docs/design.md, "Adaptive busy polling").

A request that finds the daemon's thread asleep waits for it to wake up: on the VMs we
measured, with the guest's halt polling off, that costs more than the daemon's own work
for a small request. After each request the daemon therefore keeps its event loop
polling for the next one for a short window, and the window adapts to the gaps between
requests the way the kernel's haltpoll governor adapts a vCPU's: a request that came
too late for the window but within the maximum grows it, one that came later than the
maximum shrinks it, down to not polling at all. A client in a tight loop (small files,
an RL step's calls on kept descriptors) is served without wake-ups; a client that
computes between calls, or an idle mount, costs no polling beyond a few windows.

It polls only an idle loop: while trio has a task to run or a descriptor ready, the
next request is served as soon as the loop gets to it anyway, and polling would only
add scheduler passes in front of it (a client making small files back to back, whose
next request comes before the daemon has finished its work after the last reply:
the poller's passes took 2,970 files/s down from 3,520 without polling on a VM whose
wake-ups were cheap). The poller waits for the loop to run out of work
(`trio.testing.wait_all_tasks_blocked`), and only then runs its scheduler passes.

A shared-memory sampling session (fs/shm_sessions.py) is a learner drawing batch after
batch: its next request comes once the client has copied the last batch out of the
arena (0.3-0.4 ms for DQN's 3.5 MB), past the window's usual maximum, so the window
closed and every request paid the daemon's wake-up (41 µs of the client's `send` on the
VM we measure on). After a session's draw the window may grow to SESSION_FACTOR times
the maximum (at most SESSION_MAX_S); the same adaptation stops it for a learner that
computes longer between its draws. Only while the machine has a CPU to spare
(`CpuRoom`): with more threads runnable than CPUs (two learners and the daemon on two
cores) the longer polling takes a core the learners need (schema DQN, two learners on
two cores: 97k -> 82k samples/s).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

START_S = 50e-6  # a window grows from this (haltpoll's guest_halt_poll_grow_start)
MIN_S = 10e-6  # a window halved below this becomes 0: no polling until a short gap again
SESSION_FACTOR = 5  # after a sampling session's draw the window may reach this times max_s,
SESSION_MAX_S = 10e-3  # but no more than this (the largest --busy-poll-us takes) unless max_s is more


def polled_time(ended: float, until: float, stopped: float, arrived: float) -> float:
    """How long a window polled (time.perf_counter values): from `ended` (when its
    polling began) to the arrival of the next request (`arrived`) when that came while
    it polled, else to when it stopped (`stopped`), and never past its end (`until`).

    The wall time between `ended` and `stopped` is more than that, by work that is not
    polling. A request that comes while the window polls is served at the poll's next
    checkpoint, inside the window's loop. And a thread preempted past the window's end
    stops only when it runs again: beside two CPU hogs (time slices of a few ms), the
    stats showed 23-33 ms of polling for 200 writes 3 ms apart."""
    return max(0.0, min(stopped, until, arrived) - ended)


@dataclass
class PollWindow:
    """How long to poll after a request, learnt from the gaps between requests."""

    max_s: float
    window_s: float = 0.0
    requests: int = 0  # requests seen, polled for or not
    hits: int = 0  # requests that came while polling
    queued: int = 0  # requests that ended before the poller counted the one before them
    misses: int = 0  # windows that ran out (the thread then slept; a window of 0 is none)
    polled_s: float = 0.0  # time spent polling, hits and misses

    def __post_init__(self) -> None:
        if self.max_s <= 0:
            raise ValueError(f"a poll window needs a positive maximum, got {self.max_s}")
        self.window_s = min(START_S, self.max_s)

    def limit(self, session: bool) -> float:
        """The most a window may be after a request (a sampling session's draw, or any other)."""
        if not session:
            return self.max_s
        return max(self.max_s, min(self.max_s * SESSION_FACTOR, SESSION_MAX_S))

    def length(self, session: bool) -> float:
        """How long to poll after a request of that kind."""
        return min(self.window_s, self.limit(session))

    def hit(self, polled_s: float) -> None:
        """A request came `polled_s` into the window: the window stays."""
        self.requests += 1
        self.hits += 1
        self.polled_s += polled_s

    def followed(self, count: int) -> None:
        """`count` requests ended back to back, each before the poller counted the one
        before it: the event loop did not run out of work between them (a sampling
        session's next draw already on its socket, a client whose next request came
        before the daemon had finished with the last). They needed no polling, and the
        window stays."""
        self.requests += count
        self.queued += count

    def missed(self, polled_s: float, gap_s: float, session: bool = False) -> None:
        """The window ran out after `polled_s`; the next request (a sampling session's
        draw where `session`) came `gap_s` after the last one ended. A gap the maximum for
        that request would have covered doubles the window (from START_S when it was 0);
        a longer one halves it."""
        self.requests += 1
        if self.window_s > 0:
            self.misses += 1
        self.polled_s += polled_s
        limit = self.limit(session)
        if gap_s <= limit:
            self.window_s = min(limit, max(START_S, 2 * self.window_s))
        else:
            half = self.window_s / 2
            self.window_s = half if half >= MIN_S else 0.0

    def stats(self) -> dict[str, float | int]:
        return {
            "max_us": round(self.max_s * 1e6),
            "session_max_us": round(self.limit(session=True) * 1e6),
            "window_us": round(self.window_s * 1e6),
            "requests": self.requests,
            "hits": self.hits,
            "queued": self.queued,
            "misses": self.misses,
            "polled_s": round(self.polled_s, 6),
        }


def runnable_threads(loadavg: str) -> int:
    """The threads running or ready to run now, from the text of /proc/loadavg (its
    fourth field, "running/total")."""
    return int(loadavg.split()[3].split("/")[0])


class CpuRoom:
    """Whether no more threads are runnable than this process may use CPUs (the polling
    thread itself counted), read from /proc/loadavg at most every CHECK_S: a longer
    window after a session's draw spins only on a CPU nobody else wants."""

    CHECK_S = 0.25

    def __init__(self, path: str = "/proc/loadavg", cpus: int | None = None) -> None:
        self._path = path
        self._cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
        self._checked = -self.CHECK_S
        self._room = False

    def spare(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= self.CHECK_S:
            self._checked = now
            try:
                with open(self._path, encoding="ascii") as f:
                    self._room = runnable_threads(f.read()) <= self._cpus
            except (OSError, ValueError, IndexError):
                self._room = False  # unknown: no longer windows
        return self._room


__all__ = [
    "MIN_S",
    "SESSION_FACTOR",
    "SESSION_MAX_S",
    "START_S",
    "CpuRoom",
    "PollWindow",
    "polled_time",
    "runnable_threads",
]
