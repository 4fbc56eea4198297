"""ZeRO stage 3: parameters sharded too, gathered per unit just before they are needed.

    forward:   all_gather the unit's shard -> its forward -> free the full parameters
    backward:  all_gather again -> its backward -> reduce_scatter the gradients -> free

Units are the model's repeated blocks (where FSDP2 users call fully_shard) and a root unit;
the next unit's gather is prefetched. How units are cut and freed: docs/internals.md,
"parallel/zero3.py".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from minidist.comm.check import exchange
from minidist.comm.wire import QUANT_BLOCK
from minidist.parallel.buckets import BufferPool
from minidist.parallel.compat import check_reshard_after_forward, eager, mark_hooked, refuse_unknown
from minidist.parallel.flat_shard import FlatShard
from minidist.parallel.hpz import SecondaryShards, secondary_size
from minidist.parallel.join import tensors_in
from minidist.parallel.sharded_grad import local_grad
from minidist.parallel.zero import ShardedDataParallel


SIZE_RULE_PARAMS = 100_000  # the default's fallback for a model without repeated blocks
ONE_RANK_FORWARD = ("At stage 3 every forward gathers each unit's parameters from every rank, so every rank must run "
                    "it: run the evaluation on every rank, or for rank-0-only use load model.full_state_dict() (a "
                    "collective: every rank calls it) into a plain copy of the model. Native FSDP2 cannot run it "
                    "on one rank either.")


def repeated_blocks(module: nn.Module, wanted: set[int]) -> set[int]:
    """The ids of the model's repeated blocks: children of a container (ModuleList, Sequential,
    ModuleDict) of which at least two, of one class, hold trainable parameters (a transformer's
    layers, a ResNet stage's blocks) — where FSDP2 users call fully_shard."""
    out: set[int] = set()
    for m in module.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        trained = [c for c in m.children() if any(id(p) in wanted for p in c.parameters())]
        for c in trained:
            if sum(type(other) is type(c) for other in trained) >= 2:
                out.add(id(c))
    return out


def plan_units(module: nn.Module, trainable: list[nn.Parameter], policy: Callable[[str, nn.Module], bool] | None,
               min_unit_params: int | None) -> list[tuple[str, nn.Module]]:
    """The submodules that become units, outermost first; everything else belongs to the root.

    By `policy(name, module)` if given, else each submodule of at least `min_unit_params`
    parameters, else (both None) the model's repeated blocks (repeated_blocks), or for a model
    without any, the submodules of at least SIZE_RULE_PARAMS."""
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    wanted = {id(p) for p in trainable}
    if policy is None and min_unit_params is None:
        blocks = repeated_blocks(module, wanted)
        if blocks:
            policy = lambda name, m: id(m) in blocks  # noqa: E731
        else:
            min_unit_params = SIZE_RULE_PARAMS

    def self_contained(m: nn.Module) -> bool:
        inside: dict[int, int] = {}
        for _, p in m.named_parameters(remove_duplicate=False):
            inside[id(p)] = inside.get(id(p), 0) + 1
        return all(uses[k] == v for k, v in inside.items())  # no parameter shared with the outside

    def is_unit(name: str, m: nn.Module) -> bool:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) or not self_contained(m):
            return False  # containers have no forward of their own to hook
        if policy is not None:
            return policy(name, m)
        return sum(p.numel() for p in m.parameters() if id(p) in wanted) >= min_unit_params

    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, m: nn.Module) -> None:
        for child_name, child in m.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if is_unit(name, child) and any(id(p) in wanted for p in child.parameters()):
                units.append((name, child))
            else:
                visit(name, child)

    visit("", module)
    return units


