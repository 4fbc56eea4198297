"""ZeRO stages vs their native counterparts and vs our DataParallel: paired, interleaved steps.

    python recipes/bench_zero.py                  # GPT ~20M, AdamW, 2 ranks, gloo
    python recipes/bench_zero.py steps=30 variants=[ddp,zero3,native_fsdp]
    torchrun --nproc_per_node 2 recipes/bench_zero.py

Variants (each its own copy of the model and optimizer, all in this one process):
    ddp                  minidist.DataParallel + AdamW (the baseline for the stages)
    zero1, zero2, zero3  minidist.ShardedDataParallel (collectives=auto: shared memory where the ranks share a host)
    zeroK_backend        the same stage with the backend's reduce_scatter / all_gather
    native_zero1         native DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    native_fsdp          torch.distributed.fsdp.fully_shard on each block, then the root
Every step runs every variant once, in rotating order, on the same batch; a step's
time is the slowest rank's. Memory is measured afterwards, one variant at a time
(built alone): model-state bytes from live storages after a step, and the peak of
live tensor bytes sampled through that step (forward of each block, every 8th
gradient, before and after), above what was live before the variant was built.
"""

from __future__ import annotations

import statistics
import time

import torch
from omegaconf import DictConfig, OmegaConf

import minidist
from minidist import comm
from minidist.train.app import hydra_app, run_recipe
from minidist.train.models import GPT
from minidist.train.strategies import build_strategy
from minidist_tools.benchmarking import (PeakSampler, live_tensor_bytes, paired_ratio, require_known, rotated, slowest,
                                         split_variant, strategy_options, write_json)

VARIANTS = ["ddp", "zero1", "zero2", "zero3", "native_zero1", "native_fsdp",
            "zero1_backend", "zero2_backend", "zero3_backend"]  # _backend: gloo's collectives, not auto's choice
COUNTERPART = {"zero1": "native_zero1", "zero3": "native_fsdp"}


class Variant:
    """One strategy (the trainer's adapters, minidist/train/strategies/) with its own copy of the model."""

    def __init__(self, name: str, cfg):
        torch.manual_seed(0)
        g = cfg.gpt
        self.net = GPT(vocab_size=g.vocab_size, block_size=g.block_size, n_layer=g.n_layer, n_head=g.n_head,
                       n_embd=g.n_embd)
        self.name = name
        strategy, collectives = split_variant(name)  # "auto" or "backend"
        # Bucket views for both DDPs; stage 3 and fully_shard cut the same units (each block).
        options = strategy_options(strategy, gradient_as_bucket_view=True, collectives=collectives,
                                   min_unit_params=int(cfg.min_unit_params))
        self.strategy = build_strategy(options, minidist.init_distributed())
        self.model, self.opt = self.strategy.wrap(self.net, torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.1})

    def step(self, x, y, zero_grad: bool = True) -> None:
        GPT.loss(self.model(x), y).backward()
        self.opt.step()
        if zero_grad:
            self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state held by this rank, from live storages
        (communication buffers apart; with bucket views DDP's gradients are its buckets)."""
        report = self.strategy.memory_report()
        return report["total"] - report.get("comm_buffers", 0)


def batch(cfg, step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randint(0, cfg.gpt.vocab_size, (cfg.gpt.batch, cfg.gpt.block_size), generator=g)
    return x, torch.roll(x, -1, 1)


def measure_alone(name: str, cfg, rank: int) -> tuple[int, int]:
    """(model-state bytes, peak bytes) of one variant, built alone so nothing else is counted:
    live tensor bytes are sampled through one step and the baseline before building is subtracted."""
    baseline = live_tensor_bytes()
    v = Variant(name, cfg)
    for step in range(2):  # the first steps allocate optimizer state and any persistent buffers
        v.step(*batch(cfg, 20_000 + step, rank))
    sampler = PeakSampler(list(v.net.blocks), list(v.net.parameters()))
    sampler.active = True
    sampler.sample()
    v.step(*batch(cfg, 20_002, rank), zero_grad=False)
    sampler.sample()
    sampler.remove()
    state = v.state_bytes()  # after a step, gradients still held: what the ZeRO paper counts
    del v
    return state, sampler.peak - baseline


def bench_main(cfg_dict: dict) -> None:
    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend=cfg.backend, timeout_s=cfg.timeout_s)
    variants = {name: Variant(name, cfg) for name in cfg.variants}
    psi = sum(p.numel() for p in GPT(vocab_size=cfg.gpt.vocab_size, block_size=cfg.gpt.block_size,
                                     n_layer=cfg.gpt.n_layer, n_head=cfg.gpt.n_head,
                                     n_embd=cfg.gpt.n_embd).parameters())
    minidist.print0(f"ZeRO benchmark: GPT {psi / 1e6:.1f}M parameters, AdamW, {ctx.world_size} ranks, "
                    f"{ctx.backend}; {cfg.warmup} warm-up + {cfg.steps} measured steps, interleaved")
    names = list(variants)
    times = {n: [] for n in names}
    for step in range(int(cfg.warmup) + int(cfg.steps)):
        x, y = batch(cfg, step, ctx.rank)
        for name in rotated(names, step):
            comm.barrier()
            start = time.perf_counter()
            variants[name].step(x, y)
            elapsed = time.perf_counter() - start
            if step >= int(cfg.warmup):
                times[name].append(slowest(elapsed))
    del variants
    rows = {}
    for name in names:
        state, peak = measure_alone(name, cfg, ctx.rank)
        rows[name] = {"median_step_s": statistics.median(times[name]), "state_bytes": state, "peak_bytes": peak,
                      "state_per_psi": state / psi}
    # memory differs per rank (uneven shards): report the largest
    for name in names:
        for key in ("state_bytes", "peak_bytes"):
            rows[name][key] = int(comm.max_over_ranks(rows[name][key]))
    # ratios of paired steps (each pair ran back to back), the median and its 95% interval
    if "ddp" in rows:
        for name in names:
            ratio = paired_ratio(times[name], times["ddp"])
            rows[name]["ratio_to_ddp"], rows[name]["ratio_to_ddp_ci"] = ratio["median"], ratio["ci"]
    for ours, native in COUNTERPART.items():
        if ours in rows and native in rows:
            ratio = paired_ratio(times[ours], times[native])
            rows[ours]["ratio_to_native"], rows[ours]["ratio_to_native_ci"] = ratio["median"], ratio["ci"]
    if ctx.rank == 0:
        print(f"\n  {'variant':<14}{'median step':>12}{'/ ddp':>8}{'/ native':>10}{'state MB':>10}"
              f"{'state/Psi':>11}{'peak MB':>9}")
        for name, r in rows.items():
            to_ddp = f"{r['ratio_to_ddp']:.3f}" if "ratio_to_ddp" in r else "-"
            to_native = f"{r['ratio_to_native']:.3f}" if "ratio_to_native" in r else "-"
            print(f"  {name:<14}{r['median_step_s'] * 1e3:>9.1f} ms{to_ddp:>8}{to_native:>10}"
                  f"{r['state_bytes'] / 2**20:>10.1f}{r['state_per_psi']:>11.2f}{r['peak_bytes'] / 2**20:>9.1f}")
        write_json(cfg.out, {"world_size": ctx.world_size, "psi": psi, "warmup": int(cfg.warmup), "steps": int(cfg.steps),
                             "results": rows})
    minidist.shutdown()


@hydra_app("bench_zero")
def main(cfg: DictConfig) -> None:
    require_known("variants", cfg.variants, VARIANTS)
    run_recipe(bench_main, cfg, path_keys=("out",))


if __name__ == "__main__":
    main()
