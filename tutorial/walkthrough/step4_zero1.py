"""Step 4: ZeRO stage 1 — shard the optimizer state.

In steps 1-3 every rank runs the same optimizer on the same averaged gradient: N identical
copies of Adam's two moments (8 bytes per parameter in fp32, twice the weights). ZeRO-1 keeps
one copy in total, spread over the ranks:

1. reduce_scatter instead of all_reduce: rank r receives the averaged gradient of its slice r
   of the (flattened) parameters only — half the bytes of an all_reduce;
2. each rank's optimizer updates its slice alone (its state is 1/N of the whole);
3. all_gather: every rank collects the updated slices, so all hold the full new parameters.

reduce_scatter + all_gather move exactly what one all_reduce moves (an all_reduce *is* a
reduce_scatter followed by an all_gather), so ZeRO-1 saves memory at no extra communication.
Here everything is one flat buffer padded to a multiple of N, and communication runs after
backward (as in step 2). minidist.ShardedDataParallel adds overlap, buckets, stage 2 (gradients
sharded too) and stage 3 (parameters too, gathered per layer when needed), hybrid meshes and
sharded checkpoints: minidist/parallel/zero.py and zero3.py.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from minidist import comm
from minidist.dist import get_rank, get_world_size


class Zero1DataParallel(nn.Module):
    def __init__(self, module: nn.Module, optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        super().__init__()
        self.module = module
        self.world_size, self.rank = get_world_size(), get_rank()
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                comm.broadcast(t, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        self.shard = -(-total // self.world_size)  # elements per rank, the last one padded
        self.flat = torch.zeros(self.shard * self.world_size, dtype=self.params[0].dtype)
        self._copy_params_to_flat()
        # This rank's slice, as a parameter of its own: the only thing its optimizer sees.
        mine = slice(self.rank * self.shard, (self.rank + 1) * self.shard)
        self.master = nn.Parameter(self.flat[mine].clone())
        self.optimizer = optimizer_factory([self.master])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _copy_params_to_flat(self) -> None:
        offset = 0
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()

    def finish_gradients(self) -> None:
        """1. reduce_scatter: this rank's slice of the averaged gradient, into master.grad."""
        grads = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            grads[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        grads.div_(self.world_size)
        self.master.grad = torch.empty(self.shard, dtype=grads.dtype)
        comm.reduce_scatter_tensor(self.master.grad, grads)

    def step(self) -> None:
        """2. update this rank's slice; 3. all_gather the slices into every rank's parameters."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        comm.all_gather_into(self.flat, self.master.detach())
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
                p.grad = None
