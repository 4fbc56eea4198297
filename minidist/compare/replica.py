"""One strategy in a comparison: its own model copy, optimizer, schedule and random stream.

Every replica starts from the same weights (the model is built after seeding with
trainer.seed, as the trainer does) and is fed the same micro-batches, so the only thing
that differs between replicas is the strategy. Each keeps its own torch RNG state and
switches to it around its step: interleaving replicas would otherwise hand each one a
different slice of one shared random stream (dropout).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from minidist import comm
from minidist.train.models import build_model
from minidist.train.step import optimizer_step_over, task_loss
from minidist.train.strategy import build_strategy
from minidist.train.optim import lr_lambda, optimizer_spec


class Replica:
    def __init__(self, name: str, options, cfg, info, ctx, total_steps: int):
        self.name, self.ctx, self.cfg = name, ctx, cfg
        self.is_text = info.kind == "text"
        torch.manual_seed(int(cfg.trainer.seed))
        self.net = build_model(cfg.model, info).to(ctx.device)
        self.strategy = build_strategy(options, ctx, str(cfg.trainer.precision))
        optim_cls, optim_kwargs = optimizer_spec(cfg.optim, ctx.device)
        self.model, self.optimizer = self.strategy.wrap(self.net, optim_cls, optim_kwargs)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(int(cfg.optim.warmup_steps), total_steps, float(cfg.optim.min_lr_ratio)))
        self.scaler = torch.amp.GradScaler("cuda", enabled=False)  # fp32 / bf16: no loss scaling
        dtype = {"bf16": torch.bfloat16}.get(str(cfg.trainer.precision))
        self._autocast = (lambda: torch.autocast(ctx.device.type, dtype=dtype)) if dtype else contextlib.nullcontext
        clip = float(cfg.trainer.grad_clip)
        self.max_norm = clip if clip > 0 else math.inf
        torch.manual_seed(int(cfg.trainer.seed) + 1000 * ctx.rank)
        self.rng = torch.get_rng_state()

    def step(self, micro_batches) -> dict:
        """One optimizer step on `micro_batches`; this rank's loss, grad norm, seconds and, for
        our strategies, the seconds blocked on communication (minidist.comm's tracer)."""
        torch.set_rng_state(self.rng)
        with comm.CommTracer() as tracer:
            start = time.perf_counter()
            loss, norm = optimizer_step_over(self.strategy, micro_batches,
                                             lambda out, y: task_loss(out, y, self.is_text),
                                             self.max_norm, self.scaler, self._autocast)
            self.scheduler.step()
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize(self.ctx.device)
            seconds = time.perf_counter() - start
        self.rng = torch.get_rng_state()
        return {"loss": loss.float(), "grad_norm": float(norm), "seconds": seconds,
                "blocked_s": tracer.blocked_s if self.strategy.traces_comm else None}
