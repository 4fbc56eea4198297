"""The multi-rank harness itself: results, failures with tracebacks, timeouts that kill, recovery."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from rank_pool import MAX_GROUPS_HELD, RankFailure, RankPool, RankTimeout


def whoami():
    return dist.get_rank(), dist.get_world_size()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return "fine"


def rank_one_skips_collective():
    # Rank 1 never joins: rank 0's barrier would wait for its full pg timeout.
    import torch
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return "done"


def sleep_forever():
    time.sleep(3600)


def test_results_come_back_in_rank_order(ranks):
    assert ranks(3).run(whoami) == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.slow(stand_in="test_timeout_kills_every_rank")  # the pool's ranks started again after it
def test_failure_reports_the_rank_and_traceback(ranks):
    pool = ranks(2)
    with pytest.raises(RankFailure, match=r"(?s)rank 1:.*ValueError: boom on purpose"):
        pool.run(fail_on_rank_one)
    assert pool.run(whoami) == [(0, 2), (1, 2)]  # the pool recovers


@pytest.mark.slow(stand_in="test_timeout_kills_every_rank")  # two pools started
def test_a_rank_blocked_on_a_failed_peer_is_killed_not_waited_for():
    pool = RankPool(2, failure_grace_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises((RankFailure, RankTimeout)):
            pool.run(rank_one_skips_collective, timeout_s=2)
        assert time.monotonic() - start < 30
        assert pool.run(whoami) == [(0, 2), (1, 2)]
    finally:
        pool.close()


def test_timeout_kills_every_rank():
    pool = RankPool(2)
    try:
        start = time.monotonic()
        with pytest.raises(RankTimeout, match="did not finish in time"):
            pool.run(sleep_forever, timeout_s=0.5)
        assert time.monotonic() - start < 30
        assert not pool._procs  # all ranks gone
    finally:
        pool.close()


def pid_and_threads():
    return os.getpid(), len(os.listdir(f"/proc/{os.getpid()}/task"))


def groups_used_then_left(n):
    for group in [dist.new_group([0, 1]) for _ in range(n)]:
        dist.all_reduce(torch.ones(1), group=group)  # gloo connects the group: its threads run
    return pid_and_threads()


@pytest.mark.slow(stand_in="test_results_come_back_in_rank_order")  # the pool replaced: another start
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_ranks_holding_many_groups_are_replaced_before_the_next_task(ranks):
    # gloo gives each group three threads that poll; kept for the whole suite, a pool's ranks held
    # ~700 each, which slowed every later test and threw off the timing tests.
    pool = ranks(2)
    before = pool.run(pid_and_threads)
    few = pool.run(groups_used_then_left, 2)
    assert [pid for pid, _ in few] == [pid for pid, _ in pool.run(pid_and_threads)]  # a few groups: kept
    many = pool.run(groups_used_then_left, MAX_GROUPS_HELD + 1)
    assert all(t >= b + MAX_GROUPS_HELD for (_, b), (_, t) in zip(before, many)), (before, many)
    after = pool.run(pid_and_threads)
    assert not {pid for pid, _ in after} & {pid for pid, _ in many}  # fresh ranks...
    assert all(t <= b for (_, b), (_, t) in zip(before, after)), (before, after)  # ...without the threads
    assert pool.run(whoami) == [(0, 2), (1, 2)]


def norm_of_a_dtensor_on_a_2d_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # both dims new groups
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0), Shard(0)])
    return torch.linalg.vector_norm(x).full_tensor().item()


@pytest.mark.slow(stand_in="test_results_come_back_in_rank_order")  # a 2-D DeviceMesh on 4 ranks
def test_what_torch_caches_from_one_task_still_works_in_the_next(ranks):
    # DTensor caches meshes (with the names of their groups) across runs in one process, as
    # DeepSpeed keeps its groups in module globals: a harness that destroyed a task's groups
    # broke the next task's mesh ("Could not resolve the process group registered under the name").
    pool = ranks(4)
    expected = float(torch.arange(8.0).norm())
    assert pool.run(norm_of_a_dtensor_on_a_2d_mesh) == pytest.approx([expected] * 4)
    assert pool.run(norm_of_a_dtensor_on_a_2d_mesh) == pytest.approx([expected] * 4)
