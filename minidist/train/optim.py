"""The optimizer and its schedule, from the optim config group: one place for the trainer and the
comparison (compare/replica.py), which must build them identically."""

from __future__ import annotations

import math

import torch

OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


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
    kwargs = {"lr": float(optim_cfg.lr), "weight_decay": float(optim_cfg.weight_decay)}
    fused = optim_cfg.fused
    if fused == "auto" and device.type == "cuda" or fused is True:
        kwargs["fused"] = True
    if optim_cfg.name == "adamw":
        kwargs["betas"] = tuple(float(b) for b in optim_cfg.betas)
    else:
        kwargs.update(momentum=float(optim_cfg.momentum), nesterov=bool(optim_cfg.nesterov))
    return OPTIMIZERS[optim_cfg.name], kwargs
