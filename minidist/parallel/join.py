"""Uneven inputs: ranks that run out of data shadow the collectives of those still training.

    with minidist.Join(model):              # model: a DataParallel
        for x, y in my_shard:                # shards of different lengths on different ranks
            loss_fn(model(x), y).backward()
            optimizer.step(); optimizer.zero_grad()

Without it, the rank whose data ends first leaves its loop while the others wait in their
next gradient all_reduce until the collective timeout. Under Join, native DDP's protocol
(torch.distributed.algorithms.Join):

- Each forward of a rank still training all_reduces one small "notice": that this rank
  is active, whether its backward will reduce gradients (not under no_sync) and whether
  buffers are broadcast before this forward.
- A rank that has left its loop (Join's exit) sends an empty notice per iteration of the
  others, and shadows what they do: if their backward reduces gradients, it reduces zeros
  in every bucket (the same collectives in the same order, through the same comm hook), and
  the unused-parameter all_reduce under find_unused_parameters; it takes part in the
  buffer broadcast, whose source is then the highest rank still active (a rank that left
  has stale buffers). When no rank is active any more, everyone leaves.
- Gradients stay divided by the initial world size (native's divide_by_initial_world_size):
  a rank that left adds zeros.
- At the end, the ranks that trained longest hold the newest parameters: every rank takes
  the parameters and buffers of the highest rank among the last ones active.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm
from minidist.buckets import broadcast_coalesced


class Notice:
    """What the ranks told each other before one forward (summed over ranks)."""

    def __init__(self, summed: torch.Tensor):
        values = summed.tolist()
        self.will_sync, self.buffers_due = values[0] > 0, values[1] > 0
        self.active = [r for r, v in enumerate(values[2:]) if v > 0]  # group ranks still training

    @property
    def authoritative(self) -> int | None:
        """The rank whose buffers and parameters count: the highest one still active."""
        return max(self.active) if self.active else None


class Join:
    """Context manager: under it, a DataParallel rank whose loop ends early keeps shadowing the
    collectives of the ranks still training, so every rank leaves cleanly and equal."""

    def __init__(self, model, enable: bool = True):
        from minidist.parallel.ddp import DataParallel

        if not isinstance(model, DataParallel):
            raise TypeError(f"minidist.Join takes a minidist.DataParallel, not {type(model).__name__}: "
                            "ShardedDataParallel has no uneven-input support yet (give every rank the same "
                            "number of steps, as the trainer's sampler does)")
        self.model, self.enable = model, enable
        self.last: Notice | None = None  # the latest notice in which some rank was active

    def __enter__(self) -> "Join":
        if self.enable:
            self.model._join = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enable:
            return
        try:
            if exc_type is None:
                while self.model._shadow_one_iteration(self):
                    pass
                self.model._take_final_state(self)
        finally:
            self.model._join = None

    def exchange(self, model, active: bool, will_sync: bool, buffers_due: bool) -> Notice:
        """One notice all_reduce (every rank, active or not, once per iteration of the active ones)."""
        n = model.world_size
        mine = torch.zeros(n + 2, dtype=torch.int32, device=model._join_device())
        if active:
            mine[0], mine[1] = int(will_sync), int(buffers_due)
            mine[2 + dist.get_rank(model.process_group)] = 1
        comm.all_reduce(mine, group=model.process_group)
        notice = Notice(mine.cpu())
        if notice.active:
            self.last = notice
        return notice


def final_sync(model, join: Join) -> None:
    """Every rank takes the parameters and buffers of the last active rank (the highest of them)."""
    if join.last is None or model.world_size == 1:
        return
    src = join.last.authoritative
    if model.process_group is not None:
        src = dist.get_global_rank(model.process_group, src)
    with torch.no_grad():
        broadcast_coalesced([p.data for p in model.module.parameters()] + [b.data for b in model.module.buffers()],
                            src=src, group=model.process_group)
