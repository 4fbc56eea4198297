"""Resident memory of each strategy's model state against the ZeRO paper's formulas.

    python recipes/bench_memory.py                      # 4 ranks, an 8.4M-parameter MLP, AdamW, 1 MiB buckets
    python recipes/bench_memory.py nproc=2 strategies=[zero2,zero2_backend]

Each strategy runs in freshly started ranks (launch_fresh, below). `zeroK_backend` is stage K with
the backend's reduce_scatter / all_gather instead of our send/recv ring. Reported per
rank 0: RSS above the baseline, the formula, the buffers in flight (gradient buckets or
units the strategy keeps), their ratio, and whether RSS <= 1.15 x formula + 8 MiB + those.

memory_report() counts live tensors; the process can hold more (allocator caches, memory a
backend keeps for itself). This measures resident set size (RSS) instead:

- every strategy runs in fresh processes, so nothing of an earlier one is counted;
- MALLOC_MMAP_THRESHOLD_ makes glibc serve large allocations with mmap, so freeing a
  tensor gives its pages back and RSS goes down as live tensors do;
- the baseline is taken after the same strategy has trained a tiny model once: the
  first AdamW step alone loads ~150 MiB of code and kernels no strategy owns, and
  lazy imports, hooks and threads are set up then, not inside the measurement;
- RSS means its anonymous part (RssAnon), where tensors live: pages of library code
  faulted in as new kernels run are file-backed and left out.
"""

from __future__ import annotations

import os
import time

import torch
from omegaconf import DictConfig

from minidist.train.app import hydra_app, run_local
from minidist_tools.benchmarking import require_known, split_variant, write_json

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "native_zero1", "native_fsdp",
              "zero1_backend", "zero2_backend", "zero3_backend"]


# Large allocations through mmap (returned to the system on free); set before the ranks start.
MMAP_THRESHOLD = "65536"


def rss_bytes(part: str = "RssAnon") -> int:
    """This process's anonymous resident memory now: RssAnon in /proc/self/status (Linux); or
    another `part` of it (RssFile: the file-backed pages).

    That is the part of the resident set size holding heap and anonymous mappings, where
    tensors live; file-backed pages (the code of torch's libraries, paged in as new
    kernels run) are left out, so a first call into a library does not read as memory a
    strategy holds."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(part + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no {part} in /proc/self/status (needs Linux 4.5 or later)")


def formula_bytes(strategy: str, psi: int, n: int) -> int:
    """Model-state bytes per rank the ZeRO paper gives for fp32 parameters and Adam (k = 8),
    from the strategy's spec (its ZeRO stage)."""
    from minidist.train.strategies import spec
    from minidist_tools.theory import model_state_bytes

    return int(model_state_bytes(spec(strategy), psi, n, precision="fp32"))


def _train(strategy, sizes: list[int], steps: int):
    """An MLP of `sizes` (its Linear layers as direct children: each a stage-3 unit) trained
    `steps` AdamW steps with `strategy`; the last step keeps its gradients."""
    from minidist.train.models import MLP

    torch.manual_seed(0)
    net = MLP(tuple(sizes)).net
    model, opt = strategy.wrap(net, torch.optim.AdamW, {"lr": 1e-3})
    x = torch.randn(8, sizes[0])
    for step in range(steps):
        model(x).sum().backward()
        opt.step()
        if step < steps - 1:
            opt.zero_grad(set_to_none=True)
    return net


def _options(strategy: str, bucket_cap_mb: float, collectives: str):
    from minidist_tools.benchmarking import strategy_options

    # min_unit_params=1: every Linear of the measured MLP is a stage-3 unit.
    return strategy_options(strategy, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
                            min_unit_params=1, collectives=collectives)


def _warm_up(strategy: str, bucket_cap_mb: float, collectives: str, ctx) -> None:
    """Run the same strategy once on a tiny model, so every import, kernel, hook type and
    thread it needs exists before the baseline: only the model's own state is measured."""
    from minidist.train.strategies import build_strategy

    tiny = build_strategy(_options(strategy, bucket_cap_mb, collectives), ctx)
    _train(tiny, [64, 64, 64], steps=2)
    tiny.memory_report()


