"""What the wrappers share with native PyTorch's ways: the native DDP and FSDP2 arguments they accept
(each given a meaning or refused naming why: docs/drop_in.md, "Native arguments"), communication
kept out of torch.compile's graphs (`eager`), and native DDP's buffer broadcast rule. Why:
docs/internals.md, "parallel/compat.py".
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch import nn

from minidist.parallel.buckets import FlatBuffers


# Native keyword arguments with no counterpart here, and what to do instead.
REFUSED = {
    "DataParallel": {
        "mixed_precision": "compress the all_reduce with comm_hook='bf16' or 'fp16', or compute in low precision "
                           "with torch.autocast",
        "delay_all_reduce_named_params": "every gradient is reduced in buckets during backward",
        "param_to_hook_all_reduce": "every gradient is reduced in buckets during backward",
        "skip_all_reduce_unused_params": "use find_unused_parameters=True: unused gradients count as zeros",
        "bucket_cap_mb_list": "give bucket_cap_mb, and first_bucket_mb / last_bucket_mb for the ends",
        "batched_grad_copy": "buckets are filled by one vectorised copy when many small gradients share one",
        "forward_sync_buffers": "use broadcast_buffers",
    },
    "ShardedDataParallel": {
        "offload_policy": "optimizer states and parameters stay on the module's device (no CPU offload)",
        "shard_placement_fn": "parameters are sharded as flat buffers, not along a dimension of each tensor",
        "ignored_params": "set requires_grad=False on parameters that should not be sharded or trained",
        "dp_mesh_dims": "give mesh=minidist.init_mesh(replicate=R, shard=S)",
    },
}


def refuse_unknown(wrapper: str, given: dict) -> None:
    """Raise for keyword arguments `wrapper` does not take: a native one with its reason, else a TypeError."""
    if not given:
        return
    native = {k: REFUSED[wrapper][k] for k in given if k in REFUSED[wrapper]}
    if native:
        reasons = "; ".join(f"{k}: {why}" for k, why in native.items())
        raise ValueError(f"{wrapper} does not take {', '.join(native)} ({reasons}).")
    raise TypeError(f"{wrapper} got unexpected keyword argument(s) {sorted(given)}; see help({wrapper})")


def module_device(module: nn.Module) -> torch.device:
    return next((t.device for t in [*module.parameters(), *module.buffers()]), torch.device("cpu"))


def _as_device(d) -> torch.device:
    if isinstance(d, int):
        kind = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return torch.device(kind.type if kind is not None else "cuda", d)
    return torch.device(d)


def check_devices(module: nn.Module, device_ids, output_device) -> None:
    """DDP's device_ids / output_device: accepted when they name the module's own device."""
    here = module_device(module)
    if device_ids is not None:
        ids = list(device_ids)
        if len(ids) > 1:
            raise ValueError(f"DataParallel: device_ids={ids} names several devices; one process drives one device "
                             "(as native DDP requires today): start one rank per device (torchrun "
                             "--nproc_per_node) and pass device_ids=[local_rank]")
        if ids and _as_device(ids[0]) != here:
            raise ValueError(
                f"DataParallel: device_ids={ids} names {_as_device(ids[0])}, but the module's parameters are on "
                f"{here}. minidist computes where the module is: move it first (net.to(device)), or pass "
                "device_ids=None" + (" for a CPU module (native DDP also refuses device_ids for one)"
                                     if here.type == "cpu" else ""))
    if output_device is not None and _as_device(output_device) != here:
        raise ValueError(f"DataParallel: output_device={output_device!r} is not the module's device {here}; outputs "
                         "stay where the module computes them (pass output_device=None, or the module's device)")


def process_group_of(mesh, process_group, wrapper: str):
    """A 1-D torch DeviceMesh given where a process group is meant: its group."""
    if mesh is None:
        return process_group
    if process_group is not None:
        raise ValueError(f"{wrapper}: give a device mesh or process_group, not both")
    if mesh.ndim != 1:
        raise ValueError(f"{wrapper}: a {mesh.ndim}-D DeviceMesh is not taken; for hybrid sharding give "
                         "ShardedDataParallel(mesh=minidist.init_mesh(replicate=R, shard=S))")
    return mesh.get_group()


def is_device_mesh(mesh) -> bool:
    return type(mesh).__name__ == "DeviceMesh"


def mixed_precision(mp_policy, param_dtype, reduce_dtype):
    """(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs) from FSDP2's MixedPrecisionPolicy."""
    if mp_policy is None:
        return param_dtype, reduce_dtype, None, True
    if param_dtype is not None or reduce_dtype is not None:
        raise ValueError("ShardedDataParallel: give mp_policy or param_dtype / reduce_dtype, not both")
    return mp_policy.param_dtype, mp_policy.reduce_dtype, mp_policy.output_dtype, mp_policy.cast_forward_inputs


