"""The multi-rank harness itself: results, failures with tracebacks, timeouts that kill, recovery."""

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
