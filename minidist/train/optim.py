"""The optimizer and its schedule, from the optim config group: one place for the trainer and the
comparison (train/state.py builds both).

The optimizer is Hydra's `_target_` (a torch.optim.Optimizer class) with the group's other keys
as its arguments, except the schedule's and `fused`. It is handed on as (class, arguments), not
instantiated: ZeRO builds it over its own shards. Only optimizer classes are accepted, so a
config cannot name arbitrary code to run."""

from __future__ import annotations

import math

import torch

from minidist.train.targets import class_named

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
