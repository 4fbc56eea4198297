#!/usr/bin/env bash
# Multi-node training on emulated hosts: HOSTS Linux network namespaces on this machine, each with
# its own IP address (10.77.0.1, .2, ...) on a veth pair plugged into one bridge, each running
# `torchrun --nnodes HOSTS --nproc_per_node NPROC_PER_HOST` with a c10d rendezvous at host 1's address.
# For every strategy in STRATEGIES it trains a short run, then checks that every rank ends with the
# same parameters, equal (bitwise) to a single-host run of HOSTS x NPROC_PER_HOST ranks.
#
#   sudo scripts/multinode_local.sh                       # 2 hosts x 2 ranks, ddp and zero2
#   sudo HOSTS=3 STRATEGIES="zero3" scripts/multinode_local.sh trainer.max_steps=30
#
# Arguments are trainer overrides for every run. Needs root (ip netns); without it, it says so and
# exits 3. Namespaces, links and processes are removed whatever happens (trap on EXIT).
# Environment: HOSTS (2), NPROC_PER_HOST (2), STRATEGIES ("ddp zero2"), OUT (a new temp folder),
# PREFIX (md: names of namespaces and links), TIMEOUT_S per run (300), PYTHON (.venv/bin/python).
set -uo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2}
NPROC_PER_HOST=${NPROC_PER_HOST:-2}
STRATEGIES=${STRATEGIES:-"ddp zero2"}
PREFIX=${PREFIX:-md}
TIMEOUT_S=${TIMEOUT_S:-300}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d /tmp/minidist-multinode.XXXXXX)}
SUBNET=10.77.0
PORT=29400
BRIDGE=${PREFIX}br0
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

die() { echo "multinode_local: $*" >&2; exit "${2:-1}"; }

if [ "$(id -u)" != 0 ] || ! ip netns add "${PREFIX}probe" 2>/dev/null; then
    die "cannot create network namespaces here (needs root and 'ip netns'): run as root, e.g. sudo $0" 3
fi
ip netns del "${PREFIX}probe"

cleanup() {
    for i in $(seq 1 "$HOSTS"); do
        ns=${PREFIX}h$i
        if ip netns list | grep -qw "$ns"; then
            pids=$(ip netns pids "$ns" 2>/dev/null)
            [ -n "$pids" ] && kill -9 $pids 2>/dev/null
            ip netns del "$ns" 2>/dev/null
        fi
        ip link del "${PREFIX}v$i" 2>/dev/null
    done
    ip link del "$BRIDGE" 2>/dev/null
    return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cleanup  # leftovers of an earlier run that was killed with -9

ip link add "$BRIDGE" type bridge && ip link set "$BRIDGE" up || die "cannot create bridge $BRIDGE"
for i in $(seq 1 "$HOSTS"); do
    ns=${PREFIX}h$i
    ip netns add "$ns"
    ip link add "${PREFIX}v$i" type veth peer name "${PREFIX}p$i"
    ip link set "${PREFIX}p$i" netns "$ns"
    ip link set "${PREFIX}v$i" master "$BRIDGE" up
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip link set "${PREFIX}p$i" name eth0
    ip netns exec "$ns" ip addr add "$SUBNET.$i/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
done
for i in $(seq 2 "$HOSTS"); do  # every host has a route to host 1 before anything starts
    ip netns exec "${PREFIX}h$i" ip -4 route get "$SUBNET.1" >/dev/null 2>&1 || die "host $i has no route to host 1"
done
echo "multinode_local: $HOSTS hosts ($SUBNET.1-$HOSTS) x $NPROC_PER_HOST ranks; runs in $OUT"

if [ $# -eq 0 ]; then  # a short run unless told otherwise
    set -- trainer.max_steps=20 trainer.micro_batch_size=8 trainer.eval_batches=2 trainer.ckpt_every=0 \
        trainer.log_every=5 data.max_bytes=400000
fi
TORCHRUN=(-m torch.distributed.run)
status=0
for strategy in $STRATEGIES; do
    multi=$OUT/$strategy/multi
    single=$OUT/$strategy/single
    common=("strategy=$strategy" "trainer.progress=false" "$@")
    pids=()
    for i in $(seq 1 "$HOSTS"); do
        # Each host: its own address for torchrun's store (--local-addr) and for gloo (its eth0).
        # Host 1 serves the rendezvous (is_host: the namespaces share one hostname, so torchrun
        # cannot tell from names which of them owns the endpoint's address).
        is_host=$([ "$i" = 1 ] && echo 1 || echo 0)
        ip netns exec "${PREFIX}h$i" env GLOO_SOCKET_IFNAME=eth0 timeout -k 10 "$TIMEOUT_S" \
            "$PYTHON" "${TORCHRUN[@]}" --nnodes "$HOSTS" --nproc_per_node "$NPROC_PER_HOST" \
            --rdzv-backend c10d --rdzv-endpoint "$SUBNET.1:$PORT" --rdzv-id "$strategy" --local-addr "$SUBNET.$i" \
            --rdzv-conf "is_host=$is_host" \
            recipes/train.py "${common[@]}" "hydra.run.dir=$multi" > "$OUT/$strategy.host$i.log" 2>&1 &
        pids+=($!)
    done
    failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    if [ "$failed" != 0 ]; then
        echo "multinode_local: $strategy on $HOSTS hosts failed; logs: $OUT/$strategy.host*.log" >&2
        tail -n 20 "$OUT/$strategy".host*.log >&2
        status=1
        continue
    fi
    timeout -k 10 "$TIMEOUT_S" "$PYTHON" "${TORCHRUN[@]}" --standalone --nproc_per_node $((HOSTS * NPROC_PER_HOST)) \
        recipes/train.py "${common[@]}" "hydra.run.dir=$single" > "$OUT/$strategy.single.log" 2>&1 \
        || { echo "multinode_local: the single-host run of $strategy failed: $OUT/$strategy.single.log" >&2; status=1; continue; }
    "$PYTHON" - "$multi" "$single" "$strategy" $((HOSTS * NPROC_PER_HOST)) <<'EOF' || status=1
import re, sys
from pathlib import Path

multi, single, strategy, world = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])

def digests(run):
    out = {}
    for r in range(world):
        found = re.findall(r"state_digest=(\w+)", (run / "logs" / f"rank_{r}.log").read_text())
        out[r] = found[-1] if found else None
    return out

m, s = digests(multi), digests(single)
same_ranks = len(set(m.values())) == 1 and None not in m.values()
same_as_single = same_ranks and set(m.values()) == set(s.values())
print(f"multinode_local: {strategy}: {world} ranks on emulated hosts, final state digests {sorted(set(m.values()))}; "
      f"single host {sorted(set(s.values()))}: "
      f"{'every rank identical and equal to the single-host run' if same_as_single else 'MISMATCH'}")
sys.exit(0 if same_as_single else 1)
EOF
done
exit $status
