"""Join for every wrapper (uneven inputs): ranks that run out of data shadow the collectives of those
still training, with native DDP's protocol (torch.distributed.algorithms.Join).

    with minidist.Join(model):              # a DataParallel or a ShardedDataParallel
        for x, y in my_shard:                # shards of different lengths on different ranks
            loss_fn(model(x), y).backward()
            optimizer.step(); optimizer.zero_grad()

A DataParallel rank that left adds zeros; a ShardedDataParallel rank replays its last forward
with zero gradients, so its shards keep training. The protocol: docs/internals.md, "parallel/join.py".
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from minidist import comm
from minidist.parallel.buckets import broadcast_coalesced


# What a notice announces: the kind of point the active ranks have reached, then its details.
FORWARD, CLIP, STEP = 1, 2, 3
FIELDS = ("kind", "will_sync", "buffers_due", "grad_enabled", "training", "max_norm", "norm_type",
          "unable")  # unable: 1 + the highest rank that left and cannot mirror the others (0: none)


class Notice:
    """What the active ranks announced at one point (reduced with MAX over every rank)."""

    def __init__(self, reduced: torch.Tensor, n_extra: int):
        values = reduced.tolist()
        head = dict(zip(FIELDS, values))
        self.kind = int(head["kind"])
        self.will_sync, self.buffers_due = head["will_sync"] > 0, head["buffers_due"] > 0
        self.grad_enabled, self.training = head["grad_enabled"] > 0, head["training"] > 0
        self.max_norm, self.norm_type = head["max_norm"], head["norm_type"]
        self.unable = int(head["unable"]) - 1 if head["unable"] > 0 else None
        self.extra = values[len(FIELDS):len(FIELDS) + n_extra]  # ShardedDataParallel: the learning rates
        self.active = [r for r, v in enumerate(values[len(FIELDS) + n_extra:]) if v > 0]  # group ranks

    @property
    def authoritative(self) -> int | None:
        """The rank whose buffers and parameters count: the highest one still active."""
        return max(self.active) if self.active else None


class Join:
    """Context manager: under it, a rank whose loop ends early keeps shadowing the collectives of
    the ranks still training, so every rank leaves cleanly and equal.

    Args:
        model: a minidist.DataParallel or minidist.ShardedDataParallel (stage 1, 2 or 3).
        enable: False makes it a no-op (the same code path with and without uneven inputs).

    ShardedDataParallel additionally assumes the loop native ZeRO + Join assumes: each synced
    backward is followed by at most one `clip_grad_norm_` and one `optimizer.step()`, then
    `zero_grad()`. See "Join for ShardedDataParallel" above for what a rank that left does at each point.
    """

    def __init__(self, model, enable: bool = True):
        if not hasattr(model, "_shadow_one_iteration"):
            raise TypeError(f"minidist.Join takes a minidist.DataParallel or ShardedDataParallel, "
                            f"not {type(model).__name__}")
        self.model, self.enable = model, enable
        self.last: Notice | None = None  # the latest notice in which some rank was active
        self.shadowing = False  # True while this rank mirrors the others (its own hooks stay silent)

    def __enter__(self) -> "Join":
        if self.enable:
            self.model._join = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enable:
            return
        try:
            if exc_type is None:
                self.shadowing = True
                while self.model._shadow_one_iteration(self):
                    pass
                self.model._take_final_state(self)
        finally:
            self.shadowing = False
            self.model._join = None

    def announce(self, model, kind: int, **details) -> Notice:
        """An active rank's notice (every active rank announces the same point)."""
        return self._exchange(model, active=True, kind=kind, **details)

    def listen(self, model, unable: bool = False) -> Notice:
        """A rank that left: what do the active ranks do next? (No active rank: leave.)
        `unable`: this rank cannot mirror them; every rank then raises instead of waiting forever."""
        rank = dist.get_rank(model._join_group()[0])
        return self._exchange(model, active=False, unable=rank + 1 if unable else 0)

    def _exchange(self, model, active: bool, kind: int = 0, extra: tuple = (), unable: int = 0,
                  **details) -> Notice:
        group, n = model._join_group()
        n_extra = model._join_extra_size()
        mine = torch.zeros(len(FIELDS) + n_extra + n, dtype=torch.float64, device=model._join_device())
        mine[FIELDS.index("unable")] = unable
        if active:
            values = dict(details, kind=kind)
            for k, field in enumerate(FIELDS):
                mine[k] = float(values.get(field, 0))
            if extra:
                mine[len(FIELDS):len(FIELDS) + n_extra] = torch.tensor(extra, dtype=torch.float64)
            mine[len(FIELDS) + n_extra + dist.get_rank(group)] = 1
        comm.all_reduce(mine, op=comm.ReduceOp.MAX, group=group)
        notice = Notice(mine.cpu(), n_extra)
        if notice.active and notice.unable is not None:
            raise RuntimeError(f"minidist.Join: rank {notice.unable} left its loop without running a forward under "
                               f"Join, so it has no batch to replay while ranks {notice.active} still train "
                               f"({type(model).__name__} needs one to mirror their collectives): give every rank "
                               "at least one batch")
        if notice.active:
            self.last = notice
        return notice


def global_rank(model, group_rank: int) -> int:
    """A rank of the model's data-parallel group (Join's group) as a rank of the world."""
    group = model._join_group()[0]
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def final_sync(model, join: Join, tensors: list[torch.Tensor]) -> None:
    """Every rank takes `tensors` from the last active rank (the highest of them)."""
    group, n = model._join_group()
    if join.last is None or n == 1 or not tensors:
        return
    with torch.no_grad():
        broadcast_coalesced(tensors, src=global_rank(model, join.last.authoritative), group=group)


