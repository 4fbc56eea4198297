"""minidist.DataParallel: PyTorch DDP's algorithm, from collectives and autograd hooks.

    model = DataParallel(net)            # checks all ranks agree, broadcasts rank 0's weights
    loss_fn(model(x), y).backward()      # returns with every .grad averaged over ranks
    opt.step()

A post-accumulate-grad hook per parameter marks it ready; a complete bucket (buckets.py) is
all_reduced asynchronously while backward goes on. The walk of one gradient: docs/internals.md,
"parallel/ddp.py".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from minidist import comm
from minidist.comm.wire import QUANT_BLOCK
from minidist.measure import measure, optimizer_tensors
from minidist.parallel.buckets import (Bucket, BucketedBackward, GradientSyncSwitch, MiB, broadcast_coalesced,
                                       plan_buckets)
from minidist.parallel.comm_hooks import NATIVE_INTERNALS, GradBucket, NativeHook, check_native_hook, resolve_hook
from minidist.parallel.compat import (BufferSync, check_devices, check_materialised, check_not_wrapped, check_trainable,
                                      mark_wrapped, process_group_of, refuse_unknown)
from minidist.parallel.join import DataParallelJoin


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


def replicate_from_source(module: nn.Module, src: int, group=None) -> None:
    """Make every rank's module a copy of rank `src`'s: check that all ranks hold the same
    parameters (raising on every rank otherwise), then broadcast parameters and buffers."""
    check_same_parameters(module, group)
    with torch.no_grad():
        broadcast_coalesced([p.data for p in module.parameters() if not p.is_meta] + [b.data for b in module.buffers()],
                            src=src, group=group)


def _describe(entry) -> str:
    return "nothing" if entry is None else f"{entry[0]!r} shape {list(entry[1])} {entry[2]}"


class DataParallel(DataParallelJoin, GradientSyncSwitch, nn.Module):
    """Data-parallel wrapper: replicas stay identical because every step averages gradients.

    Args:
        module: the model; the same architecture on every rank.
        bucket_cap_mb: maximum size of a gradient bucket (MiB).
        first_bucket_mb: maximum size of the first and the last bucket (MiB): small so
            the first all_reduce starts early in backward and little is left to reduce
            (exposed) after backward ends.
        last_bucket_mb: the last bucket's own maximum, when it should differ (None: as
            the first).
        bucket_closing: "at_most" (a bucket never holds more than its cap) or "reach"
            (native DDP's layout: a bucket closes once it reaches its cap, so it may exceed
            it by one tensor, and there is no separate small last bucket: fewer, fuller
            buckets, the same ones native DDP makes).
        overlap: reduce each bucket as soon as it is full (True), or all buckets after
            backward (False, for measuring what overlap buys).
        gradient_as_bucket_view: make `.grad` a view into the buckets (saves one copy
            of the gradients in memory and the copy into the bucket).
        find_unused_parameters: parameters that get no gradient in a backward are
            treated as ready with zero gradient (one small extra all_reduce per step
            finds those no rank used; their .grad is left alone). Without it such a
            parameter ends backward with an error that names it — on every rank when
            the model skips it everywhere; if only some ranks skip it (data-dependent
            control flow), the others wait in their last all_reduce until the process
            group's timeout (init_distributed's timeout_s) and then fail.
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm statistics) before a
            forward whose previous forward synchronised gradients (native DDP's rule: once
            per optimizer step under no_sync accumulation; see compat.py).
        comm_hook: callable(bucket) -> object with wait(); or "allreduce", "fp16", "bf16",
            "powersgd" (rank 4; or pass minidist.parallel.PowerSGD(rank=...)). "bf16" and "fp16"
            are native DDP's compression hooks: the all_reduce runs on the cast copy, so every partial
            sum is rounded too.
        grad_wire: what the gradients travel as, summed in full precision (None: their own dtype;
            "bf16", "fp16", "int8": block-scaled, `quant_block` elements per fp32 scale). Each rank's
            gradient / N is rounded to it once, each chunk's sum once more before it is gathered
            (minidist.comm.wire); not with a comm_hook.
        process_group: the group to reduce over (default: the world); or device_mesh, a 1-D
            torch DeviceMesh standing for its group.
        collectives: how the built-in hooks' all_reduce runs (minidist.comm.choose_algorithm):
            "auto" (shared memory where the group's ranks share a host), "shm", "backend", "ring".

    Native DDP's other arguments, as GPU scripts pass them (compat.py): device_ids and
    output_device, when they name the module's own device; dim, static_graph and
    check_reduction, which change nothing here; init_sync=False, which skips the initial
    broadcast (the ranks already agree). The rest are refused, naming why.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0, *,
                 bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 last_bucket_mb: float | None = None, bucket_closing: str = "at_most",
                 overlap: bool = True, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 comm_hook: Callable | str | None = None, process_group=None, init_sync: bool = True,
                 static_graph: bool = False, check_reduction: bool = False, device_mesh=None, grad_wire=None,
                 quant_block: int = QUANT_BLOCK, collectives: str = "auto", **native_only):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs a process group: call minidist.init_distributed() first")
        refuse_unknown("DataParallel", native_only)
        check_devices(module, device_ids, output_device)
        check_materialised(module, "DataParallel")
        check_not_wrapped(module, "DataParallel")
        process_group = process_group_of(device_mesh, process_group, "DataParallel")
        if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb}, "
                             f"first_bucket_mb={first_bucket_mb}")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.source_rank = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.comm_hook = resolve_hook(comm_hook, grad_wire, quant_block)
        self.collectives = collectives
        self._cap_bytes = int(bucket_cap_mb * MiB)
        self._first_cap_bytes = int(first_bucket_mb * MiB)
        self._last_cap_bytes = None if last_bucket_mb is None else int(last_bucket_mb * MiB)
        self._closing = bucket_closing

        self._hook_given = comm_hook is not None or grad_wire is not None
        self._overlap = overlap
        check_trainable(module)
        # A bad choice fails here; "auto" and "shm" set up the group's shared memory now.
        comm.choose_algorithm("all_reduce", process_group, collectives, device=next(module.parameters()).device)
        if init_sync:
            replicate_from_source(module, self.source_rank, process_group)
        self._attach(find_unused_parameters)
        mark_wrapped(module, "DataParallel")

    def _attach(self, find_unused_parameters: bool) -> None:
        """Buckets, gradient hooks and the buffer broadcast: what a wrapper holds beyond its settings
        (built again when a pickled wrapper is loaded)."""
        # named_parameters() yields a shared (tied) parameter once: it is reduced once.
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffer_sync = BufferSync(self.module, self.broadcast_buffers, self.world_size, self.source_rank,
                                       self.process_group)
        # Record the order gradients arrive in during the first synced backward, then rebuild.
        self._backward = BucketedBackward(
            self, self._names, self._params, self._allocate_buckets(list(reversed(range(len(self._params))))),
            world_size=self.world_size, process_group=self.process_group, overlap=self._overlap,
            find_unused_parameters=find_unused_parameters, record_ready_order=True, fill_when_complete=True)
        self._adopt_gradients()

    # Pickling (torch.save(model)), as native DDP: what lives only in this process (the process group,
    # gradient hooks, buckets with collectives in flight) is left out, and built again on loading, on the
    # default process group.
    _PROCESS_LOCAL = ("process_group", "_buffer_sync", "_backward", "_join")

    def __getstate__(self) -> dict:
        if self.process_group not in (None, dist.group.WORLD):
            raise RuntimeError("DataParallel: a wrapper pickles (torch.save(model)) only on the default process "
                               "group, which it is loaded onto; save model.module or model.state_dict() instead")
        state = {k: v for k, v in self.__dict__.items() if k not in self._PROCESS_LOCAL}
        state["_find_unused"] = self.find_unused_parameters
        return state

    def __setstate__(self, state: dict) -> None:
        find_unused = state.pop("_find_unused")
        super().__setstate__(state)
        self.process_group, self.world_size, self.source_rank = None, dist.get_world_size(), 0
        self._attach(find_unused)

    # ----------------------------------------------------------------------- buckets

    def _plan(self, order: list[int]) -> list[list[int]]:
        return plan_buckets(self._params, order, self._cap_bytes, self._first_cap_bytes, self._last_cap_bytes,
                            self._closing)

    def _allocate_buckets(self, order: list[int], shared: bool = False) -> list[Bucket]:
        return [Bucket.allocate(k, ids, self._params, self.process_group, self.world_size, self.collectives, shared)
                for k, ids in enumerate(self._plan(order))]

    def _adopt_gradients(self) -> None:
        """With gradient_as_bucket_view: keep gradients that exist, but let them live in the
        (new) buckets from now on."""
        if not self.gradient_as_bucket_view:
            return
        with torch.no_grad():
            for i, p in enumerate(self._params):
                bucket, k = self._backward.where[i]
                if p.grad is not None:
                    bucket.views[k].copy_(p.grad)
                    p.grad = bucket.views[k]

    @property
    def _buckets(self) -> list[Bucket]:
        return self._backward.buckets

    @property
    def find_unused_parameters(self) -> bool:
        """As given to the constructor (held by the backward, which acts on it)."""
        return self._backward.find_unused_parameters

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[i] for i in b.param_ids] for b in self._buckets]

    @property
    def last_wait_s(self) -> float:
        """How long the last backward waited for communication after its last gradient (exposed time)."""
        return self._backward.last_wait_s

    def _on_first_backward_done(self, ready_order: list[int]) -> None:
        # Each rank saw its own ready order; rank 0's wins so all ranks build the same buckets.
        order = torch.tensor(ready_order, dtype=torch.int64)
        if self.world_size > 1:
            order = order.to(self._buckets[0].buffer.device) if self._buckets else order
            comm.broadcast(order, src=self.source_rank, group=self.process_group)
        order = order.tolist()
        # The buckets go into shared memory here, at a collective (not when a pickled wrapper is
        # loaded, maybe on one rank only), where shm will reduce them.
        shared = self.world_size > 1 and comm.choose_algorithm(
            "all_reduce", self.process_group, self.collectives, device=self._params[0].device) == "shm"
        if shared or self._plan(order) != [b.param_ids for b in self._buckets]:
            self._backward.set_buckets(self._allocate_buckets(order, shared))
            self._adopt_gradients()

    # ----------------------------------------------------------------------- backward (a BucketReducer)

    def _before_backward(self) -> None:
        pass  # nothing to prepare: every bucket's buffer lives as long as the model

    # Fill a bucket once all its gradients are in. Copy and scale by 1/n (as native DDP, which
    # keeps results bitwise comparable with it) either per parameter in one pass (torch.mul with
    # out=: one Python-dispatched op each, a few microseconds), or for the whole bucket in two
    # vectorised ops (_foreach_copy_, then mul_ of the buffer: a second pass over the bytes).
    # A second pass over B bytes costs about B / 10 GB/s, a dispatch ~5 us: so per parameter
    # when they average over 64 KiB (few large tensors), vectorised when they are many and small.
    _PER_PARAMETER_FROM_BYTES = 64 * 1024

    def _fill_bucket(self, bucket: Bucket) -> None:
        scale = 1.0 if isinstance(self.comm_hook, NativeHook) else 1.0 / self.world_size  # native hooks divide
        one_pass = bucket.buffer.numel() * bucket.buffer.element_size() >= \
            self._PER_PARAMETER_FROM_BYTES * len(bucket.param_ids)
        targets, sources = [], []
        for k, i in enumerate(bucket.param_ids):
            view, grad = bucket.views[k], self._params[i].grad
            if grad is None:
                view.zero_()
            elif self.gradient_as_bucket_view and grad.data_ptr() == view.data_ptr():
                if one_pass and scale != 1.0:
                    view.mul_(scale)  # backward accumulated straight into the bucket
            elif one_pass:
                torch.mul(grad, scale, out=view)
            else:
                targets.append(view)
                sources.append(grad)
            if grad is not None and self.gradient_as_bucket_view and grad.data_ptr() != view.data_ptr():
                self._params[i].grad = view  # e.g. after zero_grad(set_to_none=True)
        if not one_pass:
            if targets:
                torch._foreach_copy_(targets, sources)
            if scale != 1.0:
                bucket.buffer.mul_(scale)

    def _launch(self, bucket: Bucket):
        if isinstance(self.comm_hook, NativeHook):  # native's contract: a GradBucket in, a Future out
            return self.comm_hook(GradBucket(bucket, self._params, len(self._buckets)))
        return self.comm_hook(bucket)

    def register_comm_hook(self, state, hook: Callable) -> None:
        """Native DDP's: `hook(state, bucket)` reduces each bucket and returns a torch.futures.Future
        (torch's own hooks: allreduce_hook, fp16/bf16_compress_hook, powerSGD_hook, or yours, `.then()`
        chains too). As in native DDP, `bucket.buffer()` holds this rank's gradients undivided, and the
        tensor the Future ends with is what the bucket's gradients become. Once, before the first
        backward, and not beside comm_hook= or grad_wire= (which take our hooks, over buckets of grad / N)."""
        check_native_hook(hook)
        if self._hook_given:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self._backward.synced_backwards:
            raise RuntimeError("DataParallel: register_comm_hook after a backward has reduced with another hook: "
                               "register it right after wrapping, before training (as native DDP requires)")
        self._hook_given = True
        self.comm_hook = NativeHook(state, hook)

    def _set_static_graph(self) -> None:
        """Native DDP's late `static_graph=True`, which changes nothing here (static_graph is accepted);
        refused, as native, once training started."""
        if self._backward.synced_backwards:
            raise RuntimeError("DataParallel: _set_static_graph() should be called before training loop starts")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in NATIVE_INTERNALS:
                raise AttributeError(f"DataParallel has no {name} ({NATIVE_INTERNALS[name]})") from None
            raise

    def _after_backward(self, used_anywhere: list[bool] | None) -> None:
        targets, sources = [], []
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
                    targets.append(p.grad)
                    sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)  # one op for every gradient

    # ----------------------------------------------------------------------- API

    def forward(self, *args, **kwargs):
        src = self._join_forward()  # under Join: tell the ranks that left what this forward does
        self._buffer_sync.before_forward(self._sync_enabled, src=src)
        return self.module(*args, **kwargs)

    def full_state_dict(self) -> dict:
        """The wrapped module's state_dict (already complete on every rank: nothing is sharded)."""
        return self.module.state_dict()

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = False) -> dict:
        """`optimizer.state_dict()`: complete on every rank, nothing is sharded (the call reads as
        ShardedDataParallel's, so a script works with either wrapper). With rank0_only, other
        ranks get {}."""
        return {} if rank0_only and dist.get_rank(self.process_group) != 0 else optimizer.state_dict()

    @staticmethod
    def load_full_optim_state_dict(state: dict, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.load_state_dict(state)` (as ShardedDataParallel's)."""
        optimizer.load_state_dict(state)

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes on this rank from live storages (beyond them: docs/trainer.md, "Memory"): parameters, gradients,
        comm buffers, optimizer."""
        return measure({
            "parameters": list(self.module.parameters()),
            "gradients": [p.grad for p in self._params if p.grad is not None],
            "comm_buffers": [b.buffer for b in self._buckets],
            "optimizer_state": optimizer_tensors(optimizer),
        })
