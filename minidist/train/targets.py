"""A config's `_target_`: the class it names, accepted only if it is the kind of class the
config group builds, so a config cannot name arbitrary code to run."""

from __future__ import annotations

from minidist.train.errors import ConfigError


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
