"""A 2-D mesh of ranks for hybrid sharding: replicate across hosts x shard within a host.

    mesh = minidist.init_mesh(replicate=2, shard=4)   # 8 ranks: 2 hosts of 4
    print(mesh)
    # Mesh(replicate=2 x shard=4): shard groups (within a host) [0-3] [4-7];
    #   replicate groups (across hosts) [0,4] [1,5] [2,6] [3,7]; rank 5 = replica 1, shard 1
    model = minidist.ShardedDataParallel(net, opt, stage=3, mesh=mesh)   # HSDP

Rank r sits at (replica r // S, shard r % S): a shard group is S contiguous ranks, which
is one host (or a whole number of them, or an even part of one) under torchrun and
SLURM, whose ranks are numbered host by host. A replicate group holds the ranks with the
same shard index, one per shard group: its traffic is what crosses hosts.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist

from minidist.dist import ranks_per_host


@dataclass
class Mesh:
    """The two dimensions' process groups, and where this rank sits in them."""

    replicate: int            # R: number of replicas (shard groups)
    shard: int                # S: ranks one copy of the model is sharded over
    rank: int                 # this rank in the world
    shard_group: object       # this rank's shard group (S contiguous ranks)
    replicate_group: object   # this rank's replicate group (R ranks, stride S)
    shard_ranks: list         # every shard group, as lists of world ranks
    replicate_ranks: list     # every replicate group, as lists of world ranks

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def shard_rank(self) -> int:
        """This rank's index within its shard group (which slice of each shard it owns)."""
        return self.rank % self.shard

    @property
    def replica(self) -> int:
        """Which replica (shard group) this rank belongs to."""
        return self.rank // self.shard

    def __str__(self) -> str:
        def fmt(groups):
            return " ".join(f"[{g[0]}-{g[-1]}]" if len(g) > 2 and g == list(range(g[0], g[-1] + 1))
                            else "[" + ",".join(map(str, g)) + "]" for g in groups)
        return (f"Mesh(replicate={self.replicate} x shard={self.shard}): shard groups (within a host) "
                f"{fmt(self.shard_ranks)}; replicate groups (across hosts) {fmt(self.replicate_ranks)}; "
                f"rank {self.rank} = replica {self.replica}, shard {self.shard_rank}")


def mesh_shape(world_size: int, replicate: int | None, shard: int | None, per_host: int | None) -> tuple[int, int]:
    """(R, S) from what was given; errors name the cause and the fix. Pure: tested without ranks."""
    for name, value in (("replicate", replicate), ("shard", shard)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"init_mesh: {name}={value!r} must be a positive integer")
    if shard is None and replicate is None:
        shard = per_host or world_size  # one shard group per host
    if shard is None:
        if world_size % replicate:
            raise ValueError(f"init_mesh: the world of {world_size} ranks does not split into replicate={replicate} "
                             f"groups: choose a replicate that divides {world_size}")
        shard = world_size // replicate
    if replicate is None:
        if world_size % shard:
            raise ValueError(f"init_mesh: the world of {world_size} ranks does not split into shard groups of "
                             f"{shard}: choose a shard size that divides {world_size}")
        replicate = world_size // shard
    if replicate * shard != world_size:
        raise ValueError(f"init_mesh: replicate={replicate} x shard={shard} = {replicate * shard} ranks, but the "
                         f"world has {world_size}: make replicate x shard equal the world size")
    if per_host is not None and shard % per_host and per_host % shard:
        raise ValueError(f"init_mesh: shard groups of {shard} ranks would span hosts of {per_host} ranks unevenly "
                         f"(some groups would straddle two hosts): choose a shard size that divides {per_host} "
                         f"or is a multiple of it")
    return replicate, shard


# The meshes made in this process: (R, S, timeout) -> (the world group they were made in, the mesh).
_MADE: dict[tuple, tuple[object, Mesh]] = {}


def init_mesh(replicate: int | None = None, shard: int | None = None, *, timeout_s: float | None = None,
              env: Mapping[str, str] | None = None) -> Mesh:
    """Build the 2-D process groups over the whole world; a collective: every rank calls it alike.

    Args:
        replicate: R, the number of replicas; shard: S, the ranks one replica is sharded over.
            Give either, both (R x S must be the world size) or neither (S = ranks per host).
        timeout_s: the groups' collective timeout (default: the world's).
        env: where to read the host layout (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE);
            default os.environ. Where it is known, shard groups must not straddle hosts.

    The same shape again in the same process group gives the mesh made the first time: a group
    holds its communicators (and gloo's threads) until the process ends, and a process that trains
    several times (a sweep under torchrun) would pile them up.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs a process group: call minidist.init_distributed() first")
    world, rank = dist.get_world_size(), dist.get_rank()
    R, S = mesh_shape(world, replicate, shard, ranks_per_host(env))
    default = dist.distributed_c10d._get_default_group()
    made = _MADE.get((R, S, timeout_s))
    if made is not None and made[0] is default:
        return made[1]
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    shard_ranks = [list(range(h * S, (h + 1) * S)) for h in range(R)]
    replicate_ranks = [list(range(s, world, S)) for s in range(S)]
    # Every rank creates every group, in the same order (torch.distributed's rule for new_group).
    shard_groups = [dist.new_group(ranks, **kwargs) for ranks in shard_ranks]
    replicate_groups = [dist.new_group(ranks, **kwargs) for ranks in replicate_ranks]
    mesh = Mesh(replicate=R, shard=S, rank=rank, shard_group=shard_groups[rank // S],
                replicate_group=replicate_groups[rank % S], shard_ranks=shard_ranks, replicate_ranks=replicate_ranks)
    _MADE[R, S, timeout_s] = default, mesh
    return mesh
