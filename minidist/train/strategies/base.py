"""The interface every data-parallel strategy implements, so the trainer has one loop, and the
helpers the strategy families (ours.py; minidist_tools/native.py, deepspeed.py) share.

    strategy = build_strategy(cfg.strategy, ctx)
    model, optimizer = strategy.wrap(net, torch.optim.AdamW, {"lr": 3e-4})
    with strategy.no_sync(): loss.backward()      # accumulate without communication
    strategy.backward(loss)                       # loss.backward(), or the engine's (DeepSpeed)
    strategy.clip_grad_norm_(1.0)                 # the global norm, whatever is sharded
    strategy.optimizer_step(1.0, scaler)          # unscale, clip, step, zero_grad; returns the norm
    strategy.full_state_dict()                    # rank 0: the plain state_dict of net
    strategy.optimizer_state_dict()               # rank 0: the optimizer's (what checkpoint_layouts.py saves)
    strategy.memory_report()                      # bytes on this rank, from live storages

A family module needs only this one (and registry.py), so the families never import each other.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.measure import measure, optimizer_tensors, to_host
from minidist.train.config import ConfigError
from minidist.train.strategies.registry import StrategySpec


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (fully_shard's parameters), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class Strategy:
    """The interface. Subclasses implement `_wrap`; the rest has defaults for replicated models."""

    spec: StrategySpec | None = None  # what it is (name, checkpoint layout, capabilities): set by build_strategy
    shard_size: int | None = None  # hybrid strategies: the size S of their shard groups, once wrapped
    # The profiler's c10d events do not say their group: ops that run on a subgroup, by op -> its size
    # (everything else is counted at the world size). Only strategies the tracer cannot see need it.
    op_group_sizes: dict[str, int] = {}
    total_steps: int | None = None  # the run's last step (build_training_state sets it before wrap)
    # fp16: the ranks agree on an overflow (agree_on_overflow), so every replica skips alike. DiLoCo's
    # workers have their own gradients, and so their own loss scales: they do not.
    agrees_on_overflow = True

    def __init__(self, cfg, ctx, compute_dtype: torch.dtype | None = None):
        self.cfg, self.ctx = cfg, ctx
        # bf16 runs: what stage-3 sharding gathers its parameters in (param_dtype / FSDP2's
        # MixedPrecisionPolicy). Under autocast alone, autocast's cast cache would keep a bf16 copy
        # of every unit's weights from forward to backward, undoing most of what sharding saves.
        self.compute_dtype = compute_dtype
        self.net: nn.Module | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def name(self) -> str:
        return self.spec.name if self.spec is not None else type(self).__name__

    @property
    def traces_comm(self) -> bool:
        """Its communication goes through minidist.comm, so CommTracer sees it."""
        return self.spec.traces_comm if self.spec is not None else True

    @property
    def checkpoint_shards(self) -> int:
        """How many per-rank files a sharded checkpoint holds (the world unless a strategy says)."""
        return self.ctx.world_size

    def wrap(self, net: nn.Module, optim_cls, optim_kwargs: dict):
        """Wrap `net` (already on ctx.device) and build its optimizer; return (model, optimizer)."""
        self.net = net
        self.model, self.optimizer = self._wrap(net, optim_cls, dict(optim_kwargs))
        return self.model, self.optimizer

    def _wrap(self, net, optim_cls, optim_kwargs):
        raise NotImplementedError

    def no_sync(self):
        """Backward passes inside accumulate locally; the next one outside synchronises."""
        return self.model.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm and return it (before clipping)."""
        return torch.nn.utils.clip_grad_norm_(self.net.parameters(), max_norm)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (already divided by the accumulation steps)."""
        loss.backward()

    def optimizer_step(self, max_norm: float, scaler) -> torch.Tensor:
        """End of an optimizer step: unscale (fp16), clip to `max_norm` by the global norm, step,
        zero the gradients. Returns the norm before clipping.

        A non-finite norm (a nan or inf gradient anywhere, on any rank: the norm is global, so
        every rank sees the same) skips the update: the parameters and optimizer state stay as
        they were. (With fp16 the gradient scaler does this itself, and lowers its scale.)"""
        scaler.unscale_(self.optimizer)
        if scaler.is_enabled() and self.agrees_on_overflow:
            agree_on_overflow(scaler, self.optimizer, self.ctx.device)
        norm = self.clip_grad_norm_(max_norm)
        if scaler.is_enabled():
            scaler.step(self.optimizer)
            scaler.update()
        else:
            step_unless_nonfinite(self.optimizer, norm)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def full_state_dict(self) -> dict:
        """The plain state_dict of the bare model on rank 0 ({} elsewhere), on the CPU: references,
        as torch's own (a checkpoint copies them once, where it writes or stages them). A collective."""
        return {k: v.detach().cpu() for k, v in self.net.state_dict().items()} if self.ctx.rank == 0 else {}

    def optimizer_state_dict(self, on: int = 0) -> dict:
        """The whole optimizer state on rank `on` ({} elsewhere). A collective."""
        return self.optimizer.state_dict() if self.ctx.rank == on else {}

    def load_optimizer_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def name_groups(self, optim: dict) -> dict:
        """`optim` (optimizer_state_dict's), each group naming its parameters (torch's param_names):
        the numbering need not be the module's order (optim=muon's), and another layout reads it."""
        name = {id(p): n for n, p in self.net.named_parameters()}
        for group, params in zip(optim["param_groups"], self.numbered_parameters()):
            group.pop("param_names", None)  # (one a loaded state brought: last, as in a fresh run's)
            group["param_names"] = [name[id(p)] for p in params]
        return optim

    def load_full_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state)

    def resumed_at(self, step: int) -> None:
        """A checkpoint of step `step` was loaded (strategies that count steps themselves check or
        set theirs here)."""

    def load_portable(self, model_state: dict, optim_state: dict) -> None:
        """Load a checkpoint of another strategy or world size, in its portable form: the plain
        state_dict, and the optimizer's state keyed by parameter name (checkpoint_layouts.py).
        Here it is numbered as this strategy's optimizer numbers its parameters."""
        self.load_full_state_dict(model_state)
        self.load_optimizer_state_dict(numbered(optim_state, self.net, self.numbered_parameters()))

    def numbered_parameters(self) -> list[list[nn.Parameter]]:
        """The parameters, group by group, in the order optimizer_state_dict numbers them."""
        return [list(g["params"]) for g in self.optimizer.param_groups]

    def memory_report(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state on this rank, from live storages."""
        params = [local_tensor(p) for p in self.net.parameters()]
        return measure({
            "parameters": params,
            "gradients": [local_tensor(p.grad) for p in self.net.parameters() if p.grad is not None],
            "optimizer_state": [local_tensor(t) for t in optimizer_tensors(getattr(self.optimizer, "optim", self.optimizer))],
        })


def numbered(optim_state: dict, net: nn.Module, groups_of_params: list[list[nn.Parameter]]) -> dict:
    """A name-keyed optimizer state (torch.distributed.checkpoint's full form) numbered as an
    optimizer over `groups_of_params` numbers them: the form torch's Optimizer.load_state_dict takes."""
    name_of = {id(p): n for n, p in net.named_parameters()}
    index, groups = 0, []
    state = {}
    if len(groups_of_params) != len(optim_state["param_groups"]):
        raise ValueError(f"the checkpoint's optimizer has {len(optim_state['param_groups'])} param groups, this "
                         f"one {len(groups_of_params)}")
    for params, saved in zip(groups_of_params, optim_state["param_groups"]):
        ids = []
        for p in params:
            if name_of[id(p)] in optim_state["state"]:
                state[index] = optim_state["state"][name_of[id(p)]]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k not in ("params", "param_names")}, "params": ids})
    return {"state": state, "param_groups": groups}


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
    """optimizer.step(), skipped when the gradient norm is nan or inf.

    Decided on the device where the optimizer can take the decision itself: fused optimizers
    (AdamW/Adam/SGD with fused=True, `optim.fused` in the config) read a `found_inf` tensor, as
    torch.amp.GradScaler hands it to them, and leave parameters, state and step count untouched
    when it is 1: no host synchronisation. Any other optimizer needs the host to read the norm
    (a synchronisation on CUDA, free on CPU)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = (~torch.isfinite(norm)).float().reshape(())
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif to_host(torch.isfinite(norm), "gradient norm finite"):
        optimizer.step()


def agree_on_overflow(scaler, optimizer, device) -> None:
    """After scaler.unscale_(optimizer): make every rank's found-inf the same, the MAX over ranks.

    The scaler checks the gradients this rank's optimizer holds. Under ZeRO and fully_shard that
    is one shard, so an inf in one rank's shard would make that rank alone skip the step and lower
    its scale, and the replicas would drift apart. One small all_reduce makes the decision global.
    (It writes torch.amp.GradScaler's per-optimizer record of unscale_, the state step() and
    update() read; the constraints file pins the torch it was checked against.)"""
    import torch.distributed as dist

    from minidist import comm
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    flag = torch.zeros(1, device=device)
    for value in found.values():
        flag += value.to(device).sum()
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)
    for value in found.values():  # on the device: no host read
        value.copy_((flag > 0).to(value.dtype).to(value.device).reshape(value.shape))


def mesh_dims(cfg, world_size: int) -> tuple[int, int]:
    """(replicas R, shard group size S) for strategy.shard_size (null: the ranks of one host, where
    the launcher says so); a ConfigError naming the key when it does not split the world."""
    from minidist.dist import ranks_per_host
    from minidist.dist import mesh_shape

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
