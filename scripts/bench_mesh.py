"""Measure one step's communication patterns on a real two-level network, for the cost model (scripts/lib/costmodel.py).

Run on every host under torchrun (scripts/validate_sim.sh does, on emulated hosts with shaped
links). All collectives are minidist's ring (minidist.comm.ring), the algorithm the cost model
assumes. It measures:

1. The links, from a separate probe (point-to-point send/recv, not the collectives it then
   predicts), under the load of a ring step (every rank sends and receives at once), at two
   sizes M each: t = a + M s / b, fitted by least squares on relative error.
   - intra (a, b): each rank with the next rank of its own host (s = 1);
   - inter (a, b): each host's local rank 0 with its counterpart on the next host (one stream
     per link, as in the world ring: s = 1), and every rank with its counterpart at once (the
     S streams of a host share its link, as in the replicate rings: s = S), fitted together.
2. Each strategy's step pattern on a flat fp32 buffer of --params values in --messages parts:
   ddp (all_reduce over the world), zero3 (reduce_scatter + 2 all_gathers over the world),
   hierarchical and hsdp3 (the same within each host's shard group, then an all_reduce of the
   1/S shard across the replicas), zero3_zeropp (zero3 with int8 wires and the backward's gather
   within the host).
3. The int8 wire's coding on the ranks' own cores (the cost model's codec_s).

All are timed together in --reps rounds, each round running every probe and pattern once in
turn (a barrier before each), so that a stretch of contention on a shared machine falls on the
calibration and on the patterns alike; each time is the median over the rounds of the slowest
rank's.

Rank 0 writes the JSON `python scripts/lib/costmodel.py validate` reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import minidist
from minidist import comm
from minidist_tools.benchmarking import slowest
from minidist.comm import ring
from minidist.comm.wire import Wire


def timed_in_rounds(probes: dict, reps: int) -> dict[str, float]:
    """Each probe's time: the median of `reps` runs, the slowest rank's (the step ends when it is
    done). The runs go in rounds, each round running every probe once in turn (a barrier before
    each), so that the calibration and the patterns it predicts share the machine's slow and fast
    stretches: timed one after the other, a stretch of contention on a busy CI machine once fell
    on the calibration alone (its codec_s 4-10x this machine's) and the prediction missed by 60%."""
    for fn in probes.values():
        fn()  # warm-up: connections, buffers
    times = {name: [] for name in probes}
    for _ in range(reps):
        for name, fn in probes.items():
            comm.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: slowest(statistics.median(runs)) for name, runs in times.items()}


def exchange(send_to: int, recv_from: int, nbytes: int, active: bool = True):
    """One point-to-point exchange, as a function: every rank sends `nbytes` to `send_to` while
    receiving as many from `recv_from`, all ranks at once (the load of one ring step). The bytes
    go as the ring sends them: in pieces of ring.PIECE_BYTES, each piece's send and receive
    finished before the next starts (on a shaped link one long message was ~25% faster than the
    ring's pieces: a probe of it predicted the world ring 26% too fast). A rank not `active` sits
    the probe out (one stream per host)."""
    out, into = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    step = ring.PIECE_BYTES // 4

    def run():
        if not active:
            return
        for a in range(0, out.numel(), step):
            works = [comm.irecv(into[a:a + step], recv_from), comm.isend(out[a:a + step], send_to)]
            for w in works:
                w.wait()
    return run


def fit_link(points) -> tuple[float, float]:
    """Latency a and bandwidth b minimising the relative error of t = x a + y / b over the points."""
    rows = torch.tensor([[x / t, y / t] for x, y, t in points], dtype=torch.float64)
    lat, inv_bw = torch.linalg.lstsq(rows, torch.ones(len(points), 1, dtype=torch.float64)).solution.flatten().tolist()
    return max(lat, 0.0), 1.0 / inv_bw


