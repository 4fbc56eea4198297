"""Every data-parallel strategy behind one interface, so the trainer has one loop.

    strategy = build_strategy(cfg.strategy, ctx)
    model, optimizer = strategy.wrap(net, torch.optim.AdamW, {"lr": 3e-4})
    with strategy.no_sync(): loss.backward()      # accumulate without communication
    strategy.backward(loss)                       # loss.backward(), or the engine's (DeepSpeed)
    strategy.clip_grad_norm_(1.0)                 # the global norm, whatever is sharded
    strategy.optimizer_step(1.0, scaler)          # unscale, clip, step, zero_grad; returns the norm
    strategy.save(directory) / strategy.load(directory, saved_shards)
    strategy.full_state_dict()                    # rank 0: the plain state_dict of net
    strategy.memory_report()                      # bytes on this rank, from live storages

| name         | what                                                        | checkpoint |
| single       | no wrapper, one rank                                        | full       |
| ddp          | minidist.DataParallel                                       | full       |
| zero1/2/3    | minidist.ShardedDataParallel(stage=k)                       | sharded    |
| hsdp2/3      | ShardedDataParallel(stage=k, mesh=init_mesh(shard=shard_size)) | sharded, once per shard group |
| native_ddp   | torch DistributedDataParallel                               | full       |
| native_zero1 | DistributedDataParallel + ZeroRedundancyOptimizer           | full       |
| native_fsdp  | fully_shard per unit (the units our stage 3 would pick), root | full     |
| native_hsdp  | the same on a 2-D DeviceMesh (replicate x shard_size): FSDP2's HSDP | full   |
| ds_zero1/2/3 | DeepSpeed's ZeRO engine (optional: minidist/train/deepspeed_strategy.py) | per rank |

"full": rank 0 writes model.pt (the plain state_dict) and optimizer.pt. "sharded":
every rank writes its shard with the offsets that let any world size load it.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from torch import nn

from minidist.train.errors import ConfigError
from minidist.train.safe_load import load_tensors, save_tensors
from minidist.train.strategy_base import (Strategy, agree_on_overflow, local_tensor,  # noqa: F401  (public here too)
                                          step_unless_nonfinite)

OURS = ("single", "ddp", "zero1", "zero2", "zero3", "hsdp2", "hsdp3")
NATIVE = ("native_ddp", "native_zero1", "native_fsdp", "native_hsdp")
DEEPSPEED = ("ds_zero1", "ds_zero2", "ds_zero3")
STRATEGIES = OURS + NATIVE + DEEPSPEED


class Single(Strategy):
    """One process, no wrapper: the reference every other strategy must match."""

    name = "single"

    def _wrap(self, net, optim_cls, optim_kwargs):
        if self.ctx.world_size != 1:
            raise ConfigError(f"strategy=single runs on one rank, but the world has {self.ctx.world_size}: "
                              "use launcher.nproc=1, or a data-parallel strategy such as strategy=ddp")
        return net, optim_cls(net.parameters(), **optim_kwargs)

    def no_sync(self):
        return contextlib.nullcontext()


class OursDDP(Strategy):
    name = "ddp"

    def _wrap(self, net, optim_cls, optim_kwargs):
        from minidist import DataParallel

        # Native DDP, given a bucket_cap_mb, makes its first bucket that size too (its 1 MiB first
        # bucket is only for the default cap): so do we unless told otherwise, and both sides
        # bucket alike. first_bucket_mb=1 gives our small first and last buckets (overlap
        # from the first gradients on; pays where communication has cores of its own).
        cap = float(self.cfg.bucket_cap_mb)
        first = self.cfg.get("first_bucket_mb")
        first = cap if first is None else float(first)
        last = self.cfg.get("last_bucket_mb")
        model = DataParallel(net, bucket_cap_mb=cap, first_bucket_mb=first,
                             last_bucket_mb=first if last is None else float(last),
                             bucket_closing=str(self.cfg.get("bucket_closing", "reach")),
                             gradient_as_bucket_view=bool(self.cfg.gradient_as_bucket_view),
                             find_unused_parameters=bool(self.cfg.find_unused_parameters),
                             broadcast_buffers=bool(self.cfg.broadcast_buffers),
                             overlap=bool(self.cfg.get("overlap", True)),
                             comm_hook=self._comm_hook())
        return model, optim_cls(net.parameters(), **optim_kwargs)

    def _comm_hook(self):
        hook = str(self.cfg.get("comm_hook", "allreduce"))
        if hook == "hierarchical":  # two-level all_reduce on a mesh of strategy.shard_size
            from minidist.parallel import HierarchicalAllReduce

            return HierarchicalAllReduce(build_mesh(self.cfg), algorithm=str(self.cfg.get("collectives", "auto")))
        return hook

    def memory_report(self):
        return self.model.memory_report(self.optimizer)


class OursZero(Strategy):
    """ShardedDataParallel: each rank checkpoints its own shard (loadable at any world size).
    hsdp2/hsdp3: the same on a mesh of shard groups of `shard_size` ranks (null: one per host);
    only the first replica writes the shards, the other replicas hold the same ones."""

    sharded_checkpoint = True

    def __init__(self, cfg, ctx, stage: int, hybrid: bool = False, compute_dtype: torch.dtype | None = None):
        super().__init__(cfg, ctx, compute_dtype)
        self.stage, self.hybrid = stage, hybrid
        self.name = f"{'hsdp' if hybrid else 'zero'}{stage}"

    def _wrap(self, net, optim_cls, optim_kwargs):
        from minidist import ShardedDataParallel

        kwargs = {"min_unit_params": int(self.cfg.min_unit_params)} if self.stage == 3 else \
            {"bucket_cap_mb": float(self.cfg.bucket_cap_mb)}
        kwargs["broadcast_buffers"] = bool(self.cfg.get("broadcast_buffers", True))
        kwargs["collectives"] = str(self.cfg.get("collectives", "auto"))
        kwargs["find_unused_parameters"] = bool(self.cfg.get("find_unused_parameters", False))
        if self.hybrid:
            kwargs["mesh"] = build_mesh(self.cfg)
        if self.stage == 3 and self.compute_dtype is not None:  # gathered in bf16, reduced in fp32
            kwargs.update(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        model = ShardedDataParallel(net, functools.partial(optim_cls, **optim_kwargs), stage=self.stage, **kwargs)
        return model, model.optimizer

    @property
    def shard_size(self) -> int | None:
        return self.model.mesh.shard if self.model is not None and self.model.mesh is not None else None

    @property
    def checkpoint_shards(self) -> int:
        """How many shard files a checkpoint holds: the shard group's size (the world without a mesh)."""
        return self.model.world_size

    def clip_grad_norm_(self, max_norm):
        return self.model.clip_grad_norm_(max_norm)

    def full_state_dict(self):
        return self.model.full_state_dict(rank0_only=True)

    def load_full_state_dict(self, state):
        raise NotImplementedError("ZeRO checkpoints are sharded: see save/load")

    def save(self, directory):
        state = self.model.sharded_state_dict()  # a collective within the shard group: every rank calls it
        mesh = self.model.mesh
        if mesh is None or mesh.replica == 0:  # one copy of each shard, whatever the number of replicas
            save_tensors(state, shard_path(directory, self.model.rank))
        if self.ctx.rank == 0:
            save_tensors(state_dict_layout(self.net), directory / "layout.pt")

    def load(self, directory, saved_shards):
        if saved_shards == self.model.world_size:
            state = load_tensors(shard_path(directory, self.model.rank))
        else:  # another shard count (world size or mesh): every saved shard, re-cut for this one
            state = [load_tensors(shard_path(directory, r)) for r in range(saved_shards)]
        self.model.load_sharded_state_dict(state)

    def memory_report(self):
        return self.model.memory_report()


