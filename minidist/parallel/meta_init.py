"""A model built on the meta device, materialised by ZeRO stage 3 unit by unit into its shards,
bitwise as materialising it whole on rank 0 and sharding it would (FSDP2's way).

    with torch.device("meta"):
        net = GPT(cfg)
    model = ShardedDataParallel(net, optimizer, stage=3)               # reset_parameters() of each module
    model = ShardedDataParallel(net, optimizer, stage=3, init_fn=init)  # or init(module) for each module

The two passes: docs/internals.md, "parallel/meta_init.py".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minidist import comm
from minidist.parallel.flat_shard import flat_layout


def is_meta_built(module: nn.Module) -> bool:
    """Whether the module was built on the meta device (all of it: a mix is refused)."""
    tensors = [*module.parameters(), *module.buffers()]
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        raise ValueError("ShardedDataParallel: part of the module is on the meta device and part is not; build the "
                         "whole model under torch.device('meta') (stage 3 materialises it), or none of it.")
    return bool(tensors) and all(meta)


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()


def _give(p: nn.Parameter, values: torch.Tensor) -> None:
    """Make `p` hold `values` (another device: .data cannot cross from meta), keeping the object the
    optimizer and the wrapper hold."""
    torch.utils.swap_tensors(p, nn.Parameter(values, requires_grad=p.requires_grad))


class _OwnTensorsOnly(TorchDispatchMode):
    """Refuse an initialisation that reads or writes a tensor still on the meta device."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves((args, kwargs or {}))):
            raise ValueError(
                f"ShardedDataParallel(stage=3): the initialisation of {type(self.module).__name__} touches a tensor "
                "of another module, which holds no values yet when stage 3 materialises a meta-built model module "
                "by module. Give init_fn=f, where f(module) initialises that module's own parameters and buffers "
                "(called for each module holding tensors of its own), or materialise before wrapping.")
        return func(*args, **(kwargs or {}))


class _Whole(Exception):
    """An initialisation _SliceInit cannot follow slice by slice: materialise the module whole instead."""


class _SliceInit(TorchDispatchMode):
    """Runs a module's initialisation on its meta parameters, keeping only [lo, hi) of the unit's flat
    buffer (this rank's shard) in `out`. A random fill (uniform_, normal_) runs over the whole tensor in
    chunks of one reused buffer: torch's CPU generator draws in element order (normal_ in blocks of 16),
    so the values and the generator's state after it are one call's. An in-place op with scalars only
    (fill_, zero_, mul_, clamp_, ...) runs on the slice. Anything else that writes raises _Whole."""

    CHUNK = (1 << 14) - 16  # elements drawn at a time (a multiple of 16; with a tail of up to 16 more, 64 KiB fp32)
    RANDOM = {torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default}
    SCALAR = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default, torch.ops.aten.mul_.Scalar,
              torch.ops.aten.add_.Scalar, torch.ops.aten.sub_.Scalar, torch.ops.aten.div_.Scalar,
              torch.ops.aten.erfinv_.default, torch.ops.aten.clamp_.default}

    def __init__(self, where: dict[int, int], out: torch.Tensor | None, lo: int, hi: int):
        super().__init__()
        self.where, self.out, self.lo, self.hi, self.written = where, out, lo, hi, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p = args[0] if args and id(args[0]) in self.where else None
        scalars = not any(isinstance(t, torch.Tensor) for t in tree_leaves((args[1:], kwargs)))
        if p is not None and scalars and (func in self.RANDOM or func in self.SCALAR):
            self._apply(func, p, args[1:], kwargs)
            self.written.add(id(p))
            return p
        if func._schema.is_mutable:
            raise _Whole
        return func(*args, **kwargs)

    def _apply(self, func, p: torch.Tensor, args, kwargs) -> None:
        at, n = self.where[id(p)], p.numel()
        a, b = max(self.lo - at, 0), min(self.hi - at, n)  # this rank's elements of p
        mine = lambda lo, hi: self.out[at + lo - self.lo:at + hi - self.lo]  # noqa: E731 - p's [lo, hi) in out
        if func in self.SCALAR:
            if a < b:
                func(mine(a, b), *args, **kwargs)
            return
        scratch, start = torch.empty(min(n, self.CHUNK + 16), dtype=p.dtype, device="cpu"), 0
        while start < n:
            end = n if n - start < self.CHUNK + 16 else start + self.CHUNK  # (normal_'s last 16 drawn together)
            chunk = func(scratch[:end - start], *args, **kwargs)
            if max(a, start) < min(b, end):
                mine(max(a, start), min(b, end)).copy_(chunk[max(a, start) - start:min(b, end) - start])
            start = end


