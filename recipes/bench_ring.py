"""Our collectives (the send/recv ring, shared memory) against the backend's: paired, interleaved,
per op and size, beside a memcpy of the same bytes (the machine's limit on one host).

    python recipes/bench_ring.py                  # 2 ranks, gloo: backend vs ring, 64 KiB .. 64 MiB
    python recipes/bench_ring.py nproc=4 algorithms=[backend,shm,shm_inplace,memcpy] sizes=[1048576,33554432]
    torchrun --nproc_per_node 4 recipes/bench_ring.py ops=[reduce_scatter]

For every op and size, each round times each algorithm once, in an order rotated each round (so
none always goes first), on the same buffers, after a barrier: `calls` calls back to back, as
nccl-tests times its iterations (1: a call alone, its latency, the ranks' skew leaving the barrier
included); a call's time is the slowest rank's, over `calls`. "memcpy" copies the op's bytes once
per rank (all ranks at once, as the memory bus sees them during a collective); "shm_inplace"
all_reduces a tensor in shared memory, as DataParallel's buckets are (no copy through the slots;
all_reduce only). Reported per
algorithm: the median time, busbw (nccl-tests' definition, as bench_collectives; memcpy: bytes
copied per second) and the median of the per-round ratios backend / algorithm (the speed-up;
> 1: faster than the backend) with its 95% interval. Results land in the run directory
(results.json).
"""

from __future__ import annotations

import statistics
import time

import torch
from omegaconf import DictConfig, OmegaConf

import minidist
from minidist import comm
from minidist.comm import shm
from minidist_tools.benchmarking import paired_ratio, require_known, rotated, slowest, write_json
from minidist.train.app import run_recipe
from minidist.train.app import hydra_app

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
ALGORITHMS = ("backend", "ring", "shm", "shm_inplace", "memcpy")


def make_call(op: str, nbytes: int, n: int, inplace: bool):
    """(call(algorithm), S in bytes) for `op` on about `nbytes` of fp32; `inplace` (all_reduce, a
    collective): a tensor in shared memory too, for "shm_inplace"."""
    numel = max(n, nbytes // 4 // n * n)
    big, small, copy = torch.ones(numel), torch.ones(numel // n), torch.empty(numel)
    shared = shm.shared_zeros(numel, torch.float32, None).fill_(1.0) if inplace else None
    calls = {"reduce_scatter": lambda alg: comm.reduce_scatter_tensor(small, big, algorithm=alg),
             "all_gather": lambda alg: comm.all_gather_into(big, small, algorithm=alg),
             "all_reduce": lambda alg: comm.all_reduce(shared, algorithm="shm") if alg == "shm_inplace" else
             comm.all_reduce(big, algorithm=alg),
             "broadcast": lambda alg: comm.broadcast(big, src=0, algorithm=alg)}
    return (lambda alg: copy.copy_(big) if alg == "memcpy" else calls[op](alg)), numel * 4


def bench_main(cfg_dict: dict) -> None:
    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend="gloo", timeout_s=cfg.timeout_s)
    n, algorithms, calls = ctx.world_size, list(cfg.algorithms), int(cfg.calls)
    others = [a for a in algorithms if a != "backend"]
    minidist.print0(f"{' vs '.join(algorithms)}: {n} ranks, gloo, {cfg.warmup} warm-up + {cfg.rounds} paired rounds of "
                    f"{calls} call(s)\n")
    minidist.print0(f"{'op':<16}{'bytes':>11}" + "".join(f"{a + ' ms':>16}" for a in algorithms)
                    + "".join(f"{'backend/' + a:>22}" for a in others))
    rows = []
    for size in cfg.sizes:
        for op in cfg.ops:
            if op == "broadcast" and "ring" in algorithms:
                continue  # no ring broadcast
            ways = [a for a in algorithms if a != "shm_inplace" or op == "all_reduce"]
            call, s = make_call(op, int(size), n, inplace="shm_inplace" in ways)
            times = {a: [] for a in ways}
            for k in range(int(cfg.warmup) + int(cfg.rounds)):
                for alg in rotated(ways, k):
                    comm.barrier()
                    start = time.perf_counter()
                    for _ in range(calls):
                        call(alg)
                    elapsed = slowest(time.perf_counter() - start) / calls
                    if k >= int(cfg.warmup):
                        times[alg].append(elapsed)
            row = {"op": op, "bytes": s, "world_size": n, "rounds": int(cfg.rounds), "calls": calls,
                   "ms": {a: statistics.median(t) * 1e3 for a, t in times.items()},
                   "busbw_GBps": {a: s / statistics.median(t) / 1e9 * (1 if a == "memcpy" else comm.ring_bytes_sent(op, 1, n))
                                  for a, t in times.items()},
                   "speedup": {a: paired_ratio(times["backend"], times[a]) for a in others if a in ways}}
            rows.append(row)
            minidist.print0(f"{op:<16}{s:>11}" + "".join(f"{row['ms'][a]:>16.2f}" if a in ways else f"{'-':>16}"
                                                         for a in algorithms)
                            + "".join(f"{row['speedup'][a]['median']:>22.2f}" if a in ways else f"{'-':>22}"
                                      for a in others))
    if ctx.rank == 0:
        write_json(cfg.out, {"world_size": n, "algorithms": algorithms, "rows": rows})
    comm.barrier()
    minidist.shutdown()


@hydra_app("bench_ring")
def main(cfg: DictConfig) -> None:
    require_known("ops", cfg.ops, OPS)
    require_known("algorithms", cfg.algorithms, ALGORITHMS)
    if "backend" not in cfg.algorithms:
        raise SystemExit("bench_ring: algorithms must include backend (every speed-up is over it)")
    if int(cfg.calls) < 1:
        raise SystemExit(f"bench_ring: calls={cfg.calls}: time at least 1 call per round (calls=1: each alone)")
    run_recipe(bench_main, cfg, path_keys=("out",))


if __name__ == "__main__":
    main()
