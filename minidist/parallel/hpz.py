"""hpZ, ZeRO++'s hierarchical partitioning: stage 3's backward gathers within a host.

With `secondary_shard=G` (FSDP2's `reshard_after_forward=G`), when a unit is freed after its forward, each rank keeps its 1/G of the gathered parameters within
its block of G consecutive ranks (one host under torchrun and SLURM), and the backward gathers them
back from that block only: only the forward gather crosses hosts, for 1/G instead of 1/N of each
unit's parameters held between its forward and its backward. The kept copy is what the forward
gathered (a param_wire's values too), so both compute with the same weights; it is dropped after
backward, at the next forward and after an optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist import comm
from minidist.dist import ranks_per_host
from minidist.parallel.flat_shard import FlatShard


class SecondaryShards:
    """The blocks of G ranks the backward gathers within, and each unit's kept part."""

    def __init__(self, size: int, process_group, algorithm: str):
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None \
            else list(range(dist.get_world_size()))
        n, me = len(ranks), dist.get_rank(process_group)
        self.size, self.index, self.algorithm = size, me % size, algorithm
        blocks = [ranks[b:b + size] for b in range(0, n, size)]
        groups = [dist.new_group(block) for block in blocks]  # every rank creates every group, in order
        self.group = groups[me // size]
        self._kept: dict[int, torch.Tensor] = {}  # FlatShard.index -> its part of the full parameters

    def keep(self, shard: FlatShard) -> None:
        """Before `shard` is freed after its forward: keep this rank's 1/G of its full parameters."""
        c = shard.padded // self.size
        self._kept[shard.index] = shard.full[self.index * c:(self.index + 1) * c].clone()

    def has(self, shard: FlatShard) -> bool:
        return shard.index in self._kept

    def gather(self, shard: FlatShard, async_op: bool = False):
        """Gather `shard`'s full parameters from the kept parts, within the block only."""
        part = self._kept.pop(shard.index)
        shard.materialise()
        with torch.no_grad():
            return comm.all_gather_into(shard.full, part, group=self.group, async_op=async_op,
                                        algorithm=self.algorithm)

    def drop(self) -> None:
        self._kept.clear()

    def tensors(self) -> list[torch.Tensor]:
        return list(self._kept.values())


def secondary_size(value, world_size: int, mesh) -> int | None:
    """secondary_shard as given (None, an int G, or "host") -> G, or None where it changes nothing."""
    if value is None or value is True or value is False:
        return None
    if mesh is not None:
        raise ValueError("ShardedDataParallel: secondary_shard with a mesh: hybrid sharding already gathers within "
                         "each shard group (a host); use it on a flat world (strategy=zero3)")
    if value == "host":
        value = ranks_per_host()
        if value is None:
            raise ValueError("ShardedDataParallel(secondary_shard='host'): the launcher does not say how many ranks "
                             "each host runs (LOCAL_WORLD_SIZE / SLURM): give the number instead")
    if not isinstance(value, int) or value < 1 or world_size % value:
        raise ValueError(f"ShardedDataParallel(secondary_shard={value!r}): give a number of ranks that divides the "
                         f"shard group's {world_size} (the ranks of one host), 'host', or None")
    return value if value < world_size else None  # G = N: the backward gathers over N anyway
