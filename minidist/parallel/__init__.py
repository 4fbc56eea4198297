"""Data-parallel strategies: DataParallel (DDP) and ShardedDataParallel (ZeRO 1/2/3), from scratch.

Each name is imported on first use (so reading a checkpoint's format does not import the
strategies, nor torch.compile's machinery they bring)."""

import importlib

_HOME = {
    "DataParallel": "minidist.parallel.ddp", "DiLoCo": "minidist.parallel.diloco", "Join": "minidist.parallel.join",
    "PowerSGD": "minidist.parallel.comm_hooks",
    "ShardedDataParallel": "minidist.parallel.zero3",  # which registers stage 3 with the class zero.py defines
    "allreduce_hook": "minidist.parallel.comm_hooks", "fp16_compress_hook": "minidist.parallel.comm_hooks",
    "bf16_compress_hook": "minidist.parallel.comm_hooks", "HierarchicalAllReduce": "minidist.parallel.comm_hooks",
    "register_elementwise_optimizer": "minidist.parallel.shard_optimizer",
    "register_whole_parameter_optimizer": "minidist.parallel.shard_optimizer",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minidist.parallel' has no attribute {name!r}")
