#!/usr/bin/env bash
# ZeRO++ against zero3 and native FSDP2 where the wire is the bottleneck: HOSTS emulated hosts
# (network namespaces, scripts/lib/netns.sh) whose links to each other are shaped to RATE with
# tc (a tbf qdisc on each host's eth0), NPROC_PER_HOST ranks each, training gpt_nano with
#
#   zero3         strategy=zero3
#   native_fsdp   strategy=native_fsdp (FSDP2's fully_shard)
#   zero3_zeropp  strategy=zero3 with int8 weights (qwZ), int8 gradients (qgZ) and the backward's
#                 gathers kept within the host (hpZ: strategy.secondary_shard=host)
#
# ROUNDS rounds, each running every variant once in an order that rotates by round (so a slow
# spell of the machine hits them alike); each run's step time is its summary's (the last
# trainer.log_every steps, the slowest rank's). Writes OUT/zeropp.json: per variant the step
# times, the bytes each rank sent per step (the tracer's; fully_shard's are not traced) and the
# bytes that left each host per step as its network device counted them.
#
#   sudo scripts/zeropp_local.sh                       # 2 hosts x 2 ranks, 200 Mbit/s, 3 rounds
#   sudo RATE=500mbit ROUNDS=5 scripts/zeropp_local.sh
#   sudo ROUNDS=1 STEPS=10 scripts/zeropp_local.sh trainer.micro_batch_size=4   # a quick check of the bytes
#
# Arguments are trainer overrides for every run. Environment: HOSTS (2), NPROC_PER_HOST (2), RATE (200mbit), ROUNDS (3), STEPS (30), OUT (a new temp
# folder), PREFIX (zp), TIMEOUT_S per run (300), PYTHON. Needs root; without it, exit 3.
set -uo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2}
NPROC_PER_HOST=${NPROC_PER_HOST:-2}
RATE=${RATE:-200mbit}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-30}
PREFIX=${PREFIX:-zp}
TIMEOUT_S=${TIMEOUT_S:-300}
OUT=${OUT:-$(mktemp -d /tmp/minidist-zeropp.XXXXXX)}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
if [ "$(id -u)" != 0 ]; then
    echo "zeropp_local: cannot create network namespaces here (needs root and 'ip netns'): run as root, e.g. sudo $0" >&2
    exit 3
fi
. scripts/lib/python.sh
source scripts/lib/netns.sh

netns_start "$0"
netns_shape "$RATE"
echo "zeropp_local: $HOSTS hosts x $NPROC_PER_HOST ranks, links between hosts shaped to $RATE; runs in $OUT"

declare -A ARGS=(
    [zero3]="strategy=zero3"
    [native_fsdp]="strategy=native_fsdp"
    [zero3_zeropp]="strategy=zero3 strategy.param_wire=int8 strategy.grad_wire=int8 strategy.secondary_shard=host"
)
VARIANTS=(zero3 native_fsdp zero3_zeropp)
common=(trainer.max_steps="$STEPS" trainer.log_every=10 trainer.eval_every=0 trainer.eval_batches=2
        trainer.ckpt_every=0 trainer.progress=false "$@")
for round in $(seq 1 "$ROUNDS"); do
    for k in $(seq 0 $((${#VARIANTS[@]} - 1))); do
        v=${VARIANTS[$(((k + round) % ${#VARIANTS[@]}))]}
        dir="$OUT/$v.$round"
        pids=()
        for i in $(seq 1 "$HOSTS"); do
            # shellcheck disable=SC2086  # the variant's overrides are words
            PORT=$((29500 + round * 10 + k)) netns_torchrun "$i" "$v$round" "$NPROC_PER_HOST" recipes/train.py \
                ${ARGS[$v]} "${common[@]}" "hydra.run.dir=$dir" > "$OUT/$v.$round.host$i.log" 2>&1 &
            pids+=($!)
        done
        failed=0
        for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
        [ "$failed" = 0 ] || { tail -n 20 "$OUT/$v.$round".host*.log >&2; die "$v (round $round) failed"; }
        echo "round $round: $v done"
    done
done
"$PYTHON" - "$OUT" "$RATE" "$HOSTS" "$NPROC_PER_HOST" "$ROUNDS" "${VARIANTS[@]}" <<'EOF'
import glob, json, statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, "scripts/lib")
from doc_pipeline import provenance, record
out, rate, hosts, per_host, rounds, variants = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                sys.argv[5], sys.argv[6:])
result = {"rate": rate, "hosts": hosts, "per_host": per_host, "variants": {}}
for v in variants:
    runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{v}.*/summary.json"))]
    result["variants"][v] = {
        "step_s": [r["time/step_s"] for r in runs],
        "bytes_per_step": runs[0].get("comm/bytes_per_step"),
        "host_tx_bytes_per_step": statistics.median(r["net/cross_host_tx_bytes_per_step"] for r in runs),
        "val_loss": [r["val/loss"] for r in runs],
    }
    print(f"{v:<14} step {statistics.median(result['variants'][v]['step_s']) * 1e3:7.1f} ms (median of "
          f"{len(runs)}), {result['variants'][v]['host_tx_bytes_per_step'] / 1e6:6.2f} MB out of each host per step")
command = f"sudo RATE={rate} ROUNDS={rounds} scripts/zeropp_local.sh"
record(Path(out) / "zeropp.json", result, provenance(command, torch.__version__))
print(f"wrote {out}/zeropp.json (docs/benchmarks/data/zeropp_shaped.json is its committed copy)")
EOF