def mesh_dims(cfg, world_size: int) -> tuple[int, int]:
    """(replicas R, shard group size S) for strategy.shard_size (null: the ranks of one host, where
    the launcher says so); a ConfigError naming the key when it does not split the world."""
    from minidist.mesh import mesh_shape, ranks_per_host

    shard = cfg.get("shard_size")
    if shard is not None and (not isinstance(shard, int) or isinstance(shard, bool)):
        raise ConfigError(f"strategy.shard_size={shard!r} must be a whole number of ranks (or null: one host)")
    try:
        return mesh_shape(world_size, None, shard, ranks_per_host())
    except ValueError as e:
        raise ConfigError(f"strategy.shard_size={shard}: {e}") from None


def build_mesh(cfg):
    """minidist's mesh for strategy.shard_size (see mesh_dims)."""
    import torch.distributed as dist

    import minidist

    replicate, shard = mesh_dims(cfg, dist.get_world_size())
    mesh = minidist.init_mesh(replicate=replicate, shard=shard)
    minidist.print0(str(mesh))
    return mesh


def shard_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"shard_rank{rank:05d}.pt"


def state_dict_layout(net: nn.Module) -> dict:
    """The state_dict's keys in order, and which parameter each parameter key holds (tied weights:
    two keys, one parameter) — what consolidating sharded checkpoints needs to rebuild it."""
    names = {id(p): n for n, p in net.named_parameters()}
    keys = net.state_dict(keep_vars=True)
    return {"order": list(keys), "params": {k: names[id(v)] for k, v in keys.items() if id(v) in names}}


