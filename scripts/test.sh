#!/usr/bin/env bash
# Install everything needed (scripts/setup.sh), run ruff and mypy, then the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k kill_9 -x
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup.sh"
cd "$REPO"
if [ ! -e /dev/fuse ]; then
    echo "test: WARNING: no /dev/fuse here, so every mount test will be skipped" >&2
fi
export OMP_NUM_THREADS=1
# Static checks first, as configured in pyproject.toml: a failure stops the run.
# DISTOREFS_SKIP_CHECKS=1 skips them (handy with -k while iterating).
if [ "${DISTOREFS_SKIP_CHECKS:-0}" != 1 ]; then
    echo "test: ruff check, ruff format --check, mypy"
    "$VENV/bin/ruff" check distorefs tests benchmarks docs/examples
    "$VENV/bin/ruff" format --check distorefs tests benchmarks docs/examples
    "$VENV/bin/mypy"
fi
# The suite starts hundreds of daemons and clients (`python -m distorefs`). Compile the
# package's bytecode once here, so that none of them compiles its 92 modules from source
# again: where PYTHONDONTWRITEBYTECODE is set (as on our VMs) that was 0.15 s of every
# 0.45 s daemon start.
"$VENV/bin/python" -m compileall -q -j 0 distorefs
exec "$VENV/bin/python" -m pytest "$@"
