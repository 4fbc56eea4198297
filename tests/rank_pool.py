"""Run a function on N ranks (gloo, CPU) from one parent process — the multi-rank test harness.

    pool = RankPool(world_size=3)
    results = pool.run(my_module_level_fn, arg1, arg2, timeout_s=60)   # one result per rank
    pool.close()

Why a pool: on a 2-core machine, starting a Python process that imports torch
costs seconds. The pool starts its ranks once, initialises the process group
once, and then runs many test functions on them.

Never hang, never flake:
- every `run` has a deadline; past it (or when one rank fails and the others do
  not finish shortly after, e.g. stuck in a collective waiting for the failed
  rank) the whole pool is killed and the next `run` starts a fresh one;
- a failure reports every failing rank's traceback;
- ranks that hold many process groups (each with polling threads) are replaced by fresh
  ones before the next task, so the suite's later tests get the whole machine;
- ranks leave with os._exit, skipping interpreter teardown, where gloo may
  otherwise abort ("terminate called without an active exception").
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import time
import traceback
from typing import Any, Callable

from minidist.dist import free_port

DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to finish before we assume they
# are blocked on the failed rank and kill the pool.
FAILURE_GRACE_S = 5.0
# Past this many process groups on a rank, the pool starts fresh ranks before its next task. torch
# keeps every group a task makes (new_group, meshes, DeviceMesh) until it is destroyed, and gloo
# gives each group three threads that poll: a 4-rank pool that ran the whole suite held 235 groups
# (~710 threads a rank), which took a third of the machine's CPU from every later test. Destroying
# a task's groups is not an option: torch's DTensor caches and DeepSpeed's module globals keep
# them for the next run in the same process, as they may in a real one. New processes are what
# a new run gets anyway.
MAX_GROUPS_HELD = 24
# What a rank imports once started, before its first task: the strategies and the trainer (torch.compile's
# machinery with them), and the native references, which nearly every task uses.
PRELOADED = ("minidist.parallel.zero3", "minidist.parallel.ddp", "minidist.train.trainer", "torch.distributed.fsdp",
             "torch.distributed.tensor")


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RankTimeout(AssertionError):
    """The ranks did not all finish before the deadline; the pool was killed."""


def _groups_held() -> int:
    """How many process groups torch.distributed holds on this rank (its registry; no public API counts them)."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def _context():
    """Ranks are forked from a server process that has imported torch and minidist once (PRELOADED):
    a rank starts in a fraction of a second instead of importing them again (seconds each, on 2
    cores), and from a clean process, not from the test runner with its threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "minidist", *PRELOADED])
    return ctx


def _rank_main(rank: int, world_size: int, port: int, backend: str, conn) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        import minidist

        minidist.init_distributed(backend=backend, timeout_s=60)
        for module in PRELOADED:  # part of starting a rank: every test's first task on it would pay it
            importlib.import_module(module)
        conn.send_bytes(pickle.dumps(("ready", None)))
        while True:
            task = pickle.loads(conn.recv_bytes())
            if task is None:
                break
            fn, args, kwargs = task
            try:
                payload = pickle.dumps(("ok", fn(*args, **kwargs), _groups_held()))
            except BaseException:  # noqa: BLE001 - report everything, including SystemExit
                payload = pickle.dumps(("err", f"rank {rank}:\n{traceback.format_exc()}"))
            conn.send_bytes(payload)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException:  # noqa: BLE001
        try:
            conn.send_bytes(pickle.dumps(("err", f"rank {rank} failed to start:\n{traceback.format_exc()}")))
        except Exception:  # noqa: BLE001
            pass
    finally:
        os._exit(0)


class RankPool:
    """`world_size` persistent rank processes sharing one process group (gloo unless told otherwise)."""

    startup_s = 0.0  # every pool's start-up time so far (the suite's budget leaves it out: tests/conftest.py)
    starts = 0
    start_log: list[tuple[int, str, str, float]] = []  # (world size, why, during which test, seconds)

    def __init__(self, world_size: int, backend: str = "gloo", start_timeout_s: float = 120.0,
                 failure_grace_s: float = FAILURE_GRACE_S):
        self.world_size = world_size
        self.backend = backend
        self.start_timeout_s = start_timeout_s
        self.failure_grace_s = failure_grace_s
        self._why_start = "first"  # (the start log's: then "after a failure", or "groups held")
        self._procs: list[mp.Process] = []
        self._conns: list = []

    # -- lifecycle
    def _start(self) -> None:
        began = time.monotonic()
        try:
            self._spawn()
        finally:
            took = time.monotonic() - began
            RankPool.startup_s += took
            RankPool.starts += 1
            RankPool.start_log.append((self.world_size, self._why_start, os.environ.get("PYTEST_CURRENT_TEST", ""),
                                       took))
            self._why_start = "after a failure"

    def _spawn(self) -> None:
        ctx = _context()
        port = free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, self.world_size, port, self.backend, child), daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._collect(time.monotonic() + self.start_timeout_s, "start-up")
        if any(status != "ready" for status, _ in replies):
            self.kill()
            raise RankFailure("\n".join(str(v) for s, v in replies if s != "ready"))

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
        self.kill()

    # -- running
    def _collect(self, deadline: float, what: str) -> list[tuple[str, Any]]:
        replies: dict[int, tuple[str, Any]] = {}
        failed_at: float | None = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + self.failure_grace_s)
            if now >= limit:
                break
            waiting = {self._conns[r]: r for r in range(self.world_size) if r not in replies}
            for conn in mp.connection.wait(list(waiting), timeout=min(0.5, limit - now)):
                rank = waiting[conn]
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    replies[rank] = ("err", f"rank {rank} died (exit code {self._procs[rank].exitcode})")
                if replies[rank][0] == "err" and failed_at is None:
                    failed_at = time.monotonic()
            for r in range(self.world_size):  # a rank that died without a word
                if r not in replies and not self._procs[r].is_alive() and not self._conns[r].poll():
                    replies[r] = ("err", f"rank {r} died (exit code {self._procs[r].exitcode})")
                    failed_at = failed_at or time.monotonic()
        if len(replies) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in replies]
            errors = [reply[1] for reply in replies.values() if reply[0] == "err"]
            self.kill()
            if errors:
                raise RankFailure("\n".join(errors) + f"\n(ranks {missing} were still blocked; pool killed)")
            raise RankTimeout(f"{what}: ranks {missing} of {self.world_size} did not finish in time; "
                              "pool killed (a collective is probably waiting for a rank that never joins)")
        return [replies[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; return the per-rank results in rank order.

        fn must be importable (module level) since it travels to the ranks by pickle.
        """
        if not self._procs:
            self._start()
        task = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(task)
        replies = self._collect(time.monotonic() + timeout_s, getattr(fn, "__name__", "task"))
        errors = [reply[1] for reply in replies if reply[0] != "ok"]
        if errors:
            # A rank that raised may have left collectives half done: start fresh next time.
            self.kill()
            raise RankFailure("\n".join(errors))
        if max(held for _, _, held in replies) > MAX_GROUPS_HELD:
            self.close()  # their threads would slow every later test: fresh ranks next time
            self._why_start = "groups held"
        return [value for _, value, _ in replies]


class RankPools:
    """One RankPool per world size, each started on its first use: `pools(2).run(...)`; close() ends them."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
