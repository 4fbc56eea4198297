"""Join for ShardedDataParallel: a rank that ran out of data keeps its shard of the training going.

Under ZeRO a rank that left its loop cannot simply add zeros and wait, as a DataParallel rank
does: it owns a shard of the optimizer (and, at stage 3, of the parameters). So for every
notice of the ranks still training (see join.py) it does what they do:

    FORWARD  replay this rank's last forward, with the same grad mode, train/eval mode and
             no_sync state as announced, and backward with zero output gradients. That
             issues exactly the collectives their forward and backward issue — buffer
             broadcast, stage-3 gathers in their prefetch order, every reduce_scatter —
             and contributes gradients that are exactly zero. Its own shard receives the
             true reduced gradient of the ranks still active.
    CLIP     clip_grad_norm_ with the announced max_norm and norm_type: its shard's part of
             the global norm, and the same scaling of its shard.
    STEP     optimizer.step() with the announced learning rates (the active ranks' LR
             schedulers keep going; this rank's does not), then zero_grad(), then the
             post-step gathers every rank runs.

So the shards of a rank that left stay exactly where they would be had it trained on with
zero gradients: "no update drift". Assumed, as by native ZeRO under Join: each synced
backward is followed by at most one clip and one step, and zero_grad() after the step.
A rank that never ran a forward has nothing to replay: then every rank raises, naming it,
instead of waiting for it.
"""

from __future__ import annotations

import contextlib

import torch

from minidist.parallel.join import CLIP, FORWARD, STEP, final_sync, global_rank


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
