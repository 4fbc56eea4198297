"""DiLoCo and streaming DiLoCo as strategies: workers that synchronise every H steps, not every step.

| name             | what                                                                  | checkpoint |
| diloco           | the run's optimizer inner on each worker; every sync_every steps the   | workers    |
|                  | pseudo-gradients averaged across workers into an outer Nesterov SGD    |            |
| diloco_streaming | the same, the model in `fragments` synced at staggered steps, each     | workers    |
|                  | fragment's all_reduce behind the next `sync_delay` inner steps         |            |

A worker is one rank (strategy.inner=null) or the ranks of one host running minidist's
DataParallel among themselves every step (strategy.inner=ddp; strategy.shard_size ranks, null:
one host): the realistic setup, fast links within a host, slow ones between hosts. The outer
step's all_reduce runs across the workers (one rank of each, 1/S of the model per rank), so only
it crosses hosts. minidist.parallel.diloco holds the algorithm.

"workers" checkpoints (checkpoint_layouts.Workers): each worker its own weights and inner
optimizer state, and the outer state once; they resume exactly.
"""

from __future__ import annotations

import contextlib

from minidist.train.errors import ConfigError
from minidist.memory import measure
from minidist.train.strategies.base import Strategy, build_mesh
from minidist.train.strategies.ours import WIRES
from minidist.train.strategies.registry import register
from minidist.train.strategies.spec import Collective, StrategySpec

INNER = (None, "ddp")  # what synchronises a worker's ranks every step


class DiLoCoStrategy(Strategy):
    """A worker's inner data parallelism (none, or minidist.DataParallel within the host) and the
    outer loop (minidist.DiLoCo) across the workers."""

    def _wrap(self, net, optim_cls, optim_kwargs):
        import torch.distributed as dist

        import minidist
        from minidist import DataParallel, DiLoCo

        c = self.cfg
        if c.inner is None and c.get("shard_size") not in (None, 1):
            raise ConfigError(f"strategy.shard_size={c.shard_size} with strategy.inner=null: each rank is a worker; "
                              "set strategy.inner=ddp for workers of several ranks")
        self.mesh = minidist.init_mesh(replicate=dist.get_world_size(), shard=1) if c.inner is None \
            else build_mesh(c)
        self.shard_size = self.mesh.shard
        worker = self.mesh.shard_group if self.mesh.shard > 1 else None
        model = net if c.inner is None else DataParallel(
            net, process_group=self.mesh.shard_group, bucket_cap_mb=float(c.bucket_cap_mb),
            grad_wire=c.grad_wire, quant_block=int(c.quant_block))
        optimizer = optim_cls(net.parameters(), **optim_kwargs)
        try:
            self.outer = DiLoCo(net.parameters(), sync_every=c.sync_every, outer_lr=float(c.outer_lr),
                                outer_momentum=float(c.outer_momentum), fragments=c.get("fragments", 1),
                                sync_delay=c.get("sync_delay", 0), mixing=float(c.get("mixing", 0.0)),
                                wire=self._outer_wire(), worker_group=worker, across_group=self.mesh.replicate_group,
                                total_steps=self.total_steps)
        except ValueError as e:  # the schedule's checks name the option: say it is the strategy's
            raise ConfigError(f"strategy.{e}") from None
        return model, optimizer

    def _outer_wire(self):
        from minidist.comm.wire import Wire

        wire = self.cfg.outer_wire
        return None if wire is None else Wire(str(wire), block=int(self.cfg.quant_block))

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

    def memory_report(self):
        report = super().memory_report()
        extra = measure({"outer_state": self.outer.memory_tensors()})["outer_state"]
        return {**{k: v for k, v in report.items() if k != "total"}, "outer_state": extra,
                "total": report["total"] + extra}


# The outer all_reduce: each rank's 1/S of the model across the workers, then the worker's ranks
# gather the updated slices; both once per round of sync_every steps. The inner DDP's all_reduce
# within a worker runs every step (nothing at S = 1, one rank per worker).
LOCAL_SGD = (Collective("all_reduce", group="shard"),
             Collective("all_reduce", group="replicas", payload="shard", per_round=True),
             Collective("all_gather", group="shard", per_round=True))
OPTIONS = ("inner", "shard_size", "sync_every", "outer_lr", "outer_momentum", "outer_wire", "quant_block",
           "bucket_cap_mb", "grad_wire")
CHOICES = {"inner": INNER, "outer_wire": WIRES, "grad_wire": WIRES}
for _name, _extra, _summary in (
        ("diloco", (), "DiLoCo: the run's optimizer inner on each worker, an outer Nesterov SGD on the "
                       "pseudo-gradients averaged every sync_every steps"),
        ("diloco_streaming", ("fragments", "sync_delay", "mixing"),
         "streaming DiLoCo: DiLoCo with the model in fragments synced at staggered steps, each all_reduce "
         "overlapped with the next sync_delay inner steps")):
    register(StrategySpec(_name, "minidist", DiLoCoStrategy, _summary, checkpoint="workers", reference="ddp",
                          hybrid=True, collectives=LOCAL_SGD, options=OPTIONS + _extra, choices=CHOICES,
                          checked_by="loss", outer_copies=2))
