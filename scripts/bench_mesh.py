"""Measure one step's communication patterns on a real two-level network, for minidist.sim.

Run on every host under torchrun (scripts/validate_sim.sh does, on emulated hosts with shaped
links). All collectives are minidist's ring (minidist.comm.ring), the algorithm the cost model
assumes. It measures:

1. The links, as the model sees them, under the load of a real step (every rank busy), from
   ring all_reduces at two sizes M each: t = 2 (n-1) (a + M/n / b).
   - intra (a, b): every host's shard group at once (n = S);
   - inter (a, b): the world ring (n = N, laid out host by host: one stream out of each host)
     and every replicate group at once (n = R; the G groups share a host's link: b / G),
     fitted together by least squares on relative error. (Both kinds are measured because on
     this 2-core machine the world ring, whose steps mix both levels, reaches less of the
     link's rate than the concurrent replicate rings do: the fit sits between them.)
2. Each strategy's step pattern on a flat fp32 buffer of --params values in --messages parts:
   ddp (all_reduce over the world), zero3 (reduce_scatter + 2 all_gathers over the world),
   hierarchical and hsdp3 (the same within each host's shard group, then an all_reduce of the
   1/S shard across the replicas). The median of --reps timed runs, barrier before each.

Rank 0 writes the JSON `python -m minidist.sim validate` reads.
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


def timed(fn, reps: int) -> float:
    fn()  # warm-up: connections, buffers
    times = []
    for _ in range(reps):
        comm.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    comm.all_reduce(slowest, op=comm.ReduceOp.MAX)  # the step ends when the slowest rank is done
    return slowest.item()


def ring_all_reduce(t: torch.Tensor, group) -> None:
    comm.all_reduce(t, group=group, algorithm="ring")


def ring_points(group, n: int, sizes, reps: int, sharing: int = 1) -> list[tuple[float, float, float]]:
    """(latency coefficient, inverse-bandwidth coefficient, seconds) of a ring all_reduce over
    `group` (n ranks; every rank runs its own group's at once) per size: t = 2(n-1) a + 2(n-1)/n M s / b."""
    points = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        points.append((2 * (n - 1), 2 * (n - 1) / n * nbytes * sharing, timed(lambda: ring_all_reduce(t, group), reps)))
    return points


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

    def hierarchical():
        for t, p in zip(flat, piece_shard):
            comm.reduce_scatter_tensor(p, t, group=mesh.shard_group, algorithm="ring")
            comm.all_reduce(p, group=mesh.replicate_group, algorithm="ring")
            comm.all_gather_into(t, p, group=mesh.shard_group, algorithm="ring")

    return {"ddp": ddp, "zero3": zero3, "hierarchical": hierarchical, "hsdp3": hsdp3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=1 << 20, help="fp32 values per step (divisible by world x messages)")
    parser.add_argument("--messages", type=int, default=2, help="buckets / units the step is split into")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ctx = minidist.init_distributed(backend="gloo")
    mesh = minidist.init_mesh()  # one shard group per host (LOCAL_WORLD_SIZE)
    minidist.print0(str(mesh))
    if mesh.replicate < 2 or mesh.shard < 2:
        raise SystemExit("bench_mesh: needs at least 2 hosts of at least 2 ranks")
    sizes = (1 << 20, 8 << 20)
    intra_lat, intra_bw = fit_link(ring_points(mesh.shard_group, mesh.shard, sizes, args.reps))
    inter_lat, inter_bw = fit_link(ring_points(None, ctx.world_size, sizes, args.reps)
                                   + ring_points(mesh.replicate_group, mesh.replicate, sizes, args.reps, mesh.shard))
    measured = {name: timed(fn, args.reps) for name, fn in patterns(mesh, args.params, args.messages).items()}
    if ctx.rank == 0:
        out = {"hosts": mesh.replicate, "per_host": mesh.shard, "params": args.params, "messages": args.messages,
               "intra_lat": intra_lat, "intra_bw": intra_bw, "inter_lat": inter_lat, "inter_bw": inter_bw,
               "measured": measured}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
    minidist.shutdown()


if __name__ == "__main__":
    main()
