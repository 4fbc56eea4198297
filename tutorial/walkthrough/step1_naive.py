"""Step 1: naive data parallelism.

Every rank holds the whole model and sees its own slice of the batch. Two rules make the ranks
train as one model on the whole batch:

1. start equal: rank 0's parameters are broadcast to every rank;
2. step equal: after backward, each gradient is summed over the ranks and divided by their
   number (all_reduce), so every rank applies the same averaged gradient.

One all_reduce per parameter, and only once backward has finished: correct, but many small
messages (each pays a fixed latency) and nothing overlaps. Steps 2 and 3 fix those two things.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist import comm
from minidist.dist import get_world_size


class NaiveDataParallel(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = get_world_size()
        with torch.no_grad():  # rule 1: start equal
            for t in [*module.parameters(), *module.buffers()]:
                comm.broadcast(t, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradients(self) -> None:
        """Rule 2: after backward, every gradient becomes the average over the ranks."""
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.div_(self.world_size)  # as native DDP: divide first, then sum
                comm.all_reduce(p.grad)
