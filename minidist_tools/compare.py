"""recipes/compare.py's body: check the config, start (or be) the ranks, write the report.

    status = launch(cfg, run_dir, command)   # 0, 1 (a minidist strategy off its reference), 2 (config error)

The comparison's command line: `python recipes/compare.py`, `minidist compare`.

Exit status: 0; 1 when a minidist strategy's final parameters differ from its reference's by
more than compare.tolerance (a regression check for CI); 2 for a config error (one line saying
what and how to fix it).

One strategy in a comparison: its own model copy, optimizer, schedule and random stream.

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
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import minidist
from minidist import comm
from minidist.dist import launch_rank
from minidist.profiling import record_step
from minidist.train.app import RanksFailed, run_ranks
from minidist.train.config import ConfigError
from minidist.train.config_check import grad_accum_steps
from minidist.train.models import count_parameters
from minidist.train.state import build_data, build_training_state
from minidist.train.strategies import names as strategy_names, spec
from minidist_tools.benchmarking import PeakSampler, live_tensor_bytes, rotated, slowest
from minidist_tools.report import (all_plots, base_of, build_rows, console_table, environment_info, regressions,
                                   targets_lines, transports_line, variant_options, write_outputs)


@dataclass
class ReplicaStep:
    """One optimizer step of a replica, on this rank."""

    loss: torch.Tensor          # the mean micro-batch loss (a 0-d float tensor)
    grad_norm: float            # the global gradient norm before clipping
    seconds: float              # this rank's wall time of the step (synchronised on CUDA)
    blocked_s: float | None     # seconds blocked on communication (minidist.comm's tracer); None if it cannot see it
    sent_bytes: dict            # per op, the ring-model bytes this rank sent (the tracer's; {} if it cannot see it)
    transports: set             # how its collectives ran ("shm", "ring", "backend": comm.choose_algorithm; the tracer's)


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
                           {op: row["sent_bytes"] for op, row in tracer.summary().items()} if traced else {},
                           {r.algorithm for r in tracer.records if r.op not in ("barrier", "all_gather_object")}
                           if traced else set())


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

    per = {n: {"loss": [], "grad_norm": [], "step_s": [], "blocked_s": [], "sent_bytes": [], "transports": []}
           for n in names}
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
                row["transports"] = sorted(set(row["transports"]) | m.transports)
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


def check_strategies(cfg) -> None:
    """The strategies list itself: known names, no repeats, DeepSpeed installed when asked for."""
    names = list(cfg.compare.strategies)
    if not names:
        raise ConfigError("compare.strategies is empty: name at least one, e.g. compare.strategies=[ddp,native_ddp]")
    known = strategy_names()
    variants = cfg.compare.get("variants") or {}
    for name, v in variants.items():
        if name in known:
            raise ConfigError(f"compare.variants.{name}: a strategy has that name; give the variant its own")
        if v is None or v.get("of") not in known:
            raise ConfigError(f"compare.variants.{name}: needs `of`, the strategy it varies (one of {list(known)}), "
                              "e.g. {of: zero3, param_wire: int8}")
    unknown = [n for n in names if n not in known and n not in variants]
    if unknown:
        raise ConfigError(f"compare.strategies: {unknown} unknown; choose from {list(known)} or name a "
                          "compare.variants entry")
    if len(set(names)) != len(names):
        raise ConfigError(f"compare.strategies={names} names a strategy twice: each runs once per step")
    if any(spec(base_of(n, variants)).kind == "deepspeed" for n in names):
        import torch

        from minidist_tools.deepspeed import import_deepspeed

        gpu = torch.cuda.is_available() and str(cfg.launcher.backend) != "gloo"
        import_deepspeed("cuda" if gpu else "cpu")  # a ConfigError saying how to install it, if missing
    for key in ("steps", "warmup"):
        value = cfg.compare[key]
        if not isinstance(value, int) or value < (1 if key == "steps" else 0):
            raise ConfigError(f"compare.{key}={value!r} must be an integer >= {1 if key == 'steps' else 0}")
    for key in ("tolerance", "loss_tolerance"):
        if not float(cfg.compare[key]) >= 0:
            raise ConfigError(f"compare.{key}={cfg.compare[key]!r} must be >= 0")
    unknown_refs = {k: v for k, v in cfg.compare.references.items()
                    if (k not in known and k not in variants) or (v not in known and v not in variants)}
    if unknown_refs:
        raise ConfigError(f"compare.references: {unknown_refs} names unknown strategies; choose from {list(known)}")
    if str(cfg.trainer.precision) == "fp16":
        raise ConfigError("trainer.precision=fp16: the comparison runs fp32 or bf16 (loss scaling differs between "
                          "DeepSpeed and torch's GradScaler, so the runs would not be comparable); use fp32 or bf16")


def validate_each(cfg, world_size: int, run_dir: Path) -> None:
    """The trainer's own checks (model/data match, batch sizes, ranks vs samples) for every strategy."""
    from minidist.train.config_check import validate

    for name, options in cfg.compare.options.items():
        single = OmegaConf.merge(cfg, {"strategy": options})
        validate(single, world_size, run_dir)


