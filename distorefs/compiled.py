"""Compiled kernels: import a module of numba-compiled functions, or say why not.

Owns nothing but the rule every compiled kernel follows: its module compiles (or loads
from numba's cache) at import, with signatures given, so nothing compiles on the event
loop; the daemon imports these modules in a thread of its own once the mount is up
(daemon.load_kernels); until then, and wherever numba cannot run or an environment
variable asks for the plain version, callers use the plain Python or numpy code, with
the same results.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)


def import_kernels(module: str, env: str, plain: str) -> ModuleType | None:
    """`module` imported, or None where `env` is set to `plain` or numba cannot load
    (not installed, or refusing this numpy at import)."""
    if os.environ.get(env, "") == plain:
        return None
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or numba refusing this numpy at import
        log.info("%s: not compiled, numba is not usable here (%s)", module, exc)
        return None
