"""Data-parallel strategies: DataParallel (DDP) and ShardedDataParallel (ZeRO 1/2/3), from scratch."""

from minidist.parallel.comm_hooks import HierarchicalAllReduce, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from minidist.parallel.ddp import DataParallel
from minidist.parallel.diloco import DiLoCo
from minidist.parallel.join import Join
from minidist.parallel.powersgd import PowerSGD
from minidist.parallel.shard_optimizer import register_elementwise_optimizer
from minidist.parallel.zero import ShardedDataParallel
from minidist.parallel import zero3  # noqa: F401,E402  (registers stage 3 with ShardedDataParallel)

__all__ = ["DataParallel", "DiLoCo", "ShardedDataParallel", "Join", "PowerSGD", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "HierarchicalAllReduce", "register_elementwise_optimizer"]
