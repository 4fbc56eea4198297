"""The one line a ported script changes, for the client scripts beside this file.

    model = wrap(how, model, optimizer, local_rank)

native: torch's DistributedDataParallel, as the script was written. ddp: minidist.DataParallel,
the same call with only the import changed. zero1 / zero2 / zero3: minidist.ShardedDataParallel,
which also takes the optimizer the script built (param groups and all) and from then on steps
this rank's shards through that same object.
"""

import torch

import minidist


def device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def wrap(how: str, model, optimizer, local_rank: int, **kwargs):
    device_ids = [local_rank] if torch.cuda.is_available() else None  # DDP on a CPU module takes none
    if how == "native":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=device_ids, **kwargs)
    if how == "ddp":
        from minidist import DataParallel as DDP  # the port: only this import changed
        return DDP(model, device_ids=device_ids, **kwargs)
    if how in ("zero1", "zero2", "zero3"):
        return minidist.ShardedDataParallel(model, optimizer, stage=int(how[-1]), **kwargs)
    raise ValueError(f"--wrap {how!r}: native, ddp, zero1, zero2 or zero3")
