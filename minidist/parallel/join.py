"""Uneven inputs: ranks that run out of data shadow the collectives of those still training.

    with minidist.Join(model):              # a DataParallel or a ShardedDataParallel
        for x, y in my_shard:                # shards of different lengths on different ranks
            loss_fn(model(x), y).backward()
            optimizer.step(); optimizer.zero_grad()

Without it, the rank whose data ends first leaves its loop while the others wait in their
next collective until the timeout. Under Join, native DDP's protocol
(torch.distributed.algorithms.Join), which every strategy shares:

- Ranks still training ("active") all_reduce one small notice at each point where a rank
  that left cannot guess what comes next: before every forward (will its backward reduce
  gradients? are buffers broadcast first?) and, for ShardedDataParallel, before a clip and
  before an optimizer step, since those are collectives over shards too.
- A rank that has left its loop (Join's exit) all_reduces an empty notice per notice of the
  others and mirrors what it announces (DataParallel: `_shadow_one_iteration` in ddp.py;
  ShardedDataParallel: zero_join.py). When no rank is active any more, everyone leaves.
- Gradients stay divided by the initial world size (native's divide_by_initial_world_size):
  a rank that left adds zeros.
- Buffers are broadcast from the highest rank still active (a rank that left has stale ones);
  at the end every rank takes the state of the highest among the last ones active.

The notice is reduced with MAX: every active rank sends the same announcement, a rank that
left sends zeros, and each rank marks only its own slot in the "active" part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm
from minidist.buckets import broadcast_coalesced

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
    `zero_grad()`. See zero_join.py for what a rank that left does at each point.
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
