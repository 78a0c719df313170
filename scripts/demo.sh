#!/usr/bin/env bash
# Install everything needed, mount distorefs (embedded single-node default), show it
# working, print `distore status`, and unmount. MOUNTPOINT and DATA_DIR may be set.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup.sh"

WORK="$(mktemp -d /tmp/distorefs-demo.XXXXXX)"
MNT="${MOUNTPOINT:-$WORK/mnt}"
DATA="${DATA_DIR:-$WORK/data}"
mkdir -p "$MNT"
cleanup() {
    if grep -q " $MNT fuse" /proc/mounts 2>/dev/null; then
        distore umount "$MNT" || fusermount3 -u -z "$MNT"
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; eval "$@"; }

step distore mount "$MNT" --data-dir "$DATA" --dram-budget 256MiB
step ls -la "$MNT"
step cat "$MNT/.distore/version"
step mkdir -p "$MNT/checkpoints/run-1"
step "echo 'learning_rate: 3e-4' > $MNT/checkpoints/run-1/config.yaml"
step dd if=/dev/urandom of="$WORK/weights.bin" bs=1M count=64 status=none
step cp "$WORK/weights.bin" "$MNT/checkpoints/run-1/step-1000.bin"
step sync "$MNT/checkpoints/run-1/step-1000.bin"
step ls -l "$MNT/checkpoints/run-1"
step cat "$MNT/checkpoints/run-1/config.yaml"
step cmp "$WORK/weights.bin" "$MNT/checkpoints/run-1/step-1000.bin" "&&" echo "read back: identical"
step "python -c \"import os; print(os.getxattr('$MNT/checkpoints/run-1/step-1000.bin', 'user.distore.state').decode())\""
step mkdir "$MNT/weights/policy"
step "echo 'version one' > $MNT/weights/policy/params.txt"
step "echo 'version two' > $MNT/weights/policy/params.txt"
step cat "$MNT/weights/policy/params.txt" "$MNT/weights/policy/version"
step "python -c \"import numpy as np; np.save('$MNT/checkpoints/run-1/obs.npy', np.arange(10)); print(np.load('$MNT/checkpoints/run-1/obs.npy'))\""
step mkdir "$MNT/buffers/dqn"
step "echo '{\"capacity\": 1000, \"sampler\": \"prioritized\", \"batch_size\": 4}' > $MNT/buffers/dqn/config"
step "for i in 1 2 3 4 5 6; do echo \"transition \$i\" > $MNT/buffers/dqn/append; done"
step ls "$MNT/buffers/dqn" "$MNT/buffers/dqn/items"
step "echo '2 5.0' > $MNT/buffers/dqn/priority"
step "python -c \"from distorefs import client; [print(i, round(w, 3), bytes(x)) for i, w, x in client.sample('$MNT/buffers/dqn')]\""
step "python -c \"import json; s = json.load(open('$MNT/buffers/dqn/stats')); print({k: s[k] for k in ('size', 'inserts', 'samples')})\""
step mkdir "$MNT/datasets/labels"
step "echo '{\"schema\": {\"label\": \"int32\", \"score\": \"float32\"}}' > $MNT/datasets/labels/config"
step "python -c \"import numpy as np; r = np.zeros(1000, [('label', '<i4'), ('score', '<f4')]); r['label'] = np.arange(1000); np.save(open('$MNT/datasets/labels/append', 'wb'), r)\""
step "echo seal > $MNT/datasets/labels/state"
step "echo 'shuffle 7' > $MNT/datasets/labels/order"
step cat "$MNT/datasets/labels/len" "$MNT/datasets/labels/state"
step "python -c \"import numpy as np; s = np.load(open('$MNT/datasets/labels/stream-0-of-2', 'rb')); print(len(s), 'records of rank 0, first labels', s['label'][:5])\""
step distore status "$MNT"
step distore umount "$MNT"
step distore mount "$MNT" --data-dir "$DATA"
step cmp "$WORK/weights.bin" "$MNT/checkpoints/run-1/step-1000.bin" "&&" echo "after remount: identical"
step cat "$MNT/datasets/labels/len"
step distore umount "$MNT"
echo
echo "demo: done (data dir $DATA is removed on exit; pass DATA_DIR=... to keep one)"
