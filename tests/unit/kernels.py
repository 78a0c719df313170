"""Compiled kernels in the store unit tests: a test runs with them and with their plain
versions."""

from __future__ import annotations

import pytest

from distorefs.compiled import Kernels


def compiled_or_plain(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, kernels: Kernels) -> bool:
    """For a fixture parametrized ["compiled", "numpy"]: `kernels` loaded (numba is a
    dependency: they must load) or hidden for the test; True for the compiled run."""
    if request.param == "compiled":
        assert kernels.load(), f"numba is a dependency: {kernels.name} must load"
        return True
    monkeypatch.setattr(kernels, "module", None)
    return False