class _Unit:
    """One unit's flat shard and its per-step state."""

    def __init__(self, name: str, module: nn.Module | None, shard: FlatShard, param_ids: list[int]):
        self.name, self.module, self.shard, self.param_ids = name, module, shard, param_ids
        self.gather_handle = None   # an all_gather in flight (prefetch)
        self.ready = 0              # parameters whose gradient arrived in this backward
        self.backward_started = False
        self.reduce_handle = None
        self.staging: torch.Tensor | None = None   # full-size gradients, alive while reduced
        self.reduced: torch.Tensor | None = None


class ZeroStage3(ShardedDataParallel):
    """Stage 3. Extra arguments: unit_policy(name, module) -> bool, min_unit_params (None with no
    policy: the repeated blocks, see plan_units), prefetch, max_inflight (units whose gradients may
    be in reduction at once), reshard_after_forward (False: keep each unit gathered from its
    forward to its backward, as FSDP2's option; an int G: secondary_shard=G), secondary_shard (hpZ:
    None, G ranks or "host"; the backward gathers within blocks of G ranks, flat_shard.py), init_fn
    (a model built on the meta device is materialised unit by unit into the shards by each module's
    reset_parameters(), or by init_fn(module) for every module: meta_init.py)."""

    def __init__(self, module: nn.Module, optimizer=None, *, stage: int = 3, process_group=None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 unit_policy: Callable[[str, nn.Module], bool] | None = None, min_unit_params: int | None = None,
                 prefetch: bool = True, max_inflight: int = 2, bucket_cap_mb: float | None = None,
                 overlap: bool | None = None, broadcast_buffers: bool = True, collectives: str = "auto", mesh=None,
                 find_unused_parameters: bool = False, mp_policy=None, reshard_after_forward: bool | None = None,
                 grad_wire=None, param_wire=None, quant_block: int = QUANT_BLOCK, secondary_shard=None,
                 init_fn: Callable[[nn.Module], None] | None = None, **unused):
        nn.Module.__init__(self)
        refuse_unknown("ShardedDataParallel", unused)
        if type(reshard_after_forward) is int:  # FSDP2's reshard to a smaller group: hpZ's secondary shard
            if secondary_shard not in (None, reshard_after_forward):
                raise ValueError(f"ShardedDataParallel: reshard_after_forward={reshard_after_forward} and "
                                 f"secondary_shard={secondary_shard!r} disagree: give one of them")
            secondary_shard, reshard_after_forward = reshard_after_forward, True
        # FSDP2's ZeRO-2-like mode when False: each unit stays gathered from its forward to its backward.
        self.reshard_after_forward = check_reshard_after_forward(reshard_after_forward, stage)
        if bucket_cap_mb is not None:
            raise ValueError(f"ShardedDataParallel(stage=3) does not take bucket_cap_mb={bucket_cap_mb}: stage 3 "
                             "gathers and reduces one unit (a block of layers) at a time, not buckets. Size the "
                             "units with min_unit_params or unit_policy, or use stage 1 or 2 for buckets.")
        if find_unused_parameters:
            raise ValueError(
                "ShardedDataParallel(stage=3) does not take find_unused_parameters=True: each unit's gradients "
                "are reduce_scattered as its backward ends, in the order backward runs the units, and a "
                "parameter unused on some ranks changes that order there, so the ranks' collectives would not "
                "line up (native FSDP2 has the same restriction). Use stage 1 or 2, or set "
                "requires_grad=False on parameters no rank uses.")
        self._setup_common(module, optimizer, stage, process_group, param_dtype, reduce_dtype,
                           max_inflight, broadcast_buffers, collectives, mesh, mp_policy,
                           wires=(grad_wire, param_wire, quant_block), init_fn=init_fn)
        if secondary_shard is not None and not self.reshard_after_forward:
            raise ValueError("ShardedDataParallel: secondary_shard keeps a host-local copy for units freed after their "
                             "forward; with reshard_after_forward=False nothing is freed: give one of them")
        size = secondary_size(secondary_shard, self.world_size, mesh)
        self._secondary = SecondaryShards(size, self.process_group, collectives) if size else None
        self.find_unused_parameters = False
        self._got_grad = [False] * len(self._params)  # in this backward
        self.prefetch = prefetch and overlap is not False
        self._inflight: list[_Unit] = []
        index = {id(p): i for i, p in enumerate(self._params)}
        self._units: list[_Unit] = []
        claimed: set[int] = set()
        planned = plan_units(module, self._params, unit_policy, min_unit_params)
        groups = []
        for name, sub in planned:
            ids = [index[id(p)] for p in sub.parameters() if id(p) in index and index[id(p)] not in claimed]
            claimed.update(ids)
            groups.append((name, sub, ids))
        root_ids = [i for i in range(len(self._params)) if i not in claimed]
        if root_ids:
            groups.insert(0, ("<root>", None, root_ids))
        for k, (name, sub, ids) in enumerate(groups):
            shard, ids = self._flat_shard(k, ids, keep_full=False)
            self._units.append(_Unit(name, sub, shard, ids))
        if self._meta_init is not None:
            self._meta_init.finish()
            self._meta_init = None  # (its generator states, one per module, are done with)
        self._root = self._units[0] if root_ids else None
        self._shards = [u.shard for u in self._units]
        self._unit_of = {i: u for u in self._units for i in u.param_ids}
        for u in self._units:
            if u.module is not None:
                mark_hooked(u.module)
                u.module.register_forward_pre_hook(self._make_pre_forward(u))
                u.module.register_forward_hook(self._make_post_forward(u))
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_post_accumulate(i))
        self._sync_enabled = True
        self._forwards = 0  # this rank's forwards, which every rank of the shard group runs alike
        self._in_backward = False
        self._order: list[_Unit] = []          # units in the order this forward ran them
        self._last_order: list[_Unit] = []     # ... and the previous forward (for prefetching)
        # Full-size gradient buffers for reduce_scatter, reused; each can hold any unit's gradients.
        self._pool = BufferPool(capacity=max(u.shard.padded for u in self._units))
        mark_hooked(module)
        self._make_optimizer(optimizer)

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self._units]

    def reset_parameters(self) -> None:
        """FSDP2's `to_empty()` then `reset_parameters()` after wrapping: refused (to_empty alone changes nothing)."""
        raise RuntimeError("ShardedDataParallel(stage=3) already initialised the model while wrapping: a model built on "
                           "the meta device gets each module's reset_parameters() (or init_fn=) unit by unit, straight "
                           "into the shards. Drop the to_empty()/reset_parameters() calls after wrapping.")

    # ------------------------------------------------------------------ gather / free

    def _unshard(self, u: _Unit, for_backward: bool = False) -> None:
        if u.gather_handle is not None:
            u.gather_handle.wait()
            u.gather_handle = None
        elif not u.shard.is_materialised:
            self._gather(u, for_backward, async_op=False)

    def _prefetch(self, u: _Unit | None, for_backward: bool = False) -> None:
        if self.prefetch and u is not None and u.gather_handle is None and not u.shard.is_materialised:
            u.gather_handle = self._gather(u, for_backward, async_op=True)

    def _gather(self, u: _Unit, for_backward: bool, async_op: bool):
        """Forward gathers over the shard group; backward from the secondary shards where kept (hpZ)."""
        if for_backward and self._secondary is not None and self._secondary.has(u.shard):
            return self._secondary.gather(u.shard, async_op=async_op)
        return u.shard.gather_full(async_op=async_op)

    def _reshard(self, u: _Unit) -> None:
        if u.gather_handle is None and u.shard.is_materialised:
            u.shard.free_full()

    def _neighbour(self, order: list[_Unit], u: _Unit, step: int) -> _Unit | None:
        if u in order:
            j = order.index(u) + step
            if 0 <= j < len(order):
                return order[j]
        return None

    # ------------------------------------------------------------------ forward

    # Under torch.compile, what gathers, frees and hooks runs as plain Python (@eager: a graph
    # break); each unit's own computation between those points is compiled.
    def forward(self, *args, **kwargs):
        args, kwargs = self._before_forward(args, kwargs)
        self._enter_forward()
        out = self.module(*args, **kwargs)
        self._leave_forward(out)
        return self._cast_output(out)

    @eager
    def _enter_forward(self) -> None:
        self._agree_on_forward()
        self._order = []
        if self._secondary is not None:
            self._secondary.drop()  # a forward whose backward never came: its copies go
        if self._root is not None:
            self._unshard(self._root)
        if self._last_order:
            self._prefetch(self._last_order[0])

    def _agree_on_forward(self) -> None:
        """Every rank of the shard group runs this forward, or every one raises saying so: a forward
        on one rank only (rank-0 evaluation between steps) would issue its gathers against the other
        ranks' training collectives, and gloo would abort both with a size mismatch naming nothing.
        One 24-byte all_gather per forward, on the host (gloo). On NCCL it is skipped: reading it would
        stall the device's queue every forward; there the collective timeout and NCCL's flight
        recorder name the stuck gather instead."""
        if self.world_size == 1 or dist.get_backend(self.process_group) != "gloo":
            return
        self._forwards += 1
        mine = [self._forwards, int(torch.is_grad_enabled()), int(self.training)]
        try:
            rows = exchange(mine, self.process_group)
        except RuntimeError as e:  # the others were in another collective, or never came
            raise RuntimeError(f"ShardedDataParallel(stage=3): forward #{mine[0]} on rank {dist.get_rank()} found no "
                               f"matching forward on the other ranks ({str(e).splitlines()[0][:120]}). "
                               + ONE_RANK_FORWARD) from None
        if any(row != rows[0] for row in rows):
            ranks = [dist.get_global_rank(self.process_group, k) if self.process_group is not None else k
                     for k in range(len(rows))]
            seen = "; ".join(f"rank {r}: forward #{n}, {'with grad' if g else 'no_grad'}, "
                             f"{'train' if t else 'eval'}" for r, (n, g, t) in zip(ranks, rows))
            raise RuntimeError(f"ShardedDataParallel(stage=3): the ranks are not running the same forward ({seen}). "
                               + ONE_RANK_FORWARD)

    @eager
    def _leave_forward(self, out) -> None:
        if self._root is not None:
            self._watch_backward(self._root, out)
            self._reshard_after_forward(self._root)
        self._last_order = self._order

    def _make_pre_forward(self, u: _Unit):
        @eager
        def hook(module, inputs):
            self._unshard(u)
            self._order.append(u)
            self._prefetch(self._neighbour(self._last_order, u, +1))
        return hook

    def _make_post_forward(self, u: _Unit):
        @eager
        def hook(module, inputs, output):
            self._watch_backward(u, output)
            self._reshard_after_forward(u)
        return hook

    def _reshard_after_forward(self, u: _Unit) -> None:
        # Kept gathered for its backward only when one will come (reshard_after_forward=False).
        if self.reshard_after_forward or not torch.is_grad_enabled():
            if self._secondary is not None and torch.is_grad_enabled() and u.gather_handle is None \
                    and u.shard.is_materialised:
                self._secondary.keep(u.shard)  # what the backward gathers within the host (hpZ)
            self._reshard(u)

    # ------------------------------------------------------------------ backward

    def _watch_backward(self, u: _Unit, output) -> None:
        """Gather u again when the gradient of its output arrives: its backward is next."""
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        for t in tensors:
            t.register_hook(self._make_pre_backward(u))

    def _make_pre_backward(self, u: _Unit):
        def hook(grad):
            if torch.is_grad_enabled():  # autograd records the backward itself: create_graph=True
                raise RuntimeError(
                    "ShardedDataParallel(stage=3) does not support double backward (create_graph=True, e.g. "
                    "a gradient penalty through torch.autograd.grad): the graph of the gradient would keep "
                    "every unit's gathered parameters, which stage 3 frees. Use stage 1 or 2, or DataParallel; "
                    "native FSDP2 (fully_shard) does not support it either.")
            if not self._in_backward:
                self._start_backward()
            if not u.backward_started:
                u.backward_started = True
                self._unshard(u, for_backward=True)
                if u is not self._root:  # the unit whose backward runs after this one
                    self._prefetch(self._neighbour(self._order, u, -1), for_backward=True)
            return grad
        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        self._got_grad = [False] * len(self._params)
        for u in self._units:
            u.ready, u.backward_started = 0, False
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _make_post_accumulate(self, i: int):
        def hook(param):
            if not self._sync_enabled:
                return  # no_sync: the full gradient accumulates in .grad
            if not self._in_backward:
                self._start_backward()
            u = self._unit_of[i]
            self._got_grad[i] = True
            u.ready += 1
            if u.ready == len(u.param_ids):
                self._reduce(u)
        return hook

    def _reduce(self, u: _Unit) -> None:
        """Fill the unit's gradients into a flat buffer, start its reduction (sharded_grad.py), free
        the full tensors."""
        shard = u.shard
        while len(self._inflight) >= self.max_inflight:
            self._complete(self._inflight[0])
        with torch.no_grad():
            staging = self._pool.get(shard.padded, self.reduce_dtype, shard.device)
            shard.zero_padding(staging)
            for slot, i in zip(shard.slots, u.param_ids):
                p = self._params[i]
                grad = local_grad(p)  # None: no gradient in this backward, contributes zeros
                self._grad_reduce.fill(staging[slot.offset:slot.offset + slot.numel], grad)
                if grad is not None:
                    p.grad = None
            u.staging = staging
            u.reduce_handle, u.reduced = self._grad_reduce.launch(shard, staging)
        self._inflight.append(u)
        if u is not self._root:
            self._reshard(u)

    def _complete(self, u: _Unit) -> None:
        """Wait for u's reduce_scatter, add the result to its master gradient, recycle the buffer."""
        with torch.no_grad():
            u.reduce_handle.wait()
            self._grad_reduce.finish(u.shard, u.reduced)
        self._pool.put(u.staging)
        u.staging = u.reduced = u.reduce_handle = None
        self._inflight.remove(u)

    def _finish_backward(self) -> None:
        try:
            if self._sync_enabled:
                # Got a gradient now, or holds one accumulated under no_sync.
                used = [g or local_grad(p) is not None for g, p in zip(self._got_grad, self._params)]
                if not all(used):
                    # Raise before reducing anything more: another rank may have reduced that unit
                    # mid-backward, and a late reduce here would cross the ranks' collectives.
                    while self._inflight:
                        self._complete(self._inflight[0])
                    self._check_used(used)
                for u in self._units:  # units holding gradients accumulated under no_sync only
                    if u.ready < len(u.param_ids):
                        self._reduce(u)
                while self._inflight:
                    self._complete(self._inflight[0])
                self._pool.clear()  # between backwards: the gradient shard only
                self._gradients_ready()
        finally:
            self._in_backward = False
            if self._secondary is not None:
                self._secondary.drop()
            for u in self._units:
                if u.gather_handle is not None:  # a prefetch nobody used
                    u.gather_handle.wait()
                    u.gather_handle = None
                self._reshard(u)

    def _after_optimizer_step(self) -> None:
        """The next forward gathers the updated shards. A unit still gathered (reshard_after_forward=
        False and a forward without backward) holds old values: freed, so it is gathered afresh."""
        for u in self._units:
            self._reshard(u)
        if self._secondary is not None:
            self._secondary.drop()

    def _comm_buffer_tensors(self) -> list[torch.Tensor]:
        return self._pool.tensors()

    def _parameter_tensors(self) -> list[torch.Tensor]:
        return super()._parameter_tensors() + (self._secondary.tensors() if self._secondary is not None else [])


ShardedDataParallel._stages[3] = ZeroStage3
