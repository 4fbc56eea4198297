"""The one gradient reduction every ZeRO stage (and hybrid sharding) performs:

    fill     each gradient / N into its slot of a flat, shard-padded buffer (zeros where none)
    launch   reduce_scatter the buffer over the shard group -> this rank's slice of the sum;
             with a mesh, that slice is then all_reduced across the replicas (across_replicas.py)
    finish   add the slice into the master shard's gradient (cast to the master dtype)

Stages 1-2 do it per bucket (zero.py), stage 3 per unit (zero3.py); what differs between
them is only when the buffer exists and when each step runs. The wire format
(`grad_wire`: what travels, minidist.comm.wire) is chosen here, so it applies to every stage
alike: the gradients are rounded to it once, on the sending rank, and summed in full precision.
"""

from __future__ import annotations

import torch

from minidist import comm
from minidist.parallel.across_replicas import ReplicaReduce
from minidist.parallel.flat_shard import FlatShard


class ShardedGradReduce:
    """Fill, reduce_scatter (then across the replicas) and accumulate one FlatShard's gradients.

    Args:
        dp_size: every data-parallel rank (the world with a mesh): what a gradient is divided by.
        group: the shard group the reduce_scatter runs over.
        replicate_group: with a mesh of more than one replica, the group each slice is then
            all_reduced over (None: no second level).
        dtype: the dtype of the buffers (reduce_dtype).
        algorithm: the collectives' algorithm (minidist.comm.choose_algorithm).
        wire: None (the buffer's dtype travels), or a minidist.comm.wire.Wire (or a format name).
    """

    def __init__(self, *, dp_size: int, group, replicate_group=None, dtype: torch.dtype,
                 algorithm: str = "auto", wire=None):
        self.scale = 1.0 / dp_size
        self.group, self.dtype, self.algorithm, self.wire = group, dtype, algorithm, wire
        self.replicas = ReplicaReduce(replicate_group, algorithm, wire=wire) if replicate_group is not None else None

    def fill(self, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Write grad / N into `out` (a slot of the flat buffer); zeros where there is no gradient."""
        if grad is None:
            out.zero_()
        else:
            torch.mul(grad.reshape(out.shape), self.scale, out=out)  # the average over every data-parallel rank

    def launch(self, shard: FlatShard, flat: torch.Tensor, reduced: torch.Tensor | None = None):
        """Start reducing `flat` (shard.padded long, filled); returns (handle, this rank's slice).
        `reduced` may be given (stage 1 reduces into its own bucket's slice, in place)."""
        if reduced is None:
            reduced = torch.empty(shard.shard_size, dtype=self.dtype, device=shard.device)
        handle = comm.reduce_scatter_tensor(reduced, flat, group=self.group, async_op=True,
                                            algorithm=self.algorithm, wire_dtype=self.wire)
        if self.replicas is not None:
            handle = self.replicas.after(handle, reduced)  # then summed across the replicas
        return handle, reduced

    @staticmethod
    def finish(shard: FlatShard, reduced: torch.Tensor, extra: torch.Tensor | None = None) -> None:
        """Add the reduced slice (plus `extra`, a gradient kept from an earlier backward) into the
        master shard's gradient. The handle must have been waited for."""
        grad = reduced.to(shard.master.dtype)  # no copy when the dtypes match
        if extra is not None:
            grad = grad + extra
        shard.add_grad(grad)
