"""Plots of benchmark results for docs/: distorefs against each baseline of the same run.

    .venv/bin/python benchmarks/plot.py benchmarks/results/posix.json --out docs/img/posix.png

Reads a results file a benchmark wrote with --json, shaped {metric: {target: value}}
(bench_posix.py, bench_datasets.py ...), where one target is "distorefs" and the others
are baselines measured in the same run ("tmpfs", "disk", "ceiling" for the bare pyfuse3
filesystem, "numpy" for an in-process buffer). It draws one group of bars per metric,
one bar per baseline: distorefs as a multiple of that baseline, oriented so that higher
is better (for a metric measured in seconds, `_s` but not `_per_s`, the ratio is
baseline / distorefs). The axis is logarithmic, a line marks 1.0, parity. Needs
matplotlib (the dev extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

SUBJECT = "distorefs"
COLOURS = {"tmpfs": "#4c72b0", "disk": "#55a868", "ceiling": "#c44e52", "numpy": "#8172b2"}


def ratios(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """metric -> baseline -> distorefs as a multiple of it (higher is better)."""
    out: dict[str, dict[str, float]] = {}
    for metric, values in results.items():
        ours = values.get(SUBJECT)
        if not ours:
            continue
        lower_is_better = metric.endswith("_s") and not metric.endswith("_per_s")
        for baseline, value in values.items():
            if baseline == SUBJECT or not value:
                continue
            out.setdefault(metric, {})[baseline] = value / ours if lower_is_better else ours / value
    return out


def plot(results: dict[str, dict[str, float]], title: str, out: Path) -> None:
    table = ratios(results)
    if not table:
        raise SystemExit(f"no metric has both {SUBJECT} and a baseline")
    baselines = sorted({b for row in table.values() for b in row})
    metrics = list(table)
    width = 0.8 / len(baselines)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(metrics)), 4.0))
    for i, baseline in enumerate(baselines):
        xs = [m + (i - (len(baselines) - 1) / 2) * width for m in range(len(metrics))]
        ys = [table[metric].get(baseline, 0.0) for metric in metrics]
        bars = ax.bar(xs, ys, width, label=f"vs {baseline}", color=COLOURS.get(baseline))
        ax.bar_label(bars, labels=[f"{y:.2f}" if y else "" for y in ys], fontsize=7, padding=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(metrics)), [m.replace("_", " ") for m in metrics], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"{SUBJECT} as a multiple of the baseline\n(log scale, higher is better, 1.0 = parity)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a JSON file a benchmark wrote with --json")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    results = json.loads(Path(args.results).read_text())
    plot(results, args.title or Path(args.results).stem, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
