"""Resident memory of each strategy's model state against the ZeRO paper's formulas.

    python recipes/bench_memory.py                      # 4 ranks, an 8.4M-parameter MLP, AdamW, 1 MiB buckets
    python recipes/bench_memory.py nproc=2 strategies=[zero2,zero2_backend]

Each strategy runs in freshly started ranks (minidist/benchmarking.py says how RSS is made to
follow live tensors and what the baseline includes). `zeroK_backend` is stage K with
the backend's reduce_scatter / all_gather instead of our send/recv ring. Reported per
rank 0: RSS above the baseline, the formula, the buffers in flight (gradient buckets or
units the strategy keeps), their ratio, and whether RSS <= 1.15 x formula + 8 MiB + those.
"""

from __future__ import annotations

from omegaconf import DictConfig

from minidist.benchmarking import require_known, write_json
from minidist.benchmarking import launch_fresh, measure_state_rss, within_target
from minidist.train.strategies import split_variant
from minidist.train.app import hydra_app

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "native_zero1", "native_fsdp",
              "zero1_backend", "zero2_backend", "zero3_backend"]


@hydra_app("bench_memory")
def main(cfg: DictConfig) -> None:
    require_known("strategies", cfg.strategies, STRATEGIES)
    psi = None
    rows = {}
    print(f"{'strategy':<15}{'RSS MiB':>9}{'formula':>9}{'in flight':>11}{'RSS/formula':>13}{'within bound':>14}")
    for name in cfg.strategies:
        strategy, collectives = split_variant(name)
        ranks = launch_fresh(measure_state_rss, int(cfg.nproc), (strategy, list(cfg.sizes), float(cfg.bucket_cap_mb),
                                                                  collectives))
        r = ranks[0]
        psi = r["psi"]
        r["within_target"] = within_target(r)
        r["all_ranks_within_target"] = all(within_target(x) for x in ranks.values())
        rows[name] = r
        print(f"{name:<15}{r['rss_bytes'] / 2**20:>9.1f}{r['formula_bytes'] / 2**20:>9.1f}"
              f"{r['inflight_bytes'] / 2**20:>11.1f}{r['rss_bytes'] / r['formula_bytes']:>13.2f}"
              f"{str(r['all_ranks_within_target']):>14}", flush=True)
    write_json(cfg.out, {"world_size": int(cfg.nproc), "psi": psi, "results": rows})


if __name__ == "__main__":
    main()
