"""The backward-pass schedule DataParallel and ShardedDataParallel (stages 1-2) share.

    hook per parameter --> its gradient goes into its bucket slot (fill_slot)
    bucket complete    --> launched, strictly in bucket order (launch -> handle)
    backward finished  --> autograd-engine callback: launch what is left, wait for
                           every bucket, hand the results over (after_backward)

A model *has* a BucketedBackward (composition): the model says *what* happens to a bucket
(all_reduce, reduce_scatter, ...) by providing the methods of `BucketReducer`; the
BucketedBackward decides *when*, and owns every piece of state about the backward in
progress. Launching in bucket order on every rank is what keeps collectives lined up across
ranks even when gradients become ready in a different order on each.
"""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

import torch
import torch.distributed as dist

from minidist import comm
from minidist.buckets import Bucket
from minidist.parallel.sharded_grad import local_grad


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
