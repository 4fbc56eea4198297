"""Native PyTorch's strategies, the references ours are checked against, and the checkpoint layout
two of them write (torch.distributed.checkpoint's, read safely). A plugin of the strategy
registry: configs/strategy/native_*.yaml name this module (`module: minidist_tools.native`).

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
import io
import pickle
import warnings
from pathlib import Path

import torch

from minidist.train.checkpoint_layouts import LAYOUT, load_tensors, register_layout, save_tensors, state_dict_layout
from minidist.train.checkpoint_safety import CheckpointRefused, read_metadata
from minidist.train.strategies.base import Strategy, mesh_dims
from minidist.train.strategies.registry import (ACCUMULATE, ALL_REDUCE, Collective, StrategySpec, ZERO3, in_shard_groups,
                                                register)
from minidist_tools.theory import op_group_sizes


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

    def optimizer_state_dict(self, on=0):
        self.optimizer.consolidate_state_dict(to=on)  # a collective: rank `on` receives every shard
        return self.optimizer.state_dict() if self.ctx.rank == on else {}


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
        if optim_kwargs.get("fused") and not issubclass(optim_cls, (torch.optim.Adam, torch.optim.AdamW)):
            # DTensor has sharding rules for Adam's and AdamW's fused kernels only (torch 2.14): any
            # other optimizer over fully_shard's parameters steps with foreach's, and says so
            import minidist

            minidist.print0(f"{self.name}: {optim_cls.__name__} steps with foreach's kernels, not fused ones "
                            "(torch's DTensor has no sharding rule for them)")
            optim_kwargs.pop("fused")
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

        state = self.dcp_state_dict()
        load_into(state, folder)
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
        self.op_group_sizes = op_group_sizes(self.spec, self.ctx.world_size, S)  # its collectives' groups
        return {"mesh": init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))}


# -- reading and writing torch.distributed.checkpoint folders, safely (checkpoint_safety.py: the metadata)

def _reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _safe_bytes(planner_class):
    """`planner_class` whose non-tensor items must first load under torch's restricted unpickler."""

    class SafeBytes(planner_class):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                detail = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e)[:160])
                raise CheckpointRefused(f"{read_item.dest_index.fqn} in a torch.distributed.checkpoint folder holds "
                                        f"Python objects other than plain values ({detail[:160]}); "
                                        "nothing in it was run; do not resume from this checkpoint") from e
            value.seek(0)
            super().load_bytes(read_item, value)  # DCP's own, given bytes proven to resolve nothing else

    return SafeBytes


def _refusals_raised(load) -> None:
    """Run `load`; a refusal of ours inside DCP (which wraps every rank's errors in one
    CheckpointException) is raised as itself, on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load()
    except CheckpointException as e:
        for exc, _ in e.failures.values():  # (the exception, its stack) per failed rank
            if isinstance(exc, CheckpointRefused):
                raise exc from None
        raise


def save_dcp(state: dict, folder: Path) -> None:
    """Every rank writes its own shards of `state` into `folder`; rank 0 the metadata. A collective."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))


def load_into(state: dict, folder: Path) -> None:
    """Fill `state` (this run's sharded state dict) from `folder`, at any world size. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    _refusals_raised(lambda: dcp.load(state, storage_reader=_reader(folder), planner=_safe_bytes(DefaultLoadPlanner)()))


def read_full(folder: Path, only: set[str] | None = None) -> dict:
    """The whole state `folder` holds (`only`: just these top-level keys, e.g. {"model"}), as
    plain tensors and values, in this process alone."""
    # DCP's own planner that builds the state from the metadata, and the loader that fills the dict
    # it is given (dcp.load fills a copy): what torch's format_utils.dcp_to_torch_save uses.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    with warnings.catch_warnings():  # no process group is the point here, not a mistake to warn of
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        _refusals_raised(lambda: _load_state_dict(state, storage_reader=_reader(folder),
                                                  planner=_safe_bytes(_EmptyStateDictLoadPlanner)(keys=only),
                                                  no_dist=True))
    return state


def saved_shapes(folder: Path, prefix: str) -> dict[str, tuple]:
    """{key: shape} of the tensors saved under `prefix` (e.g. "model."), from the metadata alone."""
    return {key[len(prefix):]: tuple(md.size) for key, md in read_metadata(folder).state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(md, "size")}


class Distributed:
    """torch.distributed.checkpoint's folder (native_fsdp, native_hsdp): every rank writes its own
    shards, nothing is gathered to one rank; DCP re-cuts them for any world size or mesh at load.
    Its state dict is {"model": get_model_state_dict, "optim": get_optimizer_state_dict}, so read
    whole (no process group) it is the portable form itself."""

    name = "dcp"
    FOLDER = "dcp"

    collect = None  # DCP plans the write across the ranks (collectives) as it saves: save only
    writer = "torch.distributed.checkpoint"

    def save(self, strategy, directory: Path) -> None:
        save_dcp(strategy.dcp_state_dict(), Path(directory) / self.FOLDER)
        if strategy.ctx.rank == 0:  # the module's key order, which DCP's metadata does not keep
            save_tensors(state_dict_layout(strategy.net), Path(directory) / LAYOUT)

    def load(self, strategy, directory: Path, meta: dict) -> None:
        strategy.load_dcp(Path(directory) / self.FOLDER)

    def shapes(self, ckpt: Path, meta: dict) -> dict[str, tuple]:
        return saved_shapes(Path(ckpt) / self.FOLDER, "model.")

    def consolidate(self, ckpt: Path, meta: dict) -> dict:
        model = read_full(Path(ckpt) / self.FOLDER, only={"model"})["model"]  # the optimizer's state unread
        return {key: model[key] for key in load_tensors(Path(ckpt) / LAYOUT)["order"]}

    def portable(self, ckpt: Path, meta: dict, names: list[str]) -> tuple[dict, dict]:
        state = read_full(Path(ckpt) / self.FOLDER)
        return state["model"], state["optim"]

    def describe(self, meta: dict) -> str:
        return f"torch.distributed.checkpoint's own ({self.FOLDER}/: a file per rank, nothing gathered) and {LAYOUT}"


register_layout(Distributed())


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
