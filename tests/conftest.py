"""Shared fixtures: `ranks(n)` gives a persistent pool of n gloo/CPU rank processes.

One pool per world size lives for the whole pytest run, so process start-up
(seconds per process on 2 cores) is paid once, not per test.
"""

import os

import pytest

from minidist.testing import RankPool

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ranks():
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
