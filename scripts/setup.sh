#!/usr/bin/env bash
# Installs what distorefs needs on a Debian machine, idempotently: the fuse3 packages, a C
# toolchain and Python headers for pyfuse3, a .venv, and the package with its test and dev
# extras (pytest and the real clients; ruff and mypy, which scripts/test.sh runs too).
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it skips what is there).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PYTHON="${PYTHON:-python3}"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

need_apt=()
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need_apt+=(libfuse3-dev)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)
# patch: pyfuse3 is built from its sdist with scripts/pyfuse3-noflush.patch,
# scripts/pyfuse3-read-pieces.patch, scripts/pyfuse3-fallocate.patch and
# scripts/pyfuse3-queued-reads.patch applied
command -v patch >/dev/null 2>&1 || need_apt+=(patch)
# copy tools the tests run against kind directories (cp and tar come with Debian)
command -v rsync >/dev/null 2>&1 || need_apt+=(rsync)
# getfattr/setfattr: the README's shell blocks use them
command -v getfattr >/dev/null 2>&1 || need_apt+=(attr)
# systemd-analyze: the test of the unit file `distore install-service` writes (the package
# only installs; nothing is started in a container)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
# mount(8)/umount(8) run the fstab helpers; util-linux's mount comes with Debian
command -v mount >/dev/null 2>&1 || need_apt+=(mount)
# fincore: a test counts the log's pages in the page cache after a cold read
command -v fincore >/dev/null 2>&1 || need_apt+=(util-linux-extra)
# etcd: the cluster tests start a real etcd server on loopback (multi-node mode's registry)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
"$PYTHON" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || need_apt+=(python3-dev)
"$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${need_apt[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.distorefs-installed"
noflush_patch="$REPO/scripts/pyfuse3-noflush.patch"
pieces_patch="$REPO/scripts/pyfuse3-read-pieces.patch"
fallocate_patch="$REPO/scripts/pyfuse3-fallocate.patch"
queued_patch="$REPO/scripts/pyfuse3-queued-reads.patch"
want="$(cat "$REPO/pyproject.toml" "$noflush_patch" "$pieces_patch" "$fallocate_patch" "$queued_patch" | sha256sum | cut -d' ' -f1) test,dev"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing distorefs and its test extra into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # pyfuse3 at the version pyproject.toml pins, from its sdist, with FOPEN_NOFLUSH added
    # (a read-only close then costs no FLUSH round trip; docs/operations.md) and READ
    # replies in pieces (a stream served from DRAM without a copy; docs/design.md) and
    # fallocate(2) (Operations.fallocate; docs/design.md) and queued requests read at once
    # (set_queued_reads; docs/design.md)
    pyfuse3_pin="$(grep -o 'pyfuse3==[0-9.]*' "$REPO/pyproject.toml")"
    build="$(mktemp -d)"
    "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$build" "$pyfuse3_pin"
    tar xzf "$build/pyfuse3-${pyfuse3_pin#pyfuse3==}.tar.gz" -C "$build"
    patch -s -p1 -d "$build/pyfuse3-${pyfuse3_pin#pyfuse3==}" < "$noflush_patch"
    patch -s -p1 -d "$build/pyfuse3-${pyfuse3_pin#pyfuse3==}" < "$pieces_patch"
    patch -s -p1 -d "$build/pyfuse3-${pyfuse3_pin#pyfuse3==}" < "$fallocate_patch"
    patch -s -p1 -d "$build/pyfuse3-${pyfuse3_pin#pyfuse3==}" < "$queued_patch"
    "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$build/pyfuse3-${pyfuse3_pin#pyfuse3==}"
    rm -rf "$build"
    "$VENV/bin/python" -m pip install -q -e "$REPO[test,dev]"
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
