"""Buckets, the core of DataParallel and ZeRO 1-2: gradients packed, in the order backward makes
them, into flat buffers of bounded size, each reduced as soon as it is full, strictly in bucket
order on every rank.

    hook per parameter --> its gradient goes into its bucket slot (fill_slot)
    bucket complete    --> launched, in bucket order (launch -> handle)
    backward finished  --> engine callback: launch what is left, wait, hand over (after_backward)

The model says *what* happens to a bucket (BucketReducer); BucketedBackward decides *when*
(why buckets, and why in order: docs/internals.md, "parallel/buckets.py").
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from minidist import comm
from minidist.comm import shm
from minidist.parallel.sharded_grad import local_grad


MiB = 1 << 20


# --------------------------------------------------------------------------- flat buffers


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D copy of `tensors` (all of one dtype and device)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors`, in order."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def group_by_dtype_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split into lists of one dtype and device each (a flat buffer holds one of each), order kept."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, group=None,
                        chunk_bytes: int = 256 * MiB) -> None:
    """Broadcast `tensors` from `src` in a few flat messages instead of one call per tensor."""
    for same_kind in group_by_dtype_device(tensors):
        for chunk in split_by_size(same_kind, chunk_bytes):
            flat = flatten(chunk)
            comm.broadcast(flat, src=src, group=group)
            unflatten_into(flat, chunk)


class FlatBuffers:
    """Module buffers (e.g. BatchNorm statistics) re-pointed into one flat tensor per dtype/device.

    Broadcasting them before every forward is then one message per dtype and no copies:
    layers update their buffers in place, i.e. straight inside the flat tensor. A buffer
    replaced by assignment is noticed and everything is laid out again.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._layout()

    def _layout(self) -> None:
        self.buffers = [b for b in self.module.buffers()]
        self.flats = []
        with torch.no_grad():
            for group in group_by_dtype_device(self.buffers):
                flat = flatten(group)
                offset = 0
                for b in group:
                    b.data = flat[offset:offset + b.numel()].view_as(b)
                    offset += b.numel()
                self.flats.append(flat)
        self._ptrs = [b.data_ptr() for b in self.buffers]

    def broadcast(self, src: int, group=None) -> None:
        current = list(self.module.buffers())
        if len(current) != len(self.buffers) or any(
                b is not old or b.data_ptr() != ptr for b, old, ptr in zip(current, self.buffers, self._ptrs)):
            self._layout()
        for flat in self.flats:
            comm.broadcast(flat, src=src, group=group)


