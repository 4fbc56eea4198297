"""A host that vanishes is noticed within launcher.peer_timeout_s, not after launcher.timeout_s.

A rank whose peer process dies learns it at once: the peer's kernel closes its connections,
and the collective fails. A host that loses power or its network sends nothing: gloo (and
NCCL) wait out the whole collective timeout, minutes, before torchrun can re-form the group.
So every rank beats, through the launch's store (torchrun's agent store, or MASTER_ADDR's):

    watch = PeerWatch.start(ctx, peer_timeout_s, step=lambda: trainer.step, run_dir=run_dir)
    ...
    watch.stop()   # the end of the run: this rank's beat says "done", never "gone"

A background thread, every `interval_s`, bumps this rank's counter and reads its two ring
neighbours' counters and one shared "lost" key. A neighbour whose counter has not moved for
`peer_timeout_s` since it last moved (on this rank's own clock: no clock is compared across
hosts; a neighbour is watched from its first beat on, so a slow start is no loss) is gone: this
rank writes "lost" (so every other rank learns it within one interval, whatever it watches),
says so in one line and exits with status 1 (os._exit: the training thread may be inside a
collective that cannot be interrupted). torchrun then sees its workers fail and re-forms the
group from the hosts that remain (--nnodes MIN:MAX), and the trainer resumes from the latest
checkpoint at the new world size. The store that carries the beats is served by the
rendezvous host: that host must be one that survives (as torchrun's c10d rendezvous requires
anyway). If the store itself stops answering, the watch ends (said in the rank's log): without
torchrun it is rank 0's process that serves it, gone as soon as rank 0 has finished, which is
no loss; and torchrun's agents notice a lost rendezvous host themselves.

Each rank reads three keys per interval, whatever the world size. A stuck but living rank
still beats: that is launcher.timeout_s's to catch.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

DONE = b"done"


def _store_and_prefix(timeout_s: float):
    """A client of the launch's store of its own (the beat thread must not share the process
    group's connection), and this attempt's key prefix; None where there is no store (one rank)."""
    import torch.distributed as dist

    env = os.environ
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None, ""
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    PeerWatch.started += 1  # each run of a --multirun sweep in this process: keys of its own (every rank counts alike)
    return store, f"minidist/{env.get('TORCHELASTIC_RUN_ID', 'run')}/attempt_{attempt}/run_{PeerWatch.started}/peers/"


class PeerWatch:
    """Beats for this rank and watches its ring neighbours; see the module docstring."""

    started = 0  # watches this process started (a sweep's runs)

    def __init__(self, store, prefix: str, rank: int, world_size: int, peer_timeout_s: float,
                 on_lost: Callable[[str], None], interval_s: float | None = None):
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world_size
        self.peer_timeout_s = float(peer_timeout_s)
        self.interval_s = interval_s if interval_s is not None else max(0.05, min(1.0, self.peer_timeout_s / 10))
        self.on_lost = on_lost
        self.neighbours = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minidist-peer-watch", daemon=True)

    @classmethod
    def start(cls, ctx, peer_timeout_s: float, step: Callable[[], int | None], run_dir: Path) -> "PeerWatch | None":
        """Start watching (None for one rank, or peer_timeout_s <= 0: off)."""
        if ctx.world_size < 2 or not peer_timeout_s or peer_timeout_s <= 0:
            return None
        store, prefix = _store_and_prefix(max(float(peer_timeout_s), 5.0))
        if store is None:
            return None
        watch = cls(store, prefix, ctx.rank, ctx.world_size, peer_timeout_s,
                    on_lost=lambda why: leave_the_group(why, ctx.rank, step(), run_dir))
        watch._thread.start()
        return watch

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _run(self) -> None:
        beats, seen = 0, {r: (None, time.monotonic()) for r in self.neighbours}
        lost_key = f"{self.prefix}lost"
        while not self._stop.is_set():
            try:
                beats += 1
                self.store.set(self._key(self.rank), str(beats))
                if self.store.check([lost_key]):
                    why = self.store.get(lost_key).decode(errors="replace")
                    return self.on_lost(f"{why} (said by another rank)")
                now = time.monotonic()
                for r in self.neighbours:
                    value = self.store.get(self._key(r)) if self.store.check([self._key(r)]) else None
                    if value == DONE:
                        continue
                    last, since = seen[r]
                    if value != last:
                        seen[r] = (value, now)
                    elif last is not None and now - since > self.peer_timeout_s:  # watched from its first beat
                        why = (f"rank {r} sent no heartbeat for {now - since:.0f} s (launcher.peer_timeout_s="
                               f"{self.peer_timeout_s:g}): its host is gone or cut off")
                        self.store.set(lost_key, why)
                        return self.on_lost(why)
            except Exception as e:  # noqa: BLE001 - the store itself is gone: nothing left to watch with
                # Not a loss to act on: where rank 0's process serves the store (no torchrun), it is
                # gone once rank 0 has finished; where the rendezvous host is gone, torchrun's agents
                # find that out themselves. The collectives' timeout still stands.
                if not self._stop.is_set():
                    from minidist.dist import get_logger

                    get_logger().info(f"peer watch: the launch's store at {os.environ.get('MASTER_ADDR')}:"
                                      f"{os.environ.get('MASTER_PORT')} stopped answering ({e.__class__.__name__}); "
                                      "no more heartbeats")
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """This rank is done: its beat says so (its neighbours stop watching it), and the thread ends."""
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 5)
        try:
            self.store.set(self._key(self.rank), DONE.decode())
        except Exception:  # noqa: BLE001 - the store may be gone with the end of the launch; nothing to tell
            pass


def leave_the_group(why: str, rank: int, step: int | None, run_dir: Path) -> None:
    """Say in one line that this rank leaves because a peer is gone, leave the failure record the
    launcher reads, and exit at once (the training thread may be blocked inside a collective)."""
    from minidist.train.failure_report import restart_plan, write_record
    from minidist.train.run_lock import RunDirectoryUnwritable, append_file

    where = f" after step {step}" if step is not None else ""
    line = f"error: rank {rank} stopped{where}: PeerLost: {why}; {restart_plan(run_dir)}"
    try:
        write_record(run_dir, rank, "waited", step, line)
        with append_file(Path(run_dir) / "logs" / f"rank_{rank}.log") as f:
            f.write(line + "\n")
    except (OSError, RunDirectoryUnwritable):
        pass
    print(line, file=sys.stderr, flush=True)
    os._exit(1)
