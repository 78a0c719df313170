"""The daemon's log: one line per event, rotation, journald's priority prefix, bounded
failure lines, and progress lines of long work. Each set-up runs in a child process
(it replaces the root logger's handlers)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from distorefs import progress
from distorefs.logs import FailureLog


def run_child(code: str, stderr: object = subprocess.PIPE, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, env=env, check=True)


def test_log_file_rotates_at_its_size_keeping_old_files_private(tmp_path: Path) -> None:
    log_file = tmp_path / "daemon.log"
    run_child(
        "import logging; from distorefs import logs\n"
        f"logs.setup(debug=False, log_file={str(log_file)!r}, rotate_bytes=2000, backups=2)\n"
        "for i in range(200): logging.getLogger('t').info('event %d', i)\n"
    )
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["daemon.log", "daemon.log.1", "daemon.log.2"]
    for name in files:
        assert (tmp_path / name).stat().st_size <= 2000
        assert (tmp_path / name).stat().st_mode & 0o077 == 0
    assert "event 199" in log_file.read_text()


def test_a_traceback_is_one_line(tmp_path: Path) -> None:
    log_file = tmp_path / "daemon.log"
    run_child(
        "import logging; from distorefs import logs\n"
        f"logs.setup(debug=False, log_file={str(log_file)!r})\n"
        "try:\n    1/0\nexcept ZeroDivisionError:\n    logging.getLogger('t').exception('failed\\nbadly')\n"
    )
    lines = log_file.read_text().splitlines()
    assert len(lines) == 1
    assert "failed\\nbadly" in lines[0]
    assert "ZeroDivisionError" in lines[0]


def test_under_systemd_lines_carry_the_journal_priority_and_no_time(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        st = os.fstat(f.fileno())
        run_child(
            "import logging; from distorefs import logs\n"
            "print(logs.setup(debug=False, log_file=None))\n"
            "logging.getLogger('t').warning('careful'); logging.getLogger('t').info('fine')\n",
            stderr=f, env={**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"},
        )  # fmt: skip
    assert err.read_text().splitlines() == ["<4>t: careful", "<6>t: fine"]


def test_failure_lines_are_bounded_per_operation_and_say_what_was_left_out(caplog: pytest.LogCaptureFixture) -> None:
    failures = FailureLog(logging.getLogger("test.failures"), per_window=3, window_s=0.2)
    with caplog.at_level(logging.WARNING, logger="test.failures"):
        for _ in range(10):
            failures.failed("write", "fh 3, 0, <4 bytes>", 22, "config is not valid JSON")
        failures.failed("setxattr", "ino 5", 1)
        time.sleep(0.25)
        failures.failed("write", "fh 3, 0, <4 bytes>", 22, "config is not valid JSON")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5
    assert lines[0] == (
        "request failed: write(fh 3, 0, <4 bytes>) -> EINVAL (Invalid argument): config is not valid JSON"
    )
    assert lines[3] == "request failed: setxattr(ino 5) -> EPERM (Operation not permitted)"
    assert lines[4].endswith("(7 more failures of write left out of the log)")


def test_progress_off_a_terminal_logs_amount_total_and_rate(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="test.progress"):
        with progress.Progress("recovery: metadata rows", 1000, "rows", logging.getLogger("test.progress"),
                               every_s=0.0, tty=False) as p:  # fmt: skip
            p.advance(250)
            p.advance(750)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("recovery: metadata rows: 250 rows of 1,000 rows (25%)")
    assert lines[-1].startswith("recovery: metadata rows: 1,000 rows in ")


async def test_watch_follows_the_bytes_left_while_the_work_runs(caplog: pytest.LogCaptureFixture) -> None:
    left = [3 << 20]
    seen: list[int] = []

    async def work() -> str:
        for _ in range(3):
            await trio.sleep(progress.WATCH_EVERY_S * 1.5)
            left[0] -= 1 << 20
        return "done"

    with caplog.at_level(logging.INFO, logger="test.watch"):
        result = await progress.watch("persisting", lambda: left[0], work, logging.getLogger("test.watch"), seen.append)
    assert result == "done"
    assert seen[0] == 3 << 20
    assert min(seen) < 3 << 20
    assert seen == sorted(seen, reverse=True)


async def test_watch_with_nothing_to_do_shows_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def work() -> int:
        await trio.lowlevel.checkpoint()
        return 7

    with caplog.at_level(logging.INFO):
        assert await progress.watch("persisting", lambda: 0, work, logging.getLogger("test.watch")) == 7
    assert caplog.records == []


def test_umount_shows_the_bytes_the_daemon_reports_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from distorefs.cli import PersistProgress
    from distorefs.daemon import SHUTDOWN_REPORT, ShutdownReport

    pid = os.getpid()
    report = tmp_path / SHUTDOWN_REPORT
    shown = PersistProgress(str(tmp_path), pid)
    shown()  # no report yet: nothing to show
    report.write_bytes(ShutdownReport(pid, False, 8 << 20, "persisting").render())
    shown()
    time.sleep(1.1)
    report.write_bytes(ShutdownReport(pid, False, 2 << 20, "persisting").render())
    shown()
    shown.finish()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"distore umount: daemon {pid} persisting: 6.0 MiB of 8.0 MiB (75%), ")
    assert lines[-1].startswith(f"distore umount: daemon {pid} persisting: 6.0 MiB in ")


def test_progress_on_a_terminal_draws_a_bar_only_for_work_that_takes_a_while(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    quick = progress.Progress("quick", 10, "rows", logging.getLogger("test.tty"), every_s=5.0, tty=True)
    quick.update(10)
    quick.finish()
    assert capsys.readouterr().err == ""
    slow = progress.Progress("slow", 10, "rows", logging.getLogger("test.tty"), every_s=0.0, tty=True)
    slow.update(4)
    slow.finish()
    assert "slow" in capsys.readouterr().err  # the bar, drawn on stderr


def test_refusals_are_bounded_per_key_and_say_what_was_left_out(caplog: pytest.LogCaptureFixture) -> None:
    refusals = FailureLog(logging.getLogger("test.refusals"), per_window=2, window_s=0.2)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for i in range(6):
            refusals.refused("buffers/a", f"buffers/a: bad record {i}")
        refusals.refused("buffers/b", "buffers/b: bad record")
        time.sleep(0.25)
        refusals.refused("buffers/a", "buffers/a: bad record 6")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "buffers/a: bad record 0",
        "buffers/a: bad record 1",
        "buffers/b: bad record",
        "buffers/a: bad record 6 (4 more refusals of buffers/a left out of the log)",
    ]
