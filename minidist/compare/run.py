"""One strategy in a comparison: its own model copy, optimizer, schedule and random stream.

Every replica is built by the trainer's own builder (train/state.py): the same weights (the
model is built after seeding with trainer.seed), optimizer, schedule, autocast and clipping. It
is fed the same micro-batches as the others, so the only thing
that differs between replicas is the strategy. Each keeps its own torch RNG state and
switches to it around its step: interleaving replicas would otherwise hand each one a
different slice of one shared random stream (dropout).

The comparison on one rank: every strategy on the same weights and batches, interleaved.

    results = compare_rank(cfg_dict, run_dir)    # on every rank; rank 0 gets the results

1. Build one Replica per strategy (same initial weights, same optimizer and schedule).
2. Each step: fetch the micro-batches once, then step every replica on them in an order
   that rotates each step, so machine noise hits all strategies alike. A barrier before
   each replica's step; its time is the slowest rank's. The first `warmup` steps are
   trained but not timed.
3. One more step per replica under torch.profiler: the timeline (phases, compute,
   communication), the hidden fraction and the bytes per op of every collective call.
4. One more step per replica with live tensor bytes sampled (forward of every module,
   every 8th gradient): the peak. Model-state bytes are the strategy's own report of its
   live storages, taken just before the optimizer step (gradients still held).
5. The final full state_dict of each replica (rank 0), compared with its reference's.
Every replica takes exactly the same steps, so their final states are comparable.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import minidist
from minidist import comm
from minidist.benchmarking import PeakSampler, rotated, slowest
from minidist.measure import live_tensor_bytes
from minidist.profiling import record_step
from minidist.train.config_check import grad_accum_steps
from minidist.train.models import count_parameters
from minidist.train.state import build_data, build_training_state
from minidist.train.strategies import names as strategy_names, spec


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


NO_OVERLAP = "_no_overlap"  # the timeline's extra, e.g. ddp_no_overlap: reducing every bucket after backward


def no_overlap_variant(names: list[str]) -> str | None:
    """The strategy whose timeline without overlap the comparison also draws: the first of ours
    that can turn overlap off (strategy.overlap), on a flat world."""
    return next((n for n in names if n in strategy_names() and spec(n).kind == "minidist"
                 and "overlap" in spec(n).options and not spec(n).hybrid), None)


def _mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().double().reshape(1).to(comm.control_device())  # nccl: on the GPU, not .cpu()
    comm.all_reduce(t)
    return t.item() / dist.get_world_size()


def measure_memory(replica: Replica, micro_batches) -> dict:
    """One step with live tensor bytes sampled: model state (the strategy's report, before the
    optimizer step) and the peak this replica would have alone: its state before the step plus
    the largest rise of live bytes during it (every other replica's tensors stay constant)."""
    strategy = replica.strategy
    before_step = strategy.memory_report()  # parameters and optimizer state; gradients were freed
    at_optimizer: dict = {}
    device_type = replica.ctx.device.type  # count the tensors where the model lives (a GPU's, under nccl)
    sampler = PeakSampler(list(replica.net.modules()), list(replica.net.parameters()), device_type=device_type)
    try:
        baseline = live_tensor_bytes(device_type)
        sampler.active = True
        # gradients complete and still held before the optimizer step: what the ZeRO paper counts
        replica.step(micro_batches, before_optimizer=lambda: at_optimizer.update(strategy.memory_report()))
        sampler.sample()
    finally:
        sampler.remove()
    return {"model_state": at_optimizer, "peak_bytes": before_step["total"] + max(0, sampler.peak - baseline)}


def compare_rank(cfg_dict: dict, run_dir: str) -> dict | None:
    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = minidist.init_distributed(backend=cfg.launcher.backend, timeout_s=float(cfg.launcher.timeout_s))
    try:
        return _compare(cfg, ctx)
    finally:
        minidist.shutdown()


def _compare(cfg, ctx) -> dict | None:
    c, t = cfg.compare, cfg.trainer
    grad_accum = grad_accum_steps(cfg, ctx.world_size)
    data = build_data(cfg, ctx)  # the trainer's data and sampler (train/state.py)
    info, batches = data.info, iter(data.sampler)
    names = list(c.strategies)
    warmup, steps = int(c.warmup), int(c.steps)
    total = warmup + steps + 2  # + the profiled step and the memory step
    options = c.options
    replicas = {n: Replica(n, options[n], cfg, info, ctx, total) for n in names}
    psi = count_parameters(replicas[names[0]].net)  # a tied weight counts once
    minidist.print0(f"compare: {', '.join(names)} on {cfg.model.name} ({psi / 1e6:.2f}M parameters), "
                    f"{cfg.data.name}, {ctx.world_size} rank(s), {ctx.backend}; {warmup} warm-up + {steps} timed "
                    f"steps, interleaved; global batch {int(t.micro_batch_size) * grad_accum * ctx.world_size}")

    per = {n: {"loss": [], "grad_norm": [], "step_s": [], "blocked_s": [], "sent_bytes": []} for n in names}
    started = time.perf_counter()
    for step in range(warmup + steps):
        micro = data.micro_batches(batches, grad_accum, ctx.device)
        for n in rotated(names, step):
            comm.barrier()
            m = replicas[n].step(micro)
            row = per[n]
            row["loss"].append(_mean_over_ranks(m.loss))
            row["grad_norm"].append(m.grad_norm)
            if step >= warmup:
                row["step_s"].append(slowest(m.seconds))
                row["sent_bytes"].append(m.sent_bytes)
                if m.blocked_s is not None:
                    row["blocked_s"].append(comm.max_over_ranks(m.blocked_s))
        if ctx.rank == 0 and (step + 1) % max(1, (warmup + steps) // 5) == 0:
            print(f"  step {step + 1}/{warmup + steps} ({time.perf_counter() - started:.0f} s)", flush=True)

    # The profiled step: a timeline per replica (and, when asked, ddp without overlap).
    micro = data.micro_batches(batches, grad_accum, ctx.device)
    timelines = {}
    for n in names:
        comm.barrier()
        timelines[n] = record_step(lambda: replicas[n].step(micro), ctx.world_size, replicas[n].model,
                                   traced=replicas[n].strategy.traces_comm,
                                   op_group_sizes=replicas[n].strategy.op_group_sizes)
    base = no_overlap_variant(names) if bool(c.timeline) else None
    if base is not None:
        extra = Replica(base + NO_OVERLAP, OmegaConf.merge(options[base], {"overlap": False}), cfg, info, ctx, total)
        for _ in range(2):  # warm: the first steps allocate buckets and optimizer state
            extra.step(micro)
        comm.barrier()
        timelines[base + NO_OVERLAP] = record_step(lambda: extra.step(micro), ctx.world_size, extra.model,
                                            traced=extra.strategy.traces_comm)
        del extra

    micro = data.micro_batches(batches, grad_accum, ctx.device)
    memory = {}
    for n in names:
        comm.barrier()
        memory[n] = measure_memory(replicas[n], micro)

    finals = {n: replicas[n].strategy.full_state_dict() for n in names}  # collectives; rank 0 holds them
    gathered = comm.all_gather_object({"timelines": timelines, "memory": memory})
    if ctx.rank != 0:
        return None
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "psi": psi, "strategies": names,
        "model": cfg.model.name, "data": cfg.data.name, "warmup": warmup, "steps": steps,
        "global_batch": int(t.micro_batch_size) * grad_accum * ctx.world_size, "grad_accum": grad_accum,
        "per_step": per,
        "timelines": {n: {r: g["timelines"][n] for r, g in enumerate(gathered)} for n in timelines},
        "memory": {n: [g["memory"][n] for g in gathered] for n in names},
        "finals": finals,
        # hybrid strategies: the shard group's size, which their theory of bytes depends on
        "shard_sizes": {n: replicas[n].strategy.shard_size for n in names if replicas[n].strategy.shard_size},
        "wall_s": time.perf_counter() - started,
    }
