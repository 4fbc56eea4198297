"""The arguments GPU scripts pass to native DDP and FSDP2, as the wrappers take them.

    DataParallel(net, device_ids=[local_rank], output_device=local_rank, static_graph=True)
    ShardedDataParallel(net, opt, stage=3, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                        reshard_after_forward=False)

Each has a meaning here, or is refused naming why (never a bare TypeError, never ignored when
ignoring it would change the result):

- device_ids / output_device (DDP): one device per process, the module's own. Accepted when
  they name the device the module's parameters are on; otherwise refused, since minidist
  computes where the module is (move it first, as native DDP also requires).
- dim (DDP): only scatters inputs across the devices of one process, which neither does.
- static_graph, check_reduction (DDP): hints with no effect on the result.
- init_sync=False (DDP): the ranks already agree, so the initial broadcast is skipped.
- device_mesh (DDP) / mesh (FSDP2): a 1-D DeviceMesh stands for its process group.
- mp_policy (FSDP2): param_dtype, reduce_dtype, output_dtype, cast_forward_inputs.
- reshard_after_forward (FSDP2): stage 3 keeps each unit gathered from its forward to its
  backward when False (FSDP2's ZeRO-2-like mode); stages 1-2 never reshard.
"""

from __future__ import annotations

import torch
from torch import nn

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
            f"{meta[0]!r}), so they hold no values to broadcast or shard. Materialise before wrapping: "
            "net.to_empty(device=device), then initialise it (net.reset_parameters() or your init) on every rank "
            "with the same seed, then wrap (rank 0's values are broadcast).")


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
