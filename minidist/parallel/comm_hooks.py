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
from minidist.parallel.across_replicas import ReplicaReduce


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

class WireAllReduce:
    """Comm hook: the bucket all_reduced with `wire` on the wire and full-precision sums
    (minidist.comm.wire): DataParallel(grad_wire=...)."""

    def __init__(self, wire):
        self.wire = wire
        self.__name__ = f"{wire.label}_wire"

    def __call__(self, bucket: Bucket):
        return comm.all_reduce(bucket.buffer, group=bucket.process_group, async_op=True, wire_dtype=self.wire)


BUILTIN_HOOKS = {"allreduce": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}


class HierarchicalAllReduce:
    """Comm hook: all_reduce in two levels on a mesh (minidist.init_mesh), as hierarchical
    all_reduce does on clusters whose hosts are linked more slowly than their GPUs:

        reduce_scatter within the host (shard group)     -> each rank: its 1/S, summed over the host
        all_reduce of that 1/S across hosts (replicate)  -> summed over every rank
        all_gather within the host                       -> the whole bucket, summed

    Per rank, only 2 (R-1)/R x bucket/S bytes cross hosts, against a flat ring's
    2 (N-1)/N x bucket on the ring's host-crossing links. The sum is the same as a flat
    all_reduce's up to the order of additions (equal within rounding, not bitwise).

        model = DataParallel(net, comm_hook=HierarchicalAllReduce(minidist.init_mesh(shard=4)))

    The reduce_scatter starts when the bucket is launched; the all_reduce across hosts is
    chained behind it and starts, in bucket order, as soon as it is done (across_replicas.py, as for
    hybrid sharding: the replicate group carries nothing else, so every rank issues the same
    sequence there). The gather runs in wait(), which DataParallel calls in bucket order after
    every launch: started any earlier, it could cross a later bucket's reduce_scatter on the
    shard group in a different order on different ranks.
    """

    def __init__(self, mesh, algorithm: str = "auto"):
        self.mesh, self.algorithm = mesh, algorithm
        self.__name__ = "hierarchical"
        self._across = ReplicaReduce(mesh.replicate_group, algorithm) if mesh.replicate > 1 else None

    def __call__(self, bucket: Bucket):
        S = self.mesh.shard
        flat = bucket.buffer
        pad = (-flat.numel()) % S  # reduce_scatter needs a multiple of the shard group's size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        piece = flat.new_empty(flat.numel() // S)
        handle = comm.reduce_scatter_tensor(piece, flat, group=self.mesh.shard_group, async_op=True,
                                            algorithm=self.algorithm)
        if self._across is not None:
            handle = self._across.after(handle, piece)  # then summed across hosts
        return _ThenGather(self, handle, piece, flat, bucket)


class _ThenGather:
    def __init__(self, hook: HierarchicalAllReduce, handle, piece, flat, bucket: Bucket):
        self.hook, self.handle, self.piece, self.flat, self.bucket = hook, handle, piece, flat, bucket

    def wait(self) -> None:
        self.handle.wait()  # the reduce_scatter in the host and the all_reduce across hosts
        comm.all_gather_into(self.flat, self.piece, group=self.hook.mesh.shard_group, algorithm=self.hook.algorithm)
        if self.flat is not self.bucket.buffer:
            self.bucket.buffer.copy_(self.flat[:self.bucket.buffer.numel()])
