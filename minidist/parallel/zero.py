"""minidist.ShardedDataParallel: ZeRO stages 1, 2 and 3 from reduce_scatter / all_gather.

    model = ShardedDataParallel(net, partial(torch.optim.AdamW, lr=3e-4), stage=2)
    loss_fn(model(x), y).backward()
    model.clip_grad_norm_(1.0)
    model.optimizer.step(); model.optimizer.zero_grad()

Rank r owns slice r of each FlatShard; the optimizer steps the fp32 master slices, fed by
reduce_scatter; the updated slices are all_gathered back (stages 1-2, here) or gathered per unit
on demand (stage 3, zero3.py). What each stage stores and sends: docs/api.md; what this file
holds: docs/internals.md, "parallel/zero.py".
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from minidist import comm
from minidist.comm.wire import QUANT_BLOCK, Wire, as_wire
from minidist.measure import measure, optimizer_tensors
from minidist.parallel.buckets import (Bucket, BucketedBackward, BufferPool, GradientSyncSwitch, MiB, plan_buckets,
                                       used_on_any_rank)
from minidist.parallel.compat import (BufferSync, check_materialised, check_not_wrapped, check_reshard_after_forward,
                                      eager, is_device_mesh, mark_wrapped, mixed_precision, process_group_of,
                                      refuse_unknown, runs_compiled_code)
from minidist.parallel.ddp import replicate_from_source
from minidist.parallel.flat_shard import (FlatShard, FORMAT as CHECKPOINT_FORMAT, check_format, merged_pieces,
                                          order_by_group)
from minidist.parallel.join import ShardedJoin
from minidist.parallel.meta_init import MetaInit, is_meta_built
from minidist.parallel.shard_optimizer import ModuleStateHooks, ShardOptimizer, parameter_groups, plain_module
from minidist.parallel.sharded_grad import FoundInfAgreement, GradientPlaceholders, ShardedGradReduce, local_grad


def wire_option(value, block: int, what: str) -> Wire | None:
    """grad_wire / param_wire as given (None, a format name, a dtype or a Wire), with quant_block."""
    try:
        return as_wire(value, block)
    except ValueError as e:
        raise ValueError(f"ShardedDataParallel({what}={value!r}): {e}") from None


class ShardedDataParallel(ShardedJoin, GradientSyncSwitch, nn.Module):
    """ZeRO data parallelism. `ShardedDataParallel(..., stage=k)` builds the stage-k implementation.

    After backward the averaged gradient is in `model.optimizer`'s parameters (this rank's shard);
    each module parameter's `.grad` is a placeholder answering its norm and scaling from the shards
    (torch.nn.utils.clip_grad_norm_ works; `model.clip_grad_norm_` clips by the global norm),
    GradScaler skips an overflowing step on every rank alike (sharded_grad.py), and
    full_optim_state_dict() is the optimizer's whole state, loadable anywhere (docs/drop_in.md).

    Args:
        module: the model, the same on every rank.
        optimizer: the torch optimizer the script built over the module's parameters (its param
            groups keep their options), which from then on steps this rank's shards
            (model.optimizer is it; schedulers on it keep working); or several, each over its own
            parameters (`[muon, adamw]`: model.optimizers); or a factory called with this rank's
            shards, `functools.partial(torch.optim.AdamW, lr=3e-4)`. Element-wise optimizers step
            flat slices; whole-parameter ones (Muon) whole parameters, each on one rank
            (shard_optimizer.py).
        stage: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
        bucket_cap_mb: flat-group size for stages 1-2 (also the reduce_scatter message size).
        overlap: communicate during backward (None: the stage's way: stage 2 reduce_scatters buckets
            as they fill, stage 3 prefetches the next unit); False does each after the computation
            that needs it (to measure what overlap buys). Stage 1 refuses True.
        param_dtype: compute in this dtype (e.g. torch.bfloat16) with fp32 master shards.
        reduce_dtype: dtype of gradient reduction (default: param_dtype, else fp32).
        mp_policy: FSDP2's MixedPrecisionPolicy instead: its param_dtype and reduce_dtype, outputs
            cast to its output_dtype, inputs cast to param_dtype unless cast_forward_inputs=False.
        reshard_after_forward: stage 3, as FSDP2's: False keeps each unit gathered from its forward
            to its backward (one gather a step instead of two); stages 1-2 refuse True.
        collectives: how reduce_scatter and all_gather run: "backend" (torch.distributed's), "ring"
            (from send/recv; gloo only), "shm" (shared memory, ranks on one host) or "auto" (shm
            where it can run, else the ring where it measurably wins: minidist.comm.choose_algorithm).
        grad_wire, param_wire, quant_block: what the gradients and the gathered parameters travel as
            (None, "bf16", "fp16", "int8" with one fp32 scale per quant_block: ZeRO++'s qgZ and
            qwZ), summed in full precision; the fp32 master shards are never rounded (docs/api.md).
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm statistics) before a forward
            whose previous forward synchronised gradients, as DataParallel and native DDP do.
        max_inflight: stages 2-3: at most this many full-size gradient buffers wait for their
            reduce_scatter at once (bounds peak memory; backward waits beyond it).
        unit_policy, min_unit_params, prefetch, init_fn: stage 3 only, see zero3.py.
        find_unused_parameters: as native DDP's. False: a parameter without gradient in a synced
            backward raises, naming it. True: one small all_reduce per backward finds those no rank
            used, which raise too (a flat shard cannot skip them); those unused on some ranks only
            train exactly as under native DDP.
        process_group: the group to shard over (default: the world).
        mesh: hybrid sharding (HSDP) on a minidist.init_mesh(replicate=R, shard=S) (a 1-D torch
            DeviceMesh stands for its group): shard within the mesh's shard group, replicate across
            its replicate group (each reduced shard all_reduced across the replicas: 1/S of the
            bytes cross hosts). Memory per rank follows S. Not with process_group.
    """

    # stage -> the class that implements it. Each stage's module registers itself (stages 1-2
    # below, 3 in zero3.py, which minidist.parallel imports), so this base never imports a
    # subclass: zero3.py builds on zero.py, not the other way round.
    _stages: dict[int, type] = {}

    def __new__(cls, *args, stage: int = 2, **kwargs):
        if cls is ShardedDataParallel:
            if stage not in (1, 2, 3):
                raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
            cls = ShardedDataParallel._stages[stage]
        return super().__new__(cls)

    # ------------------------------------------------------------------ shared set-up

    def _setup_common(self, module: nn.Module, optimizer, stage: int, process_group,
                      param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                      max_inflight: int, broadcast_buffers: bool, collectives: str, mesh=None,
                      mp_policy=None, wires: tuple = (None, None, QUANT_BLOCK), init_fn=None) -> list:
        if not dist.is_initialized():
            raise RuntimeError("ShardedDataParallel needs a process group: call minidist.init_distributed() first")
        meta_built = stage == 3 and is_meta_built(module)
        if not meta_built:
            check_materialised(module, f"ShardedDataParallel(stage={stage})")
            if init_fn is not None:
                raise ValueError("ShardedDataParallel: init_fn initialises a model built on the meta device; this "
                                 "one holds its values already: leave init_fn out")
        check_not_wrapped(module, "ShardedDataParallel")
        if is_device_mesh(mesh):  # FSDP2's argument: a 1-D torch DeviceMesh is its group
            process_group, mesh = process_group_of(mesh, process_group, "ShardedDataParallel"), None
        param_dtype, reduce_dtype, self.output_dtype, self.cast_forward_inputs = \
            mixed_precision(mp_policy, param_dtype, reduce_dtype)
        if optimizer is None:
            raise TypeError(
                "ShardedDataParallel needs the optimizer: pass the one you built over the module's parameters "
                "(ShardedDataParallel(net, torch.optim.AdamW(net.parameters(), lr=3e-4), stage=2); param groups "
                "keep their options), or a factory called with this rank's shards "
                "(functools.partial(torch.optim.AdamW, lr=3e-4)). model.optimizer is then the one to step.")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        # Stages 2-3: at most this many full-size gradient buffers wait for their
        # reduce_scatter at once; beyond it, backward waits for the oldest to finish.
        self.max_inflight = max_inflight
        self.module = module
        self.stage = stage
        if mesh is not None and process_group is not None:
            raise ValueError("ShardedDataParallel: give mesh (hybrid sharding) or process_group, not both")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ShardedDataParallel: the model has no trainable parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # Which optimizer group each parameter belongs to (one group for a factory): the shards are
        # laid out group by group (shard_optimizer.py). Checked before any communication.
        self._group_of, self._full_groups, self._optimizer_spans, self._whole_groups = parameter_groups(
            optimizer, module, self._params, self._names)
        self.mesh = mesh
        # Sharding happens over process_group (with a mesh: its shard group); data parallelism,
        # the buffer broadcast and Join span dp_group (with a mesh: the whole world).
        self.process_group = mesh.shard_group if mesh is not None else process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.dp_group = None if mesh is not None else process_group
        self.dp_size = dist.get_world_size(self.dp_group)
        self.source_rank = dist.get_global_rank(self.dp_group, 0) if self.dp_group is not None else 0
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype or param_dtype or torch.float32
        self.grad_wire, self.param_wire = (wire_option(w, wires[2], what) for w, what in
                                           ((wires[0], "grad_wire"), (wires[1], "param_wire")))
        # The one gradient reduction every stage performs (sharded_grad.py); with a mesh, each reduced
        # shard is then summed across the replicas (HSDP's second level, sharded_grad.py).
        self._grad_reduce = ShardedGradReduce(
            dp_size=self.dp_size, group=self.process_group, dtype=self.reduce_dtype, algorithm=collectives,
            replicate_group=mesh.replicate_group if mesh is not None and mesh.replicate > 1 else None,
            wire=self.grad_wire)
        # A meta-built model (stage 3): its buffers get their values now, its parameters unit by unit (_flat_shard).
        self._meta_init = MetaInit(module, init_fn, self.dp_group) if meta_built else None
        self._owned_so_far = None  # whole parameters each rank owns in the flat shards made so far (flat_layout)
        device = self._meta_init.device if meta_built else next((p.device for p in module.parameters()), None)
        comm.choose_algorithm("reduce_scatter", self.process_group, collectives, device=device)  # raises on a bad choice
        self.collectives = collectives
        replicate_from_source(module, self.source_rank, self.dp_group)
        self._buffer_sync = BufferSync(module, broadcast_buffers, self.dp_size, self.source_rank, self.dp_group)
        return named

    def _flat_shard(self, k: int, ids: list[int], keep_full: bool) -> tuple[FlatShard, list[int]]:
        """FlatShard k of the parameters `ids`, laid out group by group; and the ids in that order."""
        ids = order_by_group(ids, self._group_of)
        params = [self._params[i] for i in ids]
        whole = any(self._group_of[i] in self._whole_groups for i in ids)  # (FlatShard decides alike)
        load = self._owned_so_far
        values, master = self._meta_init.fill(params, self.world_size, self.rank, whole, load) \
            if self._meta_init is not None else (None, None)
        shard = FlatShard(k, [self._names[i] for i in ids], params, rank=self.rank, values=values, master=master,
                          world_size=self.world_size, group=self.process_group, compute_dtype=self.param_dtype,
                          keep_full=keep_full, algorithm=self.collectives, wire=self.param_wire,
                          groups=[self._group_of[i] for i in ids], n_groups=len(self._full_groups),
                          whole_groups=self._whole_groups, load=load)
        self._owned_so_far = shard.load_after
        return shard, ids

    def _check_used(self, used_here: list[bool]) -> None:
        """Refuse parameters that got no gradient in a synced backward, where native DDP would
        skip them and we cannot (see find_unused_parameters)."""
        unused = [self._names[i] for i, used in enumerate(used_here) if not used]
        if not unused:
            if self.find_unused_parameters:
                self._flags_all_reduce(used_here)  # every rank takes part, whatever it found
            return
        if not self.find_unused_parameters:
            raise RuntimeError(
                f"ShardedDataParallel: these parameters received no gradient in this backward on this rank: "
                f"{', '.join(unused)}. Either use them in forward's output or set requires_grad=False on "
                "them before wrapping" + (", or pass find_unused_parameters=True if other ranks use them "
                                          "(stages 1-2)." if self.stage < 3 else "."))
        used_anywhere = self._flags_all_reduce(used_here)
        nowhere = [self._names[i] for i, used in enumerate(used_anywhere) if not used]
        if nowhere:
            raise RuntimeError(
                f"ShardedDataParallel: these parameters received no gradient on any rank in this backward: "
                f"{', '.join(nowhere)}. Native DDP leaves their .grad None, so torch's optimizer skips them "
                "(no weight decay, no momentum, no step count); a ZeRO shard steps all its elements together, "
                "so their update would silently differ. Use them in every forward (e.g. add 0 * their output "
                "on the steps that skip them) or set requires_grad=False on them before wrapping.")

    def _flags_all_reduce(self, used_here: list[bool]) -> list[bool]:
        """Which parameters got a gradient on at least one data-parallel rank (one small all_reduce)."""
        return used_on_any_rank(used_here, self.dp_group, self._shards[0].device)

    def _make_optimizer(self, optimizer) -> None:
        # Once the parameters are views into the flat shards (their compute dtype): after each synced
        # backward .grad refuses to be read (sharded_grad.py), and model.state_dict() /
        # load_state_dict() behave as with native DDP (shard_optimizer.py).
        self._slot_by_id = {id(p): (shard, k) for shard in self._shards for k, p in enumerate(shard.params)}
        self._slot_of = [self._slot_by_id[id(p)] for p in self._params]
        self._grad_placeholders = GradientPlaceholders(self._names, self._params, self.stage, self._owned_grad,
                                                       self.process_group, joined=lambda: self._join is not None)
        ModuleStateHooks(self)
        self._name_of = {id(p): n for n, p in plain_module(self.module).named_parameters()}  # (DCP's keys)
        place = {"rank": self.rank, "ranks": self.world_size, "stage": self.stage}
        ends = [g0 for _, g0 in self._optimizer_spans[1:]] + [len(self._full_groups)]
        self._found_infs = [FoundInfAgreement(self._shards[0].device, {s.master.dtype for s in self._shards},
                                              self.dp_group) for _ in ends]
        self._shard_optimizers = [ShardOptimizer(given, self._shards, self._full_groups[g0:g1], self._name_of, place,
                                                 extra_param=found_inf.param, first_group=g0)
                                  for ((given, g0), g1, found_inf) in zip(self._optimizer_spans, ends, self._found_infs)]
        self.optimizers = [so.optimizer for so in self._shard_optimizers]  # one, or several (Muon + AdamW)
        for found_inf, opt in zip(self._found_infs, self.optimizers):
            found_inf.attach(opt)
            opt.register_step_pre_hook(lambda *_: self._join_step())  # under Join: announce the step
            opt.register_step_post_hook(lambda opt, *_: self._optimizer_stepped(opt))
        self._stepped: set[int] = set()  # the optimizers that stepped since the parameters were last refreshed
        mark_wrapped(self.module, "ShardedDataParallel")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that steps this rank's shards (given several: model.optimizers, in order)."""
        if len(self.optimizers) != 1:
            raise RuntimeError("ShardedDataParallel was given several optimizers: model.optimizers holds them")
        return self.optimizers[0]

    def _optimizer_stepped(self, optimizer) -> None:
        """Once every optimizer has stepped, the parameters follow the updated shards (stages 1-2
        gather them); a forward before that (some optimizer skipped its step) refreshes them first."""
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self.optimizers):
            self._refresh_after_steps()

    def _refresh_after_steps(self) -> None:
        self._stepped.clear()
        self._after_optimizer_step()

    def _shard_optimizer_for(self, optimizer) -> ShardOptimizer:
        """The ShardOptimizer of `optimizer`, one of model.optimizers (None: the only one)."""
        found = [so for so in self._shard_optimizers if optimizer is None or so.optimizer is optimizer]
        if len(found) != 1:
            raise ValueError("ShardedDataParallel: " + ("it has several optimizers: name one (optimizer=...)" if
                             optimizer is None else "that optimizer is not one of model.optimizers, which step it"))
        return found[0]

    def _owned_grad(self, i: int) -> torch.Tensor | None:
        """This rank's slice of parameter i's averaged gradient (what its .grad placeholder stands for)."""
        shard, k = self._slot_of[i]
        return shard.owned_grad(k)

    def _gradients_ready(self) -> None:
        """After a synchronised backward: .grad placeholders, and the scaler's agreement, in place."""
        self._grad_placeholders.place()
        for found_inf in self._found_infs:
            found_inf.place()

    def _after_optimizer_step(self) -> None:
        """Stages 1-2 gather the updated shards into the full parameters; stage 3 does it lazily."""

    def wait_for_parameters(self) -> None:
        """Block until every updated parameter has arrived (stages 1-2 gather them asynchronously
        after optimizer.step(); forward waits by itself). Stage 3 has nothing pending."""

    @eager
    def _before_forward(self, args, kwargs):
        """What every stage's forward does first: sync buffers (native DDP's rule), cast inputs."""
        if self._stepped:  # some optimizers stepped, not all: the parameters follow what they did
            self._refresh_after_steps()
        src = self._join_forward(args, kwargs)  # under Join: tell the ranks that left what this forward does
        self._buffer_sync.before_forward(self._sync_enabled, src=src)
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args, kwargs):
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        cast = lambda t: t.to(self.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def _apply(self, fn, recurse=True):
        """model.to(...), .cuda(), .double() after wrapping: accepted where they change nothing.
        Otherwise they would give the module new tensors apart from the flat shards, which the
        optimizer steps and the gathers write: training would silently stop reaching the model."""
        kinds = {(t.dtype, t.device) for t in [*self.module.parameters(), *self.module.buffers()]}
        for dtype, device in kinds:  # probed on empty tensors: stage 3's parameters hold no storage
            probe = torch.empty(0, dtype=dtype, device=device)
            out = fn(probe)
            if out.dtype != dtype or out.device != device:
                raise RuntimeError(
                    f"ShardedDataParallel: moving or casting the wrapped model ({dtype} on {device} -> {out.dtype} on "
                    f"{out.device}) would detach the module's parameters from the shards the optimizer steps. "
                    "Move or cast the module before wrapping (net.to(device)); for a compute dtype give "
                    "param_dtype= or mp_policy=.")
        return self

    def _cast_output(self, out):
        """mp_policy's output_dtype: floating outputs (nested in tuples, lists, dicts) cast to it."""
        if self.output_dtype is None:
            return out
        return tree_map_only(torch.Tensor, lambda t: t.to(self.output_dtype) if t.is_floating_point() else t, out)

    # ------------------------------------------------------------------ public API

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by the global norm over all shards (as if unsharded); return that norm."""
        self._join_clip(max_norm, norm_type)  # under Join: the ranks that left take part in the norm
        grads = [g for s in self._shards for g in s.grads()]
        device = self._shards[0].device
        if norm_type == math.inf:
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=device)
            total = local.float().reshape(1)
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=self.process_group)
        else:
            # Padding holds zero gradient, so summing whole shards adds nothing spurious.
            local = sum((g.float().pow(norm_type).sum() for g in grads), torch.zeros((), device=device))
            total = local.reshape(1)
            comm.all_reduce(total, group=self.process_group)
            total = total.pow(1.0 / norm_type)
        total = total.reshape(())
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # the formula torch.nn.utils uses
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # -- the master shards, for an outer loop that updates them itself (minidist.DiLoCo)
    def shard_slot(self, p: nn.Parameter) -> tuple[FlatShard, int]:
        """The FlatShard holding parameter `p`, and p's index in it: its fp32 master values on
        this rank are `shard.owned_master(k)`, each rank's range `shard.owned_range(k, r)`. Write
        them only between `wait_for_parameters()` and `refresh_parameters()`."""
        if id(p) not in self._slot_by_id:
            raise ValueError("ShardedDataParallel: that parameter is not one of the wrapped module's trained ones")
        return self._slot_by_id[id(p)]

    def refresh_parameters(self) -> None:
        """The master shards were written from outside the optimizer: make the module's parameters
        follow them, as after a step (stages 1-2 gather them again, stage 3's next forward does)."""
        self._after_optimizer_step()

    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """The complete, unsharded state_dict of the wrapped module (same keys), fp32 parameters.

        A collective: every rank must call it. With rank0_only, other ranks get {}.
        """
        self.wait_for_parameters()  # nothing of ours still in flight while the state is read
        values: dict[int, torch.Tensor] = {}  # id(parameter) -> gathered value
        for shard in self._shards:
            flat = shard.full_fp32()
            for slot, p in zip(shard.slots, shard.params):
                values[id(p)] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        if rank0_only and self.rank != 0:
            return {}
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[key] = values[id(value)] if id(value) in values else value.detach().clone()
        return out

    def load_full_state_dict(self, state: dict) -> None:
        """Load a plain state_dict of the wrapped module (what full_state_dict() returns, or the
        module's own state_dict from any run): each rank keeps its slices, no communication. The
        optimizer's state is not touched: load_full_optim_state_dict loads it."""
        sharded = {id(p) for p in self._params}
        own = self.module.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"ShardedDataParallel.load_full_state_dict: the state has no {missing[:5]}")
        slots = [slot for s in self._shards for slot in s.slots]
        self.load_sharded_state_dict({
            "format": CHECKPOINT_FORMAT, "world_size": 1, "rank": 0, "stage": self.stage, "mesh": None,
            "shapes": {slot.name: slot.shape for slot in slots},
            "params": {slot.name: [(0, state[slot.name].detach().reshape(-1).cpu().float())] for slot in slots},
            "replicated": {k: state[k] for k, v in own.items() if id(v) not in sharded}})

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer | None = None,
                              rank0_only: bool = False) -> dict:
        """The optimizer's whole state, unsharded: what a torch optimizer of the same class over
        the module's parameters (the param groups the optimizer was built with) would return from
        state_dict(), so a script's one-file checkpoint stays one file, loadable here at any
        world size (`model.optimizer.load_state_dict(it)` on every rank) and by native DDP.

        A collective: every rank must call it. With rank0_only, other ranks get {}. `optimizer`,
        if given, must be one of model.optimizers (needed when there are several; with one, the call
        reads as DataParallel's)."""
        shard_optimizer = self._shard_optimizer_for(optimizer)
        self.wait_for_parameters()
        return shard_optimizer.full_state_dict(rank0_only, self.rank)

    @property
    def full_param_groups(self) -> list[list[nn.Parameter]]:
        """The module's parameters, group by group, as full_optim_state_dict() numbers them."""
        return self._full_groups

    def load_full_optim_state_dict(self, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load what full_optim_state_dict() (or a native optimizer over the same param groups)
        saved: each rank keeps its own slice, no communication. The same as
        model.optimizer.load_state_dict(state)."""
        self._shard_optimizer_for(optimizer).optimizer.load_state_dict(state)

    def sharded_state_dict(self, copy: bool = True) -> dict:
        """This rank's shards of the parameters and optimizer state, per parameter, with metadata.

        Each entry is (start offset within the flattened parameter, values), so shards
        saved at one world size load at any other (see load_sharded_state_dict). `copy=False`:
        the values are views of the live state where they can be (to be written at once).
        """
        self.wait_for_parameters()  # nothing of ours still in flight while the state is read
        params: dict[str, list] = {}
        for shard in self._shards:
            for name, piece in shard.owned_pieces(shard.master, copy).items():
                params.setdefault(name, []).append(piece)
        optim, scalars = {}, {}
        for shard_optimizer in self._shard_optimizers:  # their groups numbered in order, their names apart
            own, own_scalars = shard_optimizer.owned_state(copy)
            for key, by_name in own.items():
                optim.setdefault(key, {}).update(by_name)
            for k, per_group in own_scalars.items():
                scalars.setdefault(k, []).extend(per_group)
        shapes = {slot.name: slot.shape for s in self._shards for slot in s.slots}
        groups = [g for o in self.optimizers for g in o.param_groups]
        return {
            "format": CHECKPOINT_FORMAT, "world_size": self.world_size, "rank": self.rank, "stage": self.stage,
            # with a mesh, world_size/rank are the shard group's: every replica holds the same shards
            "mesh": None if self.mesh is None else [self.mesh.replicate, self.mesh.shard],
            "shapes": shapes, "params": params, "optim": optim, "optim_scalars": scalars,
            "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                              "param_names": [self._name_of[id(p)] for p in full]}  # (another layout reads them)
                             for g, full in zip(groups, self._full_groups)],
            "replicated": {k: v.detach().clone() for k, v in self.module.state_dict(keep_vars=True).items()
                           if not any(v is p for p in self._params)},
        }

    def load_sharded_state_dict(self, state: dict | list[dict]) -> None:
        """Load what sharded_state_dict saved. Pass every saved rank's dict (a list) to load at a
        different world size; a single dict suffices when reloading at the same world size and rank."""
        states = state if isinstance(state, list) else [state]
        check_format(states)
        mine = {slot.name: slot.shape for s in self._shards for slot in s.slots}
        saved_shapes = states[0]["shapes"]
        if {k: tuple(v) for k, v in saved_shapes.items()} != mine:
            missing = sorted(set(mine) - set(saved_shapes))
            extra = sorted(set(saved_shapes) - set(mine))
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
                             f"{extra[:5]} (or shapes differ)")
        params = merged_pieces(states, names=mine)
        for shard in self._shards:
            shard.fill_from_pieces(shard.master.data, params)
        if "optim" in states[0]:  # (load_full_state_dict's has none: the optimizer is left as it is)
            for shard_optimizer in self._shard_optimizers:
                shard_optimizer.load_owned_state(states)
        with torch.no_grad():
            own = self.module.state_dict(keep_vars=True)
            for key, value in states[0]["replicated"].items():
                own[key].copy_(value)
        self._after_load()

    def _after_load(self) -> None:
        self._after_optimizer_step()

    def memory_report(self) -> dict[str, int]:
        """Bytes on this rank from live storages, each counted once (beyond them: docs/trainer.md, "Memory")."""
        self.wait_for_parameters()  # nothing of ours still in flight while the state is read
        return measure({
            "parameters": self._parameter_tensors(),
            "master_params": [s.master for s in self._shards],
            "gradients": self._gradient_tensors(),
            "optimizer_state": [t for o in self.optimizers for t in optimizer_tensors(o)],
            "comm_buffers": self._comm_buffer_tensors(),
            "replicated": [v for v in self.module.state_dict(keep_vars=True).values()
                           if not any(v is p for p in self._params)],
        })

    def __getstate__(self):
        raise TypeError("ShardedDataParallel cannot be pickled (torch.save(model), copy.deepcopy): its state lives "
                        "in shards across ranks; save model.full_state_dict() (one plain state_dict) or "
                        "model.sharded_state_dict() (one file per rank) instead")

    def register_comm_hook(self, state, hook) -> None:
        """Native DDP's; refused: gradients are reduce_scattered, not all_reduced in DDP's buckets."""
        raise NotImplementedError("ShardedDataParallel reduces gradients with reduce_scatter into shards, so a DDP "
                                  "comm hook (an all_reduce of a bucket) has nothing to act on: compress its "
                                  "traffic with grad_wire='bf16' / 'int8', or use DataParallel for comm hooks")

    def _parameter_tensors(self) -> list[torch.Tensor]:
        return [s.full for s in self._shards]

    def _gradient_tensors(self) -> list[torch.Tensor]:
        return [g for s in self._shards for g in s.grads()]

    def _comm_buffer_tensors(self) -> list[torch.Tensor]:
        return []


class ShardBucket(Bucket):
    """A DataParallel bucket plus the FlatShard it reduces into and its reduced slice."""

    shard: FlatShard
    reduced: torch.Tensor | None = None


class ZeroStage12(ShardedDataParallel):
    """Stages 1 and 2: full parameters on every rank, gradients reduce_scattered per bucket.

    What differs between them is where a bucket's full-size gradients live, which ZeroStage1 and
    ZeroStage2 say (_allocate, _release, _reduced_slice, _before_backward); the reduction itself
    is the one every stage shares (sharded_grad.py)."""

    def __init__(self, module: nn.Module, optimizer=None, *, stage: int = 2,
                 bucket_cap_mb: float = 25.0, overlap: bool | None = None, process_group=None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 max_inflight: int = 2, broadcast_buffers: bool = True, collectives: str = "auto", mesh=None,
                 find_unused_parameters: bool = False, mp_policy=None, reshard_after_forward: bool | None = False,
                 grad_wire=None, param_wire=None, quant_block: int = QUANT_BLOCK, **unused):
        nn.Module.__init__(self)
        stage3 = {"unit_policy", "min_unit_params", "prefetch", "secondary_shard", "init_fn"}
        if unused and set(unused) <= stage3:
            raise ValueError(f"ShardedDataParallel(stage={stage}) does not take {sorted(unused)}: those are stage 3's, "
                             "which cuts the model into units (and materialises a meta-built one); stages 1-2 reduce "
                             "in buckets (bucket_cap_mb). Use stage=3 for units.")
        refuse_unknown("ShardedDataParallel", unused)
        check_reshard_after_forward(reshard_after_forward, stage)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        overlap = self._overlap(overlap)
        self._setup_common(module, optimizer, stage, process_group, param_dtype, reduce_dtype,
                           max_inflight, broadcast_buffers, collectives, mesh, mp_policy,
                           wires=(grad_wire, param_wire, quant_block))
        cap = int(bucket_cap_mb * MiB)
        plan = plan_buckets(self._params, list(reversed(range(len(self._params)))), cap, min(cap, MiB))
        self._shards, buckets = [], []
        for k, ids in enumerate(plan):
            shard, ids = self._flat_shard(k, ids, keep_full=True)
            bucket = ShardBucket(k, ids, buffer=None, views=[], process_group=self.process_group,
                                 world_size=self.world_size)
            bucket.shard = shard
            self._shards.append(shard)
            buckets.append(bucket)
        self._after_buckets(buckets)
        # Without find_unused_parameters, a parameter without gradient raises when backward ends
        # (BucketedBackward); with it, it contributes zeros to its bucket and _check_used decides.
        self._backward = BucketedBackward(self, self._names, self._params, buckets, world_size=self.world_size,
                                          process_group=self.process_group, overlap=overlap,
                                          find_unused_parameters=find_unused_parameters,
                                          flag_unused_anywhere=False)
        self._stash: dict[int, torch.Tensor] = {}  # stage 1: gradients kept from before this backward
        # Updated parameters are gathered asynchronously after optimizer.step(); a module's
        # forward waits only for the buckets holding its own parameters (see _after_optimizer_step).
        self._pending_gathers: dict[int, object] = {}
        self._watch_parameter_use()
        self._make_optimizer(optimizer)

    def forward(self, *args, **kwargs):
        args, kwargs = self._before_forward(args, kwargs)
        if runs_compiled_code(self.module):
            # Compiled code may skip the per-module waits (see runs_compiled_code): every
            # gather lands before forward starts. Eager forwards wait module by module instead.
            self.wait_for_parameters()
        out = self.module(*args, **kwargs)
        self.wait_for_parameters()  # parameters forward did not use: current now too
        return self._cast_output(out)

    def _watch_parameter_use(self) -> None:
        """A pre-forward hook on every module that owns parameters: wait for the gathers of the
        buckets of its parameters and its submodules' (nn.MultiheadAttention computes with its
        out_proj's weight without calling out_proj: its own parameters alone would let it read a
        bucket still being gathered)."""
        bucket_of = {id(p): self._backward.where[i][0].index for i, p in enumerate(self._params)}
        for module in self.module.modules():
            if not any(id(p) in bucket_of for p in module.parameters(recurse=False)):
                continue
            ks = sorted({bucket_of[id(p)] for p in module.parameters() if id(p) in bucket_of})
            if ks:
                module.register_forward_pre_hook(lambda *_, ks=ks: self._wait_gathers(ks))

    # Not @eager: under torch.compile every gather has landed before forward (see forward), so
    # dynamo traces this as a no-op instead of breaking the graph at every module.
    def _wait_gathers(self, ks) -> None:
        for k in ks:
            handle = self._pending_gathers.pop(k, None)
            if handle is not None:
                handle.wait()

    # -- where a bucket's full-size gradients live (the stage's part)
    def _overlap(self, overlap: bool | None) -> bool:
        """Whether buckets are reduced as they fill, given the constructor's `overlap`."""
        raise NotImplementedError

    def _after_buckets(self, buckets: list[ShardBucket]) -> None:
        """The buckets exist: set up what holds their full-size gradients."""

    def _allocate(self, bucket: ShardBucket) -> None:
        """Give `bucket` its full-size gradient buffer and the slot views into it."""
        raise NotImplementedError

    def _release(self, bucket: ShardBucket) -> None:
        """The bucket's reduction is done: its full-size buffer may go."""

    def _reduced_slice(self, bucket: ShardBucket) -> torch.Tensor | None:
        """Where the bucket's reduce_scatter writes this rank's slice (None: a new tensor)."""
        return None

    @property
    def _buckets(self) -> list[ShardBucket]:
        return self._backward.buckets

    @property
    def find_unused_parameters(self) -> bool:
        """As given to the constructor (held by the backward, which acts on it; _check_used reads it)."""
        return self._backward.find_unused_parameters

    # -- what the BucketedBackward does with a bucket (a BucketReducer)
    def _before_backward(self) -> None:
        pass

    def _fill_slot(self, i: int, bucket: ShardBucket, k: int) -> None:
        if bucket.buffer is None:
            self._allocate(bucket)
        p = self._params[i]
        grad = local_grad(p)
        self._grad_reduce.fill(bucket.views[k], grad)
        if grad is not None:
            p.grad = None  # the bucket holds it now; the full-size gradient is freed

    def _launch(self, bucket: ShardBucket):
        handle, bucket.reduced = self._grad_reduce.launch(bucket.shard, bucket.buffer, self._reduced_slice(bucket))
        return handle

    def _after_backward(self, used_anywhere) -> None:
        for k, (bucket, shard) in enumerate(zip(self._buckets, self._shards)):
            self._grad_reduce.finish(shard, bucket.reduced, self._stash.pop(k, None))
            bucket.reduced = None
            self._release(bucket)
        self._gradients_ready()
        self._check_used(self._backward.used)  # this rank's flags (flag_unused_anywhere=False)

    # -- after the optimizer step
    def _after_optimizer_step(self) -> None:
        """Gather the updated shards into the full parameters, asynchronously: the last bucket
        (the first layers) first, as forward will need them, so the gathers overlap forward."""
        self.wait_for_parameters()  # a second step before any forward
        for k in reversed(range(len(self._shards))):
            self._pending_gathers[k] = self._shards[k].gather_full(async_op=True)

    @eager
    def wait_for_parameters(self) -> None:
        """Block until every updated parameter has arrived. Forward does this by itself; call it
        to read the module's parameters between optimizer.step() and the next forward."""
        if self._stepped:  # (not every optimizer has stepped: gather what those that did changed)
            self._refresh_after_steps()
        self._wait_gathers(list(self._pending_gathers))


