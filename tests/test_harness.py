"""The multi-rank harness itself: results, failures with tracebacks, timeouts that kill, recovery."""

import os
import time

import pytest
import torch.distributed as dist

from minidist.testing import RankFailure, RankPool, RankTimeout


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


def test_failure_reports_the_rank_and_traceback(ranks):
    pool = ranks(2)
    with pytest.raises(RankFailure, match=r"(?s)rank 1:.*ValueError: boom on purpose"):
        pool.run(fail_on_rank_one)
    assert pool.run(whoami) == [(0, 2), (1, 2)]  # the pool recovers


def test_a_rank_blocked_on_a_failed_peer_is_killed_not_waited_for(ranks):
    pool = ranks(2)
    start = time.monotonic()
    with pytest.raises((RankFailure, RankTimeout)):
        pool.run(rank_one_skips_collective, timeout_s=3)
    assert time.monotonic() - start < 30
    assert pool.run(whoami) == [(0, 2), (1, 2)]


def test_timeout_kills_every_rank():
    pool = RankPool(2)
    try:
        start = time.monotonic()
        with pytest.raises(RankTimeout, match="did not finish in time"):
            pool.run(sleep_forever, timeout_s=2)
        assert time.monotonic() - start < 30
        assert not pool._procs  # all ranks gone
    finally:
        pool.close()


def threads_of_this_rank():
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def groups_used_then_left(n):
    import torch
    for group in [dist.new_group([0, 1]) for _ in range(n)]:
        dist.all_reduce(torch.ones(1), group=group)  # gloo connects the group: its threads run
    return threads_of_this_rank()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_groups_a_task_made_are_destroyed_with_their_threads(ranks):
    # gloo gives each group three threads that poll; kept for the whole suite, a pool's ranks held
    # ~700 each, which slowed every later test and threw off the timing tests.
    pool = ranks(2)
    before = pool.run(threads_of_this_rank)
    during = pool.run(groups_used_then_left, 5)
    assert all(d >= b + 5 for b, d in zip(before, during)), (before, during)  # the task's groups had threads
    assert pool.run(threads_of_this_rank) == before
    assert pool.run(whoami) == [(0, 2), (1, 2)]  # the default group is kept
