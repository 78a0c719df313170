"""Real clients (cp, tar, dd, ls, numpy) on the mount, compared byte for byte with tmpfs."""

from __future__ import annotations

import filecmp
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.mount.test_durability import digest_tree

pytestmark = pytest.mark.mount

SIZES = [0, 1, 4095, 4096, 131_073, 1024 * 1024, 1024 * 1024 + 1, 5 * 1024 * 1024 + 7]


def make_source(root: Path) -> None:
    for depth in range(3):
        directory = root.joinpath(*[f"d{i}" for i in range(depth)])
        directory.mkdir(parents=True, exist_ok=True)
        for size in SIZES:
            (directory / f"file-{size}.bin").write_bytes(os.urandom(size))
    os.symlink("d0/file-1.bin", root / "link")
    os.chmod(root / "d0" / "file-1.bin", 0o600)


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def run_bytes(*argv: str) -> bytes:
    return subprocess.run(argv, check=True, capture_output=True).stdout


def test_cp_r_in_and_out_is_byte_identical(scratch: Path, tmpfs_dir: Path) -> None:
    make_source(tmpfs_dir / "src")
    run("cp", "-a", str(tmpfs_dir / "src"), str(scratch / "copy"))
    assert digest_tree(scratch / "copy") == digest_tree(tmpfs_dir / "src")
    run("cp", "-a", str(scratch / "copy"), str(tmpfs_dir / "back"))
    assert digest_tree(tmpfs_dir / "back") == digest_tree(tmpfs_dir / "src")


def test_tar_round_trip_matches_tmpfs(scratch: Path, tmpfs_dir: Path) -> None:
    make_source(tmpfs_dir / "src")
    run("tar", "-cf", str(scratch / "a.tar"), "-C", str(tmpfs_dir / "src"), ".")
    run("tar", "-cf", str(tmpfs_dir / "a.tar"), "-C", str(tmpfs_dir / "src"), ".")
    assert filecmp.cmp(scratch / "a.tar", tmpfs_dir / "a.tar", shallow=False)
    (scratch / "x").mkdir()
    run("tar", "-xf", str(scratch / "a.tar"), "-C", str(scratch / "x"))
    assert digest_tree(scratch / "x") == digest_tree(tmpfs_dir / "src")


def test_dd_writes_and_partial_overwrites_match_tmpfs(scratch: Path, tmpfs_dir: Path) -> None:
    source = tmpfs_dir / "random"
    source.write_bytes(os.urandom(8 * 1024 * 1024))
    for target in (scratch / "dd.bin", tmpfs_dir / "dd.bin"):
        run("dd", f"if={source}", f"of={target}", "bs=1M", "status=none")
        run("dd", f"if={source}", f"of={target}", "bs=4k", "count=3", "seek=1000", "conv=notrunc", "status=none")
        run("dd", f"if={source}", f"of={target}", "bs=1", "count=10", "seek=9000000", "conv=notrunc", "status=none")
    assert filecmp.cmp(scratch / "dd.bin", tmpfs_dir / "dd.bin", shallow=False)
    out_fs = run_bytes("dd", f"if={scratch / 'dd.bin'}", "bs=64k", "skip=3", "count=5", "status=none")
    out_ref = run_bytes("dd", f"if={tmpfs_dir / 'dd.bin'}", "bs=64k", "skip=3", "count=5", "status=none")
    assert out_fs == out_ref
    assert len(out_fs) == 5 * 64 * 1024


def test_ls_l_shows_what_tmpfs_shows(scratch: Path, tmpfs_dir: Path) -> None:
    for root in (scratch / "ls", tmpfs_dir / "ls"):
        root.mkdir()
        (root / "a").write_bytes(b"x" * 1234)
        (root / "sub").mkdir()
        os.symlink("a", root / "ln")
        os.chmod(root / "a", 0o754)
        os.utime(root / "a", (1_700_000_000, 1_700_000_000))
        os.utime(root / "sub", (1_700_000_000, 1_700_000_000))
        os.utime(root / "ln", (1_700_000_000, 1_700_000_000), follow_symlinks=False)

    def listing(root: Path) -> list[list[str]]:
        lines = run("ls", "-l", "--time-style=+%s", str(root)).splitlines()[1:]  # drop "total"
        # mode, links, owner, group, size, mtime, name [-> target]; drop the directory size
        rows = [line.split() for line in lines]
        return [row[:4] + ([] if row[0].startswith("d") else [row[4]]) + row[5:] for row in rows]

    assert listing(scratch / "ls") == listing(tmpfs_dir / "ls")


def test_python_file_calls_match_tmpfs(scratch: Path, tmpfs_dir: Path) -> None:
    for root in (scratch, tmpfs_dir):
        with open(root / "py.txt", "w", encoding="utf-8") as f:
            f.write("line one\n")
            f.writelines(f"line {i}\n" for i in range(1000))
        with open(root / "py.txt", "a", encoding="utf-8") as f:
            f.write("appended\n")
        with open(root / "py.txt", "r+b") as f:
            f.seek(5)
            f.write(b"ONE")
            f.seek(-9, os.SEEK_END)
            assert f.read() == b"appended\n"
    assert (scratch / "py.txt").read_bytes() == (tmpfs_dir / "py.txt").read_bytes()


def test_numpy_save_load_and_mmap(scratch: Path, tmpfs_dir: Path) -> None:
    rng = np.random.default_rng(7)
    array = rng.standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    records = np.zeros(1000, dtype=[("obs", np.uint8, (84, 84)), ("reward", np.float32), ("done", bool)])
    records["reward"] = rng.standard_normal(1000)
    for root in (scratch, tmpfs_dir):
        np.save(root / "a.npy", array)
        np.save(root / "r.npy", records)
    assert (scratch / "a.npy").read_bytes() == (tmpfs_dir / "a.npy").read_bytes()
    np.testing.assert_array_equal(np.load(scratch / "a.npy"), array)
    with open(scratch / "r.npy", "rb") as f:
        np.testing.assert_array_equal(np.load(f), records)
    mapped = np.load(scratch / "a.npy", mmap_mode="r")
    np.testing.assert_array_equal(mapped[100:200], array[100:200])
    del mapped


def test_numpy_writable_mmap_reaches_the_file(scratch: Path) -> None:
    array = np.arange(300_000, dtype=np.int64)  # 2.3 MiB
    np.save(scratch / "m.npy", array)
    mapped = np.load(scratch / "m.npy", mmap_mode="r+")
    mapped[::1000] = -1
    mapped.flush()
    del mapped
    expected = array.copy()
    expected[::1000] = -1
    with open(scratch / "m.npy", "rb") as f:
        np.testing.assert_array_equal(np.load(f), expected)
