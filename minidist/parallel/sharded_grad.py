"""The sharded gradient, from the buckets to the optimizer: the one reduction every ZeRO stage and
the mesh perform, the `.grad` placeholder torch's own code sees, and GradScaler's found-inf agreed
across ranks.

    fill     each gradient / N into its slot of a flat, shard-padded buffer
    launch   reduce_scatter over the shard group (then, on a mesh, all_reduce across replicas)
    finish   add the slice into the master shard's gradient

The mesh's chaining, the placeholder and the agreement: docs/internals.md, "parallel/sharded_grad.py".
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

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


aten = torch.ops.aten
_NORMS = (aten.linalg_vector_norm.default,)
_SCALES = (aten.mul_.Tensor, aten.mul_.Scalar)
_CLAMPS = (aten.clamp_.default, aten.clamp_.Tensor)


class ShardedGradient(torch.Tensor):
    """A storage-less stand-in for parameter `index`'s gradient, which lives sharded across ranks."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, index: int, owner: "GradientPlaceholders"):
        out = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device,
                                                  requires_grad=False)
        out.param_name, out.index, out.owner = name, index, owner
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"ShardedGradient({self.param_name!r}: held sharded by ShardedDataParallel(stage={self.owner.stage}))"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._foreach_norm.Scalar:  # clip_grad_norm_(..., foreach=True)
            return [cls._norm(t, *args[1:], **kwargs) for t in args[0]]
        if func in (aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar):
            for t in args[0]:
                cls._mine(t, func).owner.scale(t.index, args[1])
            return None
        me = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ShardedGradient))
        if func in (aten.zero_.default, aten.detach_.default, aten.detach.default):
            return me  # zero_grad(set_to_none=False): nothing to zero; cleared at the next backward
        if func in _NORMS and args[0] is me:
            return cls._norm(me, *args[1:], **kwargs)
        if func in _SCALES and args[0] is me and not isinstance(args[1], ShardedGradient):
            me.owner.scale(me.index, args[1])
            return me
        if func in _CLAMPS and args[0] is me:
            me.owner.clamp(me.index, *args[1:], **kwargs)
            return me
        raise me.refusal(func)

    @staticmethod
    def _mine(t, func) -> "ShardedGradient":
        if not isinstance(t, ShardedGradient):
            raise RuntimeError(f"ShardedDataParallel: {func} mixes sharded gradients with other tensors")
        return t

    @classmethod
    def _norm(cls, me, ord=2, dim=None, keepdim=False, *, dtype=None):
        me = cls._mine(me, "a gradient norm")
        if dim is not None:
            raise me.refusal(f"a norm along dim={dim}")
        return me.owner.norm(me.index, float(ord)).to(dtype or me.dtype)

    def refusal(self, what) -> RuntimeError:
        return RuntimeError(
            f"{self.param_name}.grad is not readable under ShardedDataParallel(stage={self.owner.stage}): after "
            "backward the averaged gradient exists only sharded across the ranks (model.optimizer's parameters). "
            "Its norm (p.grad.norm(), torch.nn.utils.clip_grad_norm_) and scaling (clipping) work; reading its "
            "values (a finiteness check, a histogram) would see nothing or a local value, unlike native DDP. Use "
            "model.clip_grad_norm_(max_norm), which clips by the global norm and returns it "
            "(max_norm=float('inf') only measures it), or read model.optimizer's parameters' .grad "
            f"(this rank's shard). [{what}]")