class DataParallelJoin:
    """Mixin for DataParallel: announce each forward under Join, shadow it after leaving (its
    backward's all_reduces with zero gradients)."""

    _join = None  # the minidist.Join this model runs under, if any

    def _join_forward(self) -> int | None:
        """Called first in forward; returns the buffer-broadcast source (None: the usual one)."""
        if self._join is None:
            return None
        notice = self._join.announce(self, FORWARD, buffers_due=self._buffer_sync.due,
                                     will_sync=torch.is_grad_enabled() and self._sync_enabled)
        return global_rank(self, notice.authoritative)

    def _join_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    def _join_group(self):
        return self.process_group, self.world_size  # the ranks that exchange Join's notices

    def _join_extra_size(self) -> int:
        return 0  # a DataParallel notice carries nothing beyond the common fields

    def _shadow_one_iteration(self, join) -> bool:
        """Mirror one iteration of the ranks still training; False once none is."""
        notice = join.listen(self)
        if not notice.active:
            return False
        if notice.buffers_due:
            self._buffer_sync.broadcast(global_rank(self, notice.authoritative))
        if notice.will_sync:
            with torch.no_grad():  # their backward's collectives, with zero gradients
                for bucket in self._buckets:
                    bucket.buffer.zero_()
                handles = [self._launch(bucket) for bucket in self._buckets]
                if self.find_unused_parameters and self.world_size > 1:
                    comm.all_reduce(torch.zeros(len(self._params), dtype=torch.int32, device=self._join_device()),
                                    group=self.process_group)
                for handle in handles:
                    handle.wait()
        return True

    def _take_final_state(self, join) -> None:
        final_sync(self, join, [p.data for p in self.module.parameters()] + [b.data for b in self.module.buffers()])
        self._buffer_sync.set_due(True)  # every rank alike from here on


class ShardedJoin:
    """Mixin for ShardedDataParallel: announce forward/clip/step under Join, shadow them after it."""

    _join = None  # the minidist.Join this model runs under, if any
    _replay: tuple | None = None  # (args, kwargs) of this rank's latest forward under Join
    _shadow_src: int | None = None  # while replaying: the rank whose buffers are broadcast

    # -- on an active rank: announce ----------------------------------------------------
    def _join_forward(self, args, kwargs) -> int | None:
        """Called first in forward; returns the buffer-broadcast source (None: the usual one)."""
        join = self._join
        if join is None:
            return None
        if join.shadowing:
            return self._shadow_src
        self._replay = (args, kwargs)
        notice = join.announce(self, FORWARD, will_sync=torch.is_grad_enabled() and self._sync_enabled,
                               buffers_due=self._buffer_sync.due, grad_enabled=torch.is_grad_enabled(),
                               training=self.training)
        return global_rank(self, notice.authoritative)

    def _join_clip(self, max_norm: float, norm_type: float) -> None:
        if self._join is not None and not self._join.shadowing:
            self._join.announce(self, CLIP, max_norm=max_norm, norm_type=norm_type)

    def _join_step(self) -> None:
        if self._join is not None and not self._join.shadowing:
            self._join.announce(self, STEP, extra=tuple(float(g["lr"]) for g in self.optimizer.param_groups))

    def _join_device(self) -> torch.device:
        return self._shards[0].device

    def _join_group(self):
        return self.dp_group, self.dp_size  # every data-parallel rank (with a mesh: the world)

    def _join_extra_size(self) -> int:
        return len(self.optimizer.param_groups)  # a STEP notice carries each group's learning rate

    # -- on a rank that left: shadow ------------------------------------------------------
    def _shadow_one_iteration(self, join) -> bool:
        """Mirror the active ranks' next announced point; False once no rank is active."""
        notice = join.listen(self, unable=self._replay is None)  # no batch to replay: every rank raises
        if not notice.active:
            return False
        if notice.kind == FORWARD:
            self._replay_forward(notice)
        elif notice.kind == CLIP:
            self.clip_grad_norm_(notice.max_norm, notice.norm_type)
        elif notice.kind == STEP:
            for group, lr in zip(self.optimizer.param_groups, notice.extra):
                if torch.is_tensor(group["lr"]):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
            self.optimizer.step()
            self.optimizer.zero_grad()
        return True

    def _replay_forward(self, notice) -> None:
        args, kwargs = self._replay
        self._shadow_src = global_rank(self, notice.authoritative)
        self._buffer_sync.set_due(notice.buffers_due)
        was_training = self.training
        self.train(notice.training)
        sync = self.no_sync() if notice.grad_enabled and not notice.will_sync else contextlib.nullcontext()
        try:
            with torch.set_grad_enabled(notice.grad_enabled), sync:
                out = self(*args, **kwargs)
                outputs = [t for t in tensors_in(out) if t.requires_grad]
                if outputs:
                    torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])
        finally:
            self.train(was_training)
            self._shadow_src = None

    def _take_final_state(self, join) -> None:
        """Parameters already agree (each shard's owner updated it); buffers come from the last active rank."""
        self.wait_for_parameters()
        final_sync(self, join, [b.data for b in self.module.buffers()])
        self._buffer_sync.set_due(True)
        self._replay = None


def tensors_in(obj):
    """Every tensor in a (nested) tuple, list or dict of outputs."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)