class NativeDDP(Strategy):
    name = "native_ddp"
    traces_comm = False

    def _native_ddp(self, net):
        import inspect

        from torch.nn.parallel import DistributedDataParallel as DDP

        # torch 2.14 renamed broadcast_buffers (same meaning for True); use the name this torch has.
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        return DDP(net, device_ids=[self.ctx.device] if self.ctx.device.type == "cuda" else None,
                   bucket_cap_mb=float(self.cfg.bucket_cap_mb),
                   gradient_as_bucket_view=bool(self.cfg.gradient_as_bucket_view),
                   find_unused_parameters=bool(self.cfg.find_unused_parameters),
                   **{sync: bool(self.cfg.broadcast_buffers)})

    def _wrap(self, net, optim_cls, optim_kwargs):
        return self._ddp(net), optim_cls(net.parameters(), **optim_kwargs)

    def _ddp(self, net):
        if not bool(self.cfg.get("overlap", True)):
            raise ConfigError(f"strategy.overlap=false: {self.name} (torch's DDP) always overlaps; only strategy=ddp "
                              "can reduce after backward")
        model = self._native_ddp(net)
        hook = str(self.cfg.get("comm_hook", "allreduce"))
        if hook != "allreduce":  # the same compression as ours, through torch's own hooks
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

            if hook == "powersgd":
                model.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4),
                                         powerSGD_hook.powerSGD_hook)
            elif hook in ("fp16", "bf16"):
                model.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
            else:
                raise ConfigError(f"strategy.comm_hook={hook!r}: choose allreduce, fp16, bf16 or powersgd")
        return model


class NativeZero1(NativeDDP):
    name = "native_zero1"

    def _wrap(self, net, optim_cls, optim_kwargs):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = self._ddp(net)
        return model, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=optim_cls, **optim_kwargs)

    def optimizer_state_dict(self):
        self.optimizer.consolidate_state_dict(to=0)  # a collective: rank 0 receives every shard
        return self.optimizer.state_dict() if self.ctx.rank == 0 else {}


