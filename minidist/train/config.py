"""The rules of a config, in one place (it imports nothing else of the trainer): the one-line errors
(ConfigError, exit status 2), where the configs are, a config's `_target_` checked against the kind
of class its group builds, and what may change on resume (docs/internals.md, "train/config.py").
"""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A bad override or an impossible combination. The message names the key and the fix."""


class CheckpointRefused(ConfigError):
    """A checkpoint file that does not match its manifest, is not only tensors and plain
    containers, or cannot be read. The message names the file; nothing in it was loaded."""


PACKAGE = Path(__file__).resolve().parents[1]  # the minidist/ folder
CANDIDATES = (PACKAGE / "_configs", PACKAGE.parent / "configs")


def config_dir() -> Path:
    """The folder holding train.yaml and the config groups (strategy/, model/, ...)."""
    for candidate in CANDIDATES:
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"minidist's configs are in none of {[str(c) for c in CANDIDATES]}: reinstall minidist "
                            "(pip install .), or run it from a checkout of the repository")


def compose_fresh(config_name: str, overrides=(), **kwargs):
    """configs/<config_name>.yaml composed with `overrides` (Hydra's compose), on a Hydra of its own:
    its global state is cleared before and after, whatever was running."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides), **kwargs)
    finally:
        GlobalHydra.instance().clear()


def class_named(target: str, base: type, key: str, example: str, module: str | None = None) -> type:
    """The class `target` (a dotted path) names, if it is a subclass of `base`; else a
    ConfigError naming `key` (e.g. "optim._target_") and a working `example`.

    Importing a module runs its code, so what may be imported is decided from the name first:
    `base`'s own package (torch for optimizers, minidist for data sets), or the package the
    group's `module` key names — the config saying, in a key of its own, which code it trusts."""
    from hydra.utils import get_object

    group = key.rsplit(".", 1)[0]
    trusted = [base.__module__.split(".")[0], *([str(module)] if module else [])]
    where = target.rsplit(".", 1)[0] if "." in target else ""
    if not any(where == p or where.startswith(p + ".") for p in trusted):
        raise ConfigError(f"{key}={target!r} was not imported: only {' and '.join(trusted)}'s classes are, without "
                          f"more (importing a module runs its code). For a class of your own, also name its package: "
                          f"{group}.module={target.split('.')[0]}")
    try:
        found = get_object(target)
    except Exception as e:  # Hydra wraps the import error
        raise ConfigError(f"{key}={target!r} cannot be imported ({str(e).splitlines()[0]}): name a "
                          f"{base.__module__}.{base.__qualname__} class, e.g. {example}") from None
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ConfigError(f"{key}={target!r} is not a subclass of {base.__module__}.{base.__qualname__}: name "
                          f"one, e.g. {example}")
    return found


# Keys (or groups, ending in ".") that may not change on resume, and why.
FIXED = {
    "model.": "the model the checkpoint holds",
    "data.": "the data stream the checkpoint's position counts in",
    "trainer.seed": "the per-rank random streams the checkpoint continues",
    "trainer.precision": "the loss scaler's state and the numbers the checkpoint was trained in",
    "optim._target_": "the optimizer whose state the checkpoint holds",
    "optim.amsgrad": "the optimizer state's layout",
}
# Where to resume from, and which local ranks and port: no part of how training goes.
NOT_SETTINGS = ("trainer.resume", "launcher.")


def flatten(tree, prefix: str = "") -> dict:
    """{"a.b.c": value} for a nested dict of plain values."""
    out = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, value in the checkpoint's config, value now) for every setting that differs."""
    old, new = flatten(saved), flatten(current)
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys
            if old.get(k) != new.get(k) and not k.startswith(NOT_SETTINGS)]


def is_fixed(key: str) -> str | None:
    """Why `key` may not change on resume, or None if it may."""
    return next((why for k, why in FIXED.items() if key == k or (k.endswith(".") and key.startswith(k))), None)


def describe(changes: list[tuple[str, object, object]], limit: int = 12, typed: set[str] = frozenset()) -> str:
    """`key old -> new, ...`. Another strategy brings its own defaults for every strategy.* key: those
    show as one item, `strategy zero3 -> ddp (its defaults)`, beside the strategy keys in `typed` (the
    keys the command line set, e.g. {"strategy.bucket_cap_mb"})."""
    items = []
    new_strategy = next(((a, b) for k, a, b in changes if k == "strategy.name"), None)
    if new_strategy is not None:
        items.append(f"strategy {new_strategy[0]} -> {new_strategy[1]} (its defaults)")
        changes = [c for c in changes if not c[0].startswith("strategy.") or c[0] in typed]
    items += [f"{k} {_short(a)} -> {_short(b)}" for k, a, b in changes]
    return ", ".join(items[:limit]) + (f" (and {len(items) - limit} more)" if len(items) > limit else "")


def typed_keys(overrides: list[str]) -> set[str]:
    """The config keys a command line's Hydra overrides set (`strategy.bucket_cap_mb=4` ->
    "strategy.bucket_cap_mb"; `+x=1`, `~x`, `++x=1` alike)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def schedule_changed(changes) -> bool:
    """Does the learning rate follow another schedule from here (its peak, warm-up, floor or span)?"""
    return any(k.startswith("optim.") or k == "trainer.max_steps" for k, _, _ in changes)
