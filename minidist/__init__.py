"""minidist: data parallelism from torch.distributed primitives, readable end to end.

    import minidist
    ctx = minidist.init_distributed()
    model = minidist.DataParallel(net)

The names below are imported on first use, so `minidist --help` and other commands that need
no torch start in a fraction of a second.
"""

import importlib

_HOME = {
    "DistContext": "minidist.dist", "RendezvousError": "minidist.dist", "get_logger": "minidist.dist",
    "init_distributed": "minidist.dist", "is_main": "minidist.dist", "print0": "minidist.dist",
    "shutdown": "minidist.dist", "Mesh": "minidist.dist", "init_mesh": "minidist.dist",
    "DataParallel": "minidist.parallel", "DiLoCo": "minidist.parallel", "Join": "minidist.parallel",
    "ShardedDataParallel": "minidist.parallel",
}
__all__ = list(_HOME)
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name, or a subpackage (`minidist.comm`), imported when first asked for."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'minidist' has no attribute {name!r}")
