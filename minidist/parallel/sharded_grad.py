"""What a parameter's `.grad` holds under ShardedDataParallel: a placeholder that refuses to be read.

After a synchronised backward, the averaged gradient exists only sharded: rank r
holds slice r in its master shards (`model.optimizer`'s parameters). No rank has
the full averaged gradient, so a `.grad` that held anything would be wrong:
`None` makes torch.nn.utils.clip_grad_norm_ return 0 and clip nothing, and the
local, unreduced gradient makes it clip by a norm no rank agrees on. Both train
silently differently from native DDP.

So every trainable parameter's `.grad` becomes a `ShardedGradient`: a tensor of
the right shape, dtype and device with no storage, whose every operation raises
an error naming the supported way (`model.clip_grad_norm_`, which computes the
global norm over the shards). `p.grad is not None` stays true, as after a native
backward, so code that checks before reading reaches the error instead of
silently skipping the parameter.

It gets out of the way by itself: a hook on each parameter clears it just before
autograd accumulates a new gradient (a second backward, or no_sync's local
accumulation), and the module's `zero_grad()` / `p.grad = None` clear it as they would
any gradient (`model.optimizer.zero_grad()` clears the master shards' gradients only).
"""

from __future__ import annotations

import torch
from torch import nn


class ShardedGradient(torch.Tensor):
    """A storage-less stand-in for a gradient that lives sharded across ranks; any use raises."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, stage: int):
        out = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device,
                                                  requires_grad=False)
        out.param_name, out.stage = name, stage
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"ShardedGradient({self.param_name!r}: held sharded by ShardedDataParallel(stage={self.stage}))"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        me = next(a for a in args if isinstance(a, ShardedGradient))
        if func in (torch.ops.aten.zero_.default, torch.ops.aten.detach_.default):
            return me  # zero_grad(set_to_none=False): nothing to zero; cleared at the next backward
        if func is torch.ops.aten.detach.default:
            return me
        raise RuntimeError(
            f"{me.param_name}.grad is not readable under ShardedDataParallel(stage={me.stage}): after "
            "backward the averaged gradient exists only sharded across the ranks (model.optimizer's "
            "parameters), so reading .grad (torch.nn.utils.clip_grad_norm_, a gradient-norm log, a "
            "finiteness check) would see nothing or a local value, unlike native DDP. Use "
            "model.clip_grad_norm_(max_norm), which clips by the global norm and returns it "
            "(max_norm=float('inf') only measures it), or read model.optimizer's parameters' .grad "
            f"(this rank's shard). [{func}]")


class GradientPlaceholders:
    """One ShardedGradient per parameter, created once; `place()` after each synchronised backward."""

    def __init__(self, names: list[str], params: list[nn.Parameter], stage: int):
        self._params = params
        self._placeholders = [ShardedGradient(p, n, stage) for n, p in zip(names, params)]
        for p in params:
            p.register_hook(self._make_clear(p))  # runs before autograd accumulates into p.grad

    def place(self) -> None:
        for p, placeholder in zip(self._params, self._placeholders):
            p.grad = placeholder

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
