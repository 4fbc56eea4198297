"""ft=torchft's local launcher: a lighthouse, then each replica group's ranks, each group in
<run dir>/group_<g> (its logs, TensorBoard, checkpoints, participation log). A group's ranks are
started as torchrun starts them (its variables; the group's rank 0 hosts its TCPStore), forked
from one fork server that imported torch, Hydra, torchft and the trainer once: a relaunch costs
no import (~3 s of CPU a rank, taken from the ranks still training where cores are few). A group
one of whose ranks dies is stopped whole and started again while another lives
(`ft.relaunched=true`: it reads no checkpoint, it heals from a live group); one that started
again after the others finished has nothing to heal from and is stopped. Each rank started is
a line in <run dir>/logs/ranks.jsonl (group, rank, pid, time). Several machines or SLURM: one
torchrun per group (docs/multinode.md)."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from minidist.dist import free_port, ranks_allocator
from minidist.train.live_recovery import LAUNCHED_AT, healed_since, summarize
from minidist.train.resilience import read_records
from minidist.train.run_files import append_file

# Overrides the launcher sets for each group itself (the user's are dropped).
SET_HERE = ("hydra.run.dir", "launcher.nproc", "ft.group", "ft.groups", "ft.lighthouse", "ft.relaunched",
            "trainer.progress")
# What the fork server imports once (torch._dynamo: the first optimizer built imports it, 1.3 s).
PRELOAD = ["minidist.train.app", "minidist.train.trainer", "torchft", "torch._dynamo", "torch.utils.tensorboard"]


def group_command(overrides: list[str], run_dir: Path, g: int, groups: int, size: int, lighthouse: str,
                  relaunched: bool) -> list[str]:
    """One rank's overrides in group `g` (the user's, less those set here)."""
    mine = [o for o in overrides if o.lstrip("+~").split("=")[0] not in SET_HERE]
    return [*mine, f"hydra.run.dir={run_dir / f'group_{g}'}", f"launcher.nproc={size}", f"ft.group={g}",
            f"ft.groups={groups}", f"ft.lighthouse={lighthouse}", f"ft.relaunched={str(relaunched).lower()}",
            f"trainer.progress={str(g == 0).lower()}"]


def run_forked_rank(entry, argv: list[str], env: dict, log: str | None) -> None:
    """A rank, forked from the fork server: a session, environment and output of its own, then
    `entry(argv)`, the trainer's main as `python -m minidist.train ARGV` runs it (its exit
    handlers too: a forked process ends without them)."""
    os.setsid()
    os.environ.update(env)
    if log is not None:
        with append_file(Path(log)) as out:
            for fd in (1, 2):
                os.dup2(out.fileno(), fd)
    try:
        entry(argv)
    finally:
        atexit._run_exitfuncs()


class Group:
    """One replica group's rank processes."""

    def __init__(self, forks, entry, argv: list[str], size: int, log: Path, console: bool):
        self.started, port = time.time(), free_port()
        env = {LAUNCHED_AT: repr(self.started), "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        self.ranks = [forks.Process(target=run_forked_rank,
                                    args=(entry, argv, {**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                          None if console and r == 0 else str(log))) for r in range(size)]
        for p in self.ranks:
            p.start()

    def poll(self) -> int | None:
        """None while running; 0 when every rank finished; else the first failure's status, the
        others stopped (as torchrun stops a group)."""
        codes = [p.exitcode for p in self.ranks]
        bad = [c for c in codes if c not in (None, 0)]
        if bad:
            self.signal(signal.SIGKILL)
            self.wait()  # (gone: its rank 0 held the group directory's lock, which its relaunch takes)
            return bad[0] if bad[0] > 0 else 128 - bad[0]
        return None if None in codes else 0

    def signal(self, signum: int) -> None:
        for p in (p for p in self.ranks if p.exitcode is None):
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:  # (not in its own session yet)
                os.kill(p.pid, signum)

    def wait(self) -> None:
        for p in self.ranks:
            p.join()