class MetaInit:
    """Pass 1 at construction (generator states, buffers); `fill` for each unit; `finish` at the end."""

    def __init__(self, module: nn.Module, init_fn: Callable[[nn.Module], None] | None, group):
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                       else torch.device("cpu"))
        self.init = init_fn or _reset_parameters
        self.by_slices = init_fn is None and self.device.type == "cpu"  # (CUDA's generator draws per launch)
        self.generator = (torch.cuda.default_generators[self.device.index] if self.device.type == "cuda"
                          else torch.default_generator)
        self.generator.set_state(comm.all_gather_object(self.generator.get_state(), group=group)[0])
        self.owners: list[tuple[nn.Module, list[nn.Parameter], torch.Tensor]] = []  # (module, its params, state before)
        with torch.no_grad():
            for m in module.modules():
                params, buffers = list(m.parameters(recurse=False)), list(m.named_buffers(recurse=False))
                if not params and not buffers:
                    continue  # a container: its children initialise themselves
                for name, b in buffers:
                    m._buffers[name] = torch.empty_like(b, device=self.device)
                if init_fn is None and not hasattr(m, "reset_parameters"):  # (a mask made in __init__ is lost too)
                    names = [n for n, _ in m.named_parameters(recurse=False)] + [n for n, _ in buffers]
                    raise ValueError(
                        f"ShardedDataParallel(stage=3): {type(m).__name__} has tensors of its own ({', '.join(names)}) "
                        "and no reset_parameters(), so nothing would give them values: pass init_fn=f, f(module) "
                        "initialising a module's own parameters and buffers (called for each module holding some).")
                state = self.generator.get_state()
                self._initialise(m, params, {id(p): 0 for p in params}, None, 0, 0)  # to move the generator on
                if params:
                    self.owners.append((m, params, state))
        self.final_state = self.generator.get_state()

    def _initialise(self, m: nn.Module, params: list[nn.Parameter], where: dict[int, int],
                    out: torch.Tensor | None, lo: int, hi: int) -> None:
        """Run m's initialisation, its parameters' values at `where` (offsets in the unit) kept in `out`
        where they fall in [lo, hi): slice by slice for torch's own layers (their reset_parameters, which
        _SliceInit follows exactly, checked: every parameter written), else materialised whole."""
        state = self.generator.get_state()
        if self.by_slices and m.reset_parameters.__module__.startswith("torch.nn.modules."):
            try:
                with _SliceInit(where, out, lo, hi) as mode:
                    self.init(m)
                if mode.written >= {id(p) for p in params}:
                    return
            except Exception:  # noqa: BLE001 - _Whole, or a read of a meta value: the whole way raises what is real
                pass
            self.generator.set_state(state)
        for p in params:
            _give(p, torch.empty_like(p, device=self.device))
        with _OwnTensorsOnly(m):
            self.init(m)
        for p in params:  # its values are kept in `out`, and come back in its unit's buffer
            at, flat = where[id(p)], p.detach().reshape(-1)
            a, b = max(lo - at, 0), min(hi - at, p.numel())
            if out is not None and a < b:
                out[at + a - lo:at + b - lo].copy_(flat[a:b])
            _give(p, torch.empty_like(p, device="meta"))

    def fill(self, params: list[nn.Parameter], world_size: int, rank: int, whole: bool = False,
             load=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(one unit's flat buffer (FlatShard's layout: flat_shard.flat_layout), which the parameters view
        but nothing writes; this rank's slice of it, holding the parameters' initial values)."""
        offsets, padded, _ = flat_layout([p.numel() for p in params], world_size, whole, load)
        size = padded // world_size
        mine = torch.zeros(size, dtype=params[0].dtype, device=self.device)
        where = {id(p): offset for p, offset in zip(params, offsets)}
        with torch.no_grad():
            for m, own, state in self.owners:
                if any(id(p) in where for p in own):
                    if not all(id(p) in where for p in own):
                        raise ValueError(
                            f"ShardedDataParallel(stage=3): {type(m).__name__} holds parameters of two units, so "
                            "its initialisation cannot run within one: choose units that keep it whole "
                            "(unit_policy), or materialise before wrapping.")
                    self.generator.set_state(state)
                    self._initialise(m, own, where, mine, rank * size, (rank + 1) * size)
        untouched = torch.empty(padded, dtype=params[0].dtype, device=self.device)  # (no page of it is written)
        for p, offset in zip(params, offsets):  # real tensors of their shapes, for FlatShard to point into its buffer
            shape, numel = p.shape, p.numel()
            _give(p, torch.empty(0, dtype=p.dtype, device=self.device))
            p.data = untouched[offset:offset + numel].view(shape)
        return untouched, mine

    def finish(self) -> None:
        """Leave the generator where initialising the whole model at once would have."""
        self.generator.set_state(self.final_state)
