"""The 2-D mesh (minidist.init_mesh): its shape from what is given, clear errors, the groups."""

import pytest
import torch

from minidist.dist import mesh_shape, ranks_per_host


@pytest.mark.parametrize("world, replicate, shard, per_host, expected", [
    (4, 2, 2, None, (2, 2)), (4, None, 4, None, (1, 4)), (4, 4, None, None, (4, 1)),
    (8, None, None, 4, (2, 4)),   # neither given: one shard group per host
    (8, None, None, None, (1, 8)),  # host layout unknown: the whole world is one shard group
    (8, None, 8, 4, (1, 8)), (8, None, 2, 4, (4, 2)),  # a multiple of a host, or an even part of one
])
def test_shape_from_what_is_given(world, replicate, shard, per_host, expected):
    assert mesh_shape(world, replicate, shard, per_host) == expected


@pytest.mark.parametrize("world, replicate, shard, per_host, message", [
    (6, 4, None, None, "does not split into replicate=4 groups"),
    (6, None, 4, None, "does not split into shard groups of 4"),
    (4, 3, 2, None, "replicate=3 x shard=2 = 6 ranks, but the world has 4"),
    (12, None, 3, 2, "shard groups of 3 ranks would span hosts of 2 ranks unevenly"),
    (12, None, 3, 4, "would span hosts of 4 ranks unevenly"),
    (4, 0, None, None, "replicate=0 must be a positive integer"),
])
def test_bad_shapes_name_the_cause_and_the_fix(world, replicate, shard, per_host, message):
    with pytest.raises(ValueError, match="init_mesh") as e:
        mesh_shape(world, replicate, shard, per_host)
    assert message in str(e.value)


def test_host_layout_from_the_launcher():
    assert ranks_per_host({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert ranks_per_host({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    assert ranks_per_host({"SLURM_NTASKS_PER_NODE": "2(x3)"}) is None  # heterogeneous: not one number
    assert ranks_per_host({}) is None
    assert ranks_per_host({"SLURM_TASKS_PER_NODE": "4(x2)"}) == 4  # what srun sets without --ntasks-per-node
    assert ranks_per_host({"SLURM_TASKS_PER_NODE": "4,4"}) == 4
    assert ranks_per_host({"SLURM_TASKS_PER_NODE": "3,1"}) is None  # hosts that differ


def test_under_srun_the_mesh_the_launch_and_the_byte_accounting_see_the_same_hosts(monkeypatch):
    """srun without --ntasks-per-node: 2 hosts of 4, seen alike by all three readers (issue 27,
    part 3: the byte accounting read LOCAL_WORLD_SIZE only, and counted one host)."""
    from minidist.dist import detect_launch
    from minidist.train.resilience import HostTraffic

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[01-02]"}
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert detect_launch().local_world_size == 4
    assert mesh_shape(8, None, None, ranks_per_host()) == (2, 4)
    traffic = HostTraffic(rank=4, world_size=8)
    assert traffic.per_host == 4 and traffic.multi_host and traffic.reads


def build_and_use(replicate: int, shard: int):
    """Build the mesh, then sum each rank's number over its shard group and its replicate group."""
    import minidist
    from minidist import comm

    mesh = minidist.init_mesh(replicate=replicate, shard=shard, env={})
    over_shard, over_replicas = torch.tensor([mesh.rank]), torch.tensor([mesh.rank])
    comm.all_reduce(over_shard, group=mesh.shard_group)
    comm.all_reduce(over_replicas, group=mesh.replicate_group)
    return str(mesh), over_shard.item(), over_replicas.item(), (mesh.replica, mesh.shard_rank)


def test_groups_at_four_ranks(ranks):
    out = ranks(4).run(build_and_use, 2, 2, timeout_s=60)
    assert out[3][0] == ("Mesh(replicate=2 x shard=2): shard groups (within a host) [0,1] [2,3]; "
                         "replicate groups (across hosts) [0,2] [1,3]; rank 3 = replica 1, shard 1")
    assert [o[1] for o in out] == [1, 1, 5, 5]   # 0+1, 2+3
    assert [o[2] for o in out] == [2, 4, 2, 4]   # 0+2, 1+3
    assert [o[3] for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    flat = ranks(4).run(build_and_use, 1, 4, timeout_s=60)
    assert "shard groups (within a host) [0-3]" in flat[0][0] and [o[1] for o in flat] == [6] * 4


def mesh_on_a_bad_host_layout():
    import minidist

    try:
        minidist.init_mesh(shard=3, env={"LOCAL_WORLD_SIZE": "2"})
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_world_that_does_not_factor_is_refused_on_every_rank(ranks):
    for message in ranks(2).run(mesh_on_a_bad_host_layout, timeout_s=60):
        assert "does not split into shard groups of 3" in message
