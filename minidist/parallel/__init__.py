"""Data-parallel strategies: DataParallel (DDP) from scratch, and comm hooks."""

from minidist.parallel.comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from minidist.parallel.ddp import DataParallel

__all__ = ["DataParallel", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]
