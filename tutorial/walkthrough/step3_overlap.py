"""Step 3: overlap communication with backward.

Backward produces gradients from the last layer to the first. In step 2 the first bucket (the
last layers) was ready long before backward ended, yet its all_reduce waited for the end. Here
a hook on each parameter (`register_post_accumulate_grad_hook`: runs once its .grad is complete)
counts the bucket's ready gradients; when the bucket is full it is copied into a flat buffer and
its all_reduce is *started* (async_op=True) while backward goes on computing earlier layers.
`finish_gradients()` then only waits for what is still in flight — the exposed communication —
and copies the sums back.

This is the core of DDP. minidist.DataParallel adds: the bucket order rebuilt from the order
gradients really arrived in the first backward, `no_sync()` for gradient accumulation,
parameters unused in a step, communication hooks (compression), buffers, and gradients that live
in the buckets (`gradient_as_bucket_view`): minidist/parallel/ddp.py and bucketed_backward.py.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist import comm
from minidist.dist import get_world_size
from tutorial.walkthrough.step2_buckets import plan_buckets


class OverlappedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 1.0):
        super().__init__()
        self.module = module
        self.world_size = get_world_size()
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                comm.broadcast(t, src=0)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = plan_buckets(list(reversed(trainable)), int(bucket_cap_mb * 2**20))
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.in_flight: list[tuple[int, torch.Tensor, comm.Handle]] = []
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """Called by autograd during backward, once p.grad is complete."""
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # the bucket is complete: send it now
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]).div_(self.world_size)
            self.in_flight.append((i, flat, comm.all_reduce(flat, async_op=True)))

    def finish_gradients(self) -> None:
        """Wait for the all_reduces still running (the part backward did not hide), copy back."""
        for i, flat, handle in self.in_flight:
            handle.wait()
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.in_flight.clear()
        self.ready = [0] * len(self.buckets)