class BufferPool:
    """Scratch flat buffers, taken and given back, reused across the buckets of one backward.

    ZeRO-2/3 fill each bucket's (unit's) full-size gradients into one before its reduce_scatter.
    Every buffer is allocated with at least `capacity` elements and serves any request up to its
    size (as a view of its start), so a backward holds only as many as are in flight at once
    (max_inflight); `clear()` after it frees them, so between backwards a rank holds its gradient
    shard alone, as the ZeRO paper counts (a buffer the size of the whole model, where one bucket
    holds it, would outweigh the shard it feeds).
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._free: list[torch.Tensor] = []
        self._in_use: dict[int, torch.Tensor] = {}  # storage address -> whole buffer

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D buffer of `numel` elements: the caller writes what it relies on."""
        for k, buf in enumerate(self._free):
            if buf.dtype == dtype and buf.device == device and buf.numel() >= numel:
                self._free.pop(k)
                break
        else:
            buf = torch.empty(max(numel, self.capacity), dtype=dtype, device=device)
        self._in_use[buf.untyped_storage().data_ptr()] = buf
        return buf[:numel]

    def put(self, t: torch.Tensor) -> None:
        self._free.append(self._in_use.pop(t.untyped_storage().data_ptr()))

    def clear(self) -> None:
        """Free the buffers given back (those in use stay theirs)."""
        self._free = []

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, in use or free (for memory reports)."""
        return list(self._in_use.values()) + self._free


def split_by_size(tensors: list[torch.Tensor], cap_bytes: int, first_cap_bytes: int | None = None,
                  closing: str = "at_most"):
    """Consecutive runs of `tensors`, each up to cap_bytes (the first up to first_cap_bytes).

    closing="at_most": a run never holds more than its cap (a tensor larger than the cap gets
    a run of its own). closing="reach": native DDP's rule, a run closes as soon as it reaches
    its cap, so it may exceed it by its last tensor (fewer, fuller runs).
    """
    if closing not in ("at_most", "reach"):
        raise ValueError(f"closing={closing!r}: choose 'at_most' or 'reach'")
    runs, current, size = [], [], 0
    cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if closing == "at_most" and current and size + nbytes > cap:
            runs.append(current)
            current, size, cap = [], 0, cap_bytes
        current.append(t)
        size += nbytes
        if closing == "reach" and size >= cap:
            runs.append(current)
            current, size, cap = [], 0, cap_bytes
    if current:
        runs.append(current)
    return runs


# --------------------------------------------------------------------------- bucket plans


def plan_buckets(params: list[torch.Tensor], order: list[int], cap_bytes: int,
                 first_cap_bytes: int, last_cap_bytes: int | None = None,
                 closing: str = "at_most") -> list[list[int]]:
    """Group parameter indices, taken in `order`, into buckets of one dtype/device.

    Every bucket holds at most cap_bytes (a larger tensor gets a bucket of its own).
    Two ends are kept small, at most first_cap_bytes:
    - the first bucket, so the first all_reduce starts early in backward;
    - the last bucket, because nothing is left to overlap it with: it holds the
      gradients that arrive last, and backward waits for all of it to be reduced
      (at most last_cap_bytes when given).
    closing="reach" is native DDP's layout instead: buckets close when they reach their cap
    (see split_by_size), and there is no separate small last bucket.
    """
    small = min(first_cap_bytes, cap_bytes)
    small_last = small if last_cap_bytes is None else min(last_cap_bytes, cap_bytes)
    by_kind: dict[tuple, list[int]] = {}
    for i in order:
        by_kind.setdefault((params[i].dtype, params[i].device), []).append(i)
    kinds = list(by_kind.values())
    buckets: list[list[int]] = []
    for n, indices in enumerate(kinds):
        tail: list[int] = []
        if n == len(kinds) - 1 and len(indices) > 1 and closing == "at_most":
            # Fill the last bucket backwards from the last-ready gradient, up to the small cap.
            rest = split_by_size([params[i] for i in reversed(indices)], small_last)[0]
            if len(rest) < len(indices):
                tail = indices[len(indices) - len(rest):]
                indices = indices[:len(indices) - len(rest)]
        sized = [params[i] for i in indices]
        position = {id(p): i for p, i in zip(sized, indices)}
        runs = split_by_size(sized, cap_bytes, small if not buckets else cap_bytes, closing)
        buckets.extend([position[id(p)] for p in run] for run in runs)
        if tail:
            buckets.append(tail)
    return buckets


@dataclass
class Bucket:
    """A flat buffer holding several parameters' gradients, and the bookkeeping of one backward.

    `buffer` is what the comm hook reduces; `views[k]` is parameter `param_ids[k]`'s slice of it.
    """

    index: int
    param_ids: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    process_group: object = None
    world_size: int = 1
    algorithm: str = "backend"           # how the built-in hooks' collective runs (comm.choose_algorithm)
    pending: int = 0                     # parameters not yet ready in this backward
    handle: object = field(default=None, repr=False)

    @classmethod
    def allocate(cls, index: int, param_ids: list[int], params: list[torch.Tensor],
                 process_group, world_size: int, algorithm: str = "backend", shared: bool = False) -> "Bucket":
        """The bucket's buffer, zeroed; `shared` (a collective, where `algorithm` runs as "shm"):
        in memory the other ranks read (shm.shared_zeros: no copy through the slots)."""
        first = params[param_ids[0]]
        total = sum(params[i].numel() for i in param_ids)
        buffer = shm.shared_zeros(total, first.dtype, process_group) if shared else \
            torch.zeros(total, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for i in param_ids:
            p = params[i]
            views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return cls(index, list(param_ids), buffer, views, process_group, world_size, algorithm, pending=len(param_ids))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class GradientSyncSwitch:
    """Whether a backward reduces gradients, in the three spellings scripts use, one switch:

        with model.no_sync(): ...                          # native DDP's context
        model.require_backward_grad_sync = (micro == last) # native DDP's attribute (nanoGPT's idiom)
        model.set_requires_gradient_sync(False)            # FSDP2's call

    While off, gradient hooks leave .grad to accumulate locally; the next backward with it on
    reduces the sum."""

    _sync_enabled: bool = True

    @property
    def require_backward_grad_sync(self) -> bool:
        """Native DDP's switch (what its no_sync() sets): False, and backward accumulates locally."""
        return self._sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync_enabled = bool(value)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's spelling of the same switch (`recurse` is accepted: one wrapper holds every unit)."""
        self._sync_enabled = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next synced backward reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous


