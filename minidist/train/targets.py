"""A config's `_target_`: the class it names, accepted only if it is the kind of class the
config group builds, so a config cannot name arbitrary code to run."""

from __future__ import annotations

from minidist.train.errors import ConfigError


def class_named(target: str, base: type, key: str, example: str) -> type:
    """The class `target` (a dotted path) names, if it is a subclass of `base`; else a
    ConfigError naming `key` (e.g. "optim._target_") and a working `example`."""
    from hydra.utils import get_object

    try:
        found = get_object(target)
    except Exception as e:  # Hydra wraps the import error
        raise ConfigError(f"{key}={target!r} cannot be imported ({str(e).splitlines()[0]}): name a "
                          f"{base.__module__}.{base.__qualname__} class, e.g. {example}") from None
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ConfigError(f"{key}={target!r} is not a subclass of {base.__module__}.{base.__qualname__}: name "
                          f"one, e.g. {example}")
    return found
