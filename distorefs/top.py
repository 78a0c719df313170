"""`distore top`: a live view of one mount, in the manner of `juicefs stats`.

Owns reading `.distore/metrics` (Prometheus text, parsed with prometheus_client's parser),
turning two readings into rates, and drawing a frame with rich: requests/s by
operation, bytes/s by kind of file, DRAM, log, flush and fsync lag, checkpoints waiting,
the busiest buffers. It reads only the mount's files, so it works for any user who may
read `.distore/metrics`.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from distorefs.units import format_size

BUSIEST = 8


@dataclass(frozen=True)
class Reading:
    """One scrape: (sample name, sorted labels) -> value, and when it was taken."""

    at: float
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """Sum of the `name` samples whose labels include `match`, per value of `label`."""
        sums: dict[str, float] = defaultdict(float)
        for (sample, labels), value in self.values.items():
            found = dict(labels)
            if sample == name and all(found.get(k) == v for k, v in match.items()):
                sums[found.get(label, "")] += value
        return dict(sums)


def read_metrics(mountpoint: str) -> Reading:
    """Scrape `.distore/metrics` of `mountpoint`. Raises OSError (not a mount, no access)."""
    with open(os.path.join(mountpoint, ".distore", "metrics"), encoding="utf-8") as f:
        text = f.read()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return Reading(time.monotonic(), values)


def rates(before: Reading, after: Reading, name: str, label: str, **match: str) -> dict[str, float]:
    """Per-second increase of counter `name` (samples whose labels include `match`)
    between two readings, per `label` value."""
    span = max(after.at - before.at, 1e-6)
    old = before.by(name, label, **match)
    return {k: max(v - old.get(k, 0.0), 0.0) / span for k, v in after.by(name, label, **match).items()}


def frame(mountpoint: str, before: Reading, after: Reading) -> Group:
    """One screen of the view from two readings."""
    now = after
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()

    def size(name: str) -> str:
        return format_size(int(now.get(name)))

    dram = f"{size('distorefs_dram_used_bytes')} of {size('distorefs_dram_budget_bytes')}"
    head.add_row("mount", f"{mountpoint}  (uptime {now.get('distorefs_uptime_s'):.0f} s)")
    head.add_row("DRAM", f"{dram}, {format_size(int(now.get('distorefs_dram_dirty_bytes')))} not yet in the log")
    head.add_row(
        "log",
        f"{size('distorefs_log_bytes')} in {int(now.get('distorefs_log_segments'))} segments, "
        f"{now.get('distorefs_log_live_ratio') * 100:.1f}% live, "
        f"{int(now.get('distorefs_blocks_compacted_segments'))} compacted",
    )
    head.add_row(
        "lag",
        f"flush {now.get('distorefs_blocks_flush_lag_s'):.1f} s, "
        f"fsync {now.get('distorefs_blocks_durable_lag_s'):.1f} s; "
        f"checkpoints waiting {size('distorefs_checkpoint_bytes_waiting')} "
        f"in {int(now.get('distorefs_checkpoint_files_waiting'))} files",
    )
    state = Text("DEGRADED (read-only)", style="bold red") if now.get("distorefs_degraded") else Text("ok", "green")
    head.add_row("state", state)

    ops = Table(title="requests/s", title_justify="left", expand=False)
    ops.add_column("op")
    ops.add_column("per s", justify="right")
    ops.add_column("errors/s", justify="right")
    per_op = rates(before, after, "distorefs_requests_total", "op")
    ok = rates(before, after, "distorefs_requests_total", "op", errno="0")
    for op, rate in sorted(per_op.items(), key=lambda kv: -kv[1])[:BUSIEST]:
        ops.add_row(op, f"{rate:,.0f}", f"{rate - ok.get(op, 0.0):,.0f}")

    data = Table(title="bytes/s", title_justify="left")
    data.add_column("kind")
    data.add_column("read", justify="right")
    data.add_column("written", justify="right")
    read = rates(before, after, "distorefs_bytes_total", "kind", direction="out")
    written = rates(before, after, "distorefs_bytes_total", "kind", direction="in")
    for kind in sorted(set(read) | set(written), key=lambda k: -(read.get(k, 0) + written.get(k, 0))):
        if read.get(kind, 0) or written.get(kind, 0):
            data.add_row(kind, format_size(int(read.get(kind, 0))), format_size(int(written.get(kind, 0))))

    buffers = Table(title="busiest buffers", title_justify="left")
    for column in ("buffer", "items", "inserts/s", "samples/s", "blocked r/w"):
        buffers.add_column(column, justify="left" if column == "buffer" else "right")
    inserts = rates(before, after, "distorefs_buffer_inserts", "buffer")
    samples = rates(before, after, "distorefs_buffer_samples", "buffer")
    names = sorted(after.by("distorefs_buffer_size", "buffer"), key=lambda n: -(inserts.get(n, 0) + samples.get(n, 0)))
    for name in names[:BUSIEST]:
        blocked = (
            f"{int(now.get('distorefs_buffer_blocked_readers', buffer=name))}/"
            f"{int(now.get('distorefs_buffer_blocked_writers', buffer=name))}"
        )
        buffers.add_row(
            name, f"{int(now.get('distorefs_buffer_size', buffer=name)):,}",
            f"{inserts.get(name, 0):,.0f}", f"{samples.get(name, 0):,.0f}", blocked,
        )  # fmt: skip
    return Group(head, Text(""), ops, data, buffers)


def run(mountpoint: str, interval_s: float, once: bool, console: Console | None = None) -> None:
    """Draw the view every `interval_s` until interrupted; `once`: one frame, after one
    interval (rates need two readings). Raises OSError when the mount cannot be read."""
    console = console or Console()
    before = read_metrics(mountpoint)
    if once:
        time.sleep(interval_s)
        console.print(frame(mountpoint, before, read_metrics(mountpoint)))
        return
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(interval_s)
            after = read_metrics(mountpoint)
            live.update(frame(mountpoint, before, after), refresh=True)
            before = after
