"""torch.amp.GradScaler on a ShardedDataParallel optimizer: every rank skips or steps together.

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

import torch
from torch import nn
from torch.utils import _pytree as pytree

from minidist import comm

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
