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


class MetaInit:
    """Pass 1 at construction (generator states, buffers); `fill` for each unit; `finish` at the end."""

    def __init__(self, module: nn.Module, init_fn: Callable[[nn.Module], None] | None, group):
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                       else torch.device("cpu"))
        self.init = init_fn or _reset_parameters
        self.generator = (torch.cuda.default_generators[self.device.index] if self.device.type == "cuda"
                          else torch.default_generator)
        self.generator.set_state(comm.all_gather_object(self.generator.get_state(), group=group)[0])
        self.owners: list[tuple[nn.Module, set[int], torch.Tensor]] = []  # (module, its parameters, state before)
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
                for p in params:
                    _give(p, torch.empty_like(p, device=self.device))
                self._run(m)
                for p in params:  # its values come back in pass 2, in its unit's buffer
                    _give(p, torch.empty_like(p, device="meta"))
                if params:
                    self.owners.append((m, {id(p) for p in params}, state))
        self.final_state = self.generator.get_state()

    def _run(self, m: nn.Module) -> None:
        with _OwnTensorsOnly(m):
            self.init(m)

    def fill(self, params: list[nn.Parameter], world_size: int, whole: bool = False, load=None) -> torch.Tensor:
        """One unit's flat buffer (FlatShard's layout: flat_shard.flat_layout) holding the parameters'
        initial values; the parameters view it."""
        offsets, padded, _ = flat_layout([p.numel() for p in params], world_size, whole, load)
        values = torch.zeros(padded, dtype=params[0].dtype, device=self.device)
        ids = {id(p) for p in params}
        for p, offset in zip(params, offsets):  # (through .data: a view's version counter would be the buffer's)
            shape, numel = p.shape, p.numel()
            _give(p, torch.empty(0, dtype=p.dtype, device=self.device))
            p.data = values[offset:offset + numel].view(shape)
        with torch.no_grad():
            for m, own, state in self.owners:
                if own & ids:
                    if not own <= ids:
                        raise ValueError(
                            f"ShardedDataParallel(stage=3): {type(m).__name__} holds parameters of two units, so its "
                            "initialisation cannot run within one: choose units that keep it whole (unit_policy), "
                            "or materialise before wrapping.")
                    self.generator.set_state(state)
                    self._run(m)
        return values

    def finish(self) -> None:
        """Leave the generator where initialising the whole model at once would have."""
        self.generator.set_state(self.final_state)