class BucketReducer(Protocol):
    """What the model that owns a BucketedBackward says about its buckets."""

    _sync_enabled: bool  # False under no_sync(): the hooks do nothing

    def _fill_slot(self, i: int, bucket: Bucket, k: int) -> None:
        """Put parameter i's gradient (None: it had none) into slot k of `bucket`."""

    def _fill_bucket(self, bucket: Bucket) -> None:
        """Fill every slot of a complete `bucket` (only with fill_when_complete)."""

    def _launch(self, bucket: Bucket):
        """Start reducing a complete bucket; return an object with wait()."""

    def _before_backward(self) -> None:
        """The first gradient of a synced backward has just arrived."""

    def _after_backward(self, used_anywhere: list[bool] | None) -> None:
        """Every bucket is reduced: hand the results to .grad / the optimizer's shards."""

    def _on_first_backward_done(self, ready_order: list[int]) -> None:
        """Once, after the first synced backward, with the order gradients arrived in (only
        with record_ready_order: DataParallel rebuilds its buckets in that order)."""


class BucketedBackward:
    """Registers one post-accumulate-grad hook per parameter and runs the backward's schedule.

    Args:
        reducer: the model (a BucketReducer): what filling, launching and finishing a bucket mean.
        names, params: the trainable parameters, in the model's order (bucket ids index them).
        buckets: the buckets, in launch order (`set_buckets` replaces them between backwards).
        world_size, process_group: the group `find_unused_parameters`' flags are reduced over.
        overlap: launch each bucket as soon as it is complete (True) or all after backward.
        find_unused_parameters: a parameter without gradient counts as ready (zeros); one small
            all_reduce finds those no rank used (unless flag_unused_anywhere is False: the
            reducer then checks `used` itself). False: such a parameter raises, named.
        record_ready_order: note the order gradients arrive in during the first synced
            backward, and hand it to the reducer's `_on_first_backward_done`.
        fill_when_complete: fill a bucket in one call of `_fill_bucket` when its last gradient
            has arrived (a few vectorised ops), instead of one `_fill_slot` per gradient.
    """

    def __init__(self, reducer: BucketReducer, names: list[str], params: list[torch.Tensor],
                 buckets: list[Bucket], *, world_size: int, process_group, overlap: bool,
                 find_unused_parameters: bool, record_ready_order: bool = False,
                 fill_when_complete: bool = False, flag_unused_anywhere: bool = True):
        self.reducer = reducer
        self.names = names
        self.params = params
        self.world_size = world_size
        self.process_group = process_group
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.fill_when_complete = fill_when_complete
        self.flag_unused_anywhere = flag_unused_anywhere
        self._record_ready_order = record_ready_order
        self._in_backward = False
        self.used = [False] * len(params)   # which parameters got a gradient in this backward, here
        self._ready = [False] * len(params)
        self._ready_order: list[int] = []
        self.launched = 0                   # buckets launched so far in this backward (a prefix)
        self.last_wait_s = 0.0              # how long the last backward waited for communication at its end
        self.synced_backwards = 0           # backwards that reduced gradients so far
        self.set_buckets(buckets)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def set_buckets(self, buckets: list[Bucket]) -> None:
        """Use `buckets` from the next backward on (between backwards only)."""
        self.buckets = buckets
        self.where: dict[int, tuple[Bucket, int]] = {}  # parameter index -> (bucket, slot)
        for bucket in buckets:
            for k, i in enumerate(bucket.param_ids):
                self.where[i] = (bucket, k)

    def launched_buckets(self) -> list[Bucket]:
        """The buckets whose collective this backward has started, in launch order."""
        return self.buckets[:self.launched]

    # -- the schedule ---------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self.reducer._sync_enabled:
                return  # no_sync: gradients just accumulate in .grad
            if not self._in_backward:
                self._start_backward()
            self.used[i] = True
            self._mark_ready(i)
        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._ready = [False] * len(self.params)
        self.used = [False] * len(self.params)
        self._ready_order = []
        self.launched = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.param_ids)
            bucket.handle = None
        self.reducer._before_backward()
        # Runs once, when the autograd engine has finished this whole backward pass.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _mark_ready(self, i: int) -> None:
        if self._ready[i]:
            raise RuntimeError(f"{type(self.reducer).__name__}: parameter {self.names[i]!r} produced a gradient "
                               "twice in one backward (reentrant backward, or a second backward before the first "
                               "ended)")
        self._ready[i] = True
        if self._record_ready_order:
            self._ready_order.append(i)
        bucket, k = self.where[i]
        if not self.fill_when_complete:
            with torch.no_grad():
                self.reducer._fill_slot(i, bucket, k)
        bucket.pending -= 1
        if bucket.pending == 0:
            if self.fill_when_complete:
                with torch.no_grad():
                    self.reducer._fill_bucket(bucket)
            if self.overlap:
                self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        # Strictly in index order: bucket k+1 never goes before bucket k, on any rank.
        while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:
            bucket = self.buckets[self.launched]
            bucket.handle = self.reducer._launch(bucket)
            self.launched += 1

    def _finish_backward(self) -> None:
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing and not self.find_unused_parameters:
                for bucket in self.launched_buckets():
                    bucket.handle.wait()  # leave no collective half done before raising
                names = ", ".join(self.names[i] for i in missing)
                raise RuntimeError(
                    f"{type(self.reducer).__name__}: these parameters received no gradient in this backward: "
                    f"{names}. Either use them in forward's output, set requires_grad=False on them, or pass "
                    "find_unused_parameters=True.")
            for i in missing:
                # Unused here: contribute zeros (or what accumulated under no_sync).
                self.used[i] = local_grad(self.params[i]) is not None
                self._mark_ready(i)
            self._launch_complete_buckets()  # whatever is left (every bucket when overlap=False)
            used_anywhere = self._used_anywhere() if self.find_unused_parameters and self.flag_unused_anywhere \
                else None
            start = time.perf_counter()
            with torch.no_grad():
                for bucket in self.buckets:
                    bucket.handle.wait()
                self.last_wait_s = time.perf_counter() - start
                self.reducer._after_backward(used_anywhere)
        finally:
            self._in_backward = False
            self.synced_backwards += 1
        if self._record_ready_order:
            self._record_ready_order = False
            self.reducer._on_first_backward_done(list(self._ready_order))

    def _used_anywhere(self) -> list[bool]:
        device = self.buckets[0].buffer.device if self.buckets else torch.device("cpu")
        return used_on_any_rank(self.used, self.process_group, device)


def used_on_any_rank(used_here: list[bool], group, device: torch.device) -> list[bool]:
    """Which parameters got a gradient on at least one rank of `group` (one small all_reduce of
    int32 flags on `device`; every rank must call it). DataParallel and ShardedDataParallel both
    ask it under find_unused_parameters."""
    if dist.get_world_size(group) == 1:
        return list(used_here)
    flags = torch.tensor(used_here, dtype=torch.int32, device=device)
    comm.all_reduce(flags, group=group)
    return flags.bool().tolist()
