"""The training state, built one way for the trainer and the comparison alike, and the device it runs on.

    data = build_data(cfg, ctx)                             # data sets, their info, this rank's sampler
    state = build_training_state(cfg, cfg.strategy, ctx, data.info, total_steps)
    loss, grad_norm = state.step(micro_batches)             # one optimizer step, then the schedule's

The device settings and MFU: docs/internals.md, "train/state.py".
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from minidist.train.data import ShardedBatchSampler, build_datasets, collate
from minidist.train.models import build_model
from minidist.train.optim import (MuonWithAdamW, accumulate_and_step, hidden_matrices, lr_lambda, optimizer_spec,
                                  task_loss)
from minidist.train.strategies import Strategy, build_strategy


def set_fp32_precision(tf32: bool) -> None:
    """fp32 matmuls and convolutions in TF32 (tf32=True) or in full fp32 ("ieee")."""
    mode = "tf32" if tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode


def configure_device(device: torch.device, tf32: bool) -> None:
    """What a run sets on its device before it starts (nothing on CPU)."""
    if device.type != "cuda":
        return
    set_fp32_precision(tf32)
    torch.cuda.reset_peak_memory_stats(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; to CUDA through pinned memory, so the copy is asynchronous."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# name fragment (as torch.cuda.get_device_name reports it): (bf16/fp16, fp32) dense TFLOP/s.
# Longer names first where one contains another (A100 before A10, L40S before L4).
KNOWN_GPUS = {
    "H200": (989.0, 67.0), "H100 PCIe": (756.0, 51.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6), "L40": (181.0, 90.5), "L4": (121.0, 30.3), "A10G": (70.0, 31.2), "A10": (125.0, 31.2),
    "V100": (125.0, 15.7), "RTX 4090": (165.0, 82.6),
}
CPU_TFLOPS = 0.2  # one CPU core in fp32, roughly


def peak_tflops(setting, device: torch.device, precision: str) -> float | None:
    """trainer.peak_tflops resolved: a number as given; auto from the device (None: unknown GPU)."""
    if str(setting) != "auto":
        return float(setting)
    if device.type != "cuda":
        return CPU_TFLOPS
    name = torch.cuda.get_device_name(device)
    for fragment, (half, fp32) in KNOWN_GPUS.items():
        if fragment in name:
            return half if precision in ("bf16", "fp16") else fp32
    return None


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainingData:
    train_set: object
    val_set: object
    info: object                   # data.DataInfo: kind (text / image), vocabulary or classes
    sampler: ShardedBatchSampler   # this rank's micro-batches, resumable
    block_size: int                # tokens per sample (1 for images)
    last_ids: list = field(default_factory=list)  # the sample ids of the last micro_batches() call

    def micro_batches(self, batches, count: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next `count` micro-batches of the sampler's iterator `batches`, as (x, y) on `device`;
        their sample ids stay in `last_ids` (trainer.log_samples writes them)."""
        out, self.last_ids = [], []
        for _ in range(count):
            ids = next(batches)
            self.last_ids += ids
            x, y = collate(self.train_set, ids)
            out.append((to_device(x, device), to_device(y, device)))
        return out


def build_data(cfg, ctx, grad_accum: int | None = None) -> TrainingData:
    """The data sets and this rank's sampler (seeded by trainer.seed, so every rank shuffles alike;
    its epochs trimmed to whole global batches of `grad_accum` micro-steps, default the config's)."""
    from minidist.train.config_check import grad_accum_steps

    t = cfg.trainer
    block_size = int(cfg.model.get("block_size", 0)) or 1
    train_set, val_set, info = build_datasets(cfg.data, block_size)
    sampler = ShardedBatchSampler(len(train_set), ctx.rank, ctx.world_size, int(t.micro_batch_size), seed=int(t.seed),
                                  grad_accum=grad_accum or grad_accum_steps(cfg, ctx.world_size))
    return TrainingData(train_set, val_set, info, sampler, block_size)


@dataclass
class TrainingState:
    """A model wrapped by its strategy, with its optimizer, schedule, loss scaler and autocast."""

    net: torch.nn.Module                  # the bare model (its state_dict is the checkpoint's)
    model: torch.nn.Module                # what forward runs: the strategy's wrapper
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler          # enabled for fp16 only
    autocast_dtype: torch.dtype | None    # bf16 / fp16 autocast, None for fp32
    max_norm: float                       # trainer.grad_clip (inf: no clipping, the norm still measured)
    is_text: bool

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.strategy.ctx.device.type, dtype=self.autocast_dtype)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return task_loss(out, y, self.is_text)

    def step(self, micro_batches, loss_fn: Callable | None = None,
             before_optimizer: Callable[[], object] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `micro_batches` (on the device), then the schedule's step.
        Returns (the mean micro-batch loss, detached; the gradient norm before clipping)."""
        loss, norm = accumulate_and_step(self.strategy, micro_batches, loss_fn or self.loss, self.max_norm,
                                         self.scaler, self.autocast, before_optimizer)
        if norm is None:  # discarded (accumulate_and_step): nor does the schedule move
            return loss, norm
        with warnings.catch_warnings():  # a first step skipped (a non-finite norm) is no misordered call
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
        return loss, norm


def build_training_state(cfg, strategy_cfg, ctx, info, total_steps: int) -> TrainingState:
    """Seed with trainer.seed, build the model on ctx.device, wrap it with the strategy
    `strategy_cfg` names, and give it the optimizer (cfg.optim) and its schedule over
    `total_steps` steps."""
    t = cfg.trainer
    torch.manual_seed(int(t.seed))  # the same initial weights on every rank and for every strategy
    net = build_model(cfg.model, info).to(ctx.device)
    strategy = build_strategy(strategy_cfg, ctx, str(t.precision))
    strategy.total_steps = int(total_steps)
    optim_cls, optim_kwargs = optimizer_spec(cfg.optim, ctx.device)
    if issubclass(optim_cls, MuonWithAdamW):  # optim=muon: the model says which weights are hidden
        optim_kwargs["muon_params"] = hidden_matrices(net)
    model, optimizer = strategy.wrap(net, optim_cls, optim_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(int(cfg.optim.warmup_steps), int(total_steps), float(cfg.optim.min_lr_ratio)))
    clip = float(t.grad_clip)
    return TrainingState(net=net, model=model, strategy=strategy, optimizer=optimizer, scheduler=scheduler,
                         scaler=torch.amp.GradScaler(ctx.device.type, enabled=str(t.precision) == "fp16"),
                         autocast_dtype=AUTOCAST_DTYPES.get(str(t.precision)),
                         max_norm=clip if clip > 0 else math.inf, is_text=info.kind == "text")


def reseed_per_rank(seed: int, rank: int) -> None:
    """Each rank its own stream of randomness from here on (dropout, augmentation), Python's too:
    a run must not depend on the entropy its processes started with."""
    torch.manual_seed(int(seed) + 1000 * rank)
    random.seed(int(seed) + 1000 * rank)