def measure_state_rss(strategy: str, sizes: list[int], bucket_cap_mb: float, collectives: str = "auto",
                      steps: int = 3) -> dict:
    """On each rank: RSS above the warmed-up baseline after `steps` AdamW steps of an MLP of `sizes`
    (gradients still held, as the ZeRO paper counts them), with what the strategy reports."""
    import gc

    import minidist
    from minidist.train.strategies import build_strategy

    torch.set_num_threads(1)
    ctx = minidist.init_distributed(backend="gloo", timeout_s=120)
    _warm_up(strategy, bucket_cap_mb, collectives, ctx)
    gc.collect()
    baseline = rss_bytes()
    s = build_strategy(_options(strategy, bucket_cap_mb, collectives), ctx)
    net = _train(s, sizes, steps)
    psi = sum(p.numel() for p in net.parameters())
    gc.collect()
    measured = rss_bytes() - baseline
    report = s.memory_report()
    inflight = report.get("comm_buffers", 0)  # gradient buckets / staging buffers the strategy keeps
    if s.spec.zero_stage == 0:
        inflight = 0  # replicated, with bucket views: its gradients are its buckets, already in the 16 bytes
    result = {"strategy": strategy, "collectives": collectives, "rank": ctx.rank, "world_size": ctx.world_size, "psi": psi,
              "rss_bytes": measured, "formula_bytes": formula_bytes(strategy, psi, ctx.world_size),
              "inflight_bytes": inflight, "report_total": report["total"]}
    minidist.shutdown()
    return result


def target_bytes(r: dict) -> float:
    """The resident-memory target on a measure_state_rss result: 1.15 x the ZeRO formula + 8 MiB + the
    buffers in flight (what the ZeRO paper counts, plus allocator slack and the strategy's own buffers)."""
    return 1.15 * r["formula_bytes"] + 8 * 2**20 + r["inflight_bytes"]


def within_target(r: dict) -> bool:
    return r["rss_bytes"] <= target_bytes(r)


def allocate_and_free(mib: int) -> tuple[int, int]:
    """(RSS growth with a `mib` MiB tensor alive, RSS growth left after freeing it): for checking
    that RSS follows live tensors in a process started by launch_fresh."""
    warm = torch.ones(1 << 18)  # the same call once first: its code and first-use costs are not the tensor's
    del warm
    baseline = rss_bytes()
    t = torch.ones(mib << 18)  # fp32: MiB x 2^18 elements; ones() touches every page
    alive = rss_bytes() - baseline
    del t
    return alive, rss_bytes() - baseline


def gathers_kept(gathers: int, mib: int) -> tuple[int, str | None]:
    """(RSS growth left after `gathers` gloo all_gathers of `mib` MiB, each freed, with small tensors made
    between them; this rank's MALLOC_MMAP_THRESHOLD_): what a rank's allocator keeps of freed blocks."""
    import gc

    import minidist
    import torch.distributed as dist

    n = minidist.init_distributed(backend="gloo", timeout_s=120).world_size
    dist.all_gather_into_tensor(torch.empty(n << 10), torch.ones(1 << 10))  # the same call once first
    gc.collect()
    baseline = rss_bytes()
    for i in range(gathers):
        out = torch.empty(mib << 18)
        dist.all_gather_into_tensor(out, torch.full(((mib << 18) // n,), float(i)))
        small = torch.randn(1000)  # noqa: F841 - small blocks between the large ones, as training makes
        del out
    dist.barrier()
    time.sleep(0.2)  # gloo's worker thread lets go of the last gather's buffers just after the call returns
    gc.collect()
    kept = rss_bytes() - baseline
    minidist.shutdown()
    return kept, os.environ.get("MALLOC_MMAP_THRESHOLD_")


def huge_pages_of_a_block(mib: int) -> tuple[int, int]:
    """Bytes of transparent huge pages backing a fresh `mib` MiB tensor (a block taken from the
    system, above the ranks' mmap threshold: what THP_MEM_ALLOC_ENABLE=1 buys), and backing the
    process's heap (Python's objects, small tensors: what it does not cost)."""
    block = torch.ones(mib << 18)
    address, huge = block.data_ptr(), {"block": 0, "heap": 0}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range, its name
                start, end = (int(x, 16) for x in head.split("-"))
                where = "block" if start <= address < end else "heap" if line.split()[-1] == "[heap]" else None
            elif where is not None and head == "AnonHugePages:":
                huge[where] += int(line.split()[1]) * 1024  # (the heap may be several mappings)
    return huge["block"], huge["heap"]


def launch_fresh(fn, nproc: int, args: tuple) -> dict:
    """fn(*args) on `nproc` newly started local ranks with the mmap threshold set; rank -> result."""
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    try:
        return run_local(fn, nproc=nproc, args=args)
    finally:
        if previous is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous


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
