"""Every strategy by name: register a spec once, and every part of minidist finds it.

    register(StrategySpec(name="mine", kind="minidist", factory=Mine, summary="...", options=(...)))
    spec("zero2"), names(), specs(kind="native")
    strategy = build_strategy(cfg.strategy, ctx, precision)

The families shipped with minidist (ours.py, native.py, deepspeed.py) are imported the first
time the registry is asked anything, by name (importlib), so the registry imports none of them
and none imports the registry back; DeepSpeed itself is imported only when a ds_* strategy
wraps a model. A strategy from outside minidist registers itself when its module is imported:
a strategy config may name that module (`module: my_package.my_strategy`), and every process
that builds the strategy imports it first.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from minidist.train.config import ConfigError, config_dir
from minidist.train.strategies.spec import StrategySpec

FAMILIES = ("minidist.train.strategies.ours", "minidist.train.strategies.native",
            "minidist.train.strategies.deepspeed")
# A minidist strategy whose own reference is not in a comparison is checked against this one
# when it is there: every strategy trains the same model on the same data, so all should agree.
STAND_IN_REFERENCE = "native_ddp"

_SPECS: dict[str, StrategySpec] = {}
_loaded = False


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True  # before importing: the families call register() while they load
        for module in FAMILIES:
            importlib.import_module(module)


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
    """Registered strategy names in registration order (of one kind, when given)."""
    return tuple(s.name for s in specs(kind))


def specs(kind: str | None = None, shipped_only: bool = False) -> list[StrategySpec]:
    """Registered specs in registration order: of one kind, when given; `shipped_only`: those
    minidist's FAMILIES define (not one a script or test registered for itself)."""
    _load_families()
    return [s for s in _SPECS.values() if (kind is None or s.kind == kind)
            and (not shipped_only or s.factory.__module__ in FAMILIES)]


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


def reference_for(name: str, present: list[str], overrides: dict | None = None) -> str | None:
    """What `name` is checked against in a comparison of `present`: compare.references[name] when
    given, else its spec's reference; when that one is absent, the stand-in for a minidist
    strategy; None when neither is present."""
    _load_families()  # (asked first, the registry would not know the shipped strategies yet)
    preferred = (overrides or {}).get(name) or (spec(name).reference if name in _SPECS else None)
    if preferred in present and preferred != name:
        return preferred
    if name in _SPECS and _SPECS[name].kind == "minidist" and STAND_IN_REFERENCE in present and \
            name != STAND_IN_REFERENCE:
        return STAND_IN_REFERENCE
    return None


# The strategy configs (configs/strategy/NAME.yaml) are where every default lives; code that builds
# a strategy without Hydra (benchmarks, measurements) reads the same files.
CONFIG_DIR = config_dir() / "strategy"


def _yaml_config(name: str):
    from omegaconf import OmegaConf

    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"strategy={name!r} has no config {path}: add one (the strategy's defaults live there)")
    node = OmegaConf.load(path)
    parents = [d for d in node.pop("defaults", []) if d != "_self_"]  # the groups' own defaults: siblings
    return OmegaConf.merge(*(_yaml_config(p) for p in parents), node) if parents else node


def strategy_options(name: str, **overrides):
    """configs/strategy/NAME.yaml as Hydra composes it, for code that builds strategies without
    Hydra; keyword arguments override it where the strategy takes that key (so one sweep can
    pass the same knobs to every strategy)."""
    from omegaconf import OmegaConf

    options = _yaml_config(name)
    taken = set(spec(str(options.name)).options)
    return OmegaConf.merge(options, {k: v for k, v in overrides.items() if k in taken})


def split_variant(variant: str) -> tuple[str, str]:
    """A benchmark variant -> (strategy name, collectives): "zero2_backend" is stage 2 with the
    backend's reduce_scatter / all_gather, "zero2" stage 2 with collectives="auto"."""
    return variant.removesuffix("_backend"), "backend" if variant.endswith("_backend") else "auto"
