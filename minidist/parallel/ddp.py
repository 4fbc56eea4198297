"""minidist.DataParallel: PyTorch DDP's algorithm, from collectives and autograd hooks.

    model = DataParallel(net)            # checks all ranks agree, broadcasts rank 0's weights
    loss = loss_fn(model(x), y)
    loss.backward()                      # returns with every .grad averaged over ranks
    opt.step()

The algorithm, in the order it happens:
1. Construction: every rank must hold the same parameters (checked), then rank 0's
   parameters and buffers are broadcast in a few flat messages.
2. Gradients are assigned to buckets in reverse registration order (backward
   produces the last layer's gradients first). The first bucket is small so
   communication starts early.
3. A post-accumulate-grad hook per parameter copies its gradient into its bucket
   slice, divided by the world size. When a bucket's last gradient arrives, the
   bucket is all_reduced asynchronously — while backward keeps computing the
   earlier layers. Buckets launch strictly in index order, so the collectives
   line up across ranks even if gradients become ready in different orders.
4. The first hook of a backward queues a callback that the autograd engine runs
   when backward finishes: it waits for every bucket and writes the averaged
   gradients back to `.grad`. The user calls nothing extra.
5. After the first iteration the buckets are rebuilt in the order gradients
   actually became ready (rank 0's order, broadcast so every rank agrees).

On CUDA, ProcessGroupNCCL orders each collective after the work already queued on
the current stream, and `wait()` makes the current stream wait for the collective,
so no kernel reads a bucket before its reduction is done.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from minidist import comm
from minidist.buckets import MiB, Bucket, broadcast_coalesced, plan_buckets
from minidist.memory import measure, optimizer_tensors
from minidist.parallel.comm_hooks import BUILTIN_HOOKS, allreduce_hook


def check_same_parameters(module: nn.Module, group=None) -> None:
    """Raise on every rank, naming the first difference, unless all ranks hold the same parameters."""
    signature = [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                 for name, p in module.named_parameters()]
    everyone = comm.all_gather_object(signature, group=group)
    reference = everyone[0]
    for rank, sig in enumerate(everyone):
        if sig == reference:
            continue
        for k in range(max(len(sig), len(reference))):
            mine = sig[k] if k < len(sig) else None
            ref = reference[k] if k < len(reference) else None
            if mine != ref:
                raise RuntimeError(
                    f"DataParallel: the model differs across ranks at parameter #{k}: rank 0 has "
                    f"{_describe(ref)}, rank {rank} has {_describe(mine)} (rank 0 has {len(reference)} "
                    f"parameters, rank {rank} has {len(sig)}). Build the same model on every rank "
                    "before wrapping it.")


def _describe(entry) -> str:
    return "nothing" if entry is None else f"{entry[0]!r} shape {list(entry[1])} {entry[2]}"


class DataParallel(nn.Module):
    """Data-parallel wrapper: replicas stay identical because every step averages gradients.

    Args:
        module: the model; the same architecture on every rank.
        bucket_cap_mb: maximum size of a gradient bucket (MiB).
        first_bucket_mb: maximum size of the first bucket (MiB), small so the first
            all_reduce starts early in backward.
        overlap: reduce each bucket as soon as it is full (True), or all buckets after
            backward (False, for measuring what overlap buys).
        gradient_as_bucket_view: make `.grad` a view into the buckets (saves one copy
            of the gradients in memory and the copy into the bucket).
        find_unused_parameters: parameters that get no gradient in a backward are
            treated as ready with zero gradient. Without it such a parameter ends
            backward with an error that names it.
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm statistics) before
            each forward that records gradients.
        comm_hook: callable(bucket) -> object with wait(); or "allreduce", "fp16", "bf16".
        process_group: the group to reduce over (default: the world).
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 overlap: bool = True, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 comm_hook: Callable | str | None = None, process_group=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs a process group: call minidist.init_distributed() first")
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
                             f"first_bucket_mb={first_bucket_mb}")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.source_rank = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        self.overlap = overlap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        if isinstance(comm_hook, str):
            if comm_hook not in BUILTIN_HOOKS:
                raise ValueError(f"unknown comm_hook {comm_hook!r}; choose from {sorted(BUILTIN_HOOKS)} "
                                 "or pass a callable")
            comm_hook = BUILTIN_HOOKS[comm_hook]
        self.comm_hook = comm_hook or allreduce_hook
        self._cap_bytes = int(bucket_cap_mb * MiB)
        self._first_cap_bytes = int(first_bucket_mb * MiB)

        check_same_parameters(module, process_group)
        # named_parameters() yields a shared (tied) parameter once: it is reduced once.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())
        with torch.no_grad():
            broadcast_coalesced([p.data for p in module.parameters()] + [b.data for b in self._module_buffers],
                                src=self.source_rank, group=process_group)

        self._build_buckets(list(reversed(range(len(self._params)))))
        self._buckets_rebuilt = False  # after the first synced backward, rebuild in ready order
        self._sync_enabled = True
        self._in_backward = False
        self._ready = [False] * len(self._params)
        self._used = [False] * len(self._params)
        self._ready_order: list[int] = []
        self._next_bucket = 0
        self.last_wait_s = 0.0  # time the last backward spent waiting for communication
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    # ----------------------------------------------------------------------- buckets

    def _build_buckets(self, order: list[int]) -> None:
        plan = plan_buckets(self._params, order, self._cap_bytes, self._first_cap_bytes)
        old = getattr(self, "_buckets", None)
        self._buckets = [Bucket.allocate(k, ids, self._params, self.process_group, self.world_size)
                         for k, ids in enumerate(plan)]
        self._where = {}  # parameter index -> (bucket, position in bucket)
        for bucket in self._buckets:
            for k, i in enumerate(bucket.param_ids):
                self._where[i] = (bucket, k)
        if self.gradient_as_bucket_view:
            # Keep gradients that exist, but let them live in the (new) buckets from now on.
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    bucket, k = self._where[i]
                    if p.grad is not None:
                        bucket.views[k].copy_(p.grad)
                        p.grad = bucket.views[k]
        del old

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[i] for i in b.param_ids] for b in self._buckets]

    def _rebuild_buckets_in_ready_order(self) -> None:
        # Each rank saw its own ready order; rank 0's wins so all ranks build the same buckets.
        order = torch.tensor(self._ready_order, dtype=torch.int64)
        if self.world_size > 1:
            order = order.to(self._buckets[0].buffer.device) if self._buckets else order
            comm.broadcast(order, src=self.source_rank, group=self.process_group)
        order = order.tolist()
        if plan_buckets(self._params, order, self._cap_bytes, self._first_cap_bytes) != \
                [b.param_ids for b in self._buckets]:
            self._build_buckets(order)
        self._buckets_rebuilt = True

    # ----------------------------------------------------------------------- backward

    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self._sync_enabled:
                return  # no_sync: gradients just accumulate in .grad
            if not self._in_backward:
                self._start_backward()
            self._used[i] = True
            self._mark_ready(i)
        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._ready = [False] * len(self._params)
        self._used = [False] * len(self._params)
        self._ready_order = []
        self._next_bucket = 0
        for bucket in self._buckets:
            bucket.pending = len(bucket.param_ids)
            bucket.handle = None
        # Runs once, when the autograd engine has finished this whole backward pass.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _mark_ready(self, i: int) -> None:
        if self._ready[i]:
            raise RuntimeError(f"DataParallel: parameter {self._names[i]!r} produced a gradient twice in one "
                               "backward (reentrant backward or a second backward before the first finished)")
        self._ready[i] = True
        if not self._buckets_rebuilt:
            self._ready_order.append(i)
        bucket, k = self._where[i]
        view, grad = bucket.views[k], self._params[i].grad
        with torch.no_grad():
            if grad is None:
                view.zero_()
            elif self.gradient_as_bucket_view:
                if grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)          # e.g. after zero_grad(set_to_none=True)
                    self._params[i].grad = view
                view.mul_(1.0 / self.world_size)
            else:
                torch.mul(grad, 1.0 / self.world_size, out=view)
        bucket.pending -= 1
        if bucket.pending == 0 and self.overlap:
            self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        # Strictly in index order: bucket k+1 never goes before bucket k, on any rank.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            bucket.handle = self.comm_hook(bucket)
            self._next_bucket += 1

    def _finish_backward(self) -> None:
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing and not self.find_unused_parameters:
                for bucket in self._buckets[:self._next_bucket]:
                    bucket.handle.wait()  # leave no collective half done before raising
                names = ", ".join(self._names[i] for i in missing)
                raise RuntimeError(
                    f"DataParallel: these parameters received no gradient in this backward: {names}. "
                    "Either use them in forward's output, set requires_grad=False on them, or wrap with "
                    "DataParallel(..., find_unused_parameters=True).")
            for i in missing:
                # Locally unused: contribute zeros (or gradients accumulated under no_sync).
                self._used[i] = self._params[i].grad is not None
                self._mark_ready(i)
            self._launch_full_buckets()  # everything left (all buckets when overlap=False)
            used_anywhere = None
            if self.find_unused_parameters and self.world_size > 1:
                used = torch.tensor(self._used, dtype=torch.int32, device=self._buckets[0].buffer.device)
                comm.all_reduce(used, group=self.process_group)
                used_anywhere = used.bool().tolist()
            elif self.find_unused_parameters:
                used_anywhere = list(self._used)
            start = time.perf_counter()
            for bucket in self._buckets:
                bucket.handle.wait()
            self.last_wait_s = time.perf_counter() - start
            self._write_back(used_anywhere)
        finally:
            self._in_backward = False
        if not self._buckets_rebuilt:
            self._rebuild_buckets_in_ready_order()

    def _write_back(self, used_anywhere: list[bool] | None) -> None:
        with torch.no_grad():
            for bucket in self._buckets:
                for k, i in enumerate(bucket.param_ids):
                    if used_anywhere is not None and not used_anywhere[i]:
                        continue  # no rank produced a gradient: leave .grad as it was (None stays None)
                    p, view = self._params[i], bucket.views[k]
                    if self.gradient_as_bucket_view:
                        p.grad = view
                    elif p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)

    # ----------------------------------------------------------------------- API

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1 and self._module_buffers and torch.is_grad_enabled():
            with torch.no_grad():
                broadcast_coalesced([b.data for b in self._module_buffers], src=self.source_rank,
                                    group=self.process_group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next synced backward reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def full_state_dict(self) -> dict:
        """The wrapped module's state_dict (already complete on every rank: nothing is sharded)."""
        return self.module.state_dict()

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes on this rank, measured from live storages: parameters, gradients, comm buffers, optimizer."""
        return measure({
            "parameters": list(self.module.parameters()),
            "gradients": [p.grad for p in self._params if p.grad is not None],
            "comm_buffers": [b.buffer for b in self._buckets],
            "optimizer_state": optimizer_tensors(optimizer),
        })
