"""`state_dict()` and `load_state_dict()` of a module wrapped by ShardedDataParallel.

Users save and load the way they do with native DDP: `torch.save(model.module.state_dict())`,
`net.state_dict()`, `model.load_state_dict(...)`. Hooks on the wrapped module (the
original one, also when it was torch.compile'd) make each of these give native's result
or fail at once:

- stages 1-2: the updated parameters are all_gathered asynchronously after
  `optimizer.step()`; `state_dict()` waits for them, so it never returns the previous
  step's values. `load_state_dict()` waits too (an in-flight gather would overwrite what
  was loaded), then also writes the loaded values into this rank's fp32 master shards:
  otherwise the next step would start from the old masters and gather them back over
  the loaded parameters.
- stages 1-2 with a param_wire: the parameters are the wire's rounding of the masters, so
  `state_dict()` refuses as stage 3's does (a checkpoint of it would resume from rounded
  values), naming full_state_dict() / sharded_state_dict().
- stage 3: the parameters hold no values between uses, and gathering them would be a
  collective that `if rank == 0: torch.save(model.state_dict())` would leave the other
  ranks out of (a hang). So `state_dict()` refuses, naming `full_state_dict()` (a
  collective, every rank calls it) and `sharded_state_dict()` (per rank, no
  communication). `state_dict(keep_vars=True)` still lists the live parameters (no
  values), for code that inspects keys and shapes. `load_state_dict()` of a full state
  dict works on every rank without communication: each rank keeps its own slice.
"""

from __future__ import annotations

import torch
from torch import nn


def plain_module(module: nn.Module) -> nn.Module:
    """The module itself, or the original module inside a torch.compile wrapper."""
    return getattr(module, "_orig_mod", module)


class ModuleStateHooks:
    """Installs the state_dict / load_state_dict hooks for one ShardedDataParallel `wrapper`."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        target = plain_module(wrapper.module)
        # Parameter names as the plain module spells them (without torch.compile's "_orig_mod.").
        strip = "_orig_mod." if target is not wrapper.module else ""
        self._slot_keys = {slot.name: slot.name.removeprefix(strip) for s in wrapper._shards for slot in s.slots}
        target.register_state_dict_pre_hook(self._before_state_dict)
        target.register_load_state_dict_pre_hook(self._before_load)
        target.register_load_state_dict_post_hook(self._after_load)

    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        w = self.wrapper
        if w.stage < 3 and getattr(w, "param_wire", None) is not None and not keep_vars:
            raise RuntimeError(
                f"ShardedDataParallel(stage={w.stage}, param_wire={w.param_wire.name!r}): state_dict() would return "
                "the weights as the wire delivered them (rounded), not the fp32 master shards the optimizer steps: "
                "a checkpoint of it would resume from rounded values. Use model.full_state_dict() on every rank "
                "(a collective; rank0_only=True keeps the result on rank 0) or model.sharded_state_dict() (per "
                "rank, no communication).")
        if w.stage < 3:
            w.wait_for_parameters()
        elif not keep_vars:
            raise RuntimeError(
                "ShardedDataParallel(stage=3): state_dict() has no values to return, since each rank holds "
                "only its shard of the parameters. Use full = model.full_state_dict() on every rank (a "
                "collective; rank0_only=True keeps the result on rank 0 only), then torch.save it on rank 0; its "
                "keys are the plain module's (no 'module.' prefix), so load it with "
                "model.module.load_state_dict(full) (every rank keeps its slice) or into the bare model. Or "
                "model.sharded_state_dict() for a per-rank checkpoint without communication "
                "(load_sharded_state_dict reloads it at any world size).")

    def _before_load(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:
        w = self.wrapper
        w.wait_for_parameters()
        with torch.no_grad():
            for shard in w._shards:
                self._load_master_slice(shard, state_dict, prefix)
                if w.stage == 3 and not shard.is_materialised:
                    # Room for torch's own copy into the parameters; freed again after the load.
                    shard.full.untyped_storage().resize_(shard.padded * shard.full.element_size())

    def _after_load(self, module, incompatible_keys) -> None:
        if self.wrapper.stage == 3:
            for shard in self.wrapper._shards:
                shard.free_full()

    def _load_master_slice(self, shard, state_dict: dict, prefix: str) -> None:
        """Write the loaded values of this rank's slice into the fp32 master shard."""
        for slot in shard.slots:
            value = state_dict.get(prefix + self._slot_keys[slot.name])
            if not torch.is_tensor(value) or tuple(value.shape) != slot.shape:
                continue  # missing or mismatched: torch's own load reports it
            a, b = max(slot.offset, shard.lo), min(slot.offset + slot.numel, shard.hi)
            if a < b:
                piece = value.detach().reshape(-1)[a - slot.offset:b - slot.offset]
                shard.master.data[a - shard.lo:b - shard.lo].copy_(piece)
