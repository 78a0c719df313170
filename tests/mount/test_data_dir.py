"""The data dir is private to the daemon: 0700, its files 0600, also when made beforehand."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.conftest import mounted_at


def modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def test_a_data_dir_made_open_beforehand_is_made_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    (data / "notes.txt").write_text("left by the user")
    os.chmod(data / "notes.txt", 0o644)
    with mounted_at(tmp_path / "mnt", data) as mount:
        (mount.path / "f").write_bytes(b"x")
        found = modes(data)
        assert found["."] == 0o700
        files = {name: mode for name, mode in found.items() if (data / name).is_file()}
        dirs = {name: mode for name, mode in found.items() if name != "." and (data / name).is_dir()}
        assert "meta.sqlite" in files
        assert any(name.startswith("log/") for name in files)
        assert all(mode & 0o077 == 0 for mode in files.values()), files
        assert all(mode & 0o077 == 0 for mode in dirs.values()), dirs