def write_report(results: dict, cfg, run_dir: Path, command: str) -> int:
    """Rank 0's (or the launching process's) last part: every output, the console table, the status."""
    from minidist.profiling import write_chrome_trace

    rows = build_rows(results, cfg.compare)
    timeline_files = []
    if bool(cfg.compare.timeline):
        for name, traces in results["timelines"].items():
            path = run_dir / f"timeline_{name}.json"
            write_chrome_trace(traces, path, name)
            timeline_files.append(path.name)
    results["timeline_files"] = timeline_files
    files = write_outputs(results, rows, run_dir, environment_info(results["backend"]), command)
    plots = all_plots(results, rows, run_dir, bool(cfg.compare.timeline))
    print("\n" + console_table(rows))
    for line in targets_lines(rows):
        print(line)
    transports = transports_line(rows, results["backend"])
    if transports:
        print(f"- collectives: {transports}")
    print(f"\nreport       {files['report']}\nresults      {files['csv']}, {files['json']}, {files['losses']}\n"
          f"plots        {', '.join(p.name for p in plots)}\n"
          f"tensorboard  tensorboard --logdir {files['tensorboard']}")
    failed = regressions(rows)
    if failed:
        by_params = [n for n in failed if rows[n]["checked_by"] == "parameters"]
        by_loss = [n for n in failed if rows[n]["checked_by"] == "loss"]
        problems = []
        if by_params:
            details = ", ".join(f"{n} vs {rows[n]['reference']}: {rows[n]['final_param_diff']:.3g}" for n in by_params)
            problems.append(f"final parameters differ beyond compare.tolerance={float(cfg.compare.tolerance):g} "
                            f"({details})")
        if by_loss:
            details = ", ".join(f"{n} vs {rows[n]['reference']}: {rows[n]['final_loss_diff']:.2%}" for n in by_loss)
            problems.append(f"final loss differs beyond compare.loss_tolerance="
                            f"{float(cfg.compare.loss_tolerance):g} ({details})")
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def _rank_main(cfg_dict: dict, run_dir: str, command: str) -> int | None:
    """One rank: compare, then rank 0 writes the report and returns the status (None elsewhere)."""
    results = compare_rank(cfg_dict, run_dir)
    if results is None:
        return None
    return write_report(results, OmegaConf.create(cfg_dict), Path(run_dir), command)


def launch(cfg, run_dir: Path, command: str) -> int:
    from minidist.train.app import world_size_for

    run_dir = Path(run_dir).absolute()
    try:
        world = world_size_for(cfg)
        validate_each(cfg, world, run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    if launch_rank() == 0:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # the resolved config, once
    try:
        statuses = run_ranks(_rank_main, nproc=world, args=(OmegaConf.to_container(cfg, resolve=True), str(run_dir),
                                                            command))
    except RanksFailed as e:
        print(f"error: the comparison failed on rank(s) {e.ranks} (their traceback is above)", file=sys.stderr)
        return 1
    return statuses.get(0) or 0


def strategy_options(name: str, compare_cfg):
    """configs/strategy/NAME.yaml (composed, so its defaults apply; a variant's: its `of`'s, with
    the variant's options), then compare.bucket_cap_mb, compare.shard_size and
    compare.overrides.NAME on top."""
    from hydra import compose
    from omegaconf import OmegaConf

    variants = compare_cfg.get("variants") or {}
    options = compose(config_name="train", overrides=[f"strategy={base_of(name, variants)}"]).strategy
    options = OmegaConf.merge(options, variant_options(name, variants))
    if compare_cfg.bucket_cap_mb is not None and "bucket_cap_mb" in options:
        options.bucket_cap_mb = float(compare_cfg.bucket_cap_mb)
    # (DiLoCo with inner=null: every rank is a worker, there are no shard groups to size)
    if compare_cfg.get("shard_size") is not None and "shard_size" in options and options.get("inner", "") is not None:
        options.shard_size = int(compare_cfg.shard_size)
    return OmegaConf.merge(options, compare_cfg.overrides.get(name, {}))


def compare(cfg) -> None:
    """Check the strategies named, then run the comparison (launch_compare.launch); exit with its status."""
    import hydra.errors
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from minidist.dist import launch_rank
    from minidist.train.config import ConfigError

    try:
        check_strategies(cfg)
        options = {name: strategy_options(name, cfg.compare) for name in cfg.compare.strategies}
    except (ConfigError, hydra.errors.MissingConfigException) as e:
        if launch_rank() == 0:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    OmegaConf.set_struct(cfg, False)
    cfg.compare.options = options
    command = f"{sys.argv[0]} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    status = launch(cfg, Path(HydraConfig.get().runtime.output_dir), command.strip())
    if status:
        sys.exit(status)


def main(argv: list[str] | None = None, prog: str = "minidist compare") -> None:
    from minidist.train.app import run_app

    run_app("compare", compare, sys.argv[1:] if argv is None else argv, prog)
