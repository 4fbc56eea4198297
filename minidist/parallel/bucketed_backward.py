"""The backward-pass machinery DataParallel and ShardedDataParallel (stages 1-2) share.

    hook per parameter --> its gradient goes into its bucket slot (fill_slot)
    bucket complete    --> launched, strictly in bucket order (launch -> handle)
    backward finished  --> autograd-engine callback: launch what is left, wait for
                           every bucket, hand the results over (after_backward)

A subclass says *what* happens to a bucket (all_reduce, reduce_scatter, ...) by
implementing `_fill_slot` (or `_fill_bucket`), `_launch` and `_after_backward`; this class decides
*when*. Launching in bucket order on every rank is what keeps collectives lined up
across ranks even when gradients become ready in a different order on each.
"""

from __future__ import annotations

import contextlib
import time

import torch

from minidist import comm
from minidist.buckets import Bucket
from minidist.parallel.sharded_grad import local_grad


class GradientSyncSwitch:
    """`no_sync()` for every strategy: while off, gradient hooks leave .grad to accumulate locally."""

    _sync_enabled: bool = True

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next synced backward reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous


class BucketedBackward(GradientSyncSwitch):
    """Mixin: call `_init_bucketed_backward` once the buckets exist; implement the three hooks.

    The class it is mixed into owns the parameters and the group (the attributes below, set
    before `_init_bucketed_backward`); this mixin reads them and owns only the backward's state."""

    # -- what the class it is mixed into holds (set once, by that class) ------------
    _names: list[str]
    _params: list[torch.Tensor]
    world_size: int
    process_group: object

    def _init_bucketed_backward(self, *, overlap: bool, find_unused_parameters: bool,
                                record_ready_order: bool = False) -> None:
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self._record_ready_order = record_ready_order
        self._sync_enabled = True
        self._in_backward = False
        self._ready = [False] * len(self._params)
        self._used = [False] * len(self._params)
        self._ready_order: list[int] = []
        self._next_bucket = 0
        self.last_wait_s = 0.0  # how long the last backward waited for communication at its end
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    # -- what a subclass provides -------------------------------------------------
    _buckets: list[Bucket]
    _where: dict[int, tuple[Bucket, int]]  # parameter index -> (bucket, slot)

    def _fill_slot(self, i: int, bucket: Bucket, k: int) -> None:
        """Put parameter i's gradient (None: it had none) into slot k of `bucket`."""
        raise NotImplementedError

    # Fill each slot as its gradient arrives (False), or the whole bucket at once when its last
    # gradient has arrived (True: a subclass whose _fill_bucket does it in a few vectorised ops,
    # instead of one Python call and one tensor op per parameter).
    _fill_when_complete = False

    def _fill_bucket(self, bucket: Bucket) -> None:
        """Fill every slot of a complete `bucket` (when _fill_when_complete)."""
        for k, i in enumerate(bucket.param_ids):
            self._fill_slot(i, bucket, k)

    def _launch(self, bucket: Bucket):
        """Start reducing a complete bucket; return an object with wait()."""
        raise NotImplementedError

    def _after_backward(self, used_anywhere: list[bool] | None) -> None:
        """Every bucket is reduced: hand the results to .grad / the optimizer's shards."""
        raise NotImplementedError

    def _on_first_backward_done(self) -> None:
        """Called once, after the first synced backward (DataParallel rebuilds its buckets)."""

    # -- the machinery -------------------------------------------------------------
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
        self._before_backward()
        # Runs once, when the autograd engine has finished this whole backward pass.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _before_backward(self) -> None:
        """Subclass hook: the first gradient of a synced backward has just arrived."""

    def _mark_ready(self, i: int) -> None:
        if self._ready[i]:
            raise RuntimeError(f"{type(self).__name__}: parameter {self._names[i]!r} produced a gradient twice "
                               "in one backward (reentrant backward, or a second backward before the first ended)")
        self._ready[i] = True
        if self._record_ready_order:
            self._ready_order.append(i)
        bucket, k = self._where[i]
        if not self._fill_when_complete:
            with torch.no_grad():
                self._fill_slot(i, bucket, k)
        bucket.pending -= 1
        if bucket.pending == 0:
            if self._fill_when_complete:
                with torch.no_grad():
                    self._fill_bucket(bucket)
            if self.overlap:
                self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        # Strictly in index order: bucket k+1 never goes before bucket k, on any rank.
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            bucket.handle = self._launch(bucket)
            self._next_bucket += 1

    def _finish_backward(self) -> None:
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing and not self.find_unused_parameters:
                for bucket in self._buckets[:self._next_bucket]:
                    bucket.handle.wait()  # leave no collective half done before raising
                names = ", ".join(self._names[i] for i in missing)
                raise RuntimeError(
                    f"{type(self).__name__}: these parameters received no gradient in this backward: {names}. "
                    "Either use them in forward's output, set requires_grad=False on them, or pass "
                    "find_unused_parameters=True.")
            for i in missing:
                # Unused here: contribute zeros (or what accumulated under no_sync).
                self._used[i] = local_grad(self._params[i]) is not None
                self._mark_ready(i)
            self._launch_complete_buckets()  # whatever is left (every bucket when overlap=False)
            used_anywhere = self._used_anywhere() if self.find_unused_parameters else None
            start = time.perf_counter()
            with torch.no_grad():
                for bucket in self._buckets:
                    bucket.handle.wait()
                self.last_wait_s = time.perf_counter() - start
                self._after_backward(used_anywhere)
        finally:
            self._in_backward = False
        if self._record_ready_order:
            self._record_ready_order = False
            self._on_first_backward_done()

    def _used_anywhere(self) -> list[bool]:
        """Which parameters got a gradient on at least one rank (one small all_reduce)."""
        if self.world_size == 1:
            return list(self._used)
        device = self._buckets[0].buffer.device if self._buckets else torch.device("cpu")
        used = torch.tensor(self._used, dtype=torch.int32, device=device)
        comm.all_reduce(used, group=self.process_group)
        return used.bool().tolist()