class ZeroStage1(ZeroStage12):
    """Stage 1: each bucket keeps its full-size gradient buffer for good and is reduce_scattered in
    place after backward; only the optimizer state is sharded."""

    def _overlap(self, overlap: bool | None) -> bool:
        if overlap:
            raise ValueError("ShardedDataParallel(stage=1) does not take overlap=True: stage 1 keeps full-size "
                             "gradients and reduce_scatters them after backward. Use stage=2 to reduce during "
                             "backward.")
        return False

    def _after_buckets(self, buckets: list[ShardBucket]) -> None:
        for bucket in buckets:
            self._allocate(bucket)  # full-size gradients all the time

    def _allocate(self, bucket: ShardBucket) -> None:
        shard = bucket.shard
        bucket.buffer = torch.zeros(shard.padded, dtype=self.reduce_dtype, device=shard.device)
        bucket.views = [bucket.buffer[s.offset:s.offset + s.numel].view(s.shape) for s in shard.slots]

    def _reduced_slice(self, bucket: ShardBucket) -> torch.Tensor:
        return bucket.buffer[bucket.shard.lo:bucket.shard.hi]  # in place: slice r of the bucket

    def _before_backward(self) -> None:
        # The reduced gradient is a view into the bucket, which this backward overwrites: keep a
        # copy if the user is accumulating across optimizer steps.
        for k, shard in enumerate(self._shards):
            grad = shard.take_grad()
            if grad is not None:
                self._stash[k] = grad

    def _gradient_tensors(self) -> list[torch.Tensor]:
        return [b.buffer for b in self._buckets if b.buffer is not None] + super()._gradient_tensors()


