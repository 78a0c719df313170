"""Copy tools and backups of buffers, models and datasets, through a real mount.

cp -a, tar and rsync copy a kind directory's data whole (config and stats at their real
size, items, records, published files) and are refused, with a clear error, the files
that act when read (sample, wait, stream); the documented backup and restore commands
(docs/operations.md) run end to end."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs import client
from tests.conftest import Mount, dir_for_test

RECORD = np.dtype([("x", "<i8"), ("y", "<f4")])


def sh(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, env={
        "PATH": "/usr/bin:/bin", **env})  # fmt: skip


@pytest.fixture
def buffer(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    with dir_for_test(mounted.path / "buffers", request) as path:
        (path / "config").write_text(json.dumps({"schema": {"x": "int64", "y": "float32"}, "capacity": 500}))
        records = np.zeros(12, RECORD)
        records["x"] = np.arange(12)
        records["y"] = np.arange(12) / 2
        client.append(path, records)
        yield path


def test_cp_a_and_tar_copy_the_data_and_refuse_only_what_acts(mounted: Mount, buffer: Path, tmp_path: Path) -> None:
    copied = sh(f"cp -a '{buffer}' '{tmp_path}/cp'")
    assert copied.returncode != 0  # refused, with a clear error, for `sample` alone
    assert "sample" in copied.stderr
    assert "Operation not permitted" in copied.stderr
    backup = tmp_path / "cp"
    assert json.loads((backup / "config").read_text()) == json.loads((buffer / "config").read_text())
    assert json.loads((backup / "stats").read_text())["size"] == 12
    assert sorted(int(p.name) for p in (backup / "items").iterdir()) == list(range(12))
    assert not (backup / "sample").exists()
    assert json.loads(client.read_all(buffer / "stats"))["samples"] == 0  # nothing was drawn
    tarred = sh(f"tar -C '{buffer.parent}' -cf '{tmp_path}/b.tar' '{buffer.name}'")
    assert "file changed as we read it" not in tarred.stderr
    assert "sample: Cannot open: Operation not permitted" in tarred.stderr
    synced = sh(f"rsync -a '{buffer}/' '{tmp_path}/rs/'")  # scripts/setup.sh installs rsync
    assert synced.returncode != 0
    assert "sample" in synced.stderr
    assert json.loads((tmp_path / "rs" / "config").read_text())["capacity"] == 500


def test_the_documented_buffer_backup_and_restore(mounted: Mount, buffer: Path, tmp_path: Path) -> None:
    restored = mounted.path / "buffers" / (buffer.name + "-restored")
    done = sh(
        """
        tar -C "$M/buffers" --exclude=sample -cf "$T/b.tar" "$B"
        mkdir "$T/r" && tar -C "$T/r" -xf "$T/b.tar"
        mkdir "$M/buffers/$R"
        cp "$T/r/$B/config" "$M/buffers/$R/config"
        (cd "$T/r/$B/items" && cat $(ls -v)) > "$M/buffers/$R/append"
        """,
        M=str(mounted.path), T=str(tmp_path), B=buffer.name, R=restored.name,
    )  # fmt: skip
    try:
        assert done.returncode == 0, done.stderr
        assert json.loads((restored / "config").read_text()) == json.loads((buffer / "config").read_text())
        got = np.concatenate([np.frombuffer(client.read_all(restored / "items" / str(i)), RECORD) for i in range(12)])
        assert got["x"].tolist() == list(range(12))
    finally:
        subprocess.run(["rm", "-rf", str(restored)], check=False)


def test_the_documented_model_and_dataset_backup_and_restore(mounted: Mount, tmp_path: Path) -> None:
    model, dataset = mounted.path / "weights" / "bk", mounted.path / "datasets" / "bk"
    model.mkdir()
    (model / "a.bin").write_bytes(b"A" * 5000)
    (model / "b.bin").write_bytes(b"B" * 7000)
    dataset.mkdir()
    (dataset / "config").write_text(json.dumps({"schema": {"v": "int64"}}))
    with open(dataset / "append", "wb") as f:
        f.write(np.arange(9, dtype=np.int64).tobytes())
    (dataset / "state").write_text("seal\n")
    try:
        done = sh(
            """
            tar -C "$M/weights" --exclude=wait -cf "$T/m.tar" bk
            tar -C "$M/datasets" --exclude=stream --exclude=append -cf "$T/d.tar" bk
            mkdir "$T/r" && tar -C "$T/r" -xf "$T/m.tar" && mkdir "$T/rd" && tar -C "$T/rd" -xf "$T/d.tar"
            mkdir "$M/weights/bk2"
            find "$T/r/bk" -type f ! -name version -exec cp {} "$M/weights/bk2/" \\;
            mkdir "$M/datasets/bk2"
            cp "$T/rd/bk/config" "$M/datasets/bk2/config"
            (cd "$T/rd/bk/records" && cat $(ls -v)) > "$M/datasets/bk2/append"
            echo seal > "$M/datasets/bk2/state"
            """,
            M=str(mounted.path), T=str(tmp_path),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (mounted.path / "weights" / "bk2" / "a.bin").read_bytes() == b"A" * 5000
        assert (mounted.path / "weights" / "bk2" / "b.bin").read_bytes() == b"B" * 7000
        assert (mounted.path / "datasets" / "bk2" / "state").read_text() == "sealed\n"
        assert int((mounted.path / "datasets" / "bk2" / "len").read_text()) == 9
        assert client.read_all(mounted.path / "datasets" / "bk2" / "records" / "8") == np.int64(8).tobytes()
    finally:
        for path in ("weights/bk", "weights/bk2", "datasets/bk", "datasets/bk2"):
            subprocess.run(["rm", "-rf", str(mounted.path / path)], check=False)
