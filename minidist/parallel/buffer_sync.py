"""Buffers (BatchNorm statistics) across ranks: native DDP's rule, shared by every strategy.

Gradients keep parameters identical; buffers are updated by forward itself, from each
rank's own batch, so they drift apart. DDP's answer, and ours: before a forward,
broadcast the source rank's buffers — but only when the previous forward was a
synchronising one (it recorded gradients outside no_sync), and before the very first.
So under no_sync accumulation the broadcast happens once per optimizer step, not once
per micro-batch, and a forward after an evaluation (no_grad) forward does not
broadcast. This is `require_forward_param_sync` in torch/nn/parallel/distributed.py.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.buckets import FlatBuffers


class BufferSync:
    """Call `before_forward(sync_enabled)` at the start of every forward of the wrapper."""

    def __init__(self, module: nn.Module, enabled: bool, world_size: int, src: int, group=None):
        has_buffers = any(True for _ in module.buffers())
        self._flat = FlatBuffers(module) if enabled and world_size > 1 and has_buffers else None
        self._src, self._group = src, group
        self._due = True  # the first forward synchronises

    @property
    def due(self) -> bool:
        """Will the next forward broadcast?"""
        return self._flat is not None and self._due

    def before_forward(self, sync_enabled: bool, src: int | None = None) -> None:
        """Broadcast if the previous forward was a synchronising one; note whether this one is.
        `src` overrides the source rank for this broadcast (Join: the highest rank still active)."""
        if self.due:
            self.broadcast(src)
        self._due = torch.is_grad_enabled() and sync_enabled

    def broadcast(self, src: int | None = None) -> None:
        """Broadcast the buffers now (a rank that joined shadows the others' broadcast with it)."""
        if self._flat is not None:
            self._flat.broadcast(src=self._src if src is None else src, group=self._group)

    def set_due(self, due: bool) -> None:
        """Say whether the next forward broadcasts (Join: a rank that left follows the others' notice,
        and after Join's final sync every rank broadcasts at its next forward)."""
        self._due = due
