"""ft=torchft's local launcher: a lighthouse, then each replica group's ranks, each group in
<run dir>/group_<g> (its logs, TensorBoard, checkpoints, participation log). A group's ranks are
started as torchrun starts them (its variables; the group's rank 0 hosts its TCPStore) but without
torchrun's agent, whose own import of torch would add ~3 s to each relaunch. A group one of whose
ranks dies is stopped whole and started again while another lives (`ft.relaunched=true`: it reads
no checkpoint, it heals from a live group); one that started again after the others finished has
nothing to heal from and is stopped. With ft.spare, each group has a spare, started once the group
commits (its imports done, then waiting): a group that dies is replaced by its spare at once, and
a new spare started once that one commits. Several machines or SLURM: one torchrun per group
(docs/multinode.md)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from minidist.dist import free_port
from minidist.train.live_recovery import STARTS_ON_STDIN, logged_since, summarize
from minidist.train.resilience import read_records
from minidist.train.run_files import append_file

# Overrides the launcher sets for each group itself (the user's are dropped).
SET_HERE = ("hydra.run.dir", "launcher.nproc", "ft.group", "ft.groups", "ft.lighthouse", "ft.relaunched",
            "trainer.progress")


def group_command(overrides: list[str], run_dir: Path, g: int, groups: int, size: int, lighthouse: str,
                  relaunched: bool) -> list[str]:
    """One rank's command line in group `g` (the user's overrides, less those set here)."""
    mine = [o for o in overrides if o.lstrip("+~").split("=")[0] not in SET_HERE]
    return [sys.executable, "-m", "minidist.train", *mine, f"hydra.run.dir={run_dir / f'group_{g}'}",
            f"launcher.nproc={size}", f"ft.group={g}", f"ft.groups={groups}", f"ft.lighthouse={lighthouse}",
            f"ft.relaunched={str(relaunched).lower()}", f"trainer.progress={str(g == 0).lower()}"]


class Group:
    """One replica group's rank processes: started at once, or a spare's waiting for go()."""

    def __init__(self, cmd: list[str], size: int, env: dict, log: Path, console: bool, spare: bool = False):
        self.started = None
        with append_file(log) as out:
            self.ranks = [subprocess.Popen(cmd, env={**env, STARTS_ON_STDIN: "1", "RANK": str(r), "LOCAL_RANK": str(r),
                                                     "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size),
                                                     "MASTER_ADDR": "127.0.0.1"}, stdin=subprocess.PIPE,
                                           stdout=None if console and r == 0 else out,
                                           stderr=None if console and r == 0 else out, start_new_session=True)
                          for r in range(size)]
        if not spare:
            self.go()

    def go(self) -> Group:
        """Start (minidist.train.live_recovery.await_start): the launch time, and the port for the
        group's TCPStore, which its rank 0 hosts."""
        self.started, port = time.time(), free_port()
        for p in self.ranks:
            with contextlib.suppress(OSError):  # (a rank that died already: poll() says it)
                p.stdin.write(f"{self.started!r} {port}\n".encode())
                p.stdin.close()
        return self

    def poll(self) -> int | None:
        """None while running; 0 when every rank finished; else the first failure's status, the
        others stopped (as torchrun stops a group)."""
        codes = [p.poll() for p in self.ranks]
        bad = [c for c in codes if c not in (None, 0)]
        if bad:
            self.signal(signal.SIGKILL)
            self.wait()  # (gone before a spare takes the run directory's lock)
            return bad[0] if bad[0] > 0 else 128 - bad[0]
        return None if None in codes else 0

    def signal(self, signum: int) -> None:
        for p in self.ranks:
            if p.poll() is None:
                os.killpg(p.pid, signum)

    def wait(self) -> None:
        for p in self.ranks:
            p.wait()


def launch_groups(cfg, run_dir: Path, overrides: list[str], world: int) -> int:
    """Run the replica groups to the end; the exit status (0: some group finished the run)."""
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
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    def start(g: int, relaunched: bool, spare: bool = False) -> Group:  # group 0's rank 0 on the console
        return Group(group_command(overrides, run_dir, g, groups, size, address, relaunched), size, env,
                     run_dir / "logs" / f"group_{g}.log", console=g == 0, spare=spare)

    def ended(g: int, code: int) -> str:
        why = "; ".join(r["line"] for r in read_records(run_dir / f"group_{g}", running[g].started).values())
        return f"live recovery: replica group {g} ended (exit status {code}{': ' + why if why else ''})"

    stop: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    running, spares = {g: start(g, False) for g in range(groups)}, {}
    finished, failed, relaunched, relaunches = [], {}, set(), 0
    try:
        while running:
            time.sleep(0.1)
            for g in [g for g in running if cfg.ft.spare and cfg.ft.relaunch and g not in spares]:
                if logged_since(run_dir / f"group_{g}", "commit", running[g].started):  # (after it, not beside)
                    spares[g] = start(g, True, spare=True)
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
                    return o not in relaunched or logged_since(run_dir / f"group_{o}", "heal", running[o].started)
                live = [o for o in running if o != g and heals(o)]
                if code == 0:
                    finished.append(g)
                elif cfg.ft.relaunch and live and not finished and heals(g):
                    print(f"{ended(g, code)}; the others go on, and it starts again to heal from them (its "
                          f"log: {run_dir / f'group_{g}' / 'logs'})", file=sys.stderr, flush=True)
                    spare = spares.pop(g, None)  # (one that failed while it waited is not used)
                    running[g] = spare.go() if spare and spare.poll() is None else start(g, True)
                    relaunched.add(g)
                    relaunches += 1
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
        for spare in spares.values():  # (waiting, or still importing: nothing of theirs to keep)
            spare.signal(signal.SIGKILL)
            spare.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if lighthouse is not None:
            lighthouse.shutdown()
    seen = summarize(run_dir)
    heal = f", heal {seen['heal_s_median']:.1f} s median" if seen["heal_s_median"] is not None else ""
    print(f"live recovery: {groups} groups x {size} ranks; failures survived {relaunches}, steps discarded "
          f"{seen['steps_discarded']}{heal}" + (f"; groups {sorted(failed)} failed" if failed else ""),
          file=sys.stderr, flush=True)
    return 0 if finished else 1
