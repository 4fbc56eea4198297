#!/usr/bin/env bash
# Multi-node training on emulated hosts: HOSTS Linux network namespaces on this machine, each with
# its own IP address (10.77.0.1, .2, ...) on a veth pair plugged into one bridge, each running
# `torchrun --nnodes HOSTS --nproc_per_node NPROC_PER_HOST` with a c10d rendezvous at host 1's address.
# It trains a short run of every strategy in STRATEGIES (one Hydra sweep: torchrun starts the ranks
# once), then checks that every rank ends with the same parameters, equal (bitwise) to a
# single-host run of HOSTS x NPROC_PER_HOST ranks. Hybrid strategies (hsdp2, hsdp3,
# ddp_hierarchical) find their shard groups from the host layout (one per host); their
# single-host run gets the same mesh through strategy.shard_size. Then every strategy's final model is checked against the single-host
# REFERENCE run (plain ddp) within TOLERANCE (relative to the largest parameter). TOLERANCE=auto
# derives it from the run itself: strategies sum gradients in other orders than REFERENCE (our
# ring's, gloo's), and float sums in different orders differ by rounding that training carries
# on. So REFERENCE runs once more on the single host with strategy.bucket_cap_mb=0.05: the same
# arithmetic with gloo's chunks cut elsewhere, i.e. every element summed in another order. The
# difference D between its two runs is the size of that effect for this model, data and step
# count; the tolerance is 4 D (two independent reorderings differ by about as much as one from
# the reference, and the max over all parameters of such a difference varies from run to run).
#
#   sudo scripts/multinode_local.sh                       # 2 hosts x 2 ranks, ddp and zero2
#   sudo STRATEGIES="ddp hsdp2 hsdp3 ddp_hierarchical" scripts/multinode_local.sh
#   sudo HOSTS=3 STRATEGIES="zero3" scripts/multinode_local.sh trainer.max_steps=30
#
# Arguments are trainer overrides for every run. Needs root (ip netns); without it, it says so and
# exits 3. Namespaces, links and processes are removed whatever happens (trap on EXIT).
# Environment: HOSTS (2), NPROC_PER_HOST (2), STRATEGIES ("ddp zero2"), OUT (a new temp folder),
# PREFIX (md: names of namespaces and links), TIMEOUT_S per sweep (300), PYTHON (.venv/bin/python, else python3 on PATH),
# REFERENCE (ddp), TOLERANCE (auto, or a number), TWINS ("all": the strategies that also get a single-host twin
# run for the bitwise check; others are only checked against REFERENCE, which must be a twin).
set -uo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2}
NPROC_PER_HOST=${NPROC_PER_HOST:-2}
STRATEGIES=${STRATEGIES:-"ddp zero2"}
REFERENCE=${REFERENCE:-ddp}
TOLERANCE=${TOLERANCE:-auto}
TWINS=${TWINS:-all}
PREFIX=${PREFIX:-md}
TIMEOUT_S=${TIMEOUT_S:-300}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
if [ "$(id -u)" != 0 ]; then  # before anything is read: this may run from stdin, as a user who cannot read the checkout
    echo "multinode_local: cannot create network namespaces here (needs root and 'ip netns'): run as root, e.g. sudo $0" >&2
    exit 3
fi
OUT=${OUT:-$(mktemp -d /tmp/minidist-multinode.XXXXXX)}  # (after the check: a refusal leaves nothing behind)
. scripts/lib/python.sh  # PYTHON: .venv when present, else python3 on PATH, else "make setup first"
source scripts/lib/netns.sh

netns_start "$0"
echo "multinode_local: $HOSTS hosts ($SUBNET.1-$HOSTS) x $NPROC_PER_HOST ranks; runs in $OUT"

