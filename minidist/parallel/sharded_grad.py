"""Gradients under ZeRO as torch's own code sees them: the `.grad` placeholder, and GradScaler's
found-inf agreed across ranks.

What a parameter's `.grad` holds under ShardedDataParallel: a placeholder for a gradient that
exists only sharded, which answers what clipping asks of it and refuses the rest.

After a synchronised backward, the averaged gradient exists only sharded: rank r holds slice
r in its master shards (`model.optimizer`'s parameters). No rank has the full averaged
gradient, so a `.grad` holding a plain tensor would be wrong: `None` makes
torch.nn.utils.clip_grad_norm_ return 0 and clip nothing, and the local, unreduced gradient
makes it clip by a norm no rank agrees on. Both train silently differently from native DDP.

So every trainable parameter's `.grad` becomes a `ShardedGradient`: a tensor of the right
shape, dtype and device with no storage, which knows where its parameter's slice of the
averaged gradient lives on this rank. It answers what gradient clipping and gradient-norm
logs ask, as DTensor does for fully_shard's gradients:

- `torch.linalg.vector_norm(p.grad, ord)` / `p.grad.norm()` (what
  `torch.nn.utils.clip_grad_norm_` computes per parameter): the norm of the whole averaged
  gradient. The first such call after a backward computes every parameter's norm with one
  all_reduce over the shard group (of each rank's part of each norm), later calls read them.
  A collective, so every rank must make the same calls, as clipping does.
- `p.grad.mul_(c)` (the clipping itself) and `p.grad.clamp_(lo, hi)`
  (`torch.nn.utils.clip_grad_value_`): applied to this rank's slice.

Every other use (reading values, a finiteness check) raises an error naming the supported way.
`p.grad is not None` stays true, as after a native backward, so code that checks before
reading reaches the answer or the error instead of silently skipping the parameter.

It gets out of the way by itself: a hook on each parameter clears it just before autograd
accumulates a new gradient (a second backward, or no_sync's local accumulation), and the
module's `zero_grad()` / `p.grad = None` clear it as they would any gradient
(`model.optimizer.zero_grad()` clears the master shards' gradients only).

torch.amp.GradScaler on a ShardedDataParallel optimizer: every rank skips or steps together.

    scaler.scale(loss).backward()
    scaler.step(model.optimizer)     # all ranks skip, or all step
    scaler.update()                  # one scale on every rank

The scaler decides from the gradients the optimizer holds, which under ZeRO are this rank's
shard. An overflow in one layer lands in one rank's shard only, so that rank alone would skip
the step and lower its scale: at stages 1-2 the others would wait for its post-step all_gather
until the timeout; at stage 3 the replicas would silently drift apart. Under native DDP every
rank holds the whole averaged gradient, so every rank sees the inf.

The agreement happens where the scaler looks. `scaler.unscale_(optimizer)` (also run inside
`scaler.step`) calls `torch._amp_foreach_non_finite_check_and_unscale_` on the optimizer's
gradients, once per device and dtype, all writing one found-inf flag per device. One extra
parameter in the optimizer's last group, with no elements, has as its gradient a tensor
subclass whose dispatch receives that call: the flag then holds every other gradient's check,
and it is all_reduced (MAX) over the data-parallel ranks — what DTensor does for fully_shard's
gradients. Its dtype is one no shard uses, so its group is the device's last. `step()` then
reads the same flag on every rank, and `update()` changes one scale everywhere.

The parameter steps nothing: a step pre-hook clears its gradient before the optimizer looks at
it, and the wrapper places it again after each synchronised backward.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from minidist import comm


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
