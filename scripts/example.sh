#!/usr/bin/env bash
# Install what is missing, mount a fresh distorefs, run the distributed DQN example of
# docs/examples/distributed_dqn.py for a bounded time (default 120 s, 2 actors), print its
# learning curve, write it to $OUT/summary.json and $OUT/curve.png, and unmount.
#
#   SECONDS_TO_RUN, ACTORS, OUT      how long, how many actor processes, where results go
#   KILL_LEARNER_AT=S                kill -9 the learner after S and start it again: it
#                                    resumes from the newest durable checkpoint
#   STOP_AT_RETURN=R                 end early once 20 episodes in a row average R
#   NODES=3                          cluster mode: a local etcd and 3 daemons on this
#                                    machine, the buffer sharded over the 3, actors on each
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup.sh"

WORK="$(mktemp -d /tmp/distorefs-example.XXXXXX)"
OUT="${OUT:-$WORK/out}"
NODES="${NODES:-1}"
ETCD_PID=""
MOUNTS=()
mkdir -p "$OUT"
cleanup() {
    for mnt in "${MOUNTS[@]}"; do
        if grep -q " $mnt fuse" /proc/mounts 2>/dev/null; then
            distore umount "$mnt" || fusermount3 -u -z "$mnt"
        fi
    done
    if [ -n "$ETCD_PID" ]; then kill "$ETCD_PID" 2>/dev/null || true; wait "$ETCD_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT

free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

cluster=()
if [ "$NODES" -gt 1 ]; then
    client_port="$(free_port)"
    peer_port="$(free_port)"
    etcd --data-dir "$WORK/etcd" --listen-client-urls "http://127.0.0.1:$client_port" \
        --advertise-client-urls "http://127.0.0.1:$client_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" > "$WORK/etcd.log" 2>&1 &
    ETCD_PID=$!
    for _ in $(seq 100); do
        python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$client_port/health', timeout=1)" \
            2>/dev/null && break
        sleep 0.2
    done
    cluster=(--cluster "http://127.0.0.1:$client_port")
fi

for i in $(seq "$NODES"); do
    mnt="$WORK/mnt$i"
    mkdir -p "$mnt"
    MOUNTS+=("$mnt")
    node=()
    [ "$NODES" -gt 1 ] && node=(--node "node$i")
    distore mount "$mnt" --data-dir "$WORK/data$i" --dram-budget "${DRAM_BUDGET:-512MiB}" "${cluster[@]}" "${node[@]}"
done

joined="$(IFS=,; echo "${MOUNTS[*]}")"
python "$REPO/docs/examples/distributed_dqn.py" run --mount "$joined" --shards "$NODES" --out "$OUT" \
    --seconds "${SECONDS_TO_RUN:-120}" --actors "${ACTORS:-$((NODES > 1 ? NODES : 2))}" \
    --kill-learner-at "${KILL_LEARNER_AT:-0}" --stop-at-return "${STOP_AT_RETURN:-0}"
ls "${MOUNTS[0]}/checkpoints/dqn"
cat "${MOUNTS[0]}/weights/policy/version"
echo "results: $OUT (summary.json, curve.png)"
