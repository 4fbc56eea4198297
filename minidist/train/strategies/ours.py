"""minidist's own strategies: single, ddp, ddp_hierarchical (DataParallel), zero1-3 and hsdp2/3
(ShardedDataParallel, flat or on a 2-D mesh), diloco and diloco_streaming (workers of one rank or
strategy.shard_size ranks). The table with each one's checkpoint layout: docs/internals.md,
"train/strategies/ours.py".
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from minidist.comm import ALGORITHMS
from minidist.comm.wire import FORMATS
from minidist.measure import measure
from minidist.parallel.diloco import DiLoCo
from minidist.train.config import ConfigError
from minidist.train.optim import merged_state_dicts, split_state_dict
from minidist.train.strategies.base import Strategy, build_mesh
from minidist.train.strategies.registry import (ACCUMULATE, ALL_REDUCE, Collective, StrategySpec, ZERO12, ZERO3,
                                                in_shard_groups, register)


class Single(Strategy):
    """One process, no wrapper: the reference every other strategy must match."""

    def _wrap(self, net, optim_cls, optim_kwargs):
        if self.ctx.world_size != 1:
            raise ConfigError(f"strategy={self.name} runs on one rank, but the world has {self.ctx.world_size}: "
                              "use launcher.nproc=1, or a data-parallel strategy such as strategy=ddp")
        return net, optim_cls(net.parameters(), **optim_kwargs)

    def no_sync(self):
        return contextlib.nullcontext()


class OursDDP(Strategy):
    """minidist.DataParallel; on a mesh (the hybrid spec, whose comm_hook is hierarchical) its
    all_reduce runs in two levels."""

    def _wrap(self, net, optim_cls, optim_kwargs):
        from minidist import DataParallel

        # Native DDP, given a bucket_cap_mb, makes its first bucket that size too (its 1 MiB first
        # bucket is only for the default cap): so do we unless told otherwise, and both sides
        # bucket alike. first_bucket_mb=1 gives our small first and last buckets (overlap
        # from the first gradients on; pays where communication has cores of its own).
        c = self.cfg
        cap = float(c.bucket_cap_mb)
        first = cap if c.first_bucket_mb is None else float(c.first_bucket_mb)
        model = DataParallel(net, bucket_cap_mb=cap, first_bucket_mb=first,
                             last_bucket_mb=first if c.last_bucket_mb is None else float(c.last_bucket_mb),
                             bucket_closing=str(c.bucket_closing),
                             gradient_as_bucket_view=bool(c.gradient_as_bucket_view),
                             find_unused_parameters=bool(c.find_unused_parameters),
                             broadcast_buffers=bool(c.broadcast_buffers),
                             overlap=bool(c.overlap),
                             comm_hook=self._comm_hook(), grad_wire=c.grad_wire, quant_block=int(c.quant_block),
                             collectives=str(c.collectives))
        return model, optim_cls(net.parameters(), **optim_kwargs)

    def _comm_hook(self):
        hook = str(self.cfg.comm_hook)
        if hook == "hierarchical":  # two-level all_reduce on a mesh of strategy.shard_size
            from minidist.parallel import HierarchicalAllReduce

            mesh = build_mesh(self.cfg)
            self.shard_size = mesh.shard
            return HierarchicalAllReduce(mesh, algorithm=str(self.cfg.collectives))
        return hook

    def memory_report(self):
        return self.model.memory_report(self.optimizer)


class ShardedModelState:
    """What a strategy whose model is a ShardedDataParallel (self.model) answers from it: the
    global norm, the whole state_dicts gathered from the shards, loading into them, memory."""

    def clip_grad_norm_(self, max_norm):
        return self.model.clip_grad_norm_(max_norm)

    def full_state_dict(self):
        return self.model.full_state_dict(rank0_only=True)

    def optimizer_state_dict(self, on=0):
        """Each of model.optimizers' whole state (one, or optim=muon's two numbered on as one), on
        rank `on` of the shard group (of each replica's, with a mesh; of the worker's, in DiLoCo)."""
        states = [self.model.full_optim_state_dict(o, rank0_only=on == 0) for o in self.model.optimizers]
        return merged_state_dicts(states) if self.model.rank == on else {}

    def load_full_state_dict(self, state):
        self.model.load_full_state_dict(state)

    def load_optimizer_state_dict(self, state):
        optimizers = self.model.optimizers
        for o, part in zip(optimizers, split_state_dict(state, optimizers)):
            self.model.load_full_optim_state_dict(part, o)

    def numbered_parameters(self):
        """As a native optimizer over the module numbers them (full_optim_state_dict's form)."""
        return self.model.full_param_groups

    def memory_report(self):
        return self.model.memory_report()


class OursZero(ShardedModelState, Strategy):
    """ShardedDataParallel at the spec's ZeRO stage: each rank checkpoints its own shard (loadable
    at any world size). Hybrid specs (hsdp2/hsdp3): the same on a mesh of shard groups of
    `shard_size` ranks (null: one per host); only the first replica writes the shards, the other
    replicas hold the same ones."""

    def _wrap(self, net, optim_cls, optim_kwargs):
        from minidist import ShardedDataParallel

        stage, c = self.spec.zero_stage, self.cfg
        # The options this stage takes (its spec's), as the config gives them; shard_size makes the mesh.
        kwargs = {key: c[key] for key in self.spec.options if key not in ("shard_size", *ACCUMULATE)}
        if self.spec.hybrid:
            kwargs["mesh"] = build_mesh(c)
        if stage == 3 and self.compute_dtype is not None:  # gathered in bf16, reduced in fp32
            kwargs.update(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        optimizer = optim_cls(net.parameters(), **optim_kwargs)  # adopted: its groups rebound to the shards
        return ShardedDataParallel(net, optimizer, stage=stage, **kwargs), optimizer

    @property
    def shard_size(self) -> int | None:
        return self.model.mesh.shard if self.model is not None and self.model.mesh is not None else None

    @property
    def checkpoint_shards(self) -> int:
        """How many shard files a checkpoint holds: the shard group's size (the world without a mesh)."""
        return self.model.world_size

    # -- what checkpoint_layouts.Sharded saves and loads
    def sharded_state_dict(self) -> dict:
        return self.model.sharded_state_dict(copy=False)  # views: the checkpoint copies them once

    def load_sharded_state_dict(self, state) -> None:
        self.model.load_sharded_state_dict(state)

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group: the shard file it reads at the same shard count."""
        return self.model.rank

    @property
    def writes_shard(self) -> bool:
        """The first replica writes the shards; the others hold the same ones."""
        return self.model.mesh is None or self.model.mesh.replica == 0


# -- the specs: what each strategy is, sends and holds (registry.py says how they are read)
DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters", "broadcast_buffers",
               "first_bucket_mb", "last_bucket_mb", "bucket_closing", "overlap", "comm_hook", "grad_wire", "quant_block", "collectives")
WIRES = (None, *FORMATS)  # what a wire option takes (minidist.comm.wire)
FLAT_HOOKS = {"comm_hook": ("allreduce", "fp16", "bf16", "powersgd"),  # the two-level one is ddp_hierarchical
              "grad_wire": WIRES, "collectives": ALGORITHMS}
WIRE_OPTIONS = ("grad_wire", "param_wire", "quant_block")
ZERO_OPTIONS = {1: ("bucket_cap_mb", "broadcast_buffers", "collectives", "find_unused_parameters") + WIRE_OPTIONS,
                3: ("min_unit_params", "broadcast_buffers", "collectives") + WIRE_OPTIONS}  # stage 3: units, not buckets
HPZ = ("secondary_shard",)  # flat stage 3 only: hybrid sharding gathers within the host already
ZERO_OPTIONS[2] = ZERO_OPTIONS[1] + tuple(ACCUMULATE)
ZERO_OPTIONS[3] += tuple(ACCUMULATE)
ZERO_CHOICES = {1: {"grad_wire": WIRES, "param_wire": WIRES, "collectives": ALGORITHMS}}
ZERO_CHOICES[2] = ZERO_CHOICES[3] = {**ZERO_CHOICES[1], **ACCUMULATE}
register(StrategySpec("single", "minidist", Single, "no wrapper, one rank: the reference the others must match",
                      collectives=(), single_rank=True))
register(StrategySpec("ddp", "minidist", OursDDP, "minidist.DataParallel: bucketed all_reduce overlapped with "
                      "backward", reference="native_ddp", collectives=ALL_REDUCE, options=DDP_OPTIONS,
                      choices=FLAT_HOOKS))
register(StrategySpec("ddp_hierarchical", "minidist", OursDDP, "DataParallel with the two-level all_reduce: "
                      "reduce_scatter in each shard group, all_reduce of 1/S across, all_gather within",
                      reference="native_ddp", hybrid=True, collectives=in_shard_groups(ZERO12),
                      options=DDP_OPTIONS + ("shard_size",),
                      choices={"comm_hook": ("hierarchical",), "grad_wire": (None,), "collectives": ALGORITHMS}))
for _stage, _collectives in ((1, ZERO12), (2, ZERO12), (3, ZERO3)):
    register(StrategySpec(f"zero{_stage}", "minidist", OursZero, f"minidist.ShardedDataParallel stage {_stage}",
                          checkpoint="sharded", reference={1: "native_zero1", 2: "ds_zero2", 3: "native_fsdp"}[_stage],
                          zero_stage=_stage, messages="units" if _stage == 3 else "buckets",
                          collectives=_collectives, options=ZERO_OPTIONS[_stage] + (HPZ if _stage == 3 else ()),
                          choices=ZERO_CHOICES[_stage],
                          flat_optimizer_shards=True))
for _stage, _collectives in ((2, ZERO12), (3, ZERO3)):
    register(StrategySpec(f"hsdp{_stage}", "minidist", OursZero, f"ShardedDataParallel stage {_stage} on a mesh: "
                          "sharded within shard groups of strategy.shard_size ranks, replicated across them",
                          checkpoint="sharded", reference={2: "native_ddp", 3: "native_hsdp"}[_stage],
                          zero_stage=_stage, hybrid=True, messages="units" if _stage == 3 else "buckets",
                          collectives=in_shard_groups(_collectives),
                          options=ZERO_OPTIONS[_stage] + ("shard_size",), choices=ZERO_CHOICES[_stage],
                          flat_optimizer_shards=True))


ZERO_INNER = {"zero1": 1, "zero2": 2, "zero3": 3}  # strategy.inner -> its ZeRO stage within the worker
INNER = (None, "ddp", *ZERO_INNER)  # what synchronises a worker's ranks every step


class DiLoCoStrategy(Strategy):
    """A worker's inner data parallelism (none, or minidist.DataParallel within the host) and the
    outer loop (minidist.DiLoCo) across the workers."""

    def _wrap(self, net, optim_cls, optim_kwargs):
        import torch.distributed as dist

        import minidist

        c = self.cfg
        if c.inner is None and c.get("shard_size") not in (None, 1):
            raise ConfigError(f"strategy.shard_size={c.shard_size} with strategy.inner=null: each rank is a worker; "
                              "set strategy.inner=ddp (or zero1-3) for workers of several ranks")
        self.mesh = minidist.init_mesh(replicate=dist.get_world_size(), shard=1) if c.inner is None \
            else build_mesh(c)
        self.shard_size = self.mesh.shard
        model, optimizer = self._inner(net, optim_cls, optim_kwargs)
        try:
            self.outer = DiLoCo(net.parameters(), sync_every=c.sync_every, outer_lr=float(c.outer_lr),
                                outer_momentum=float(c.outer_momentum), fragments=c.get("fragments", 1),
                                sync_delay=c.get("sync_delay", 0), mixing=float(c.get("mixing", 0.0)),
                                wire=self._outer_wire(), across_group=self.mesh.replicate_group,
                                total_steps=self.total_steps, **self._placement(model))
        except ValueError as e:  # the schedule's checks name the option: say it is the strategy's
            raise ConfigError(f"strategy.{e}") from None
        return model, optimizer

    def _inner(self, net, optim_cls, optim_kwargs):
        """The worker's model and inner optimizer: net itself (inner=null) or DataParallel over the
        worker's ranks (inner=ddp), and the run's optimizer over its parameters."""
        from minidist import DataParallel

        c = self.cfg
        model = net if c.inner is None else DataParallel(
            net, process_group=self.mesh.shard_group, bucket_cap_mb=float(c.bucket_cap_mb),
            grad_wire=c.grad_wire, quant_block=int(c.quant_block))
        return model, optim_cls(net.parameters(), **optim_kwargs)

    def _placement(self, model) -> dict:
        """How DiLoCo finds a worker's ranks: each holds the whole parameters."""
        return {"worker_group": self.mesh.shard_group if self.mesh.shard > 1 else None}

    def _outer_wire(self):
        from minidist.comm.wire import as_wire

        return as_wire(self.cfg.outer_wire, self.cfg.quant_block)

    _restarted = False  # load_portable: the weights came from another strategy's checkpoint

    @property
    def checkpoint_shards(self) -> int:
        """A checkpoint's worker files: one per worker."""
        return self.mesh.replicate

    @property
    def worker(self) -> int:
        """Which worker this rank belongs to."""
        return self.mesh.replica

    @property
    def worker_rank(self) -> int:
        """This rank's place within its worker."""
        return self.mesh.shard_rank

    def no_sync(self):
        return contextlib.nullcontext() if self.cfg.inner is None else self.model.no_sync()

    # Each worker keeps its own loss scale: its gradients are its own, so no agreement across
    # workers (within one, DDP made the gradients equal already).
    agrees_on_overflow = False

    def optimizer_step(self, max_norm: float, scaler):
        """The inner step (unscale, clip by the worker's gradient norm, step, zero_grad), then the
        outer loop's turn."""
        norm = super().optimizer_step(max_norm, scaler)
        self.outer.after_inner_step()
        return norm

    def load_portable(self, model_state: dict, optim_state: dict) -> None:
        """Another strategy's checkpoint: its weights and optimizer state on every worker, and a
        new round from those weights (resumed_at sets the step)."""
        super().load_portable(model_state, optim_state)
        self._restarted = True

    def resumed_at(self, step: int) -> None:
        if self._restarted:
            self.outer.restart(step)
        elif self.outer.step != step:
            raise RuntimeError(f"the checkpoint's outer state is at step {self.outer.step}, its meta at {step}")

    # -- what checkpoint_layouts.Workers saves and loads
    def worker_state(self) -> dict:
        """This worker's weights and inner optimizer state, on its first rank ({} elsewhere)."""
        if self.worker_rank != 0:
            return {}
        return {"model": {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()},
                "optimizer": self.name_groups(self.optimizer.state_dict())}

    def load_worker_state(self, state: dict) -> None:
        """What worker_state saved, into this worker (each rank of a ZeRO worker keeps its slices)."""
        self.load_full_state_dict(state["model"])
        self.load_optimizer_state_dict(state["optimizer"])

    def memory_report(self):
        return with_outer_state(super().memory_report(), self.outer)


class DiLoCoOverZero(ShardedModelState, DiLoCoStrategy):
    """DiLoCo whose workers run ZeRO within themselves (strategy.inner=zero1 | zero2 | zero3): each
    rank holds 1/S of the worker's model state, and the outer loop works on its master shards."""

    def _inner(self, net, optim_cls, optim_kwargs):
        """ShardedDataParallel at the inner stage over the worker's ranks, with the run's optimizer."""
        from minidist import ShardedDataParallel

        c, stage = self.cfg, ZERO_INNER[self.cfg.inner]
        kwargs = {"grad_wire": c.grad_wire, "quant_block": int(c.quant_block)}
        if stage < 3:
            kwargs["bucket_cap_mb"] = float(c.bucket_cap_mb)
        else:  # as strategy=zero3: units by size, gathered in bf16 and reduced in fp32 under bf16
            kwargs["min_unit_params"] = c.get("min_unit_params")
            if self.compute_dtype is not None:
                kwargs.update(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        optimizer = optim_cls(net.parameters(), **optim_kwargs)
        return ShardedDataParallel(net, optimizer, stage=stage, process_group=self.mesh.shard_group,
                                   **kwargs), optimizer

    def _placement(self, model) -> dict:
        """DiLoCo works on each rank's master shards."""
        return {"sharded_by": model}

    def worker_state(self) -> dict:
        """As DiLoCoStrategy's, gathered from the worker's shards (a collective within the worker):
        the same files whatever the inner strategy."""
        model, optim = self.full_state_dict(), self.optimizer_state_dict()
        if self.worker_rank != 0:
            return {}
        return {"model": {k: v.detach().cpu() for k, v in model.items()}, "optimizer": self.name_groups(optim)}

    def memory_report(self):
        return with_outer_state(self.model.memory_report(), self.outer)


def with_outer_state(report: dict, outer) -> dict:
    """A memory report with what the outer loop adds (`outer_state`, measured) in its total."""
    extra = measure({"outer_state": outer.memory_tensors()})["outer_state"]
    return {**{k: v for k, v in report.items() if k != "total"}, "outer_state": extra,
            "total": report["total"] + extra}


def diloco_strategy(cfg, ctx, compute_dtype=None) -> DiLoCoStrategy:
    """The DiLoCo strategy for strategy.inner: ZeRO within the worker, or whole parameters."""
    cls = DiLoCoOverZero if cfg.get("inner") in ZERO_INNER else DiLoCoStrategy
    return cls(cfg, ctx, compute_dtype)


# The outer all_reduce: each rank's 1/S of the model across the workers, then the worker's ranks
# gather the updated slices; both once per round of sync_every steps. The inner DDP's all_reduce
# within a worker runs every step (nothing at S = 1, one rank per worker).
OUTER_ALL_REDUCE = Collective("all_reduce", group="replicas", payload="shard", per_round=True, wire="outer_wire")
LOCAL_SGD = (Collective("all_reduce", group="shard", wire="grad_wire"), OUTER_ALL_REDUCE,
             Collective("all_gather", group="shard", per_round=True))


def with_inner(s: StrategySpec, options) -> StrategySpec:
    """DiLoCo's spec under strategy.inner: with ZeRO within the worker, the stage's collectives in
    the worker every step and its model state sharded over the worker's S ranks; once a round the
    outer all_reduce, and at stages 1-2 the gather of the written master shards (stage 3's next
    forward gathers them anyway)."""
    stage = ZERO_INNER.get(options.get("inner"))
    if stage is None:
        return s
    inner = tuple(Collective(c.op, "shard", c.payload, c.count, wire=c.wire) for c in (ZERO3 if stage == 3 else ZERO12))
    regather = () if stage == 3 else (Collective("all_gather", group="shard", per_round=True),)
    return dataclasses.replace(s, zero_stage=stage, messages="units" if stage == 3 else "buckets",
                               collectives=inner + (OUTER_ALL_REDUCE,) + regather, flat_optimizer_shards=True)


OPTIONS = ("inner", "shard_size", "sync_every", "outer_lr", "outer_momentum", "outer_wire", "quant_block",
           "bucket_cap_mb", "min_unit_params", "grad_wire")
CHOICES = {"inner": INNER, "outer_wire": WIRES, "grad_wire": WIRES}
for _name, _extra, _summary in (
        ("diloco", (), "DiLoCo: the run's optimizer inner on each worker, an outer Nesterov SGD on the "
                       "pseudo-gradients averaged every sync_every steps"),
        ("diloco_streaming", ("fragments", "sync_delay", "mixing"),
         "streaming DiLoCo: DiLoCo with the model in fragments synced at staggered steps, each all_reduce "
         "overlapped with the next sync_delay inner steps")):
    register(StrategySpec(_name, "minidist", diloco_strategy, _summary, checkpoint="workers", reference="ddp",
                          hybrid=True, collectives=LOCAL_SGD, options=OPTIONS + _extra, choices=CHOICES,
                          checked_by="loss", outer_copies=2, configured=with_inner))
