"""benchmarks/plot.py: ratios oriented so that higher is better, and a real PNG out."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plot.py"


def load_plot() -> Any:
    spec = importlib.util.spec_from_file_location("bench_plot", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratios_are_distorefs_over_each_baseline_and_inverted_for_seconds() -> None:
    plot = load_plot()
    table = plot.ratios(
        {
            "seq_write_MBps": {"distorefs": 400.0, "tmpfs": 2000.0, "ceiling": 800.0},
            "readdir_100k_s": {"distorefs": 2.0, "disk": 0.5},
            "stat_per_s": {"distorefs": 100.0, "disk": 400.0},
            "only_ours": {"distorefs": 1.0},
        }
    )
    assert table == {
        "seq_write_MBps": {"tmpfs": 0.2, "ceiling": 0.5},
        "readdir_100k_s": {"disk": 0.25},
        "stat_per_s": {"disk": 0.25},
    }


def test_the_script_writes_a_png(tmp_path: Path) -> None:
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"seq_write_MBps": {"distorefs": 400.0, "tmpfs": 2000.0, "disk": 900.0}}))
    out = tmp_path / "img" / "r.png"
    subprocess.run([sys.executable, str(SCRIPT), str(results), "--out", str(out)], check=True, capture_output=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000
