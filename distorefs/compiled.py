"""Compiled kernels: a module of numba-compiled functions, imported once, or not at all.

Owns the rule every compiled kernel follows: its module compiles (or loads from numba's
cache) at import, with signatures given, so nothing compiles on the event loop; the
daemon imports these modules in a thread of its own the first time a caller asks for
one (`load_on_first_use`, daemon.load_kernels); until then, and wherever numba cannot
run or an environment variable asks for the plain version, callers use the plain Python
or numpy code, with the same results.

Not at the mount: numba's import holds the GIL for most of 0.4-2 s (longer with a cold
page cache) and reads its own files from the disk, and a cold read of a checkpoint
right after a mount (a training job resuming) ran at 276-479 MB/s beside it against
1,057-1,431 MB/s after it. A daemon serving only small files never loads them. One whose
data dir holds a buffer or a dataset, or that has written a big file to its log, also
loads them once its mount has been idle for a second (daemon.load_kernels_when_idle),
before a restarted job's first call needs them. Some callers use a kernel only once it
is loaded and never start the loading (the log's big appends: their first big write
runs the plain code rather than meet numba's import).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
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
        self._module: ModuleType | None = None

    @property
    def module(self) -> ModuleType | None:
        """The compiled module, or None (the caller runs the plain version). Asking while
        it is not loaded starts the loading registered by `load_on_first_use` (once)."""
        if self._module is None:
            _first_use()
        return self._module

    @module.setter
    def module(self, module: ModuleType | None) -> None:  # (tests swap it)
        self._module = module

    def load(self) -> bool:
        """Import the module (once); False where `env` is set to `plain`, or numba cannot
        load (not installed, or refusing this numpy at import)."""
        if self._module is None and os.environ.get(self.env, "") != self.plain:
            try:
                self._module = importlib.import_module(self.name)
            except Exception as exc:  # ImportError, or numba refusing this numpy at import
                log.info("%s: not compiled, numba is not usable here (%s)", self.name, exc)
        return self._module is not None

    @property
    def loaded(self) -> bool:
        """Whether `load` has imported the module (never imports, never starts a load)."""
        return self._module is not None


_loader: Callable[[], None] | None = None
_started = threading.Event()
_start_lock = threading.Lock()


def load_on_first_use(loader: Callable[[], None] | None) -> None:
    """Run `loader` (the daemon's: it loads every kernel) in a thread of its own the first
    time any `Kernels.module` is asked for while not loaded. None: forget it."""
    global _loader
    _loader = loader


def start_loading() -> None:
    """Start the registered loading now, once, as a first use would (the daemon's
    preload when its mount is idle: daemon.load_kernels_when_idle)."""
    _first_use()


def loading_started() -> bool:
    """Whether the registered loading has started (by a first use or `start_loading`)."""
    return _started.is_set()


def _first_use() -> None:
    loader = _loader
    if loader is None or _started.is_set():
        return
    with _start_lock:
        if _started.is_set():
            return
        _started.set()
    threading.Thread(target=loader, name="kernels compile", daemon=True).start()


def compiled_array(array: np.ndarray, dtype: type[Any]) -> np.ndarray:
    """`array` as compiled kernels take it: of `dtype`, contiguous and writable (numba types
    a read-only array apart, such as one `np.frombuffer` made of a peer's bytes, and a
    signature without it refuses it); a copy only where it is not."""
    if array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable:
        return array
    return np.array(array, dtype=dtype, order="C")