class NativeFSDP(Strategy):
    name = "native_fsdp"
    traces_comm = False
    op_group_sizes: dict = {}  # the profiler's c10d events are counted at the world size unless named here

    def _wrap(self, net, optim_cls, optim_kwargs):
        from torch.distributed.fsdp import fully_shard

        from minidist.parallel.zero3 import plan_units

        kwargs = self._mesh_kwargs()
        if self.compute_dtype is not None:  # as zero3 / hsdp3: gathered in bf16, reduced in fp32
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        trainable = [p for p in net.parameters() if p.requires_grad]
        for _, unit in plan_units(net, trainable, None, int(self.cfg.min_unit_params)):
            fully_shard(unit, **kwargs)
        model = fully_shard(net, **kwargs)
        return model, optim_cls(net.parameters(), **optim_kwargs)

    def _mesh_kwargs(self) -> dict:
        return {}  # fully_shard's default: shard over the whole world

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm):
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.net, options=self._options())  # a collective
        return state if self.ctx.rank == 0 else {}

    def optimizer_state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(self.net, self.optimizer, options=self._options())
        return state if self.ctx.rank == 0 else {}

    def load_full_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.net, state, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.net, self.optimizer, state, options=StateDictOptions(full_state_dict=True))


class NativeHSDP(NativeFSDP):
    """fully_shard on a 2-D DeviceMesh (replicate x shard): FSDP2's HSDP, the reference for hsdp3."""

    name = "native_hsdp"

    def _mesh_kwargs(self) -> dict:
        from torch.distributed.device_mesh import init_device_mesh

        R, S = mesh_dims(self.cfg, self.ctx.world_size)
        device = "cuda" if self.ctx.device.type == "cuda" else "cpu"
        self.shard_size = S
        # The profiler's c10d events do not say their group: HSDP all_reduces across the R
        # replicas and gathers / reduce_scatters within the S shard ranks.
        self.op_group_sizes = {"all_reduce": R, "all_gather": S, "reduce_scatter": S}
        return {"mesh": init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))}


def split_variant(variant: str) -> tuple[str, str]:
    """A benchmark variant -> (strategy name, collectives): "zero2_backend" is stage 2 with the
    backend's reduce_scatter / all_gather, "zero2" stage 2 with collectives="auto"."""
    return variant.removesuffix("_backend"), "backend" if variant.endswith("_backend") else "auto"


def strategy_options(name: str, **overrides):
    """A strategy config as configs/strategy/*.yaml hold one, for code that builds strategies
    without Hydra (benchmarks, measurements); keyword arguments override the defaults."""
    from omegaconf import OmegaConf

    options = {"name": name, "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False,
               "find_unused_parameters": False, "broadcast_buffers": True, "min_unit_params": 100_000,
               "collectives": "auto", "overlap": True, "comm_hook": "allreduce", "first_bucket_mb": None,
               "last_bucket_mb": None, "bucket_closing": "reach", "shard_size": None}
    options.update(overrides)
    return OmegaConf.create(options)


def build_strategy(cfg, ctx, precision: str = "fp32") -> Strategy:
    """The strategy `cfg.name` names, configured by the rest of `cfg` (the strategy config group).
    precision (trainer.precision): bf16 makes stage-3 sharding (zero3, hsdp3, native_fsdp,
    native_hsdp) gather parameters in bf16 and reduce gradients in fp32."""
    name = cfg.name
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name!r} is unknown: choose one of {list(STRATEGIES)}")
    compute_dtype = torch.bfloat16 if precision == "bf16" else None
    if name.startswith(("zero", "hsdp")):
        return OursZero(cfg, ctx, int(name[-1]), hybrid=name.startswith("hsdp"), compute_dtype=compute_dtype)
    if name.startswith("ds_zero"):
        from minidist.train.deepspeed_strategy import DeepSpeedZero

        return DeepSpeedZero(cfg, ctx, int(name[-1]))
    return {"single": Single, "ddp": OursDDP, "native_ddp": NativeDDP, "native_zero1": NativeZero1,
            "native_fsdp": NativeFSDP, "native_hsdp": NativeHSDP}[name](cfg, ctx, compute_dtype)
