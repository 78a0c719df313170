"""Common writers and readers, unchanged, through a real mount: safetensors, the
write-to-temp-then-rename pattern, numpy and torch with replay buffers."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from distorefs import client
from tests.conftest import Mount, dir_for_test

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture
def model(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    with dir_for_test(mounted.path / "weights", request) as path:
        yield path


@pytest.fixture
def buffer(mounted: Mount, request: pytest.FixtureRequest) -> Iterator[Path]:
    with dir_for_test(mounted.path / "buffers", request) as path:
        yield path


def version(model: Path) -> int:
    return int((model / "version").read_text().split()[0])


def test_safetensors_save_file_publishes_exactly_one_version_of_the_target(model: Path) -> None:
    tensors = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}
    for step in range(1, 4):
        tensors["b"] = torch.full((3,), float(step))
        safetensors_torch.save_file(tensors, str(model / "m.safetensors"))  # temp, rename, then close
        assert version(model) == step
        assert sorted(os.listdir(model)) == ["m.safetensors", "version", "wait"]
        loaded = safetensors_torch.load_file(str(model / "m.safetensors"))
        assert torch.equal(loaded["b"], torch.full((3,), float(step)))
        assert torch.equal(loaded["w"], tensors["w"])


def test_close_then_rename_publishes_the_target_once_and_never_the_temp_name(model: Path) -> None:
    for step in range(1, 3):
        temp = model / f".model.pt.{step}"
        torch.save({"step": step}, temp)  # closed under a staging name: not a version
        assert version(model) == step - 1
        os.replace(temp, model / "model.pt")
        assert version(model) == step
        assert not temp.exists()
        assert torch.load(model / "model.pt")["step"] == step
    assert sorted(os.listdir(model)) == ["model.pt", "version", "wait"]


def test_an_unlinked_temp_file_publishes_nothing(model: Path) -> None:
    with open(model / "weights.tmp", "wb") as f:
        f.write(b"abandoned")
    os.unlink(model / "weights.tmp")
    assert version(model) == 0
    assert sorted(os.listdir(model)) == ["version", "wait"]


ACTOR_RECORD = np.dtype([("obs", "<f4", (4,)), ("action", "<i8"), ("reward", "<f4"), ("done", "?")])


def transitions(n: int) -> np.ndarray:
    records = np.zeros(n, ACTOR_RECORD)
    records["obs"] = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    records["action"] = np.arange(n) % 2
    records["reward"] = 1.0
    return records


def test_np_save_to_append_works_though_numpy_adds_npy(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"schema": {"obs": ["float32", [4]], "action": "int64",
                                                          "reward": "float32", "done": "bool"}}))  # fmt: skip
    np.save(buffer / "append", transitions(10))  # numpy writes append.npy
    stats = json.loads(client.read_all(buffer / "stats"))
    assert stats["size"] == 10
    np.save(buffer / "priority", np.array([[0, 5.0], [1, 2.0]]))  # and priority.npy
    assert json.loads(client.read_all(buffer / "stats"))["total_priority"] > 0
    assert "append.npy" not in os.listdir(buffer)  # an alias, not a file of its own


def test_a_sample_goes_into_torch_without_a_copy_the_user_writes(buffer: Path) -> None:
    (buffer / "config").write_text(json.dumps({"schema": {"obs": ["float32", [4]], "action": "int64",
                                                          "reward": "float32", "done": "bool"},
                                               "batch_size": 8}))  # fmt: skip
    client.append(buffer, transitions(20))
    with open(buffer / "sample.npz", "rb") as f:
        batch = np.load(io.BytesIO(f.read()))
        tensors = {name: torch.as_tensor(batch[name]) for name in batch.files}
    assert set(tensors) == {"obs", "action", "reward", "done", "_index", "_weight"}
    assert tensors["obs"].shape == (8, 4)
    indices = tensors["_index"].numpy()
    assert np.array_equal(tensors["obs"].numpy(), transitions(20)["obs"][indices])
    assert tensors["action"].dtype == torch.int64
    with open(buffer / "sample", "rb") as f:  # the documented packed .npy stays as it was
        packed = np.load(f)
    assert packed.dtype.names == ("obs", "action", "reward", "done", "_index", "_weight")


def shell(*cmd: str) -> str:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True).stdout


def test_ls_shows_dot_and_dotdot_and_du_counts_real_use(mounted: Mount, buffer: Path, model: Path) -> None:
    sub = mounted.path / "ls-a-dir"
    sub.mkdir()
    try:
        for directory in (mounted.path, sub):
            assert shell("ls", "-a", str(directory)).split()[:2] == [".", ".."]
        sparse = sub / "sparse.bin"
        with open(sparse, "wb") as f:
            f.truncate(1 << 30)  # an empty 1 GiB sparse file
        assert os.stat(sparse).st_size == 1 << 30
        assert os.stat(sparse).st_blocks == 0
        with open(sparse, "r+b") as f:
            f.write(b"x" * 4096)
        assert 0 < os.stat(sparse).st_blocks * 512 <= 1 << 20  # one block of data, not 1 GiB
    finally:
        shell("rm", "-rf", str(sub))
    client.append(buffer, [b"y" * 100_000] * 10)
    (model / "m.bin").write_bytes(b"z" * 300_000)
    assert os.stat(model / "m.bin").st_blocks * 512 >= 300_000
    assert int(shell("du", "-sk", str(buffer)).split()[0]) * 1024 >= 1_000_000  # du sees what it holds


MAPPED_READER = """
import sys, os, time, torch
import numpy as np
path, stop = sys.argv[1], sys.argv[2]
loads = 0
while not os.path.exists(stop) or loads == 0:
    try:
        state = torch.load(path, mmap=True)
    except (FileNotFoundError, EOFError, RuntimeError) as exc:
        print("error", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    w = state["w"]
    for _ in range(3):  # hold the mapping while the learner republishes, touching every page
        assert bool((w == w[0]).all()), "a mapped version changed under its reader"
        time.sleep(0.02)
    if np.load(path + ".npy", mmap_mode="r")[0] < 0:
        sys.exit(4)
    loads += 1
print(loads)
"""


def test_mapped_readers_keep_their_version_while_torch_save_republishes(model: Path, tmp_path: Path) -> None:
    path = model / "model.pt"
    torch.save({"w": torch.zeros(12 << 20)}, path)  # 48 MiB, as in the report
    np.save(model / "model.pt.npy", np.zeros(1 << 20))
    stop = tmp_path / "stop"
    readers = [
        subprocess.Popen([sys.executable, "-c", MAPPED_READER, str(path), str(stop)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
        for _ in range(3)
    ]  # fmt: skip
    try:
        for step in range(1, 16):  # the learner: O_TRUNC opens of the file readers map
            torch.save({"w": torch.full((12 << 20,), float(step))}, path)
            np.save(model / "model.pt.npy", np.full(1 << 20, float(step)))
    finally:
        stop.touch()
        outs = [reader.communicate(timeout=120)[0] for reader in readers]
    for reader, out in zip(readers, outs, strict=True):
        assert reader.returncode == 0, (reader.returncode, out)  # -7 is SIGBUS
        assert int(out.split()[-1]) >= 1
    assert torch.load(path, mmap=True)["w"][0].item() == 15.0
