#!/usr/bin/env bash
# One replica group of a live-recovery run (ft=torchft) on machines of its own: a torchrun for the
# group, started again whenever it ends with an error (then with ft.relaunched=true: it reads no
# checkpoint, it heals from a live group), until it ends cleanly. A fresh torchrun each time:
# torchrun's own --max-restarts fails to re-rendezvous with torchft loaded. Arguments are trainer
# overrides. First, once, on a host every group reaches (the lighthouse: the quorum, not training):
#   torchft_lighthouse --min_replicas 1 --heartbeat_timeout_ms 1000 --join_timeout_ms 5000 &
# then on each group's first host (a group of several hosts: TORCHRUN_ARGS with its rendezvous):
#   FT_GROUP=0 FT_GROUPS=2 FT_LIGHTHOUSE=http://lighthouse-host:29510 NPROC_PER_NODE=8 scripts/ft_group.sh strategy=zero2
#   FT_GROUP=1 ... the same on the other group's host
# --heartbeat_timeout_ms is ft.heartbeat_ms; --join_timeout_ms half of ft.timeout_s (what the local launcher gives it).
# The run directory (RUN_DIR, each group in RUN_DIR/group_G) need not be shared: a group heals from a peer.
set -euo pipefail
: "${FT_GROUP:?the replica group this launch runs (0..FT_GROUPS-1)}" "${FT_GROUPS:?how many groups}"
: "${FT_LIGHTHOUSE:?the lighthouse, http://HOST:PORT}"
run_dir=${RUN_DIR:-outputs/train/ft}
relaunched=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RUST_LOG=${RUST_LOG:-warn}
for _ in $(seq 0 "${MAX_RELAUNCHES:-100}"); do
    # shellcheck disable=SC2086  # TORCHRUN_ARGS: several arguments
    if "${TORCHRUN:-.venv/bin/torchrun}" ${TORCHRUN_ARGS:---standalone} --nproc_per_node "${NPROC_PER_NODE:-1}" \
        recipes/train.py ft=torchft ft.group="$FT_GROUP" ft.groups="$FT_GROUPS" ft.lighthouse="$FT_LIGHTHOUSE" \
        ft.relaunched=$relaunched hydra.run.dir="$run_dir/group_$FT_GROUP" "$@"; then
        exit 0
    fi
    relaunched=true
    echo "ft_group.sh: replica group $FT_GROUP ended with an error; starting it again, to heal from a live group" >&2
done
exit 1