if [ $# -eq 0 ]; then  # a short run unless told otherwise
    set -- trainer.max_steps=20 trainer.micro_batch_size=8 trainer.eval_batches=2 trainer.ckpt_every=0 \
        trainer.log_every=5 data.max_bytes=400000
fi
# One Hydra sweep over STRATEGIES on the emulated hosts (torchrun starts the ranks once; job j is
# the j-th strategy, in $OUT/multi/j), and over TWINS on a single host of as many ranks. The twins
# that take a mesh (strategy.shard_size, from their spec) get the emulated hosts' one through it, in
# a sweep of their own ($OUT/single_mesh); the others run in $OUT/single (they refuse the key).
list() { echo "$*" | tr ' ' ','; }
[ "$TWINS" = all ] && TWINS=$STRATEGIES
common=("trainer.progress=false" "$@")
status=0
pids=()
for i in $(seq 1 "$HOSTS"); do
    netns_torchrun "$i" multi "$NPROC_PER_HOST" recipes/train.py -m "strategy=$(list $STRATEGIES)" "${common[@]}" \
        "hydra.sweep.dir=$OUT/multi" > "$OUT/multi.host$i.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if [ "$status" != 0 ]; then
    tail -n 20 "$OUT"/multi.host*.log >&2
    die "the sweep on $HOSTS hosts failed; logs: $OUT/multi.host*.log"
fi
takes_mesh() { "$PYTHON" -c "import sys; from minidist.train.strategies import spec
print(' '.join(s for s in sys.argv[2:] if ('shard_size' in spec(s).options) == (sys.argv[1] == 'yes')))" "$@"; }
# The single-host runs reduce as the emulated hosts' flat groups do, through gloo (and our ring),
# not through shared memory (which sums in another order): no /dev/shm for them.
single_host() { MINIDIST_SHM_DIR=/nonexistent "$@"; }
single_sweep() {  # single_sweep DIR STRATEGIES... [overrides after --]
    local dir=$1; shift
    local names=(); while [ "$1" != -- ]; do names+=("$1"); shift; done; shift
    [ ${#names[@]} = 0 ] && return 0
    single_host timeout -k 10 "$TIMEOUT_S" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc_per_node $((HOSTS * NPROC_PER_HOST)) recipes/train.py -m "strategy=$(list "${names[@]}")" "$@" \
        "${common[@]}" "hydra.sweep.dir=$OUT/$dir" > "$OUT/$dir.log" 2>&1 \
        || { tail -n 20 "$OUT/$dir.log" >&2; die "the single-host sweep failed: $OUT/$dir.log"; }
}
MESH_TWINS=$(takes_mesh yes $TWINS)
FLAT_TWINS=$(takes_mesh no $TWINS)
single_sweep single $FLAT_TWINS --
single_sweep single_mesh $MESH_TWINS -- "strategy.shard_size=$NPROC_PER_HOST"
if [ "$TOLERANCE" = auto ]; then  # REFERENCE again, every sum in another order (see the top)
    single_host timeout -k 10 "$TIMEOUT_S" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc_per_node $((HOSTS * NPROC_PER_HOST)) recipes/train.py "strategy=$REFERENCE" \
        "++strategy.bucket_cap_mb=0.05" "${common[@]}" "hydra.run.dir=$OUT/reordered" > "$OUT/reordered.log" 2>&1 \
        || { tail -n 20 "$OUT/reordered.log" >&2; die "the reordered reference run failed: $OUT/reordered.log"; }
fi

# Bitwise: every rank of every twin identical and equal to the single host's; every strategy's
# model within TOLERANCE of REFERENCE's on the single host (other sums: equal within rounding).
"$PYTHON" - "$OUT" $((HOSTS * NPROC_PER_HOST)) "$REFERENCE" "$TOLERANCE" "$STRATEGIES" "$FLAT_TWINS" "$MESH_TWINS" <<'EOF'
import re
import sys
from pathlib import Path

from minidist.train.checkpoint import consolidate, list_checkpoints

out, world, reference, tolerance = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
strategies, flat_twins, mesh_twins = sys.argv[5].split(), sys.argv[6].split(), sys.argv[7].split()
multi = {s: out / "multi" / str(j) for j, s in enumerate(strategies)}
single = {**{s: out / "single" / str(j) for j, s in enumerate(flat_twins)},
          **{s: out / "single_mesh" / str(j) for j, s in enumerate(mesh_twins)}}
twins = list(single)


def digests(run):
    found = [re.findall(r"state_digest=(\w+)", (run / "logs" / f"rank_{r}.log").read_text()) for r in range(world)]
    return {f[-1] if f else None for f in found}


failed = False
for s in twins:
    m, one = digests(multi[s]), digests(single[s])
    ok = len(m) == 1 and None not in m and m == one
    failed |= not ok
    print(f"multinode_local: {s}: {world} ranks on emulated hosts, final state digests {sorted(m)}; single host "
          f"{sorted(one)}: {'every rank identical and equal to the single-host run' if ok else 'MISMATCH'}")
def largest_relative_difference(mine, ref, scale):
    return max(((mine[k].double() - v.double()).abs() / (v.double().abs() + scale)).max().item()
               for k, v in ref.items() if v.is_floating_point())


if reference in single:
    ref = consolidate(list_checkpoints(single[reference])[-1])
    scale = max(v.abs().max().item() for v in ref.values() if v.is_floating_point())
    if tolerance == "auto":
        order = largest_relative_difference(consolidate(list_checkpoints(out / "reordered")[-1]), ref, scale)
        tolerance = 4 * order
        print(f"multinode_local: tolerance 4 x {order:.1e} = {tolerance:.1e}: {reference} with its sums in another "
              f"order (strategy.bucket_cap_mb=0.05) differs from itself by {order:.1e}")
    tolerance = float(tolerance)
    for s in strategies:
        if s == reference:
            continue
        mine = consolidate(list_checkpoints(multi[s])[-1])
        worst = largest_relative_difference(mine, ref, scale)
        failed |= worst > tolerance
        print(f"multinode_local: {s} on emulated hosts vs {reference} on one host: largest relative difference "
              f"{worst:.1e} ({'within' if worst <= tolerance else 'ABOVE'} {tolerance:.1e})")

# Cross-host bytes: what the hosts' network interfaces sent between the first and the last step
# (the kernel's counters, read by each host's local rank 0), against the ring model's payload
# from the run's own collectives (minidist/train/resilience.py). The wire adds headers: at most
# 66 bytes per packet and an ACK of as much per packet the other way (with TSO/GRO far fewer),
# so theory <= measured <= theory + 2 x 66 x packets + SLACK, where SLACK (16 KiB per step)
# covers what the model does not see: the trainer's metric all_reduce every log_every steps (a
# few hundred bytes) and torchrun's store keep-alives (about a hundred bytes a second).
SLACK = 16 * 1024
summaries = {}
for s in strategies:
    line = [l for l in (multi[s] / "logs" / "rank_0.log").read_text().splitlines() if "summary: " in l][-1]
    summaries[s] = dict(re.findall(r"([\w/]+)=([-\d.e+]+)", line))
for s, summary in summaries.items():
    measured = float(summary["net/cross_host_tx_bytes_per_step"])
    if "comm/cross_host_bytes_per_step" not in summary:
        print(f"{s}: cross-host bytes per step measured {measured / 2**20:.2f} MiB, theory - (its collectives "
              "are not minidist's)")
        continue
    theory = float(summary["comm/cross_host_bytes_per_step"])
    print(f"{s}: of the bytes sent, through shared memory (a host's own groups): "
          f"{float(summary['comm/shm_share']):.1%}")
    packets = float(summary["comm/cross_host_packets_per_step"])
    high = theory + 2 * 66 * packets + SLACK
    ok = theory <= measured <= high
    failed |= not ok
    print(f"{s}: cross-host bytes per step measured {measured / 2**20:.2f} MiB, theory {theory / 2**20:.2f} MiB "
          f"(ratio {measured / theory:.3f}; headers, ACKs and the rest allow up to {high / 2**20:.2f} MiB: "
          f"{'within' if ok else 'OUTSIDE'})")
sys.exit(1 if failed else 0)
EOF