def launch_groups(cfg, run_dir: Path, overrides: list[str], world: int, entry) -> int:
    """Run the replica groups to the end, each rank `entry(its overrides)` (the trainer's main);
    the exit status (0: some group finished the run)."""
    from torchft._torchft import LighthouseServer

    size = int(cfg.ft.group_size or world)
    groups = world // size
    lighthouse, address = None, cfg.ft.lighthouse
    if address is None:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=int(cfg.ft.min_replicas),
                                      join_timeout_ms=int(500 * float(cfg.ft.timeout_s)),
                                      heartbeat_timeout_ms=int(cfg.ft.heartbeat_ms))
        address = lighthouse.address()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for key, value in (("RUST_LOG", "warn"), ("OMP_NUM_THREADS", "1")):  # the fork server's, read at its imports
        os.environ.setdefault(key, value)
    forks = multiprocessing.get_context("forkserver")
    forks.set_forkserver_preload(PRELOAD)

    def start(g: int, relaunched: bool) -> Group:  # group 0's rank 0 on the console (its progress bar)
        group = Group(forks, entry, group_command(overrides, run_dir, g, groups, size, address, relaunched), size,
                      run_dir / "logs" / f"group_{g}.log", console=g == 0)
        with append_file(run_dir / "logs" / "ranks.jsonl") as out:
            out.write("".join(json.dumps({"group": g, "rank": r, "pid": p.pid, "time": group.started}) + "\n"
                              for r, p in enumerate(group.ranks)))
        return group

    def ended(g: int, code: int) -> str:
        why = "; ".join(r["line"] for r in read_records(run_dir / f"group_{g}", running[g].started).values())
        return f"live recovery: replica group {g} ended (exit status {code}{': ' + why if why else ''})"

    stop: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    with ranks_allocator():  # the fork server, started with the first group, passes it to every rank
        running = {g: start(g, False) for g in range(groups)}
    finished, failed, relaunched = [], {}, []  # (relaunched: a group each time one was)
    try:
        while running:
            time.sleep(0.1)
            if stop:  # pass the stop on (before a rank's stop status is taken for a failure): each group
                for group in running.values():  # checkpoints the step it reached
                    group.signal(stop[0])
                for group in running.values():
                    group.wait()
                return 128 + stop[0]
            for g, group in list(running.items()):
                if (code := group.poll()) is None:
                    continue
                def heals(o: int) -> bool:  # a group one could heal from: not a relaunch still healing itself
                    return o not in relaunched or healed_since(run_dir / f"group_{o}", running[o].started)
                live = [o for o in running if o != g and heals(o)]
                if code == 0:
                    finished.append(g)
                elif cfg.ft.relaunch and live and not finished and heals(g):
                    print(f"{ended(g, code)}; the others go on, and it starts again to heal from them (its "
                          f"log: {run_dir / f'group_{g}' / 'logs'})", file=sys.stderr, flush=True)
                    running[g] = start(g, True)
                    relaunched.append(g)
                    continue
                else:  # (a relaunched group that died before it healed is not started a third time)
                    print(ended(g, code), file=sys.stderr, flush=True)
                    failed[g] = code
                del running[g]
                if finished or not live:  # a relaunched group that has not healed yet has nothing to heal from
                    for other in [o for o in running if not heals(o)]:
                        print(f"live recovery: replica group {other} started again, but no group is left to heal "
                              "from (the others have finished or failed); it is stopped", file=sys.stderr, flush=True)
                        running[other].signal(signal.SIGTERM)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if lighthouse is not None:
            lighthouse.shutdown()
    seen = summarize(run_dir)
    heal = f", heal {seen['heal_s_median']:.1f} s median" if seen["heal_s_median"] is not None else ""
    print(f"live recovery: {groups} groups x {size} rank{'s' * (size > 1)}; failures survived {len(relaunched)}, "
          f"steps discarded {seen['steps_discarded']}{heal}" + (f"; groups {sorted(failed)} failed" if failed else ""),
          file=sys.stderr, flush=True)
    return 0 if finished else 1
