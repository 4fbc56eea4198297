"""DataParallel's communication hooks (how one bucket is reduced) and PowerSGD (Vogels et al.,
2019), a hook that sends a rank-r approximation of each gradient matrix with error feedback.

    model = DataParallel(net, comm_hook=bf16_compress_hook)
    model = DataParallel(net, comm_hook=PowerSGD(rank=4))

A hook takes a `Bucket` holding grad / world_size and returns an object whose `wait()` leaves the
average in `bucket.buffer`. PowerSGD's algorithm: docs/internals.md, "parallel/comm_hooks.py".
"""

from __future__ import annotations

import inspect

import torch

from minidist import comm
from minidist.comm.wire import QUANT_BLOCK, as_wire
from minidist.parallel.buckets import Bucket
from minidist.parallel.sharded_grad import ReplicaReduce


def allreduce_hook(bucket: Bucket):
    """The default: one async all_reduce (sum) of the bucket in place."""
    return comm.all_reduce(bucket.buffer, group=bucket.process_group, async_op=True, algorithm=bucket.algorithm)


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
        handle = comm.all_reduce(compressed, group=bucket.process_group, async_op=True, algorithm=bucket.algorithm)
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
    chained behind it and starts, in bucket order, as soon as it is done (sharded_grad.py, as for
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


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Columns of p made orthonormal (reduced QR), done in fp32."""
    q, _ = torch.linalg.qr(p.float(), mode="reduced")
    return q.to(p.dtype)


class PowerSGD:
    """A stateful comm hook: call it with a bucket, get an object with wait()."""

    def __init__(self, rank: int = 4, start_iter: int = 0, seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.start_iter, self.seed = rank, start_iter, seed
        self.step = 0            # counts buckets of bucket index 0: one per backward
        # Keyed by the parameter's index in the model (stable when buckets are rebuilt).
        self._q: dict[int, torch.Tensor] = {}       # warm-started Q per matrix
        self._error: dict[int, torch.Tensor] = {}   # error feedback per matrix

    def __call__(self, bucket: Bucket):
        if bucket.index == 0:
            self.step += 1
        if self.step <= self.start_iter:
            return comm.all_reduce(bucket.buffer, group=bucket.process_group, async_op=True)
        return _PowerStep(self, bucket)

    def compressible(self, view: torch.Tensor) -> bool:
        if view.dim() < 2:
            return False
        rows, cols = view.shape[0], view[0].numel()
        return self.rank * (rows + cols) < rows * cols  # only where it actually saves bytes

    def q_for(self, key: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        if key not in self._q:
            # The same random start on every rank (a seeded generator), as the algorithm needs.
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
            self._q[key] = orthonormalise(torch.randn(cols, self.rank, generator=g)).to(like)
        return self._q[key]


class _PowerStep:
    """The two rounds of one bucket: P's all_reduce is in flight when created; wait() does the rest."""

    def __init__(self, hook: PowerSGD, bucket: Bucket):
        self.hook, self.bucket = hook, bucket
        group = bucket.process_group
        self.matrices, vectors = [], []
        for k, view in enumerate(bucket.views):
            (self.matrices if hook.compressible(view) else vectors).append((k, view))
        # Uncompressed part: one flat all_reduce.
        self.flat = torch.cat([v.reshape(-1) for _, v in vectors]) if vectors else None
        self.flat_handle = comm.all_reduce(self.flat, group=group, async_op=True) if vectors else None
        self.vectors = vectors
        # Round 1: P = M Q for every matrix, all_reduced together.
        self.ms, ps = [], []
        for k, view in self.matrices:
            key = bucket.param_ids[k]
            m = view.reshape(view.shape[0], -1)
            if key in hook._error:
                m.add_(hook._error[key])  # in place: m is the bucket's view
            q = hook.q_for(key, m.shape[1], m)
            self.ms.append((key, m, q))
            ps.append(m @ q)
        self.p_flat = torch.cat([p.reshape(-1) for p in ps]) if ps else None
        self.p_shapes = [p.shape for p in ps]
        self.p_handle = comm.all_reduce(self.p_flat, group=group, async_op=True) if ps else None

    def wait(self) -> None:
        hook, group = self.hook, self.bucket.process_group
        world = torch.distributed.get_world_size(group)
        if self.p_handle is not None:
            self.p_handle.wait()
            ps, offset = [], 0
            for shape in self.p_shapes:
                n = shape[0] * shape[1]
                ps.append(orthonormalise(self.p_flat[offset:offset + n].view(shape)))
                offset += n
            # Round 2: Q = M^T P, all_reduced together.
            qs = [m.t() @ p for (_, m, _), p in zip(self.ms, ps)]
            q_flat = torch.cat([q.reshape(-1) for q in qs])
            comm.all_reduce(q_flat, group=group)
            offset = 0
            for (key, m, _), p, q in zip(self.ms, ps, qs):
                n = q.numel()
                q = q_flat[offset:offset + n].view(q.shape)
                offset += n
                approx = p @ q.t()
                # What this rank's compression lost, kept at the bucket's scale (1/world of the
                # gradient): m is this rank's (gradient + error) / world, approx the average's
                # approximation. Comparing m with approx itself, as this did, stored the other
                # ranks' gradients as "error" and fed them back: training barely progressed.
                hook._error[key] = m - approx / world
                m.copy_(approx)
                hook._q[key] = q.clone()            # warm start for the next step
        if self.flat_handle is not None:
            self.flat_handle.wait()
            offset = 0
            for _, view in self.vectors:
                view.copy_(self.flat[offset:offset + view.numel()].view_as(view))
                offset += view.numel()


class GradBucket:
    """What a native DDP comm hook is handed: torch.distributed.GradBucket's methods, over one of our
    buckets (torch's GradBucket cannot be built from Python)."""

    def __init__(self, bucket: Bucket, params: list[torch.Tensor], count: int):
        self._bucket, self._params, self._count = bucket, params, count

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return [self._params[i] for i in self._bucket.param_ids]

    def is_last(self) -> bool:
        return self._bucket.index == self._count - 1


def check_native_hook(hook) -> None:
    """register_comm_hook's checks, with native DDP's messages."""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    signature = inspect.signature(hook)
    if "bucket" in signature.parameters and signature.parameters["bucket"].annotation not in (
            inspect.Parameter.empty, torch.distributed.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")


class NativeHook:
    """A hook given to register_comm_hook, called as native DDP calls it (see DataParallel.register_comm_hook)."""

    def __init__(self, state, hook):
        self.state, self.hook = state, hook
        self.__name__ = getattr(hook, "__name__", "native_hook")

    def __call__(self, bucket: GradBucket):
        future = self.hook(self.state, bucket)
        if not isinstance(future, torch._C.Future):  # (torch.futures.Future, and what get_future() returns)
            raise RuntimeError(f"callback must return a torch.futures.Future object, but got {type(future)}")
        return _FutureInto(future, bucket._bucket)


class _FutureInto:
    def __init__(self, future, bucket: Bucket):
        self.future, self.bucket = future, bucket

    def wait(self) -> None:
        value = self.future.wait()
        value = value[0] if isinstance(value, (list, tuple)) else value  # an all_reduce's future holds a list
        if value is not self.bucket.buffer:
            self.bucket.buffer.copy_(value)


# Native DDP's internals some scripts and PyTorch's own tests call, and why DataParallel has none.
NATIVE_INTERNALS = {
    name: "native DDP's internal logging; minidist's timings are model.last_wait_s and the profiler "
          "(minidist.profiling)" for name in ("_get_ddp_logging_data", "_set_ddp_runtime_logging_sample_rate")}


def resolve_hook(comm_hook, grad_wire=None, quant_block: int = QUANT_BLOCK):
    """DataParallel's comm_hook and grad_wire arguments as the one hook its buckets call."""
    if comm_hook == "powersgd":
        comm_hook = PowerSGD()  # stateful: one per model
    elif isinstance(comm_hook, str):
        if comm_hook not in BUILTIN_HOOKS:
            raise ValueError(f"unknown comm_hook {comm_hook!r}; choose from "
                             f"{sorted([*BUILTIN_HOOKS, 'powersgd'])} or pass a callable")
        comm_hook = BUILTIN_HOOKS[comm_hook]
    if grad_wire is not None:
        if comm_hook not in (None, allreduce_hook):
            raise ValueError(f"DataParallel: grad_wire={grad_wire!r} chooses how the all_reduce sends gradients, "
                             f"which comm_hook={getattr(comm_hook, '__name__', comm_hook)!r} replaces: give one "
                             "of them")
        comm_hook = WireAllReduce(as_wire(grad_wire, quant_block))
    return comm_hook or allreduce_hook
