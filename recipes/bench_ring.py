"""Our send/recv ring against the backend's collective: paired, interleaved, per op and size.

    python recipes/bench_ring.py                  # 2 ranks, gloo, 64 KiB .. 64 MiB
    python recipes/bench_ring.py nproc=4
    torchrun --nproc_per_node 4 recipes/bench_ring.py ops=[reduce_scatter]

For every op and size, each round times the backend's call and the ring's call once
each, in alternating order (so neither always goes first), on the same buffers, after
a barrier; a call's time is the slowest rank's. Reported: the median time of each, the
median of the per-round ratios backend/ring (the speed-up; > 1: the ring is faster),
and busbw (nccl-tests' definition, as bench_collectives). Results land in the run
directory (results.json).
"""

from __future__ import annotations

import statistics
import time

import torch
from omegaconf import DictConfig, OmegaConf

import minidist
from minidist import comm
from minidist_tools.benchmarking import paired_ratio, require_known, rotated, slowest, write_json
from minidist.train.app import run_recipe
from minidist.train.app import hydra_app

OPS = ("all_reduce", "all_gather", "reduce_scatter")  # those the ring implements


def make_call(op: str, nbytes: int, n: int):
    """(call(algorithm), S in bytes) for `op` on about `nbytes` of fp32."""
    numel = max(n, nbytes // 4 // n * n)
    big, small = torch.ones(numel), torch.ones(numel // n)
    if op == "reduce_scatter":
        return (lambda alg: comm.reduce_scatter_tensor(small, big, algorithm=alg)), numel * 4
    if op == "all_gather":
        return (lambda alg: comm.all_gather_into(big, small, algorithm=alg)), numel * 4
    return (lambda alg: comm.all_reduce(big, algorithm=alg)), numel * 4


def bench_main(cfg_dict: dict) -> None:
    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend="gloo", timeout_s=cfg.timeout_s)
    n = ctx.world_size
    minidist.print0(f"ring vs backend: {n} ranks, gloo, {cfg.warmup} warm-up + {cfg.rounds} paired rounds\n")
    minidist.print0(f"{'op':<16}{'bytes':>11}{'backend ms':>12}{'ring ms':>10}{'busbw b/r GB/s':>18}"
                    f"{'speed-up':>10}")
    rows = []
    size = int(cfg.min_bytes)
    while size <= int(cfg.max_bytes):
        for op in cfg.ops:
            call, s = make_call(op, size, n)
            times = {"backend": [], "ring": []}
            for k in range(int(cfg.warmup) + int(cfg.rounds)):
                for alg in rotated(["backend", "ring"], k):
                    comm.barrier()
                    start = time.perf_counter()
                    call(alg)
                    elapsed = slowest(time.perf_counter() - start)
                    if k >= int(cfg.warmup):
                        times[alg].append(elapsed)
            b, r = statistics.median(times["backend"]), statistics.median(times["ring"])
            speedup = paired_ratio(times["backend"], times["ring"])
            ratio = speedup["median"]
            bus = {alg: s / statistics.median(t) / 1e9 * comm.ring_bytes_sent(op, 1, n) for alg, t in times.items()}
            rows.append({"op": op, "bytes": s, "world_size": n, "backend_ms": b * 1e3, "ring_ms": r * 1e3,
                         "busbw_backend_GBps": bus["backend"], "busbw_ring_GBps": bus["ring"], "speedup": ratio,
                         "speedup_ci": speedup["ci"], "rounds": len(times["ring"])})
            minidist.print0(f"{op:<16}{s:>11}{b * 1e3:>12.2f}{r * 1e3:>10.2f}"
                            f"{bus['backend']:>9.2f}/{bus['ring']:<8.2f}{ratio:>10.2f}")
        size *= int(cfg.factor)
    if ctx.rank == 0:
        write_json(cfg.out, {"world_size": n, "rows": rows})
    comm.barrier()
    minidist.shutdown()


@hydra_app("bench_ring")
def main(cfg: DictConfig) -> None:
    require_known("ops", cfg.ops, OPS)
    run_recipe(bench_main, cfg, path_keys=("out",))


if __name__ == "__main__":
    main()
