#!/usr/bin/env bash
# DiLoCo against ddp and hsdp3 where the link between hosts is slow: HOSTS emulated hosts (network
# namespaces, scripts/lib/netns.sh) whose links are shaped by tc to each rate of RATES (and, where
# the kernel has tc's netem, DELAY more on every packet), NPROC_PER_HOST ranks each, training gpt_nano for STEPS steps (the same
# tokens for all) with
#
#   ddp          strategy=ddp: one flat all_reduce over every rank, every step
#   hsdp3        strategy=hsdp3: ZeRO-3 within the host, each shard's all_reduce across, every step
#   diloco_hH    strategy=diloco strategy.inner=ddp: DDP within the host every step, the outer
#                all_reduce across hosts every H steps (H in SYNC_EVERY)
#
# Every run evaluates every EVAL_EVERY steps; the trainer logs the step times of each window, so
# each evaluation is placed at the training time spent so far (the windows' sums: start-up and the
# evaluations themselves left out, alike for all). Writes OUT/diloco_shaped.json: per rate and
# variant the (step, training seconds, validation loss) curve, tokens per second and bytes out of
# each host per step. scripts/make_benchmarks.py renders it (docs/benchmarks.md, docs/img/).
#
#   sudo scripts/diloco_local.sh                           # 2 hosts x 2 ranks, 50 and 200 Mbit/s
#   sudo RATES="100mbit" DELAY=5ms SYNC_EVERY="8 32" scripts/diloco_local.sh
#   sudo STEPS=16 EVAL_EVERY=8 EVAL_BATCHES=2 scripts/diloco_local.sh trainer.micro_batch_size=4   # a quick check
#
# Arguments are trainer overrides for every run. Environment: HOSTS (2), NPROC_PER_HOST (2), RATES
# ("50mbit 200mbit"), DELAY (none), STEPS (200), EVAL_EVERY (20), EVAL_BATCHES (8), SYNC_EVERY
# ("8 16"), OUT (a new temp folder), PREFIX (dl), TIMEOUT_S per run (1500), PYTHON. Needs root;
# without it, exit 3.
set -uo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2}
NPROC_PER_HOST=${NPROC_PER_HOST:-2}
RATES=${RATES:-"50mbit 200mbit"}
DELAY=${DELAY:-}
STEPS=${STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-20}
EVAL_BATCHES=${EVAL_BATCHES:-8}
SYNC_EVERY=${SYNC_EVERY:-"8 16"}
PREFIX=${PREFIX:-dl}
TIMEOUT_S=${TIMEOUT_S:-1500}
OUT=${OUT:-$(mktemp -d /tmp/minidist-diloco.XXXXXX)}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
if [ "$(id -u)" != 0 ]; then
    echo "diloco_local: cannot create network namespaces here (needs root and 'ip netns'): run as root, e.g. sudo $0" >&2
    exit 3
fi
. scripts/lib/python.sh
source scripts/lib/netns.sh

declare -A ARGS=([ddp]="strategy=ddp" [hsdp3]="strategy=hsdp3")
VARIANTS=(ddp hsdp3)
for h in $SYNC_EVERY; do
    ARGS[diloco_h$h]="strategy=diloco strategy.inner=ddp strategy.sync_every=$h"
    VARIANTS+=("diloco_h$h")
done
common=(trainer.max_steps="$STEPS" trainer.log_every="$EVAL_EVERY" trainer.eval_every="$EVAL_EVERY"
        trainer.eval_batches="$EVAL_BATCHES" trainer.ckpt_every=0 trainer.progress=false "$@")
k=0
for rate in $RATES; do
    netns_start "$0"
    netns_shape "$rate" "$DELAY"
    echo "diloco_local: $HOSTS hosts x $NPROC_PER_HOST ranks, links between hosts at $rate${DELAY:+ + $DELAY}; runs in $OUT"
    for v in "${VARIANTS[@]}"; do
        dir="$OUT/$rate/$v"
        pids=()
        k=$((k + 1))
        for i in $(seq 1 "$HOSTS"); do
            # shellcheck disable=SC2086  # the variant's overrides are words
            PORT=$((29500 + k)) netns_torchrun "$i" "$v$k" "$NPROC_PER_HOST" recipes/train.py \
                ${ARGS[$v]} "${common[@]}" "hydra.run.dir=$dir" > "$OUT/$rate.$v.host$i.log" 2>&1 &
            pids+=($!)
        done
        failed=0
        for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
        [ "$failed" = 0 ] || { tail -n 20 "$OUT/$rate.$v".host*.log >&2; die "$v at $rate failed"; }
        echo "$rate: $v done"
    done
    netns_cleanup
done
"$PYTHON" scripts/lib/diloco_curves.py "$OUT" "$STEPS" "${DELAY:-none}" "$HOSTS" "$NPROC_PER_HOST" $RATES -- "${VARIANTS[@]}"
