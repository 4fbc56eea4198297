"""Helpers for paired, interleaved benchmarks (recipes/bench_*.py): fair order, slowest rank, peaks,
and the live tensor bytes they (and the memory tests) check a strategy's own report against."""

from __future__ import annotations

import gc
import json
import statistics
import warnings
from pathlib import Path

import torch

from minidist import comm


# A benchmark variant is a strategy's name, or that name and how it was run: not compiled
# (recipes/bench_compile.py), with gloo's collectives instead of our ring (recipes/bench_zero.py).
VARIANT_SUFFIXES = ("_eager", "_backend")


def variant_spec(variant: str):
    """The StrategySpec a benchmark variant runs: what code asks instead of reading the name."""
    from minidist.train.strategies import spec

    for suffix in VARIANT_SUFFIXES:
        variant = variant.removesuffix(suffix)
    return spec(variant)


def split_variant(variant: str) -> tuple[str, str]:
    """A benchmark variant -> (strategy name, collectives): "zero2_backend" is stage 2 with the
    backend's reduce_scatter / all_gather, "zero2" stage 2 with collectives="auto"."""
    return variant.removesuffix("_backend"), "backend" if variant.endswith("_backend") else "auto"


def strategy_options(name: str, **overrides):
    """configs/strategy/NAME.yaml as Hydra composes it, for code that builds strategies without
    Hydra; keyword arguments override it where the strategy takes that key (so one sweep can
    pass the same knobs to every strategy)."""
    from omegaconf import OmegaConf

    from minidist.train.strategies import spec

    options = _yaml_config(name)
    taken = set(spec(str(options.name)).options)
    return OmegaConf.merge(options, {k: v for k, v in overrides.items() if k in taken})


def _yaml_config(name: str):
    from omegaconf import OmegaConf

    from minidist.train.config import ConfigError
    from minidist.train.strategies.registry import CONFIG_DIR

    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"strategy={name!r} has no config {path}: add one (the strategy's defaults live there)")
    node = OmegaConf.load(path)
    parents = [d for d in node.pop("defaults", []) if d != "_self_"]  # the groups' own defaults: siblings
    return OmegaConf.merge(*(_yaml_config(p) for p in parents), node) if parents else node


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


def live_tensor_bytes(device_type: str = "cpu", collect: bool = True) -> int:
    """Bytes of every live tensor storage on `device_type` ("cpu", "cuda": pass the device the
    model lives on) in this process, found through the garbage collector.

    Independent of any bookkeeping of ours: what a strategy's memory_report claims can be
    checked against it. Slow (a scan of all Python objects): for tests and benchmarks only.
    collect=False skips the full garbage collection first (tensors die by reference
    counting anyway; only cycles would be missed) for frequent sampling.
    """
    if collect:
        gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]  # one C-speed pass
    # A gradient autograd set in C++ has no Python object, so no garbage-collector entry, until Python
    # reads it (a first backward under no_sync): reached through its parameter instead.
    tensors += [t.grad for t in tensors if t.requires_grad and t.is_leaf and t.grad is not None]
    for obj in tensors:
        try:
            if obj.device.type == device_type:
                s = obj.untyped_storage()
                if s.data_ptr() not in seen and s.nbytes() > 0:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
        except Exception:  # noqa: BLE001 - tensors without storage (meta, sparse, ...)
            continue
    return total
