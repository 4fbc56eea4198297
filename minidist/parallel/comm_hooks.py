"""Gradient communication hooks for DataParallel: how one bucket gets reduced.

A hook takes a `Bucket` whose `buffer` holds this rank's gradients already divided
by the world size, starts the reduction, and returns an object with `wait()`.
When `wait()` returns, `bucket.buffer` must hold the averaged gradients.

    model = DataParallel(net, comm_hook=bf16_compress_hook)
"""

from __future__ import annotations

import torch

from minidist import comm
from minidist.buckets import Bucket


def allreduce_hook(bucket: Bucket):
    """The default: one async all_reduce (sum) of the bucket in place."""
    return comm.all_reduce(bucket.buffer, group=bucket.process_group, async_op=True)


class _CastBack:
    """Waits for the all_reduce of a low-precision copy, then writes it back into the bucket."""

    def __init__(self, handle, compressed: torch.Tensor, bucket: Bucket):
        self.handle, self.compressed, self.bucket = handle, compressed, bucket

    def wait(self) -> None:
        self.handle.wait()
        self.bucket.buffer.copy_(self.compressed)


def _compress_hook(dtype: torch.dtype):
    def hook(bucket: Bucket):
        # Half the bytes on the wire; the price is the rounding of each rank's
        # (already averaged-by-n) gradient to `dtype` and of the sum itself.
        compressed = bucket.buffer.to(dtype)
        handle = comm.all_reduce(compressed, group=bucket.process_group, async_op=True)
        return _CastBack(handle, compressed, bucket)
    hook.__name__ = f"{str(dtype).replace('torch.', '')}_compress_hook"
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
bf16_compress_hook = _compress_hook(torch.bfloat16)

BUILTIN_HOOKS = {"allreduce": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
