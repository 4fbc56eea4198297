"""Native PyTorch's strategies, the references ours are checked against.

| name         | what                                                                 | checkpoint |
| native_ddp   | torch DistributedDataParallel                                        | full       |
| native_zero1 | DistributedDataParallel + ZeroRedundancyOptimizer                    | full       |
| native_fsdp  | fully_shard per unit (the units our stage 3 would pick), then the root | dcp      |
| native_hsdp  | the same on a 2-D DeviceMesh (replicate x shard_size): FSDP2's HSDP  | dcp        |

Their communication is torch's own (minidist.comm's tracer does not see it: traces_comm=False);
the comparison counts it from the profiler's events.
"""

from __future__ import annotations

import contextlib

import torch

from minidist.train.strategies.base import Strategy, mesh_dims
from minidist.train.strategies.registry import (ACCUMULATE, ALL_REDUCE, Collective, StrategySpec, ZERO3, in_shard_groups,
                                                register)


class NativeDDP(Strategy):
    """torch's DistributedDataParallel, with the same options as ours."""

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
        model = self._native_ddp(net)
        hook = str(self.cfg.comm_hook)
        if hook != "allreduce":  # the same compression as ours, through torch's own hooks
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

            if hook == "powersgd":
                model.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4),
                                         powerSGD_hook.powerSGD_hook)
            else:  # fp16 | bf16 (the spec's choices)
                model.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
        return model


class NativeZero1(NativeDDP):
    """DistributedDataParallel + ZeroRedundancyOptimizer."""

    def _wrap(self, net, optim_cls, optim_kwargs):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = self._ddp(net)
        return model, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=optim_cls, **optim_kwargs)

    def optimizer_state_dict(self):
        self.optimizer.consolidate_state_dict(to=0)  # a collective: rank 0 receives every shard
        return self.optimizer.state_dict() if self.ctx.rank == 0 else {}


class NativeFSDP(Strategy):
    """fully_shard on the units our stage 3 would pick, then on the root."""

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

    def dcp_state_dict(self) -> dict:
        """The sharded state torch.distributed.checkpoint saves and loads (DTensors: each rank's own)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {"model": get_model_state_dict(self.net), "optim": get_optimizer_state_dict(self.net, self.optimizer)}

    def load_dcp(self, folder) -> None:
        """Load a torch.distributed.checkpoint folder saved at any world size or mesh. A collective."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from minidist.train import checkpoint_safety

        state = self.dcp_state_dict()
        checkpoint_safety.load_into(state, folder)
        set_model_state_dict(self.net, state["model"])
        set_optimizer_state_dict(self.net, self.optimizer, state["optim"])

    def load_portable(self, model_state, optim_state):
        """The portable form is torch.distributed.checkpoint's full one: loaded as it is."""
        self.load_full_state_dict(model_state)
        self.load_optimizer_state_dict(optim_state)


class NativeHSDP(NativeFSDP):
    """fully_shard on a 2-D DeviceMesh (replicate x shard): FSDP2's HSDP, the reference for hsdp3."""

    def _mesh_kwargs(self) -> dict:
        from torch.distributed.device_mesh import init_device_mesh

        R, S = mesh_dims(self.cfg, self.ctx.world_size)
        device = "cuda" if self.ctx.device.type == "cuda" else "cpu"
        self.shard_size = S
        self.op_group_sizes = self.spec.op_group_sizes(self.ctx.world_size, S)  # its collectives' groups
        return {"mesh": init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))}

# -- the specs (registry.py says how they are read)
DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters", "broadcast_buffers", "overlap",
               "comm_hook")
# torch's own hooks of the names ours has; torch's DDP always overlaps (only ours reduces after backward).
HOOKS = {"comm_hook": ("allreduce", "fp16", "bf16", "powersgd"), "overlap": (True,)}

register(StrategySpec("native_ddp", "native", NativeDDP, "torch.nn.parallel.DistributedDataParallel",
                      collectives=ALL_REDUCE, options=DDP_OPTIONS, choices=HOOKS, traces_comm=False))
# ZeroRedundancyOptimizer broadcasts each parameter from the rank that updated it: one broadcast
# of the whole model per step, counted in full for every rank as minidist.comm does.
register(StrategySpec("native_zero1", "native", NativeZero1, "DistributedDataParallel + ZeroRedundancyOptimizer",
                      zero_stage=1, collectives=ALL_REDUCE + (Collective("broadcast"),),
                      options=DDP_OPTIONS, choices=HOOKS, traces_comm=False, several_optimizers=False))
register(StrategySpec("native_fsdp", "native", NativeFSDP, "torch.distributed.fsdp.fully_shard (FSDP2)",
                      zero_stage=3, messages="units", collectives=ZERO3, options=("min_unit_params", "accumulate"),
                      choices=ACCUMULATE, checkpoint="dcp", traces_comm=False, several_optimizers=False))
register(StrategySpec("native_hsdp", "native", NativeHSDP, "fully_shard on a 2-D DeviceMesh: FSDP2's HSDP",
                      zero_stage=3, hybrid=True, messages="units", choices=ACCUMULATE,
                      options=("min_unit_params", "shard_size", "accumulate"),
                      collectives=in_shard_groups(ZERO3), checkpoint="dcp", traces_comm=False,
                      several_optimizers=False))
