#!/usr/bin/env bash
# Elastic scale-down on emulated hosts (network namespaces, as scripts/multinode_local.sh makes
# them): HOSTS hosts x NPROC_PER_HOST ranks train STRATEGY under
# `torchrun --nnodes 1:HOSTS --max-restarts 3`, the rendezvous on host 1. Once the run has passed
# step LOSE_AT, the last host vanishes as a host that loses power does: its link goes first, then
# its processes and its namespace. Nothing tells the survivors: their collectives would wait
# launcher.timeout_s. Their heartbeat (minidist/train/resilience.py) notices the silence within
# launcher.peer_timeout_s, they leave, torchrun re-forms the group from the hosts left (after
# the rendezvous' last call, last_call_timeout), and the trainer resumes from the latest
# checkpoint at the smaller world size, with the same global batch (grad_accum grows).
#
# Then the same training is switched by hand: HOSTS x NPROC_PER_HOST ranks on one host, its
# checkpoint of the step the elastic run resumed from copied into a new run directory, resumed
# there at the survivors' world size. Checked: the elastic run finishes at the smaller world
# size; its final model equals the hand-switched run's within TOLERANCE (relative to the largest
# parameter); the sample ids every step consumed (trainer.log_samples) are the same. Reported
# (and written to $OUT/elastic.json): the seconds from the loss to the end of the first step at
# the new size, and the steps redone.
#
#   sudo scripts/elastic_local.sh                          # 2 hosts x 2 ranks, zero2
#   sudo STRATEGY=ddp LOSE_AT=15 scripts/elastic_local.sh model.n_layer=2
#
# Arguments are trainer overrides for every run. Needs root (ip netns); without it, it says so and
# exits 3. Namespaces, links and processes are removed whatever happens (trap on EXIT).
# Environment: HOSTS (2), NPROC_PER_HOST (2), STRATEGY (zero2), STEPS (40), EVERY (10: checkpoint
# interval), LOSE_AT (25), PEER_TIMEOUT_S (5), LAST_CALL_S (5), TOLERANCE (1e-5), OUT (a new temp
# folder), PREFIX (me), TIMEOUT_S per launch (300), PYTHON (.venv/bin/python, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2}
NPROC_PER_HOST=${NPROC_PER_HOST:-2}
STRATEGY=${STRATEGY:-zero2}
STEPS=${STEPS:-100}
EVERY=${EVERY:-10}
LOSE_AT=${LOSE_AT:-25}
PEER_TIMEOUT_S=${PEER_TIMEOUT_S:-5}
LAST_CALL_S=${LAST_CALL_S:-5}
REJOIN=${REJOIN:-1}
STEP_DELAY_S=${STEP_DELAY_S:-0.25}
TOLERANCE=${TOLERANCE:-1e-5}
PREFIX=${PREFIX:-me}
TIMEOUT_S=${TIMEOUT_S:-300}
OUT=${OUT:-$(mktemp -d /tmp/minidist-elastic.XXXXXX)}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ "$(id -u)" != 0 ]; then
    echo "elastic_local: cannot create network namespaces here (needs root and 'ip netns'): run as root, e.g. sudo $0" >&2
    exit 3
fi
. scripts/lib/python.sh
source scripts/lib/netns.sh

netns_start "$0"
WORLD=$((HOSTS * NPROC_PER_HOST))
LEFT=$(((HOSTS - 1) * NPROC_PER_HOST))
echo "elastic_local: $HOSTS hosts x $NPROC_PER_HOST ranks, $STRATEGY; host $HOSTS is lost after step $LOSE_AT; runs in $OUT"

common=("strategy=$STRATEGY" "trainer.max_steps=$STEPS" "trainer.ckpt_every=$EVERY" "trainer.keep_last=1000"
        "trainer.log_samples=true" "trainer.progress=false" "trainer.eval_batches=0" "trainer.log_every=5"
        "launcher.peer_timeout_s=$PEER_TIMEOUT_S" "debug.step_delay_s=$STEP_DELAY_S" "$@")