def patterns(mesh, params: int, messages: int) -> dict:
    """Each strategy's collectives for one step, as functions (fp32 buffers made once)."""
    per = params // messages
    S, world = mesh.shard, dist.get_world_size()
    flat = [torch.ones(per) for _ in range(messages)]
    piece_world = [torch.empty(per // world) for _ in range(messages)]
    piece_shard = [torch.empty(per // S) for _ in range(messages)]

    def ddp():
        for t in flat:
            comm.all_reduce(t, algorithm="ring")

    def zero3():
        for t, p in zip(flat, piece_world):
            comm.all_gather_into(t, p, algorithm="ring")  # forward
            comm.all_gather_into(t, p, algorithm="ring")  # backward
            comm.reduce_scatter_tensor(p, t, algorithm="ring")

    def hsdp3():
        for t, p in zip(flat, piece_shard):
            comm.all_gather_into(t, p, group=mesh.shard_group, algorithm="ring")  # forward
            comm.all_gather_into(t, p, group=mesh.shard_group, algorithm="ring")  # backward
            comm.reduce_scatter_tensor(p, t, group=mesh.shard_group, algorithm="ring")
            comm.all_reduce(p, group=mesh.replicate_group, algorithm="ring")  # the only step across hosts

    def zero3_zeropp():  # ZeRO++ (costmodel.VARIANTS): int8 weights and gradients, backward gathers in the host
        for t, p in zip(flat, piece_world):
            comm.all_gather_into(t, p, wire_dtype="int8")  # forward (qwZ)
            host_part = t[:per // S]  # hpZ: the kept 1/S, gathered within the host
            comm.all_gather_into(t, host_part.clone(), group=mesh.shard_group, algorithm="ring")
            comm.reduce_scatter_tensor(p, t, wire_dtype="int8")  # qgZ

    def hierarchical():
        for t, p in zip(flat, piece_shard):
            comm.reduce_scatter_tensor(p, t, group=mesh.shard_group, algorithm="ring")
            comm.all_reduce(p, group=mesh.replicate_group, algorithm="ring")
            comm.all_gather_into(t, p, group=mesh.shard_group, algorithm="ring")

    return {"ddp": ddp, "zero3": zero3, "zero3_zeropp": zero3_zeropp, "ddp_hierarchical": hierarchical,
            "hsdp3": hsdp3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=1 << 20, help="fp32 values per step (divisible by world x messages)")
    parser.add_argument("--messages", type=int, default=2, help="buckets / units the step is split into")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # The ring schedule throughout, the one the model describes: below DIRECT_BELOW_BYTES our ring
    # sends each chunk straight to its rank in one step, which puts (G-1)/G of a host's chunks on
    # its link instead of one per step; the model does not cover that schedule (with it, the
    # world ring's patterns here took a third longer than the ring model says).
    ring.DIRECT_BELOW_BYTES = {op: 0 for op in ring.DIRECT_BELOW_BYTES}
    ctx = minidist.init_distributed(backend="gloo")
    mesh = minidist.init_mesh()  # one shard group per host (LOCAL_WORLD_SIZE)
    minidist.print0(str(mesh))
    if mesh.replicate < 2 or mesh.shard < 2:
        raise SystemExit("bench_mesh: needs at least 2 hosts of at least 2 ranks")
    sizes = (ring.PIECE_BYTES, 4 * ring.PIECE_BYTES)  # one piece, four
    S, r = mesh.shard, ctx.rank
    host, local = divmod(r, S)
    hosts = mesh.replicate
    # Within a host: to the next rank of one's own host. Between hosts: to one's counterpart on the
    # next host, under two loads fitted together: one stream out of each host (local rank 0 only:
    # the world ring's case) and all S at once (the replicate rings'). A single TCP stream gets less
    # of a shaped link than S together; one (a, b) for both sits between them.
    nxt, prv = ((host + 1) % hosts) * S + local, ((host - 1) % hosts) * S + local
    probes, links = {}, {}  # links: probe name -> (level, bytes crossing each link: M s in t = a + M s / b)
    for nbytes in sizes:
        probes[f"intra {nbytes}"] = exchange(host * S + (local + 1) % S, host * S + (local - 1) % S, nbytes)
        links[f"intra {nbytes}"] = ("intra", nbytes)
        probes[f"inter one {nbytes}"] = exchange(nxt, prv, nbytes, active=local == 0)
        links[f"inter one {nbytes}"] = ("inter", nbytes)
        probes[f"inter all {nbytes}"] = exchange(nxt, prv, nbytes)
        links[f"inter all {nbytes}"] = ("inter", nbytes * S)
    # The wire's coding on this rank's cores (the cost model's codec_s): encode and decode the whole
    # payload once, with no communication; every rank at once, as in a step (the ranks share the
    # cores). Short and noisy: three runs a round.
    payload, wire = torch.randn(args.params), Wire("int8")
    for i in range(3):
        probes[f"codec {i}"] = lambda: wire.round_trip(payload)
    step_patterns = patterns(mesh, args.params, args.messages)
    times = timed_in_rounds({**probes, **step_patterns}, args.reps)
    intra_lat, intra_bw = fit_link([(1, y, times[n]) for n, (level, y) in links.items() if level == "intra"])
    inter_lat, inter_bw = fit_link([(1, y, times[n]) for n, (level, y) in links.items() if level == "inter"])
    codec_s = statistics.median(times[f"codec {i}"] for i in range(3)) / args.params
    measured = {name: times[name] for name in step_patterns}
    if ctx.rank == 0:
        out = {"hosts": mesh.replicate, "per_host": mesh.shard, "params": args.params, "messages": args.messages,
               "intra_lat": intra_lat, "intra_bw": intra_bw, "inter_lat": inter_lat, "inter_bw": inter_bw,
               "codec_s": codec_s,
               "measured": measured}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
    minidist.shutdown()


if __name__ == "__main__":
    main()
