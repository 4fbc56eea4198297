"""Helpers for paired, interleaved benchmarks (recipes/bench_*.py): fair order, slowest rank, peaks.

Resident memory of a strategy's model state, as the operating system sees it.

memory_report() counts live tensors; the process can hold more (allocator caches,
memory a backend keeps for itself). This measures resident set size (RSS) instead:

    launch_fresh(measure_state_rss, nproc=4, args=(name, [2048, 2048, 2048], 1.0))

- every strategy runs in fresh processes, so nothing of an earlier one is counted;
- MALLOC_MMAP_THRESHOLD_ makes glibc serve large allocations with mmap, so freeing a
  tensor gives its pages back and RSS goes down as live tensors do;
- the baseline is taken after the same strategy has trained a tiny model once: the
  first AdamW step alone loads ~150 MiB of code and kernels no strategy owns, and
  lazy imports, hooks and threads are set up then, not inside the measurement;
- RSS means its anonymous part (RssAnon), where tensors live: pages of library code
  faulted in as new kernels run are file-backed and left out.

The result is compared with the ZeRO paper's bytes per parameter (fp32, Adam) plus
what a strategy legitimately keeps besides: its gradient buckets or units in flight.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from minidist import comm
from minidist.measure import live_tensor_bytes


# A benchmark variant is a strategy's name, or that name and how it was run: not compiled
# (recipes/bench_compile.py), with gloo's collectives instead of our ring (recipes/bench_zero.py).
VARIANT_SUFFIXES = ("_eager", "_backend")


def variant_spec(variant: str):
    """The StrategySpec a benchmark variant runs: what code asks instead of reading the name."""
    from minidist.train.strategies import spec

    for suffix in VARIANT_SUFFIXES:
        variant = variant.removesuffix(suffix)
    return spec(variant)


def rotated(names: list[str], step: int) -> list[str]:
    """The variants in a different order each step, so none always runs first or last."""
    k = step % len(names)
    return names[k:] + names[:k]


def slowest(seconds: float) -> float:
    """A step is as slow as its slowest rank (a collective: every rank must call it)."""
    return comm.max_over_ranks(seconds)


def bootstrap_median_ci(values: list[float], level: float = 0.95, resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of the median of `values` (e.g. step-by-step time ratios)."""
    import random
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def paired_ratio(times: list[float], reference: list[float]) -> dict:
    """`times` over `reference`, step by step (each pair ran back to back, so drift between pairs
    cancels): the median ratio and the 95% bootstrap interval of that median."""
    ratios = [a / b for a, b in zip(times, reference)]
    low, high = bootstrap_median_ci(ratios)
    return {"median": statistics.median(ratios), "ci": [low, high]}


class PeakSampler:
    """Sample live tensor bytes at hook points of one (untimed) step: forward of each module,
    each parameter's gradient arriving, and explicit calls. The max is the step's peak."""

    def __init__(self, modules, params, every: int = 8, device_type: str = "cpu"):
        self.samples: list[int] = []
        self.device_type = device_type  # the tensors counted: those on this kind of device
        self.active = False
        self._handles = [m.register_forward_hook(lambda *_: self.sample()) for m in modules]
        # every 8th gradient: enough points to see backward's peak, few enough to stay quick
        self._handles += [p.register_post_accumulate_grad_hook(lambda *_: self.sample()) for p in params[::every]]

    def sample(self) -> None:
        if self.active:
            self.samples.append(live_tensor_bytes(self.device_type, collect=False))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @property
    def peak(self) -> int:
        return max(self.samples) if self.samples else 0


def require_known(what: str, given, known) -> None:
    """Exit with the choices when a config names a variant / op the benchmark does not have."""
    unknown = set(given) - set(known)
    if unknown:
        raise SystemExit(f"unknown {what} {sorted(unknown)}; choose from {sorted(known)}")


def write_json(path: str | None, payload: dict) -> None:
    """Write a benchmark's results (rank 0 only, by the caller) and say where."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {path}", flush=True)


# Large allocations through mmap (returned to the system on free); set before the ranks start.
MMAP_THRESHOLD = "65536"


def rss_bytes() -> int:
    """This process's anonymous resident memory now: RssAnon in /proc/self/status (Linux).

    That is the part of the resident set size holding heap and anonymous mappings, where
    tensors live; file-backed pages (the code of torch's libraries, paged in as new
    kernels run) are left out, so a first call into a library does not read as memory a
    strategy holds."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError("no RssAnon in /proc/self/status (needs Linux 4.5 or later)")


def formula_bytes(strategy: str, psi: int, n: int) -> int:
    """Model-state bytes per rank the ZeRO paper gives for fp32 parameters and Adam (k = 8),
    from the strategy's spec (its ZeRO stage)."""
    from minidist.train.strategies import spec

    return int(spec(strategy).model_state_bytes(psi, n, precision="fp32"))


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
    from minidist.train.strategies import strategy_options

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


def launch_fresh(fn, nproc: int, args: tuple) -> dict:
    """fn(*args) on `nproc` newly started local ranks with the mmap threshold set; rank -> result."""
    from minidist.train.app import run_local

    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    try:
        return run_local(fn, nproc=nproc, args=args)
    finally:
        if previous is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous
