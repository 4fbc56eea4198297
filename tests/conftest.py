"""Shared fixtures and the fast suite's budget.

`ranks(n)` gives a persistent pool of n gloo/CPU rank processes: one pool per world size lives
for the whole pytest run, so process start-up (seconds per process on 2 cores) is paid once, not
per test.

The tiers, and what each may cost in `make test` (`-m "not slow"`):
- a test in-process or on the warm pools: at most BUDGET_S of its own (setup, call), the pools'
  start-up not counted;
- an end-to-end launch (`@pytest.mark.launch`: a recipe as a user runs it, in fresh processes):
  at most LAUNCH_BUDGET_S, and at most LAUNCHES of them;
- a test over budget fails with its name, its time and the two ways out. `make test-all` runs
  the slow tests too (`@pytest.mark.slow(stand_in=...)`), without a budget.
`make test` ends with its total against GOAL_S. MINIDIST_TEST_BUDGET=0 turns the budget off (a
machine much slower than the 2-core one it was set on).
"""

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

# The tools beside the package (the cost model, the documents' pipeline) import as the scripts import them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lib"))

from rank_pool import RankPool, RankPools

os.environ.setdefault("OMP_NUM_THREADS", "1")

BUDGET_S = 5.0
LAUNCH_BUDGET_S = 15.0
LAUNCHES = 5
GOAL_S = 180.0


@pytest.fixture(scope="session")
def ranks():
    pools = RankPools()
    yield pools
    pools.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "launch: an end-to-end launch in fresh processes (its own budget, "
                                       f"at most {LAUNCHES} in make test)")
    config.addinivalue_line("markers", "pool: runs on the warm rank pools (given to every test that uses `ranks`)")
    config._minidist_started = time.monotonic()
    # The processes the tests start get a temporary folder of their own, removed at the end: native
    # torchrun leaves a torchelastic_* folder in it per launch. This process keeps its own (asked for
    # first, so pytest's folders stay where they were).
    tempfile.gettempdir()
    config._minidist_tmp = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="minidist-tests-")


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_minidist_tmp", ""), ignore_errors=True)


def _budgeted(config) -> bool:
    return config.getoption("markexpr") == "not slow" and os.environ.get("MINIDIST_TEST_BUDGET", "1") != "0"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._minidist_startup = RankPool.startup_s  # the pools' start-up before this test
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when not in ("setup", "call") or not report.passed or not _budgeted(item.config):
        return
    startup = RankPool.startup_s - item._minidist_startup
    item._minidist_startup = RankPool.startup_s
    own = report.duration - startup
    launch = item.get_closest_marker("launch") is not None
    limit = LAUNCH_BUDGET_S if launch else BUDGET_S
    if own > limit:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {own:.1f} s ({report.when}{f'; {startup:.1f} s more starting ranks' if startup > 0.05 else ''}), "
                           f"over make test's budget of {limit:g} s for a{'n end-to-end launch' if launch else ' fast test'}: "
                           "make it faster, or mark it @pytest.mark.slow(stand_in=...) with a fast test that stands "
                           "for it (tests/test_slow_stand_ins.py)")


def pytest_collection_modifyitems(config, items):
    for item in items:  # the tier is the fixture: pytest -m pool (or "not pool") runs one tier
        if {"ranks", "clean_ranks"} & set(getattr(item, "fixturenames", ())):
            item.add_marker("pool")
    if not _budgeted(config):
        return
    launches = [i.nodeid for i in items if i.get_closest_marker("launch") is not None
                and i.get_closest_marker("slow") is None]
    if len(launches) > LAUNCHES:
        raise pytest.UsageError(f"make test holds {len(launches)} end-to-end launches, at most {LAUNCHES}: "
                                f"{launches}; mark the others slow, each with a fast stand-in")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _budgeted(config):
        return
    total = time.monotonic() - config._minidist_started
    verdict = "within" if total <= GOAL_S else "OVER"
    terminalreporter.write_line(f"make test: {total:.0f} s of pytest, {verdict} the {GOAL_S:.0f} s goal "
                                f"({RankPool.startup_s:.0f} s of it starting {RankPool.starts} rank pool(s))")
    if os.environ.get("MINIDIST_POOL_LOG"):
        for world, why, test, took in RankPool.start_log:
            terminalreporter.write_line(f"  pool of {world} started ({why}, {took:.1f} s): {test}")
