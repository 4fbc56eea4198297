#!/usr/bin/env bash
# Validate the cost model (scripts/lib/costmodel.py) on emulated hosts whose links are shaped with tc:
# HOSTS network namespaces (scripts/lib/netns.sh) whose eth0 sends at most RATE (a tbf qdisc), so
# that hosts are linked far more slowly than the ranks inside one (loopback). Latency is the
# veth's own (netem, which could add delay, is not in every kernel: not in this one); the
# calibration measures it, as it measures the bandwidths. On them,
# scripts/bench_mesh.py calibrates both levels' latency and bandwidth, then times the step
# patterns of ddp, zero3, hierarchical all_reduce and hsdp3; `python scripts/lib/costmodel.py validate`
# predicts each from the calibrated links and fails when one is off by more than TOLERANCE.
#
#   sudo scripts/validate_sim.sh                               # 2 hosts x 2 ranks, 200 Mbit/s
#   sudo RATE=1gbit PARAMS=4194304 scripts/validate_sim.sh
#
# Environment: HOSTS (2), NPROC_PER_HOST (2), RATE (200mbit), PARAMS (fp32 values
# per step, 1048576), MESSAGES (2), REPS (5), TOLERANCE (0.25), OUT (a new temp folder), PREFIX
# (ms), TIMEOUT_S (300), PYTHON (.venv/bin/python, else python3 on PATH). Needs root; without it, exit 3.
set -uo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2}
NPROC_PER_HOST=${NPROC_PER_HOST:-2}
RATE=${RATE:-200mbit}
PARAMS=${PARAMS:-1048576}
MESSAGES=${MESSAGES:-2}
REPS=${REPS:-5}
TOLERANCE=${TOLERANCE:-0.25}
PREFIX=${PREFIX:-ms}
TIMEOUT_S=${TIMEOUT_S:-300}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# glibc keeps the memory a rank frees instead of handing it back at once: otherwise each int8 coding
# of the payload maps fresh pages, and its page faults were two thirds of the coding's time here
# (16 ms of a round trip where 7 ms is the arithmetic, 4 ranks on 2 cores) and far more on a busy
# CI machine (4-10x), so that codec_s measured one machine state and the ZeRO++ pattern another.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1073741824} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-1073741824}
if [ "$(id -u)" != 0 ]; then
    echo "validate_sim: cannot create network namespaces here (needs root and 'ip netns'): run as root, e.g. sudo $0" >&2
    exit 3
fi
OUT=${OUT:-$(mktemp -d /tmp/minidist-validate-sim.XXXXXX)}  # (after the check: a refusal leaves nothing behind)
. scripts/lib/python.sh  # PYTHON: .venv when present, else python3 on PATH, else "make setup first"
source scripts/lib/netns.sh

netns_start "$0"
netns_shape "$RATE"  # each host's outgoing link: RATE
echo "validate_sim: $HOSTS hosts x $NPROC_PER_HOST ranks, links between hosts shaped to $RATE; in $OUT"

pids=()
for i in $(seq 1 "$HOSTS"); do
    netns_torchrun "$i" validate "$NPROC_PER_HOST" scripts/bench_mesh.py --params "$PARAMS" --messages "$MESSAGES" \
        --reps "$REPS" --out "$OUT/measured.json" > "$OUT/host$i.log" 2>&1 &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
if [ "$failed" != 0 ]; then
    tail -n 20 "$OUT"/host*.log >&2
    die "the measurement failed; logs: $OUT/host*.log"
fi
"$PYTHON" scripts/lib/costmodel.py validate "$OUT/measured.json" --tolerance "$TOLERANCE"
