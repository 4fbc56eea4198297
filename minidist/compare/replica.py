"""One strategy in a comparison: its own model copy, optimizer, schedule and random stream.

Every replica is built by the trainer's own builder (train/state.py): the same weights (the
model is built after seeding with trainer.seed), optimizer, schedule, autocast and clipping. It
is fed the same micro-batches as the others, so the only thing
that differs between replicas is the strategy. Each keeps its own torch RNG state and
switches to it around its step: interleaving replicas would otherwise hand each one a
different slice of one shared random stream (dropout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from minidist import comm
from minidist.train.state import build_training_state


@dataclass
class ReplicaStep:
    """One optimizer step of a replica, on this rank."""

    loss: torch.Tensor          # the mean micro-batch loss (a 0-d float tensor)
    grad_norm: float            # the global gradient norm before clipping
    seconds: float              # this rank's wall time of the step (synchronised on CUDA)
    blocked_s: float | None     # seconds blocked on communication (minidist.comm's tracer); None if it cannot see it
    sent_bytes: dict            # per op, the ring-model bytes this rank sent (the tracer's; {} if it cannot see it)


class Replica:
    def __init__(self, name: str, options, cfg, info, ctx, total_steps: int):
        self.name, self.ctx, self.cfg = name, ctx, cfg
        self.state = build_training_state(cfg, options, ctx, info, total_steps)  # as the trainer builds it
        self.net, self.model, self.strategy = self.state.net, self.state.model, self.state.strategy
        torch.manual_seed(int(cfg.trainer.seed) + 1000 * ctx.rank)  # the trainer's per-rank stream
        self.rng = torch.get_rng_state()

    def step(self, micro_batches, before_optimizer: Callable[[], object] | None = None) -> ReplicaStep:
        """One optimizer step on `micro_batches` (before_optimizer: see accumulate_and_step)."""
        torch.set_rng_state(self.rng)
        with comm.CommTracer() as tracer:
            start = time.perf_counter()
            loss, norm = self.state.step(micro_batches, before_optimizer=before_optimizer)
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize(self.ctx.device)
            seconds = time.perf_counter() - start
        self.rng = torch.get_rng_state()
        traced = self.strategy.traces_comm
        return ReplicaStep(loss.float(), float(norm), seconds, tracer.blocked_s if traced else None,
                           {op: row["sent_bytes"] for op, row in tracer.summary().items()} if traced else {})
