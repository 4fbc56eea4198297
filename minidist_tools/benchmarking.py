"""Helpers for paired, interleaved benchmarks (recipes/bench_*.py): fair order, slowest rank, peaks."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

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
