"""One optimizer step through a strategy: the trainer's and the comparison's, the same code.

    loss, grad_norm = accumulate_and_step(strategy, micro_batches, loss_fn, max_norm, scaler)
    accumulate_and_step(..., before_optimizer=lambda: strategy.memory_report())   # gradients complete

All micro-batches but the last run under the strategy's no_sync (accumulation without
communication); each loss is divided by their number, so the gradient is the mean over
the global batch. Forward, backward and the optimizer run inside profiler ranges
("minidist.forward", ...), which cost nothing unless torch.profiler is recording:
they are what the comparison's timeline draws as compute.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.profiler import record_function


def task_loss(out: torch.Tensor, y: torch.Tensor, is_text: bool) -> torch.Tensor:
    """Cross-entropy in fp32: per token for a language model, per sample for a classifier."""
    if is_text:
        return F.cross_entropy(out.float().reshape(-1, out.size(-1)), y.reshape(-1))
    return F.cross_entropy(out.float(), y)


def accumulate_and_step(strategy, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                        loss_fn: Callable, max_norm: float, scaler,
                        autocast: Callable = contextlib.nullcontext,
                        before_optimizer: Callable[[], object] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one optimizer step over `micro_batches` (a list of (x, y) already on the device).
    `before_optimizer()`, when given, runs once the gradients are complete, just before the
    optimizer step (what the comparison measures the model state at).

    Returns (the summed loss over micro-batches, each divided by their number, detached;
    the global gradient norm before clipping)."""
    micro_batches = list(micro_batches)
    n = len(micro_batches)
    loss_sum = None
    for k, (x, y) in enumerate(micro_batches):
        with (contextlib.nullcontext() if k == n - 1 else strategy.no_sync()):
            with record_function("minidist.forward"), autocast():
                loss = loss_fn(strategy.model(x), y) / n
            with record_function("minidist.backward"):
                strategy.backward(scaler.scale(loss))
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    if before_optimizer is not None:
        before_optimizer()
    with record_function("minidist.optimizer"):
        norm = strategy.optimizer_step(max_norm, scaler)
    return loss_sum, norm
