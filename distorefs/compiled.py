"""Compiled kernels: a module of numba-compiled functions, imported once, or not at all.

Owns the rule every compiled kernel follows: its module compiles (or loads from numba's
cache) at import, with signatures given, so nothing compiles on the event loop; the
daemon imports these modules in a thread of its own once the mount is up
(daemon.load_kernels); until then, and wherever numba cannot run or an environment
variable asks for the plain version, callers use the plain Python or numpy code, with
the same results.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class Kernels:
    """One module of compiled kernels: `module` once `load` has imported it, else None.

    Examples:
        >>> walks = Kernels("distorefs.stores.replay.sumtree_jit", "DISTOREFS_SUMTREE", "numpy")
        >>> walks.load()   # in a thread: numba's import and its cache, or a compile
        True
    """

    def __init__(self, module: str, env: str, plain: str) -> None:
        self.name = module
        self.env = env
        self.plain = plain
        self.module: ModuleType | None = None

    def load(self) -> bool:
        """Import the module (once); False where `env` is set to `plain`, or numba cannot
        load (not installed, or refusing this numpy at import)."""
        if self.module is None and os.environ.get(self.env, "") != self.plain:
            try:
                self.module = importlib.import_module(self.name)
            except Exception as exc:  # ImportError, or numba refusing this numpy at import
                log.info("%s: not compiled, numba is not usable here (%s)", self.name, exc)
        return self.module is not None

    @property
    def loaded(self) -> bool:
        """Whether `load` has imported the module (never imports here)."""
        return self.module is not None


def compiled_array(array: np.ndarray, dtype: type[Any]) -> np.ndarray:
    """`array` as compiled kernels take it: of `dtype`, contiguous and writable (numba types
    a read-only array apart, such as one `np.frombuffer` made of a peer's bytes, and a
    signature without it refuses it); a copy only where it is not."""
    if array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable:
        return array
    return np.array(array, dtype=dtype, order="C")
