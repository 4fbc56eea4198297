"""Step 2: flat buckets.

Step 1 sent one message per parameter: a GPT has hundreds of tensors, many of them tiny (biases,
LayerNorm weights), and every message pays a fixed cost (a round trip, a kernel launch) however
small it is. Here the gradients are copied into a few flat buffers of up to `bucket_cap_mb`, one
all_reduce per buffer, and copied back. Same sums, fewer and larger messages.

Buckets are filled in reverse parameter order: roughly the order backward produces gradients
(the last layer first), which step 3 will need.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist import comm
from minidist.dist import get_world_size


def plan_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of `params` of at most cap_bytes each (a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]


class BucketedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 1.0):
        super().__init__()
        self.module = module
        self.world_size = get_world_size()
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                comm.broadcast(t, src=0)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = plan_buckets(list(reversed(trainable)), int(bucket_cap_mb * 2**20))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradients(self) -> None:
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # one message for the whole bucket
            flat.div_(self.world_size)
            comm.all_reduce(flat)
            offset = 0
            for p in bucket:  # and back into each parameter's .grad
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
