"""minidist's own strategies: one rank, DataParallel (flat or two-level all_reduce) and
ShardedDataParallel (ZeRO stages 1-3, flat or hybrid on a 2-D mesh).

| name             | what                                                             | checkpoint |
| single           | no wrapper, one rank                                             | full       |
| ddp              | minidist.DataParallel                                            | full       |
| ddp_hierarchical | DataParallel, all_reduce in two levels on a mesh (comm_hook=hierarchical) | full |
| zero1/2/3        | minidist.ShardedDataParallel(stage=k)                            | sharded    |
| hsdp2/3          | ShardedDataParallel(stage=k, mesh=init_mesh(shard=shard_size))   | sharded, once per shard group |

"full": rank 0 writes model.pt (the plain state_dict) and optimizer.pt. "sharded": every rank
writes its shard with the offsets that let any world size load it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from minidist.comm.wire import FORMATS
from minidist.train.config import ConfigError
from minidist.train.strategies.base import Strategy, build_mesh
from minidist.train.strategies.registry import register
from minidist.train.strategies.spec import ALL_REDUCE, ZERO3, ZERO12, StrategySpec, in_shard_groups


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
                             comm_hook=self._comm_hook(), grad_wire=c.grad_wire, quant_block=int(c.quant_block))
        return model, optim_cls(net.parameters(), **optim_kwargs)

    def _comm_hook(self):
        hook = str(self.cfg.comm_hook)
        if hook == "hierarchical":  # two-level all_reduce on a mesh of strategy.shard_size
            from minidist.parallel import HierarchicalAllReduce

            mesh = build_mesh(self.cfg)
            self.shard_size = mesh.shard
            return HierarchicalAllReduce(mesh, algorithm=str(self.cfg.get("collectives", "auto")))
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

    def optimizer_state_dict(self):
        return self.model.full_optim_state_dict(rank0_only=True)

    def load_full_state_dict(self, state):
        self.model.load_full_state_dict(state)

    def load_optimizer_state_dict(self, state):
        self.model.load_full_optim_state_dict(state)

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
        kwargs = {key: c[key] for key in self.spec.options if key != "shard_size"}
        if self.spec.hybrid:
            kwargs["mesh"] = build_mesh(c)
        if stage == 3 and self.compute_dtype is not None:  # gathered in bf16, reduced in fp32
            kwargs.update(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        model = ShardedDataParallel(net, functools.partial(optim_cls, **optim_kwargs), stage=stage, **kwargs)
        return model, model.optimizer

    @property
    def shard_size(self) -> int | None:
        return self.model.mesh.shard if self.model is not None and self.model.mesh is not None else None

    @property
    def checkpoint_shards(self) -> int:
        """How many shard files a checkpoint holds: the shard group's size (the world without a mesh)."""
        return self.model.world_size

    # -- what checkpoint_layouts.Sharded saves and loads
    def sharded_state_dict(self) -> dict:
        return self.model.sharded_state_dict()  # a collective within the shard group

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


# -- the specs: what each strategy is, sends and holds (spec.py says how they are read)
DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters", "broadcast_buffers",
               "first_bucket_mb", "last_bucket_mb", "bucket_closing", "overlap", "comm_hook", "grad_wire", "quant_block")
WIRES = (None, *FORMATS)  # what a wire option takes (minidist.comm.wire)
FLAT_HOOKS = {"comm_hook": ("allreduce", "fp16", "bf16", "powersgd"),  # the two-level one is ddp_hierarchical
              "grad_wire": WIRES}
WIRE_OPTIONS = ("grad_wire", "param_wire", "quant_block")
ZERO_OPTIONS = {1: ("bucket_cap_mb", "broadcast_buffers", "collectives", "find_unused_parameters") + WIRE_OPTIONS,
                3: ("min_unit_params", "broadcast_buffers", "collectives") + WIRE_OPTIONS}  # stage 3: units, not buckets
HPZ = ("secondary_shard",)  # flat stage 3 only: hybrid sharding gathers within the host already
ZERO_OPTIONS[2] = ZERO_OPTIONS[1]
ZERO_CHOICES = {"grad_wire": WIRES, "param_wire": WIRES}
register(StrategySpec("single", "minidist", Single, "no wrapper, one rank: the reference the others must match",
                      collectives=(), single_rank=True))
register(StrategySpec("ddp", "minidist", OursDDP, "minidist.DataParallel: bucketed all_reduce overlapped with "
                      "backward", reference="native_ddp", collectives=ALL_REDUCE, options=DDP_OPTIONS,
                      choices=FLAT_HOOKS))
register(StrategySpec("ddp_hierarchical", "minidist", OursDDP, "DataParallel with the two-level all_reduce: "
                      "reduce_scatter in each shard group, all_reduce of 1/S across, all_gather within",
                      reference="native_ddp", hybrid=True, collectives=in_shard_groups(ZERO12),
                      options=DDP_OPTIONS + ("shard_size", "collectives"),
                      choices={"comm_hook": ("hierarchical",), "grad_wire": (None,)}))
for _stage, _collectives in ((1, ZERO12), (2, ZERO12), (3, ZERO3)):
    register(StrategySpec(f"zero{_stage}", "minidist", OursZero, f"minidist.ShardedDataParallel stage {_stage}",
                          checkpoint="sharded", reference={1: "native_zero1", 2: "ds_zero2", 3: "native_fsdp"}[_stage],
                          zero_stage=_stage, messages="units" if _stage == 3 else "buckets",
                          collectives=_collectives, options=ZERO_OPTIONS[_stage] + (HPZ if _stage == 3 else ()),
                          choices=ZERO_CHOICES,
                          flat_optimizer_shards=True))
for _stage, _collectives in ((2, ZERO12), (3, ZERO3)):
    register(StrategySpec(f"hsdp{_stage}", "minidist", OursZero, f"ShardedDataParallel stage {_stage} on a mesh: "
                          "sharded within shard groups of strategy.shard_size ranks, replicated across them",
                          checkpoint="sharded", reference={2: "native_ddp", 3: "native_hsdp"}[_stage],
                          zero_stage=_stage, hybrid=True, messages="units" if _stage == 3 else "buckets",
                          collectives=in_shard_groups(_collectives),
                          options=ZERO_OPTIONS[_stage] + ("shard_size",), choices=ZERO_CHOICES,
                          flat_optimizer_shards=True))