def check_reshard_after_forward(value, stage: int):
    """FSDP2's reshard_after_forward: stage 3's choice (None: True); refused where it cannot hold."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"ShardedDataParallel: reshard_after_forward={value!r}: give True (free each unit after "
                         "its forward), False (keep it gathered until its backward) or, at stage 3, an int G (FSDP2's "
                         "reshard to G ranks: keep 1/G for the backward, gathered within G ranks; secondary_shard)")
    if stage < 3 and value:
        raise ValueError(f"ShardedDataParallel(stage={stage}) keeps the full parameters on every rank, so it "
                         "cannot reshard after forward: use stage=3 (reshard_after_forward=True is its default)")
    return value


def check_materialised(module: nn.Module, wrapper: str) -> None:
    """Refuse meta-device parameters or buffers, which hold no values to broadcast or shard."""
    meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"{wrapper}: {len(meta)} parameter(s) or buffer(s) of the module are on the meta device (the first: "
            f"{meta[0]!r}), so they hold no values to broadcast or shard. Wrap with ShardedDataParallel(stage=3), "
            "which materialises a meta-built model unit by unit into its shards, or materialise before wrapping: "
            "net.to_empty(device=device), then initialise it (net.reset_parameters() or your init) on every rank "
            "with the same seed, then wrap (rank 0's values are broadcast).")


def check_trainable(module: nn.Module) -> None:
    """Refuse what DataParallel cannot reduce: a module with no parameter that requires a gradient
    (as native DDP does), or one whose gradients come sparse (its buckets are dense)."""
    if not any(p.requires_grad for p in module.parameters()):
        raise RuntimeError("DataParallel: the module has no parameter that requires a gradient, so there is "
                           "nothing to synchronise (native DDP refuses it too): use it unwrapped")
    for name, m in module.named_modules():
        if getattr(m, "sparse", False) is True and any(p.requires_grad for p in m.parameters(recurse=False)):
            raise ValueError(f"DataParallel: {name or 'the module'!r} ({type(m).__name__}) makes sparse gradients, "
                             "which the dense gradient buckets cannot hold: build it with sparse=False (a dense "
                             "gradient of the same values), or freeze it (requires_grad=False)")


def check_not_wrapped(module: nn.Module, wrapper: str) -> None:
    """Refuse a module another minidist wrapper already holds: its parameters belong to that one
    (views into its flat shards, hooks that reduce its gradients), so a second wrapper would reduce
    twice or read freed storage."""
    previous = getattr(getattr(module, "_orig_mod", module), "_minidist_wrapper", None)
    if previous is not None:
        raise ValueError(f"{wrapper}: this module is already wrapped by a minidist.{previous}, which owns its "
                         "parameters' gradients (and, sharded, their storage). Wrap a freshly built model, or keep "
                         "using the first wrapper.")


def mark_wrapped(module: nn.Module, wrapper: str) -> None:
    getattr(module, "_orig_mod", module)._minidist_wrapper = wrapper


F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """Run `fn` (and everything it calls) outside torch.compile: a graph break at each call."""
    return torch.compiler.disable(fn, recursive=True)


def runs_compiled_code(module: torch.nn.Module) -> bool:
    """Whether a forward of `module` may run torch.compile'd code (now, while dynamo traces the
    caller, or in a compiled submodule).

    Per-module forward hooks cannot be relied on inside compiled code: dynamo does not guard
    on module hooks by default (torch._dynamo.config.skip_nnmodule_hook_guards), so a graph
    traced earlier for another instance of the same class runs without ours. A wrapper whose
    correctness needs a hook must do that work before entering such a module instead.
    """
    if torch.compiler.is_compiling():
        return True
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


_HOOKED_CLASSES: dict[type, type] = {}


def mark_hooked(module: torch.nn.Module) -> None:
    """Give `module` a subclass of its class (same behaviour, name prefixed "Sharded"), as
    FSDP2's fully_shard does.

    Why: a graph dynamo traced for a plain instance of the class (e.g. a reference model
    compiled earlier in the process) carries no guard on module hooks, and would run for this
    instance without the hooks that gather its parameters. Dynamo does guard on the module's
    type, so a distinct class makes it trace this module afresh, hooks included.
    """
    cls = type(module)
    if cls in _HOOKED_CLASSES.values():
        return
    if cls not in _HOOKED_CLASSES:
        _HOOKED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (cls,), {"__module__": cls.__module__})
    module.__class__ = _HOOKED_CLASSES[cls]


class BufferSync:
    """Call `before_forward(sync_enabled)` at the start of every forward of the wrapper."""

    def __init__(self, module: nn.Module, enabled: bool, world_size: int, src: int, group=None):
        has_buffers = any(True for _ in module.buffers())
        self._flat = FlatBuffers(module) if enabled and world_size > 1 and has_buffers else None
        self._src, self._group = src, group
        self._due = True  # the first forward synchronises

    @property
    def due(self) -> bool:
        """Will the next forward broadcast?"""
        return self._flat is not None and self._due

    def before_forward(self, sync_enabled: bool, src: int | None = None) -> None:
        """Broadcast if the previous forward was a synchronising one; note whether this one is.
        `src` overrides the source rank for this broadcast (Join: the highest rank still active)."""
        if self.due:
            self.broadcast(src)
        self._due = torch.is_grad_enabled() and sync_enabled

    def broadcast(self, src: int | None = None) -> None:
        """Broadcast the buffers now (a rank that joined shadows the others' broadcast with it)."""
        if self._flat is not None:
            self._flat.broadcast(src=self._src if src is None else src, group=self._group)

    def set_due(self, due: bool) -> None:
        """Say whether the next forward broadcasts (Join: a rank that left follows the others' notice,
        and after Join's final sync every rank broadcasts at its next forward)."""
        self._due = due
