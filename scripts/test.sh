#!/usr/bin/env bash
# Install everything needed (scripts/setup.sh) and run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k kill_9 -x
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup.sh"
cd "$REPO"
if [ ! -e /dev/fuse ]; then
    echo "test: WARNING: no /dev/fuse here, so every mount test will be skipped" >&2
fi
export OMP_NUM_THREADS=1
exec "$VENV/bin/python" -m pytest "$@"
