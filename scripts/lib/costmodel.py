"""A cost model of one training step's communication on a two-level cluster, to 16,384 ranks.

    python scripts/lib/costmodel.py recommend --params 70e9 --hosts 128 --per-host 8 --cluster ib
    python scripts/lib/costmodel.py table --plot scale.png      # the tables of docs/scale.md (scripts/make_scale_doc.py)
    python scripts/lib/costmodel.py validate measured.json      # against scripts/validate_sim.sh's runs

The cluster: H hosts of G ranks (N = H G). Within a host, each rank has links of bandwidth
`intra_bw` (bytes/s) and latency `intra_lat` (s); between hosts, each host has `inter_bw`
(its network bandwidth, all NICs together) and `inter_lat`. Ranks are numbered host by
host (as torchrun and SLURM do), so a group of contiguous ranks stays within a host.

Collectives, alpha-beta model, on a group of n ranks moving M bytes:

    ring reduce_scatter or all_gather   (n-1) x (a + M/n / b)       n-1 steps of M/n per rank
    ring all_reduce                     2 (n-1) x (a + M/n / b)     reduce_scatter + all_gather
    tree all_reduce (double binary)     2 log2(n) x a + 2 (n-1)/n M / b   latency grows with log n only
                                        (pipelined, two trees: the ring's bandwidth term, as NCCL's trees reach)

where (a, b) is the slowest link a step crosses. A group within one host: (intra_lat,
intra_bw). A group spanning hosts, laid out host by host (a flat ring over the world): each
step sends one M/n message out of each host, so (inter_lat, inter_bw); where the two levels
share the ranks' cores (Cluster.levels_in_series, the emulated hosts) the step's hop within
the host adds its transfer time, the bandwidths in series. A replicate group
(one rank per host, stride G): every step crosses hosts, and the G replicate groups of a
mesh run at once, sharing each host's network: (inter_lat, inter_bw / G). Each step is
paid per message, so a step split into k buckets or units pays k latencies per step.

Per optimizer step (Psi parameters, `comm_bytes` each on the wire, bf16 by default), each
strategy priced by the collectives its spec declares (minidist/train/strategies/registry.py):

    ddp               all_reduce(Psi) over N                               (buckets)
    ddp_hierarchical  reduce_scatter(Psi) in host, all_reduce(Psi/G) across hosts, all_gather in host
    zero1, zero2      reduce_scatter(Psi) + all_gather(Psi) over N         (buckets)
    zero3             reduce_scatter(Psi) + 2 all_gather(Psi) over N       (units)
    zero3_zeropp      zero3 with ZeRO++'s three: the reduce_scatter an int8 all-to-all (qgZ: out of
                      each host go G (N - G) chunks of Psi/N at 1 + 4/256 bytes an element), the
                      forward gather an int8 ring (qwZ), the backward gather a ring within the host (hpZ)
    hsdp2             zero2 within the shard group + all_reduce(Psi/S) across the replicas
    hsdp3             zero3 within the shard group + all_reduce(Psi/S) across the replicas  (units)

A shard group is S ranks: one host (S = G) by default; when the state does not fit at S = G,
`evaluate` takes the smallest S (G times a power of two) at which it does: then the shard
group's rings cross hosts, as a world ring does (inter_lat, inter_bw).

Memory per rank (mixed precision, Adam: 2 + 2 + 12 bytes per parameter, the ZeRO paper's
K = 12, from each spec's ZeRO stage): ddp/ddp_hierarchical 16 Psi; zero1 4 Psi + 12 Psi/N; zero2 2 Psi + 14 Psi/N; zero3
16 Psi/N; hsdp2 2 Psi + 14 Psi/S; hsdp3 16 Psi/S. Activations are left out: a strategy
"fits" when its model state takes at most `state_fraction` of the device memory.

This is communication only: compute and how much of the communication it hides are not
modelled, except a wire format's coding (Cluster.codec_s: encoding and decoding int8 takes the
ranks' own time, measured by scripts/bench_mesh.py; 0 by default, as on GPUs where it runs at
memory bandwidth). docs/scale.md (rendered by scripts/make_scale_doc.py) holds the tables and plots, and
how the model compares with the emulated hosts (scripts/validate_sim.sh).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace

from minidist.train.strategies import spec, specs
from minidist_tools.theory import model_state_bytes



def strategies() -> tuple[str, ...]:
    """The strategies priced: minidist's own shipped ones that communicate (native PyTorch's and
    DeepSpeed's move the same bytes as their minidist counterparts), in the registry's order.
    Read at each call, so a strategy added to the registry's families is priced at once; one a
    script registers for itself is not (the documents rendered from here describe minidist's).
    DiLoCo's are another algorithm, not another way to compute the same step: they are priced
    apart (local_sgd_strategies, diloco_crossover), never recommended for the same result."""
    return tuple(s.name for s in specs("minidist", shipped_only=True) if s.collectives and s.checked_by == "parameters")


def local_sgd_strategies() -> tuple[str, ...]:
    """minidist's strategies that synchronise once per round of strategy.sync_every steps (DiLoCo's)."""
    return tuple(s.name for s in specs("minidist", shipped_only=True) if any(c.per_round for c in s.collectives))


def default_sync_every(strategy: str) -> int:
    """strategy.sync_every as its YAML sets it (1 for a strategy without rounds)."""
    from minidist_tools.benchmarking import strategy_options

    return int(strategy_options(strategy).get("sync_every", 1)) if "sync_every" in spec(strategy).options else 1


@dataclass(frozen=True)
class Cluster:
    """Links of a two-level cluster (bandwidths in bytes/s, latencies in s)."""

    per_host: int          # G: ranks per host
    intra_bw: float        # per rank, within a host
    intra_lat: float
    inter_bw: float        # per host, all of its network links together
    inter_lat: float
    device_bytes: float = 80e9  # memory per rank (an 80 GB GPU)
    # Seconds per element to encode a wire format and decode it again (one round trip of an fp32
    # value; 0: free, as on a GPU, where it is a few elementwise kernels at memory bandwidth).
    # On CPUs the ranks' cores do it: scripts/bench_mesh.py measures it as it measures the links.
    codec_s: float = 0.0
    # A ring over hosts crosses both levels every step. On a GPU cluster NVLink and the NICs move
    # data at once, so a step takes its slowest link's time (False). On the emulated hosts of
    # scripts/validate_sim.sh both levels are copies by the same few CPU cores, and a step's hop
    # within the host adds to its hop across hosts (True): their bandwidths in series.
    levels_in_series: bool = False

    @classmethod
    def calibrated(cls, m: dict) -> "Cluster":
        """The emulated hosts scripts/bench_mesh.py measured (its JSON's fields); their levels
        share the ranks' cores, so in series."""
        return cls(per_host=m["per_host"], intra_bw=m["intra_bw"], intra_lat=m["intra_lat"], inter_bw=m["inter_bw"],
                   inter_lat=m["inter_lat"], codec_s=m.get("codec_s", 0.0), levels_in_series=True)


# Two clusters to tabulate: 8 GPUs a host on NVLink (about 200 GB/s each way per GPU), linked
# by InfiniBand 8 x 400 Gb/s (about 400 GB/s a host) or by one 100 Gb/s Ethernet link.
CLUSTERS = {
    "ib": Cluster(per_host=8, intra_bw=200e9, intra_lat=3e-6, inter_bw=400e9, inter_lat=10e-6),
    "ethernet": Cluster(per_host=8, intra_bw=200e9, intra_lat=3e-6, inter_bw=12.5e9, inter_lat=30e-6),
}

# Two models to tabulate: parameters and the layers that become stage-3 units.
MODELS = {"1B": (1.0e9, 24), "70B": (70e9, 80)}


@dataclass(frozen=True)
class Link:
    lat: float
    bw: float


def ring_steps_time(n: int, nbytes: float, link: Link, passes: int, messages: int = 1) -> float:
    """`passes` ring passes (1: reduce_scatter or all_gather, 2: all_reduce) of `nbytes` split
    into `messages` collectives, on n ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    per = nbytes / messages
    return messages * passes * (n - 1) * (link.lat + per / n / link.bw)


def tree_all_reduce_time(n: int, nbytes: float, link: Link, messages: int = 1) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    per = nbytes / messages
    return messages * (2 * math.ceil(math.log2(n)) * link.lat + 2 * (n - 1) / n * per / link.bw)


def ring_link(c: Cluster, ranks: int) -> Link:
    """The bottleneck of a ring over `ranks` contiguous ranks: within a host, or across hosts
    (laid out host by host: one message out of each host per step; with the levels in series,
    each step's hop within the host adds its transfer time)."""
    if ranks <= c.per_host:
        return Link(c.intra_lat, c.intra_bw)
    if c.levels_in_series:
        return Link(c.inter_lat, 1 / (1 / c.inter_bw + 1 / c.intra_bw))
    return Link(c.inter_lat, c.inter_bw)


def replicas_link(c: Cluster) -> Link:
    """A replicate group's ring: every step crosses hosts, and the G groups share each host's network."""
    return Link(c.inter_lat, c.inter_bw / c.per_host)


def all_reduce_time(n: int, nbytes: float, link: Link, algorithm: str, messages: int) -> float:
    if algorithm == "tree":
        return tree_all_reduce_time(n, nbytes, link, messages)
    return ring_steps_time(n, nbytes, link, 2, messages)


def all_to_all_time(n: int, nbytes: float, c: Cluster, replicas: bool = False, messages: int = 1) -> float:
    """A wire's exchange (minidist.comm.wire): each of n ranks sends n-1 chunks of nbytes/n at once,
    each straight to its owner. Ranks laid out host by host: out of each host go G (n - G) chunks
    of a group spanning hosts (G(n-1) for a replicate group, one rank per host), through its link;
    the G-1 within it take the intra link. One latency per message: the sends are concurrent."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    G, chunk = c.per_host, nbytes / messages / n
    crossing = G * (n - 1) if replicas else (G * (n - G) if n > G else 0)
    inter = c.inter_lat + crossing * chunk / c.inter_bw if crossing else 0.0
    intra = c.intra_lat + (min(n, G) - 1) * chunk / c.intra_bw if not replicas else 0.0
    return messages * max(inter, intra)


def wire_bytes_per_element(wire: str | None, default: float, block: int = 256) -> float:
    """Bytes an element takes on a wire (None: `default`, the dtype's): int8 carries its scales."""
    if wire is None:
        return default
    from minidist.comm.wire import Wire

    return Wire(wire, block=block).chunk_bytes(block) / block


# Patterns priced beside the strategies: name -> (strategy, its wire options). ZeRO++ (int8 weights
# and gradients, hpZ's host-local backward gathers) for each strategy that takes secondary_shard.
ZEROPP = {"grad_wire": "int8", "param_wire": "int8", "secondary": True}
VARIANTS = {f"{s.name}_zeropp": (s.name, ZEROPP) for s in specs("minidist") if "secondary_shard" in s.options}


def step_comm_time(strategy: str, params: float, hosts: int, c: Cluster, *, comm_bytes: int = 2,
                   algorithm: str = "ring", units: int = 24, bucket_bytes: float = 25 * 2**20,
                   shard: int | None = None, grad_wire: str | None = None, param_wire: str | None = None,
                   secondary: bool = False, sync_every: int | None = None, options=None) -> dict[str, float]:
    """Seconds of communication per optimizer step: "group" (the world's collectives, or the
    shard group's), "replicas" (the all_reduce across replicas) and "total".

    `algorithm` applies to all_reduce (ring or tree); reduce_scatter and all_gather are rings.
    `shard`: the shard group's size S for a hybrid strategy (default: one host).
    `grad_wire` / `param_wire` (strategy.grad_wire / param_wire): the gradients' reduce_scatter or
    all_reduce becomes the wire's all-to-all (then, for an all_reduce, a ring all_gather) of its
    bytes per element; the parameters' all_gathers are rings of the wire's bytes. `secondary`
    (hpZ, stage 3): the second all_gather runs within each host, at comm_bytes. `sync_every`
    (DiLoCo's H; None: its YAML's): a per-round collective costs 1/H of itself a step. `options`:
    the strategy's own where one changes what it sends (DiLoCo's inner, StrategySpec.for_options)."""
    if strategy not in strategies() + local_sgd_strategies():
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {strategies() + local_sgd_strategies()}")
    H = default_sync_every(strategy) if sync_every is None else int(sync_every)
    s = spec(strategy).for_options(options)
    G, N = c.per_host, hosts * c.per_host
    S = shard or G
    if s.hybrid and N % S:
        raise ValueError(f"a shard group of {S} does not divide {N} ranks")
    size = params * comm_bytes
    messages = units if s.messages == "units" else max(1, math.ceil(size / bucket_bytes))
    ranks = {"world": N, "shard": S, "replicas": N // S}
    links = {"world": ring_link(c, N), "shard": ring_link(c, S), "replicas": replicas_link(c)}
    grad_per = wire_bytes_per_element(grad_wire, comm_bytes) / comm_bytes  # the wire's share of comm_bytes
    param_per = wire_bytes_per_element(param_wire, comm_bytes) / comm_bytes
    out = {"group": 0.0, "replicas": 0.0}
    for op in s.collectives:
        share = 1 / H if op.per_round else 1  # once a round of H steps
        payload = size / S if op.payload == "shard" else size
        n, link = ranks[op.group], links[op.group]
        replicas = op.group == "replicas"
        # A wire's coding, on the rank's own cores: a reduce_scatter encodes and decodes every element
        # (half a round trip each); an all_gather encodes its 1/n and decodes all.
        codec = c.codec_s * params * (payload / size)
        if op.op == "all_reduce" and grad_wire is not None:
            t = all_to_all_time(n, payload * grad_per, c, replicas, messages) + \
                ring_steps_time(n, payload * grad_per, link, 1, messages) + codec * (1.5 + 0.5 / n)
        elif op.op == "all_reduce":
            t = all_reduce_time(n, payload, link, algorithm, messages)
        elif op.op == "reduce_scatter" and grad_wire is not None:
            t = all_to_all_time(n, payload * grad_per, c, replicas, messages) + codec
        elif op.op == "reduce_scatter":
            t = ring_steps_time(n, payload, link, 1, messages)
        elif op.op == "all_gather":
            coded = codec * (0.5 + 0.5 / n) if param_wire is not None else 0.0
            t = op.count * (ring_steps_time(n, payload * param_per, link, 1, messages) + coded)
            if secondary and op.count == 2:  # hpZ: the backward's gather within the host, from the kept copy
                t = t / 2 + ring_steps_time(min(n, G), payload, ring_link(c, min(n, G)), 1, messages)
            out["replicas" if replicas else "group"] += share * t
            continue
        else:
            raise ValueError(f"{strategy}: the cost model prices rings, not {op.op}")
        out["replicas" if replicas else "group"] += share * op.count * t
    return {**out, "total": out["group"] + out["replicas"]}


def diloco_crossover(params: float, hosts: int, c: Cluster, compute_s: float, *, sync_every: int,
                     token_factor: float = 1.0, strategy: str | None = None, **priced) -> float:
    """The link speed between hosts (c.inter_bw, bytes/s a host) below which `strategy` (default:
    the first of local_sgd_strategies) at H = `sync_every` reaches its spec's reference's loss
    sooner: where token_factor x (compute_s + its communication) < compute_s + the reference's,
    communication not overlapped. token_factor: the tokens it needs for the reference's loss over
    the reference's (measured: 1 or less, it wins on any link). `priced`: step_comm_time's other options (comm_bytes, units, shard, ...)."""
    strategy = strategy or local_sgd_strategies()[0]
    reference = spec(strategy).reference

    def advantage(bw: float) -> float:
        at = replace(c, inter_bw=bw)
        ours = step_comm_time(strategy, params, hosts, at, sync_every=sync_every, **priced)["total"]
        theirs = step_comm_time(reference, params, hosts, at, **priced)["total"]
        return (compute_s + theirs) - token_factor * (compute_s + ours)
    low, high = 1e3, 1e14
    if advantage(high) >= 0:
        return math.inf  # faster on every link
    if advantage(low) < 0:
        return 0.0
    for _ in range(200):  # bisect in log space
        mid = math.sqrt(low * high)
        low, high = (mid, high) if advantage(mid) >= 0 else (low, mid)
    return low


def state_bytes_per_rank(strategy: str, params: float, hosts: int, per_host: int, shard: int | None = None,
                         options=None) -> float:
    """Model state per rank (mixed precision + Adam), the ZeRO paper's formulas with K = 12."""
    return model_state_bytes(spec(strategy).for_options(options), params, hosts * per_host, shard or per_host,
                             precision="mixed")


def inner_strategies(strategy: str) -> list[str]:
    """What a DiLoCo strategy's workers may run within themselves (strategy.inner), in its spec's
    order: replicated first, then the ZeRO stages."""
    return [i for i in spec(strategy).choices.get("inner", ()) if i is not None]


def diloco_worker(strategy: str, params: float, hosts: int, c: Cluster,
                  state_fraction: float = 0.5) -> tuple[str, int] | None:
    """(strategy.inner, ranks per worker) for a DiLoCo run: the first inner strategy it takes whose
    state fits `state_fraction` of a device with one host a worker (ddp, then the ZeRO stages);
    else ZeRO-3 over the smallest number of hosts that fits, leaving 2 workers at least; None
    where nothing fits."""
    N, budget = hosts * c.per_host, state_fraction * c.device_bytes
    inners = inner_strategies(strategy)

    def fits(inner: str, shard: int) -> bool:
        return state_bytes_per_rank(strategy, params, hosts, c.per_host, shard, {"inner": inner}) <= budget
    for inner in inners:
        if fits(inner, c.per_host):
            return inner, c.per_host
    shard, deepest = c.per_host * 2, inners[-1]
    while shard * 2 <= N and N % shard == 0:
        if fits(deepest, shard):
            return deepest, shard
        shard *= 2
    return None


def evaluate(params: float, units: int, hosts: int, c: Cluster, algorithm: str = "ring",
             state_fraction: float = 0.5) -> dict[str, dict]:
    """Every strategy: communication seconds per step, state per rank, whether it fits, and for
    the hybrid ZeRO strategies (hsdp2/hsdp3) the shard group size used (one host, or the smallest multiple that fits)."""
    N, budget = hosts * c.per_host, state_fraction * c.device_bytes
    out = {}
    for s in strategies():
        shard = None
        if spec(s).hybrid and spec(s).zero_stage:  # sharded on a mesh: the smallest shard group that fits
            shard = c.per_host
            while state_bytes_per_rank(s, params, hosts, c.per_host, shard) > budget and shard * 2 <= N \
                    and N % (shard * 2) == 0:
                shard *= 2
        t = step_comm_time(s, params, hosts, c, algorithm=algorithm, units=units, shard=shard)
        state = state_bytes_per_rank(s, params, hosts, c.per_host, shard)
        out[s] = {**t, "state_bytes": state, "fits": state <= budget, "shard": shard}
    return out


def recommend(params: float, units: int, hosts: int, c: Cluster, algorithm: str = "ring",
              state_fraction: float = 0.5) -> tuple[str | None, dict]:
    """The strategy with the least communication among those whose state fits (None: none fits)."""
    rows = evaluate(params, units, hosts, c, algorithm, state_fraction)
    order = list(rows)  # the registry's
    fitting = [s for s in order if rows[s]["fits"]]
    return (min(fitting, key=lambda s: (rows[s]["total"], order.index(s))) if fitting else None), rows


# --------------------------------------------------------------------------- table and plot

RANKS = (16, 64, 256, 1024, 4096, 16384)


def table_markdown(algorithm: str = "ring") -> str:
    lines, priced = [], strategies()
    for cname, c in CLUSTERS.items():
        for mname, (params, units) in MODELS.items():
            lines += [f"### {mname} parameters, `{cname}` cluster ({c.per_host} ranks a host, "
                      f"{c.intra_bw / 1e9:g} GB/s within, {c.inter_bw / 1e9:g} GB/s a host between), "
                      f"{algorithm} all_reduce", "",
                      "| ranks | " + " | ".join(priced) + " | pick |",
                      "|---" * (len(priced) + 2) + "|"]
            for n in RANKS:
                pick, rows = recommend(params, units, n // c.per_host, c, algorithm)
                cells = [f"{rows[s]['total'] * 1e3:,.0f}" + ("" if rows[s]["fits"] else " ✗")
                         + (f" (S={rows[s]['shard']})" if rows[s]["shard"] not in (None, c.per_host) else "")
                         for s in priced]
                lines.append(f"| {n:,} | " + " | ".join(cells) + f" | **{pick or '-'}** |")
            lines.append("")
    return "\n".join(lines)


DILOCO_H = (8, 32, 128)
DILOCO_RANKS = (64, 1024)


def diloco_table_markdown(algorithm: str = "ring") -> str:
    """Communication per step of DiLoCo at H in DILOCO_H (the outer all_reduce across workers once a
    round), beside its reference (ddp) and the synchronous pick: what rounds of H steps buy on
    paper. Each worker runs the inner strategy diloco_worker picks: DDP within a host where the
    state fits, else a ZeRO stage within it, else ZeRO-3 over several hosts (its name and worker
    size in the cell); ✗: nothing fits half of the device (priced as DDP within a host).
    Streaming DiLoCo moves the same bytes a round, a fragment at a time."""
    lines = []
    for name in local_sgd_strategies()[:1]:
        reference = spec(name).reference
        heads = [reference, "synchronous pick", *(f"{name} H={h}" for h in DILOCO_H)]
        lines += [f"### {name}", "", "| cluster | model | ranks | " + " | ".join(heads) + " |",
                  "|---" * (len(heads) + 3) + "|"]
        for cname, c in CLUSTERS.items():
            for mname, (params, units) in MODELS.items():
                for n in DILOCO_RANKS:
                    hosts = n // c.per_host
                    pick, sync = recommend(params, units, hosts, c, algorithm)
                    worker = diloco_worker(name, params, hosts, c)
                    plain = (inner_strategies(name)[0], c.per_host)  # replicated within a host
                    inner, shard = worker or plain
                    note = "" if worker in (None, plain) else \
                        f" ({inner}" + ("" if shard == c.per_host else f", S={shard}") + ")"

                    def cell(t: float, ok: bool) -> str:
                        return f"{t * 1e3:,.0f}" + ("" if ok else " ✗")
                    cells = [cell(sync[reference]["total"], sync[reference]["fits"]),
                             f"{pick} {sync[pick]['total'] * 1e3:,.0f}" if pick else "-"]
                    cells += [cell(step_comm_time(name, params, hosts, c, algorithm=algorithm, units=units,
                                                  sync_every=h, shard=shard, options={"inner": inner})["total"],
                                   worker is not None) + note for h in DILOCO_H]
                    lines.append(f"| {cname} | {mname} | {n:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(path: str, algorithm: str = "ring") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priced = strategies()
    fig, axes = plt.subplots(len(CLUSTERS), len(MODELS), figsize=(11, 8), sharex=True)
    for i, (cname, c) in enumerate(CLUSTERS.items()):
        for j, (mname, (params, units)) in enumerate(MODELS.items()):
            ax = axes[i][j]
            for s in priced:
                xs, ys, fits = [], [], []
                for n in RANKS:
                    r = evaluate(params, units, n // c.per_host, c, algorithm)[s]
                    xs.append(n)
                    ys.append(r["total"])
                    fits.append(r["fits"])
                # Several strategies cost the same (ddp = zero1 = zero2 with a ring; ddp_hierarchical
                # = hsdp2): styles differ so that every line stays visible.
                k = priced.index(s)
                markers = "os^vDP*"  # cycled: a strategy registered later (any number) still gets one
                ax.plot(xs, ys, marker=markers[k % len(markers)], linestyle=("-", "--", ":", "-.")[k % 4], label=s, alpha=0.85,
                        markersize=4 + (k % 3))
                ax.plot([x for x, f in zip(xs, fits) if not f], [y for y, f in zip(ys, fits) if not f], "x",
                        color="black", markersize=9)
            ax.set(xscale="log", yscale="log", title=f"{mname}, {cname}", xlabel="ranks",
                   ylabel="communication per step (s)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Cost model ({algorithm} all_reduce): x = model state does not fit in half of 80 GB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- validation

def predict_measured(m: dict, levels_in_series: bool = True) -> dict[str, float]:
    """Predictions for what scripts/validate_sim.sh measured: `m` holds the cluster it calibrated
    (hosts, per_host, intra/inter bandwidth and latency) and the payload; fp32 bytes, ring.
    `levels_in_series=False` prices it with a GPU cluster's rule instead (the levels at once)."""
    c = replace(Cluster.calibrated(m), levels_in_series=levels_in_series)

    def priced(name: str) -> float:
        strategy, wires = VARIANTS.get(name, (name, {}))
        return step_comm_time(strategy, m["params"], m["hosts"], c, comm_bytes=4, algorithm="ring",
                              units=m["messages"], bucket_bytes=m["params"] * 4 / m["messages"], **wires)["total"]
    return {s: priced(s) for s in m["measured"]}


def prediction_errors(m: dict, predicted: dict[str, float] | None = None) -> dict[str, float]:
    """Per pattern that scripts/validate_sim.sh measured: (predicted - measured) / measured
    (`predicted`: predict_measured(m), when the caller has it already)."""
    predicted = predicted if predicted is not None else predict_measured(m)
    return {s: (predicted[s] - measured) / measured for s, measured in m["measured"].items()}


def validate(m: dict, tolerance: float = 0.25) -> tuple[bool, str]:
    predicted = predict_measured(m)
    lines = ["| pattern | measured s | predicted s | error |", "|---|---|---|---|"]
    ok = True
    for s, err in prediction_errors(m, predicted).items():
        measured = m["measured"][s]
        ok &= abs(err) <= tolerance
        lines.append(f"| {s} | {measured:.3f} | {predicted[s]:.3f} | {err:+.0%} |")
    return ok, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/lib/costmodel.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("recommend", help="which strategy for a model on a cluster")
    r.add_argument("--params", type=float, required=True)
    r.add_argument("--units", type=int, default=None, help="stage-3 units (layers); default: 24 or 80 by size")
    r.add_argument("--hosts", type=int, required=True)
    r.add_argument("--per-host", type=int, default=None)
    r.add_argument("--cluster", choices=list(CLUSTERS), default="ib")
    r.add_argument("--algorithm", choices=["ring", "tree"], default="ring")
    r.add_argument("--device-gb", type=float, default=80.0)
    t = sub.add_parser("table", help="write the markdown table and the plot")
    t.add_argument("--out", default=None)
    t.add_argument("--plot", default=None)
    t.add_argument("--algorithm", choices=["ring", "tree"], default="ring")
    v = sub.add_parser("validate", help="compare predictions with scripts/validate_sim.sh's measurements")
    v.add_argument("measured", help="the JSON that recipes/bench_mesh.py wrote")
    v.add_argument("--tolerance", type=float, default=0.25)
    args = parser.parse_args(argv)
    if args.command == "recommend":
        c = CLUSTERS[args.cluster]
        c = replace(c, per_host=args.per_host or c.per_host, device_bytes=args.device_gb * 1e9)
        units = args.units or (24 if args.params < 10e9 else 80)
        pick, rows = recommend(args.params, units, args.hosts, c, args.algorithm)
        print(f"{args.params / 1e9:g}B parameters on {args.hosts} hosts x {c.per_host} ({args.cluster}, "
              f"{args.algorithm} all_reduce):")
        for s in rows:
            row = rows[s]
            shard = f"  shard groups of {row['shard']}" if row["shard"] else ""
            print(f"  {s:<17}{row['total'] * 1e3:>10,.1f} ms/step  state {row['state_bytes'] / 1e9:>8,.1f} GB/rank"
                  f"{'' if row['fits'] else '  (does not fit)'}{shard}")
        print(f"pick: {pick or 'none fits: more ranks per replica (a larger shard group) or offloading'}")
        return 0
    if args.command == "table":
        text = table_markdown(args.algorithm)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        else:
            print(text)
        if args.plot:
            plot(args.plot, args.algorithm)
        return 0
    with open(args.measured) as f:
        m = json.load(f)
    ok, text = validate(m, args.tolerance)
    print(text)
    print(f"cluster calibrated: {json.dumps({k: m[k] for k in ('intra_bw', 'intra_lat', 'inter_bw', 'inter_lat', 'codec_s') if k in m})}")
    print("within" if ok else "NOT within", f"{args.tolerance:.0%} for every pattern")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