class ZeroStage2(ZeroStage12):
    """Stage 2: full-size gradient buffers come from a pool as buckets fill during backward and go
    back as soon as their reduce_scatter is done, freed when it ends; gradients persist sharded only."""

    def _overlap(self, overlap: bool | None) -> bool:
        return overlap is not False

    def _after_buckets(self, buckets: list[ShardBucket]) -> None:
        # Full-size gradient buffers, reused across the buckets of a backward; each can hold any bucket.
        self._pool = BufferPool(capacity=max(shard.padded for shard in self._shards))

    def _allocate(self, bucket: ShardBucket) -> None:
        shard = bucket.shard
        self._limit_inflight()
        bucket.buffer = self._pool.get(shard.padded, self.reduce_dtype, shard.device)
        shard.zero_padding(bucket.buffer)  # every slot is written by _fill_slot
        bucket.views = [bucket.buffer[s.offset:s.offset + s.numel].view(s.shape) for s in shard.slots]

    def _release(self, bucket: ShardBucket) -> None:
        if bucket.buffer is not None:  # may already be back in the pool (_limit_inflight)
            self._pool.put(bucket.buffer)
            bucket.buffer, bucket.views = None, []

    def _launch(self, bucket: ShardBucket):
        self._release_completed()
        return super()._launch(bucket)

    def _limit_inflight(self) -> None:
        # Before taking another full-size buffer, let the oldest launched reductions finish.
        while True:
            inflight = [b for b in self._backward.launched_buckets() if b.buffer is not None]
            if len(inflight) < self.max_inflight:
                return
            inflight[0].handle.wait()
            self._release(inflight[0])

    def _release_completed(self) -> None:
        # A full-size bucket is dropped as soon as its reduce_scatter is done.
        for bucket in self._backward.launched_buckets():
            if bucket.buffer is not None and bucket.handle is not None and bucket.handle.is_completed():
                bucket.handle.wait()
                self._release(bucket)

    def _after_backward(self, used_anywhere) -> None:
        super()._after_backward(used_anywhere)
        self._pool.clear()  # between backwards: the gradient shard only

    def _comm_buffer_tensors(self) -> list[torch.Tensor]:
        return self._pool.tensors()


ShardedDataParallel._stages.update({1: ZeroStage1, 2: ZeroStage2})
