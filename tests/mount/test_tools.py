"""Common writers and readers, unchanged, through a real mount: safetensors, the
write-to-temp-then-rename pattern, numpy and torch with replay buffers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

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
