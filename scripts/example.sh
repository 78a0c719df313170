#!/usr/bin/env bash
# Install what is missing, mount a fresh distorefs, run the distributed DQN example of
# docs/examples/distributed_dqn.py for a bounded time (default 120 s, 2 actors), print its
# learning curve, write it to $OUT/summary.json and $OUT/curve.png, and unmount.
# SECONDS_TO_RUN, ACTORS, OUT and KILL_LEARNER_AT (kill -9 the learner after S, then
# restart it: it resumes from the newest durable checkpoint) may be set.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup.sh"

WORK="$(mktemp -d /tmp/distorefs-example.XXXXXX)"
MNT="$WORK/mnt"
OUT="${OUT:-$WORK/out}"
mkdir -p "$MNT" "$OUT"
cleanup() {
    if grep -q " $MNT fuse" /proc/mounts 2>/dev/null; then
        distore umount "$MNT" || fusermount3 -u -z "$MNT"
    fi
}
trap cleanup EXIT

distore mount "$MNT" --data-dir "$WORK/data" --dram-budget 1GiB
python "$REPO/docs/examples/distributed_dqn.py" run --mount "$MNT" --out "$OUT" \
    --seconds "${SECONDS_TO_RUN:-120}" --actors "${ACTORS:-2}" --kill-learner-at "${KILL_LEARNER_AT:-0}"
ls "$MNT/checkpoints/dqn"
cat "$MNT/weights/policy/version"
echo "results: $OUT (summary.json, curve.png)"