class GradientPlaceholders:
    """One ShardedGradient per parameter, created once; `place()` after each synchronised backward.

    `segment(i)`: this rank's slice of parameter i's averaged gradient (a view into the master
    shards' gradients), or None where this rank holds none of it; `group`: the ranks whose
    slices make up every parameter (the shard group); `joined()`: whether a minidist.Join is
    active, under which ranks that left cannot take part in a norm's collective."""

    def __init__(self, names: list[str], params: list[nn.Parameter], stage: int,
                 segment: Callable[[int], torch.Tensor | None], group, joined: Callable[[], bool]):
        self._params = params
        self.stage = stage
        self._segment, self._group, self._joined = segment, group, joined
        self._norms: tuple[float, torch.Tensor] | None = None  # (ord, every parameter's norm)
        self._placeholders = [ShardedGradient(p, n, i, self) for i, (n, p) in enumerate(zip(names, params))]
        for p in params:
            p.register_hook(self._make_clear(p))  # runs before autograd accumulates into p.grad

    def place(self) -> None:
        self._norms = None
        for p, placeholder in zip(self._params, self._placeholders):
            p.grad = placeholder

    def norm(self, i: int, ord: float) -> torch.Tensor:
        """The ord-norm of parameter i's whole averaged gradient (all of them at the first call)."""
        if self._norms is None or self._norms[0] != ord:
            self._norms = (ord, self._all_norms(ord))
        return self._norms[1][i]

    def _all_norms(self, ord: float) -> torch.Tensor:
        if self._joined():
            raise RuntimeError("ShardedDataParallel: under minidist.Join, ranks that ran out of data cannot take "
                               "part in torch.nn.utils.clip_grad_norm_'s norm: use model.clip_grad_norm_(max_norm), "
                               "which they follow")
        if not (ord == math.inf or ord > 0):
            raise RuntimeError(f"ShardedDataParallel: a gradient norm of order {ord} is not supported on sharded "
                               "gradients (orders > 0 and inf are)")
        device = self._params[0].device
        segments = [self._segment(i) for i in range(len(self._params))]
        local = [s.float() if s is not None else torch.zeros(0, device=device) for s in segments]
        if ord == math.inf:
            part = torch.stack([s.abs().max() if s.numel() else torch.zeros((), device=device) for s in local])
            comm.all_reduce(part, op=comm.ReduceOp.MAX, group=self._group)
            return part
        part = torch.stack(torch._foreach_norm(local, ord)).pow(ord)  # this rank's sum of |g|^ord
        comm.all_reduce(part, group=self._group)
        return part.pow(1.0 / ord)

    def scale(self, i: int, factor) -> None:
        segment = self._segment(i)
        if segment is not None:
            segment.mul_(factor.to(segment.device) if torch.is_tensor(factor) else factor)
        self._norms = None

    def clamp(self, i: int, min=None, max=None) -> None:
        segment = self._segment(i)
        if segment is not None:
            segment.clamp_(min, max)
        self._norms = None

    @staticmethod
    def _make_clear(p: nn.Parameter):
        def clear(grad):
            if isinstance(p.grad, ShardedGradient):
                p.grad = None  # the new gradient is accumulated onto nothing, as after zero_grad
            return grad
        return clear


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """p.grad, or None where it holds a ShardedGradient (a parameter unused since the last backward)."""
    g = p.grad
    return None if isinstance(g, ShardedGradient) else g


_CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default


class AgreeOnFoundInf(torch.Tensor):
    """An empty gradient that makes the scaler's found-inf check global over `group`."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, group):
        out = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                  requires_grad=False)
        out.group = group
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return "AgreeOnFoundInf(the GradScaler's overflow check, agreed across ranks)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _CHECK:
            grads, found_inf, inv_scale = args
            ours = [g for g in grads if isinstance(g, AgreeOnFoundInf)]
            rest = [g for g in grads if not isinstance(g, AgreeOnFoundInf)]
            if rest:
                func(rest, found_inf, inv_scale)
            comm.all_reduce(found_inf, op=comm.ReduceOp.MAX, group=ours[0].group)
            return None
        if func in (torch.ops.aten.zero_.default, torch.ops.aten.detach_.default, torch.ops.aten.detach.default):
            return args[0]
        # Anything else (a norm over the optimizer's gradients, a foreach op): an empty tensor.
        empty = lambda t: torch.empty(0, dtype=t.dtype, device=t.device) \
            if isinstance(t, AgreeOnFoundInf) else t  # noqa: E731
        args, kwargs = pytree.tree_map(empty, (args, kwargs))
        return func(*args, **kwargs)


class FoundInfAgreement:
    """The extra, empty parameter (`param`) and its agreeing gradient, for one optimizer."""

    def __init__(self, device: torch.device, dtypes_in_use: set[torch.dtype], group):
        dtype = next(d for d in (torch.float64, torch.float32, torch.bfloat16) if d not in dtypes_in_use)
        self.param = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=True)
        self._grad = AgreeOnFoundInf(self.param, group)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        # Cleared before every step: the optimizer never sees it (a skipped step leaves it; harmless).
        optimizer.register_step_pre_hook(lambda *_: self.clear())

    def place(self) -> None:
        """After a synchronised backward: the next unscale_ of the optimizer agrees across ranks."""
        self.param.grad = self._grad

    def clear(self) -> None:
        self.param.grad = None
