#!/usr/bin/env bash
# Gather what a lent GPU machine (Ubuntu, Python 3.12, no network, no libfuse) needs to
# mount distorefs and run the benchmarks, into .dev/ (ignored by git; carried to the
# machine by the device tool's `carry`): libfuse3 and fuse3 from Debian, pyfuse3's C
# generated here from its sdist with scripts/pyfuse3-noflush.patch (compiled there by
# scripts/device/setup.sh), and the wheels for Python 3.12 that its image lacks.
# Run once here, then on the machine: `source scripts/device/setup.sh` (docs/benchmarks.md,
# "Sixteen cores and a GPU").
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="$REPO/.venv/bin/python"
DEV="$REPO/.dev"
mkdir -p "$DEV/deb" "$DEV/whl" "$DEV/whl2" "$REPO/.git/info"
grep -qx "/.dev/" "$REPO/.git/info/exclude" 2>/dev/null || echo "/.dev/" >> "$REPO/.git/info/exclude"
(cd "$DEV/deb" && apt-get download libfuse3-3 libfuse3-dev fuse3)
platforms=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux_2_28_x86_64)
for pin in trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 crc32c==2.9.post0 zstandard==0.25.0 cpprb==11.0.0; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$DEV/whl" "$pin"
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DEV/whl2" py-spy==0.4.3
build="$(mktemp -d)"
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$build" pyfuse3==3.5.0
tar xzf "$build/pyfuse3-3.5.0.tar.gz" -C "$build"
patch -s -p1 -d "$build/pyfuse3-3.5.0" < "$REPO/scripts/pyfuse3-noflush.patch"
"$PY" -m pip install -q --target "$build/cython" "Cython>=3.0,<3.3"
(cd "$build/pyfuse3-3.5.0" && PYTHONPATH="$build/cython" "$PY" -m cython -3 -I Include src/pyfuse3/__init__.pyx -o src/pyfuse3/__init__.c)
rm -rf "$DEV/pyfuse3" && mkdir -p "$DEV/pyfuse3" && cp -r "$build/pyfuse3-3.5.0/Include" "$build/pyfuse3-3.5.0/src" "$DEV/pyfuse3/"
rm -rf "$build"
du -sh "$DEV"