RUN=$OUT/elastic
SAMPLES=$RUN/samples/rank_0.txt
export NNODES="1:$HOSTS" RDZV_CONF="last_call_timeout=$LAST_CALL_S" TORCHRUN_ARGS="--max-restarts 3 --monitor-interval 0.2"
# torch's c10d rendezvous shares its TCP store with the workers by default, and then a node that
# joins a later round waits forever for the store's address: the node that stays rank 0 does not
# publish it again (dynamic_rendezvous.py, torch 2.14). Without the sharing, each round's rank 0
# publishes a fresh address and a returning host joins.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
pids=()
for i in $(seq 1 "$HOSTS"); do
    netns_torchrun "$i" elastic "$NPROC_PER_HOST" recipes/train.py "${common[@]}" "hydra.run.dir=$RUN" \
        > "$OUT/elastic.host$i.log" 2>&1 &
    pids+=($!)
done
last_step() { local s; s=$([ -f "$SAMPLES" ] && tail -n 1 "$SAMPLES" | cut -d' ' -f1); echo "${s:-0}"; }
waited=0
while [ "$(last_step)" -lt "$LOSE_AT" ]; do
    sleep 0.05
    waited=$((waited + 1))
    kill -0 "${pids[0]}" 2>/dev/null || die "host 1's torchrun ended before step $LOSE_AT: $OUT/elastic.host1.log"
    [ $waited -gt $((TIMEOUT_S * 20)) ] && die "no step $LOSE_AT within $TIMEOUT_S s: $OUT/elastic.host*.log"
done
date +%s.%N > "$OUT/lost_at"
width=$(head -n 1 "$SAMPLES" | wc -w)
lines_before=$(wc -l < "$SAMPLES")
netns_lose_host "$HOSTS"
lost_pid=${pids[$((HOSTS - 1))]}
pids=("${pids[@]:0:$((HOSTS - 1))}")  # its torchrun went with it
wait "$lost_pid" 2>/dev/null
echo "elastic_local: host $HOSTS lost after step $(last_step)"
# until_width W SINCE_LINE FILE_FOR_TIME: wait for the first line rank 0 appends after line
# SINCE_LINE with W fields (the samples file is line-buffered, written as each step ends, and a
# step at another world size consumes another number of samples per rank), polled every 50 ms.
until_width() {
    local want=$1 since=$2 stamp=$3 n=0
    until tail -n +$((since + 1)) "$SAMPLES" | awk -v w="$want" 'NF == w {f = 1} END {exit !f}'; do
        kill -0 "${pids[0]}" 2>/dev/null || die "host 1's torchrun ended before a step at the new size: $OUT/elastic.host1.log"
        n=$((n + 1))
        [ $n -gt $((TIMEOUT_S * 20)) ] && die "no step at the new size within $TIMEOUT_S s: $OUT/elastic.host*.log"
        sleep 0.05
    done
    date +%s.%N > "$OUT/$stamp"
}
small=$(( (width - 1) * HOSTS / (HOSTS - 1) + 1 ))  # rank 0's ids per step at the smaller world size, plus the step
until_width "$small" "$lines_before" recovered_at
echo "elastic_local: the survivors train at $LEFT ranks"
if [ "$REJOIN" = 1 ]; then  # the host comes back: torchrun restarts the group with it (a membership change)
    lines_before=$(wc -l < "$SAMPLES")
    netns_add_host "$HOSTS"
    date +%s.%N > "$OUT/rejoined_at"
    netns_torchrun "$HOSTS" elastic "$NPROC_PER_HOST" recipes/train.py "${common[@]}" "hydra.run.dir=$RUN" \
        > "$OUT/elastic.host$HOSTS.rejoined.log" 2>&1 &
    pids+=($!)
    until_width "$width" "$lines_before" back_at
    echo "elastic_local: host $HOSTS is back: $WORLD ranks again"
fi
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ "$status" = 0 ] || { tail -n 30 "$OUT"/elastic.host*.log >&2; die "the elastic run did not finish: $OUT/elastic.host*.log"; }

# The same training switched by hand at the same checkpoints, on one host; then the checks.
"$PYTHON" scripts/lib/elastic_check.py "$OUT" "$TOLERANCE" "$TIMEOUT_S" "${common[@]}" "debug.step_delay_s=0"
