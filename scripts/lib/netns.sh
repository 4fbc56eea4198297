# Emulated hosts: Linux network namespaces with their own IP addresses on veth pairs joined by a
# bridge. Sourced by scripts/multinode_local.sh, validate_sim.sh, elastic_local.sh and zeropp_local.sh.
#
#   HOSTS=2 PREFIX=md; source scripts/lib/netns.sh
#   netns_start "$0"             # root or exit 3 with the reason; leftovers removed; the hosts up;
#                                # everything removed again at exit (trap), whatever happens
#   netns_torchrun 1 "$name" NPROC script.py args...   # host 1's share of a c10d-rendezvous job
#   netns_lose_host 2; netns_add_host 2                  # a host gone, and back
#   netns_shape 200mbit          # links between hosts at 200 Mbit/s (tc)
#   netns_shape 50mbit 5ms       # ... at 50 Mbit/s, each packet 5 ms later (netem)
#
# Host i is namespace ${PREFIX}h$i with address $SUBNET.$i on its eth0; the rendezvous is at host 1.
SUBNET=${SUBNET:-10.77.0}
PORT=${PORT:-29400}
BRIDGE=${PREFIX}br0

die() { echo "$(basename "$0" .sh): $*" >&2; exit "${2:-1}"; }

netns_require_root() {
    if [ "$(id -u)" != 0 ] || ! ip netns add "${PREFIX}probe" 2>/dev/null; then
        die "cannot create network namespaces here (needs root and 'ip netns'): run as root, e.g. sudo $1" 3
    fi
    ip netns del "${PREFIX}probe"
}

netns_start() {
    netns_require_root "$1"
    trap netns_cleanup EXIT
    trap 'exit 130' INT TERM
    netns_cleanup  # leftovers of an earlier run that was killed with -9
    netns_up
}

netns_cleanup() {
    local i ns pids
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

# netns_shape RATE: every host's outgoing link (eth0) sends at most RATE (tc's tbf, with a queue
# large enough never to drop), so hosts are linked far more slowly than the ranks inside one.
# TCP would restart slow start after every idle gap between two ring steps (a cluster's RDMA
# links do not): each connection keeps its window, so the link runs at RATE.
# A second argument delays every packet leaving a host by that much (netem, before the tbf), so a
# round trip between two hosts takes twice it.
netns_shape() {
    local i parent=root
    for i in $(seq 1 "$HOSTS"); do
        if [ -n "${2:-}" ]; then
            ip netns exec "${PREFIX}h$i" tc qdisc add dev eth0 root handle 1: netem delay "$2" limit 100000 \
                || die "cannot delay eth0 with tc's netem qdisc"
            parent="parent 1:"
        fi
        # shellcheck disable=SC2086  # "parent 1:" is two words
        ip netns exec "${PREFIX}h$i" tc qdisc add dev eth0 $parent handle 2: tbf rate "$1" burst 64kb limit 32mb \
            || die "cannot shape eth0 with tc's tbf qdisc"
        ip netns exec "${PREFIX}h$i" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0
    done
}

# netns_lose_host HOST: the host vanishes as one that loses power does: its link goes first (so
# nothing it could still say reaches anyone), then its processes and its namespace.
netns_lose_host() {
    local ns=${PREFIX}h$1 pids
    ip link del "${PREFIX}v$1" 2>/dev/null
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    ip netns del "$ns" 2>/dev/null
    return 0
}

# netns_add_host HOST: namespace ${PREFIX}hHOST, its veth plugged into the bridge, its address up.
netns_add_host() {
    local i=$1 ns=${PREFIX}h$1
    ip netns add "$ns"
    ip link add "${PREFIX}v$i" type veth peer name "${PREFIX}p$i"
    ip link set "${PREFIX}p$i" netns "$ns"
    ip link set "${PREFIX}v$i" master "$BRIDGE" up
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip link set "${PREFIX}p$i" name eth0
    ip netns exec "$ns" ip addr add "$SUBNET.$i/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    [ "$i" = 1 ] || ip netns exec "$ns" ip -4 route get "$SUBNET.1" >/dev/null 2>&1 || die "host $i has no route to host 1"
}

netns_up() {
    ip link add "$BRIDGE" type bridge && ip link set "$BRIDGE" up || die "cannot create bridge $BRIDGE"
    for i in $(seq 1 "$HOSTS"); do  # every host has a route to host 1 before anything starts
        netns_add_host "$i"
    done
}

# netns_torchrun HOST RDZV_ID NPROC_PER_HOST SCRIPT ARGS...: runs in the foreground; background it.
# NNODES (default HOSTS; MIN:MAX for an elastic job), RDZV_CONF (more --rdzv-conf settings, comma
# separated) and TORCHRUN_ARGS (e.g. "--max-restarts 2") pass on to torchrun.
netns_torchrun() {
    local i=$1 id=$2 nproc=$3
    shift 3
    # Each host: its own address for torchrun's store (--local-addr) and for gloo (its eth0).
    # Host 1 serves the rendezvous (is_host: the namespaces share one hostname, so torchrun
    # cannot tell from names which of them owns the endpoint's address).
    local is_host=0
    [ "$i" = 1 ] && is_host=1
    ip netns exec "${PREFIX}h$i" env GLOO_SOCKET_IFNAME=eth0 timeout -k 10 "$TIMEOUT_S" \
        "$PYTHON" -m torch.distributed.run --nnodes "${NNODES:-$HOSTS}" --nproc_per_node "$nproc" \
        --rdzv-backend c10d --rdzv-endpoint "$SUBNET.1:$PORT" --rdzv-id "$id" --local-addr "$SUBNET.$i" \
        --rdzv-conf "is_host=$is_host${RDZV_CONF:+,$RDZV_CONF}" ${TORCHRUN_ARGS:-} "$@"
}
