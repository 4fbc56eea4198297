"""What a strategy is, declared once (StrategySpec), and every strategy by name.

    register(StrategySpec(name="mine", kind="minidist", factory=Mine, summary="...", options=(...)))
    strategy = build_strategy(cfg.strategy, ctx, precision)

A spec declares what a step sends (`collectives`) and what is sharded (`zero_stage`); the tools
price both (minidist_tools/theory.py). The shipped families (ours; the references, plugins in
minidist_tools that their configs name) are imported by name on first use. Both:
docs/internals.md, "train/strategies/registry.py".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from minidist.train.config import ConfigError, config_dir


KINDS = ("minidist", "native", "deepspeed")
CHECKPOINTS = ("full", "sharded", "deepspeed", "dcp", "workers")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
GROUPS = ("world", "shard", "replicas")

@dataclass(frozen=True)
class Collective:
    """One collective a step performs: `op` over `group`, carrying `payload` ("model": all Ψ
    parameters; "shard": 1/S of them, one shard group's piece), `count` times per step; `per_round`:
    once per round of strategy.sync_every (H) steps instead; `per_micro_batch`: once per micro-batch
    (stage 3's gathers: every forward and backward gathers); `wire`: the option naming the format
    it travels as, where one does (None: the element size it is priced at). The gradient's
    collectives (wire grad_wire) run every micro-batch under strategy.accumulate=sharded."""

    op: str
    group: str = "world"
    payload: str = "model"
    count: int = 1
    per_round: bool = False
    wire: str | None = None
    per_micro_batch: bool = False

    def __post_init__(self):
        if self.op not in OPS or self.group not in GROUPS or self.payload not in ("model", "shard"):
            raise ValueError(f"Collective({self.op!r}, {self.group!r}, {self.payload!r}): op one of {OPS}, "
                             f"group one of {GROUPS}, payload model or shard")


# The patterns the families share: DDP's all_reduce; ZeRO-1/2's reduce_scatter + all_gather;
# ZeRO-3's, whose parameters are gathered twice (for forward and for backward). Gradients travel
# as strategy.grad_wire, gathered parameters as strategy.param_wire, where a strategy takes them.
ALL_REDUCE = (Collective("all_reduce", wire="grad_wire"),)
ZERO12 = (Collective("reduce_scatter", wire="grad_wire"), Collective("all_gather", wire="param_wire"))
ZERO3 = (Collective("reduce_scatter", wire="grad_wire"),
         Collective("all_gather", count=2, wire="param_wire", per_micro_batch=True))


# strategy.accumulate (read by the step, train/optim.py, not the wrapper): where gradients add up across
# micro-batches: "local", in full under no_sync, one reduction per step; "sharded", in the gradient shard,
# a reduction per micro-batch. Taken by the strategies that hold a gradient shard (stages 2-3).
ACCUMULATE = {"accumulate": ("local", "sharded")}


def in_shard_groups(collectives: tuple[Collective, ...]) -> tuple[Collective, ...]:
    """`collectives` within each shard group, then each rank's 1/S all_reduced across the replicas:
    the hybrid form of a pattern (HSDP, the two-level all_reduce)."""
    return tuple(Collective(c.op, "shard", c.payload, c.count, wire=c.wire, per_micro_batch=c.per_micro_batch)
                 for c in collectives) + \
        (Collective("all_reduce", group="replicas", payload="shard", wire="grad_wire"),)


@dataclass(frozen=True)
class StrategySpec:
    """One strategy, registered once (registry.register). `factory(cfg, ctx, compute_dtype)`
    builds its Strategy; everything else is read by the config checks, the comparison, the
    RSS bound, the cost model and the docs."""

    name: str
    kind: str                          # minidist (ours) | native (PyTorch's) | deepspeed
    factory: Callable
    summary: str                       # one line: what it is
    checkpoint: str = "full"           # full: model.pt, optimizer.pt (rank 0, the last); sharded: a shard per rank; deepspeed, dcp: theirs
    reference: str | None = None       # what a comparison checks it against (None: nothing)
    zero_stage: int = 0                # 0 replicated ... 3 parameters sharded too
    hybrid: bool = False               # on a 2-D mesh: shard groups of strategy.shard_size, replicated
    messages: str = "buckets"          # what splits a step's payload: buckets (bucket_cap_mb) or units (stage 3)
    collectives: tuple[Collective, ...] = ()
    options: tuple[str, ...] = ()      # the strategy config's keys it reads (besides name)
    # The values an option may take, where not every value of the key fits (others are refused
    # before any work, naming the strategies that do take them), e.g. {"comm_hook": ("allreduce", ...)}.
    choices: dict[str, tuple] = field(default_factory=dict, hash=False)
    fp16: bool = True                  # takes torch's GradScaler (trainer.precision=fp16)
    traces_comm: bool = True           # its communication goes through minidist.comm (CommTracer sees it)
    single_rank: bool = False          # runs on exactly one rank
    # Its optimizer steps flat slices cut across parameters (ZeRO's flat shards), so only an
    # element-wise optimizer class is exact there (minidist.parallel.shard_optimizer).
    flat_optimizer_shards: bool = False
    # Takes several optimizers stepped as one (optim=muon: train/optim.py's CombinedOptimizer); torch's
    # ZeroRedundancyOptimizer and fully_shard and DeepSpeed take one optimizer class over their partitions.
    several_optimizers: bool = True
    # What a comparison checks it by: "parameters" (equal to its reference's within
    # compare.tolerance) or "loss" (its final loss within compare.loss_tolerance of its
    # reference's: an algorithm whose weights are not expected equal, such as DiLoCo's).
    checked_by: str = "parameters"
    # fp32 copies of the model it keeps besides the model state, over its shard group's S ranks
    # (DiLoCo: the outer weights and the outer momentum, 2).
    outer_copies: int = 0
    # Where an option changes what the strategy sends or holds (DiLoCo's strategy.inner, ZeRO
    # within a worker): (this spec, the options) -> the spec of the strategy so configured.
    configured: Callable | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"StrategySpec {self.name!r}: kind={self.kind!r}, choose one of {KINDS}")
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"StrategySpec {self.name!r}: checkpoint={self.checkpoint!r}, choose one of {CHECKPOINTS}")
        if self.messages not in ("buckets", "units") or not 0 <= self.zero_stage <= 3:
            raise ValueError(f"StrategySpec {self.name!r}: messages buckets|units, zero_stage 0-3")
        if self.checked_by not in ("parameters", "loss"):
            raise ValueError(f"StrategySpec {self.name!r}: checked_by parameters | loss")
        if any(c.group != "world" for c in self.collectives) and not self.hybrid:
            raise ValueError(f"StrategySpec {self.name!r}: shard/replica collectives need hybrid=True")

    def for_options(self, options) -> StrategySpec:
        """This strategy as `options` (its config, or any mapping of its keys) configure it: the spec
        itself, unless one of them changes its theory (`configured`)."""
        return self.configured(self, options) if self.configured is not None and options is not None else self


_SPECS: dict[str, StrategySpec] = {}
_families: tuple[str, ...] = ()


def families() -> tuple[str, ...]:
    """The modules that register the shipped strategies: ours, and every module a shipped strategy
    config names (`module:`): the references (native PyTorch's, DeepSpeed's) are plugins in
    minidist_tools that register themselves through that seam, as a strategy of a user's does."""
    import yaml

    modules = []
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        try:
            modules.append((yaml.safe_load(path.read_text()) or {}).get("module"))
        except (yaml.YAMLError, AttributeError) as e:  # (a list, a scalar: no keys)
            raise ConfigError(f"{path} is not a strategy config ({e.__class__.__name__}): fix it or remove it") from None
    return ("minidist.train.strategies.ours", *dict.fromkeys(m for m in modules if m))


def _load_families() -> None:
    global _families
    if not _families:
        _families = families()  # before importing: the families call register() while they load
        for module in _families:
            try:
                importlib.import_module(module)
            except ImportError:  # a config's plugin that does not import: asked for, spec() says why
                if module == _families[0]:
                    raise


def register(spec: StrategySpec) -> StrategySpec:
    """Add `spec` under its name (once: a second spec with the same name is an error)."""
    _load_families()
    if spec.name in _SPECS and _SPECS[spec.name] != spec:
        raise ValueError(f"strategy {spec.name!r} is already registered ({_SPECS[spec.name].summary})")
    _SPECS[spec.name] = spec
    return spec


def import_module_of(cfg) -> None:
    """Import the module a strategy config names (`module:`), which registers its strategy."""
    module = cfg.get("module") if cfg is not None else None
    if module:
        try:
            importlib.import_module(str(module))
        except ImportError as e:
            raise ConfigError(f"strategy.module={module!r} cannot be imported ({e}): give an importable module "
                              "that registers the strategy (minidist.train.strategies.register)") from e


def names(kind: str | None = None) -> tuple[str, ...]:
    """Registered strategy names in specs' order (of one kind, when given)."""
    return tuple(s.name for s in specs(kind))


def specs(kind: str | None = None, shipped_only: bool = False) -> list[StrategySpec]:
    """Registered specs by kind (KINDS' order), each kind in registration order: of one kind, when
    given; `shipped_only`: those the shipped families define (not one a script or test registered)."""
    _load_families()
    return sorted((s for s in _SPECS.values() if (kind is None or s.kind == kind)
                   and (not shipped_only or s.factory.__module__ in _families)), key=lambda s: KINDS.index(s.kind))


def unregister(name: str) -> None:
    """Forget a strategy `register` added (a test's or a notebook's own; nothing else needs it)."""
    _SPECS.pop(name, None)


def spec(name: str, cfg=None) -> StrategySpec:
    """The spec of `name`; a ConfigError listing the known names when there is none. `cfg`, a
    strategy config, may name the module that registers it."""
    _load_families()
    if name not in _SPECS:
        import_module_of(cfg)
    if name not in _SPECS:
        raise ConfigError(f"strategy={name!r} is unknown: choose one of {list(names())}")
    return _SPECS[name]


def check_options(cfg) -> StrategySpec:
    """The spec of cfg.name as cfg configures it (StrategySpec.for_options), after checking every key
    of the strategy config is one it reads and takes its value."""
    s = spec(str(cfg.name), cfg)
    unknown = sorted(set(cfg.keys()) - {"name", "module", *s.options})
    if unknown:
        raise ConfigError(f"strategy.{unknown[0]}: strategy={s.name} does not take it (it takes "
                          f"{', '.join(s.options) or 'no options'}); remove it, or pick a strategy that does")
    for key, allowed in s.choices.items():
        value = cfg.get(key)
        if value not in allowed:
            others = [o.name for o in specs() if key in o.options and value in o.choices.get(key, (value,))]
            raise ConfigError(f"strategy.{key}={value!r}: strategy={s.name} takes {' | '.join(map(str, allowed))}"
                              + (f"; {key}={value} is strategy={' or '.join(others)}" if others else ""))
    return s.for_options(cfg)


def build_strategy(cfg, ctx, precision: str = "fp32"):
    """The strategy `cfg.name` names, configured by the rest of `cfg` (the strategy config group).
    precision (trainer.precision): bf16 makes stage-3 sharding gather parameters in bf16 and
    reduce gradients in fp32."""
    import torch

    s = check_options(cfg)
    strategy = s.factory(cfg, ctx, torch.bfloat16 if precision == "bf16" else None)
    strategy.spec = s
    return strategy


# The strategy configs (configs/strategy/NAME.yaml): every default, and the module of a plugin's strategy.
CONFIG_DIR = config_dir() / "strategy"
