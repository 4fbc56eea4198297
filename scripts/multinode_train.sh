#!/usr/bin/env bash
# minidist trainer on several machines without a scheduler: run this on every machine with the
# same MASTER (a host:port every machine can reach) and NNODES; torchrun's c10d rendezvous assigns
# the ranks. Arguments are trainer overrides.
#   MASTER=node0:29500 NNODES=2 scripts/multinode_train.sh strategy=zero2 hydra.run.dir=/shared/runs/a
# NPROC_PER_NODE defaults to the number of GPUs (1 on a machine without). The run directory must be
# on a file system every machine sees.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER:?set MASTER=host:port of the rendezvous (any one of the machines)}"
: "${NNODES:?set NNODES to the number of machines}"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
nproc=${NPROC_PER_NODE:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 1)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${TORCHRUN:-.venv/bin/torchrun}" --nnodes "$NNODES" --nproc_per_node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER" --rdzv-id "${RDZV_ID:-minidist}" \
    recipes/train.py "$@"
