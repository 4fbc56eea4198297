"""ZeRO's gradient reduction, one path for every stage and the mesh: reduce_scatter within the shard group,
then (hybrid sharding) the all_reduce across the replicas.

The second level of hybrid sharding: each reduced shard summed across the replicas.

With a mesh (minidist.init_mesh), a gradient is reduce_scattered within the shard group
(one host), which leaves each rank the sum over its host of 1/S of the gradient; that
piece is then all_reduced across the replicate group (one rank per host), which makes it
the sum over every rank. Only that all_reduce crosses hosts: 1/S of the bytes.

The all_reduce can start only once the reduce_scatter has finished, so it is chained
behind it; chained reductions start strictly in issue order (a later bucket's never
before an earlier one's), so every rank of a replicate group issues them alike. Each new
reduction first starts those at the head of the queue whose reduce_scatter is already
done, so the all_reduces overlap the rest of backward instead of all waiting for its end.

On CUDA the host cannot tell when a reduce_scatter is done without waiting for the GPU (the
host runs ahead of it, so `is_completed()` would be false at every check and every all_reduce
would start at the end of backward). There the chain is kept by the device instead: each
all_reduce is issued at once from a side stream that waits for its reduce_scatter, so it starts
on the GPU the moment that is done, and neither the host nor the compute stream waits.

The one gradient reduction every ZeRO stage (and hybrid sharding) performs:

    fill     each gradient / N into its slot of a flat, shard-padded buffer (zeros where none)
    launch   reduce_scatter the buffer over the shard group -> this rank's slice of the sum;
             with a mesh, that slice is then all_reduced across the replicas (ReplicaReduce, above)
    finish   add the slice into the master shard's gradient (cast to the master dtype)

Stages 1-2 do it per bucket (zero.py), stage 3 per unit (zero3.py); what differs between
them is only when the buffer exists and when each step runs. The wire format
(`grad_wire`: what travels, minidist.comm.wire) is chosen here, so it applies to every stage
alike: the gradients are rounded to it once, on the sending rank, and summed in full precision.
"""

from __future__ import annotations

import torch

from minidist import comm
from minidist.parallel.flat_shard import FlatShard


class ReplicaReduce:
    """Sum reduced shards over `group` (the mesh's replicate group), each after its reduce_scatter."""

    def __init__(self, group, algorithm: str = "auto", wire=None):
        self.group, self.algorithm, self.wire = group, algorithm, wire  # wire: what travels (comm.wire)
        self._queue: list[_ThenAcrossReplicas] = []
        self._side_stream = None  # CUDA: where the all_reduces wait for their reduce_scatters

    def after(self, handle, tensor: torch.Tensor) -> "_ThenAcrossReplicas":
        """A handle whose wait() returns once `handle` and the all_reduce of `tensor` are done."""
        chained = _ThenAcrossReplicas(self, handle, tensor)
        if tensor.is_cuda:  # chained on the device, started now, in issue order like the host's queue
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(tensor.device)
            self._side_stream.wait_stream(torch.cuda.current_stream(tensor.device))  # `tensor` is ready there
            with torch.cuda.stream(self._side_stream):
                handle.wait_on_stream()  # the side stream, not the computation, waits for the reduce_scatter
                chained.second = comm.all_reduce(tensor, group=self.group, async_op=True, algorithm=self.algorithm,
                                                 wire_dtype=self.wire)
            return chained
        self.progress()
        self._queue.append(chained)
        return chained

    def progress(self) -> None:
        """Start the all_reduces at the head of the queue whose reduce_scatter has finished."""
        while self._queue and self._queue[0].first.is_completed():
            self._start(self._queue.pop(0))

    def _start_up_to(self, target: "_ThenAcrossReplicas") -> None:
        while self._queue:
            head = self._queue.pop(0)
            self._start(head)
            if head is target:
                return

    def _start(self, chained: "_ThenAcrossReplicas") -> None:
        chained.first.wait()
        chained.second = comm.all_reduce(chained.tensor, group=self.group, async_op=True, algorithm=self.algorithm,
                                         wire_dtype=self.wire)


class _ThenAcrossReplicas:
    def __init__(self, owner: ReplicaReduce, first, tensor: torch.Tensor):
        self.owner, self.first, self.tensor, self.second = owner, first, tensor, None

    def wait(self) -> None:
        if self.second is None:
            self.owner._start_up_to(self)
        self.second.wait()

    def is_completed(self) -> bool:
        return self.second is not None and self.second.is_completed()


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
