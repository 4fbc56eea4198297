"""The optimizer, its schedule, and one optimizer step.

The optimizer and its schedule, from the optim config group: one place for the trainer and the
comparison (train/state.py builds both).

The optimizer is Hydra's `_target_` (a torch.optim.Optimizer class) with the group's other keys
as its arguments, except the schedule's and `fused`. It is handed on as (class, arguments), not
instantiated: ZeRO builds it over its own shards. Only optimizer classes are accepted, so a
config cannot name arbitrary code to run.

One optimizer step through a strategy: the trainer's and the comparison's, the same code.

    loss, grad_norm = accumulate_and_step(strategy, micro_batches, loss_fn, max_norm, scaler)
    accumulate_and_step(..., before_optimizer=lambda: strategy.memory_report())   # gradients complete

All micro-batches but the last run under the strategy's no_sync (accumulation without
communication), unless strategy.accumulate=sharded (stages 2-3, FSDP2): then every backward
reduce-scatters into the gradient shard, as FSDP2's and DeepSpeed's loops do, and no rank holds
a full gradient between micro-batches. Each loss is divided by their number, so the gradient is
the mean over the global batch. Forward, backward and the optimizer run inside profiler ranges
("minidist.forward", ...), which cost nothing unless torch.profiler is recording:
they are what the comparison's timeline draws as compute.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from minidist.train.config import class_named


# The optim group's keys that are not the optimizer's own arguments.
NOT_ARGUMENTS = ("_target_", "name", "module", "warmup_steps", "min_lr_ratio", "fused")


def lr_lambda(warmup_steps: int, max_steps: int, min_ratio: float):
    """Linear warm-up to the peak, then a cosine decay to min_ratio x peak at max_steps."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def optimizer_spec(optim_cfg, device: torch.device = torch.device("cpu")) -> tuple[type, dict]:
    """(optimizer class, keyword arguments) from the optim config group. `fused: auto` takes the
    fused kernels on CUDA, where they also skip a non-finite step without a host synchronisation
    (strategy.step_unless_nonfinite), and the default (foreach) ones elsewhere."""
    from omegaconf import OmegaConf

    cls = class_named(str(optim_cfg._target_), torch.optim.Optimizer, "optim._target_", "torch.optim.AdamW",
                      module=optim_cfg.get("module"))
    kwargs = {k: tuple(v) if isinstance(v, list) else v  # betas: a tuple, as torch writes them
              for k, v in OmegaConf.to_container(optim_cfg, resolve=True).items() if k not in NOT_ARGUMENTS}
    fused = optim_cfg.fused
    if fused == "auto" and device.type == "cuda" or fused is True:
        kwargs["fused"] = True
    return cls, kwargs


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
    local = strategy.cfg.get("accumulate", "local") == "local"
    loss_sum = None
    for k, (x, y) in enumerate(micro_batches):
        with (strategy.no_sync() if local and k < n - 1 else contextlib.nullcontext()):
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
