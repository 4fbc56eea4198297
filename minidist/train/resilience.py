"""When things go wrong, in one place: fault injection, failed collectives named, NCCL's flight
recorder, bytes between hosts, the failure report and the heartbeat that notices a lost host
(PeerWatch). What each does for a user: docs/multinode.md; how: docs/internals.md,
"train/resilience.py"; stop signals: stop_signal.py, which imports no torch.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from minidist import comm
from minidist.comm import ring
from minidist.dist import ranks_per_host
from minidist.train.checkpoint import latest_checkpoint
from minidist.train.run_files import RunDirectoryUnwritable, append_file, write_replacing
from minidist.train.stop_signal import signal_name


def planned_kills(debug_cfg) -> list[tuple[int, int]]:
    """[(rank, step), ...] from debug.kill_rank / debug.kill_at_step (ints or equal-length lists)."""
    if debug_cfg is None or debug_cfg.get("kill_at_step") is None:
        return []
    steps, ranks = debug_cfg.kill_at_step, debug_cfg.get("kill_rank", 0)
    steps = [int(s) for s in steps] if not isinstance(steps, int) else [steps]
    ranks = [int(r) for r in ranks] if not isinstance(ranks, int) else [ranks] * len(steps)
    if len(ranks) != len(steps):
        raise ValueError(f"debug.kill_rank has {len(ranks)} entries and debug.kill_at_step {len(steps)}: "
                         "give one rank, or one per step")
    return list(zip(ranks, steps))


def marker(run_dir: Path, rank: int, step: int) -> Path:
    return Path(run_dir) / "faults" / f"killed_rank{rank}_step{step}"


def _rank_and_step(debug_cfg, prefix: str) -> tuple[int, int] | None:
    """(debug.PREFIX_rank, debug.PREFIX_at_step), or None when no step is given."""
    if debug_cfg is None or debug_cfg.get(f"{prefix}_at_step") is None:
        return None
    return int(debug_cfg.get(f"{prefix}_rank", 0)), int(debug_cfg[f"{prefix}_at_step"])


class FaultPlan:
    """The faults the debug config asks for, parsed once."""

    def __init__(self, debug_cfg):
        self.kills = planned_kills(debug_cfg)
        self.kill_during = str(debug_cfg.get("kill_during", "step")) if debug_cfg is not None else "step"
        self.stall = _rank_and_step(debug_cfg, "stall")
        self.nan = _rank_and_step(debug_cfg, "nan")
        self.step_delay_s = float(debug_cfg.get("step_delay_s", 0) or 0) if debug_cfg is not None else 0.0

    def maybe_kill(self, run_dir: Path, rank: int, step: int, during: str = "step") -> None:
        """Die now if planned for this rank and step, `during` the step or its checkpoint's save,
        and not done in this run directory yet (before a restart: then it runs through)."""
        if during != self.kill_during or (rank, step) not in self.kills:
            return
        if (path := marker(run_dir, rank, step)).exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"rank {rank} killed itself after step {step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def maybe_stall(self, rank: int, step: int) -> None:
        """Stop participating, for good, if this rank is to stall before this step (and sleep
        debug.step_delay_s before every step)."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        if self.stall == (rank, step):
            while True:  # until the launcher stops the job
                time.sleep(3600)

    def nan_loss(self, rank: int, step: int) -> bool:
        """Is this rank's loss to be nan at this step?"""
        return self.nan == (rank, step)


# What the backends' messages contain when a peer is gone or late (gloo, nccl, c10d). Not a bare
# "gloo" or "nccl": every backend error names its backend (a size mismatch, an invalid argument),
# and relabelling those as a stalled peer would hide the real cause.
_SIGNS = ("timed out", "timeout", "connection reset", "connection closed", "connection refused", "broken pipe",
          "peer", "socket closed")


class CollectiveFailure(RuntimeError):
    """A collective did not complete on this rank because another rank stopped participating."""


def collective_failure(error: BaseException, records, step: int, strategy: str,
                       timeout_s: float) -> CollectiveFailure | None:
    """A CollectiveFailure describing `error` (raised while running `step`), or None when the
    error is not a communication failure (then it should propagate as it is)."""
    text = str(error).strip()
    if not any(sign in text.lower() for sign in _SIGNS):
        return None
    pending = [r for r in records if r.pending()]
    if pending:
        r = pending[0]
        what = f"{r.op} of {r.bytes:,} bytes ({r.algorithm})"
    elif records:
        what = f"the collective after {records[-1].op}"
    else:
        what = f"a collective of strategy {strategy}"
    first_line = text.splitlines()[0][:300] if text else type(error).__name__
    return CollectiveFailure(
        f"step {step}: {what} did not complete on this rank: {first_line}. Another rank stopped "
        f"participating (it died, is stuck, or issued a different collective); collectives give up after "
        f"launcher.timeout_s={timeout_s:g} s")


FLIGHT_RECORDER_ENTRIES = 2000  # collectives remembered per rank: a few steps of a large model
DUMP_PREFIX = "nccl_trace_rank_"  # torch appends the rank


def flight_recorder_env(log_dir: Path) -> dict[str, str]:
    """The environment that makes NCCL's watchdog dump its flight recorder into `log_dir`."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(log_dir) / DUMP_PREFIX)}


def enable_flight_recorder(log_dir: Path) -> None:
    """Before the process group exists (NCCL reads these when it is created)."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    for key, value in flight_recorder_env(log_dir).items():
        os.environ.setdefault(key, value)


def dumps_line(log_dir: Path) -> str | None:
    """One line naming the flight recorder's dumps in `log_dir`, or None when there are none."""
    dumps = sorted(Path(log_dir).glob(f"{DUMP_PREFIX}*"))
    if not dumps:
        return None
    return (f"NCCL's watchdog dumped the last collectives of rank(s) "
            f"{', '.join(d.name[len(DUMP_PREFIX):] for d in dumps)} into {log_dir}/{DUMP_PREFIX}*: "
            f"python -m torch.distributed.flight_recorder.fr_trace {log_dir} --prefix {DUMP_PREFIX} "
            "names the collective the ranks disagree on")


MSS = 1448  # TCP payload bytes per packet on a 1500-byte MTU (20 IP + 32 TCP with timestamps)


def _phases(record) -> list[tuple[str, float]]:
    """(ring phase, bytes this rank sends in it): an all_reduce is a reduce_scatter then an all_gather."""
    if record.op == "all_reduce":
        return [("reduce_scatter", record.sent_bytes / 2), ("all_gather", record.sent_bytes / 2)]
    return [(record.op, record.sent_bytes)]


def cross_host_sent(records, rank: int, per_host: int) -> tuple[float, int]:
    """(bytes, TCP packets at most) this rank sent to ranks on other hosts over `records`.

    A collective over k ranks moves its payload in chunks of bytes/k. In a ring step each rank
    sends one chunk to its successor; our ring's small collectives send each chunk straight to
    the rank that needs it instead (ring.sends_direct), so every peer gets an equal share. Each
    chunk is ceil(chunk / MSS) packets."""
    sent, packets = 0.0, 0
    for r in records:
        group = r.group_ranks
        k = len(group)
        if rank not in group or k < 2 or not r.sent_bytes:
            continue
        me = group.index(rank)
        chunk = r.bytes / k
        chunk_packets = max(1, -(-int(chunk) // MSS))
        for phase, phase_bytes in _phases(r):
            if r.algorithm == "ring" and ring.sends_direct(phase, int(chunk), k):
                away = sum(1 for q in group if q // per_host != rank // per_host)
                sent += phase_bytes * away / (k - 1)
                packets += away * chunk_packets
            elif group[(me + 1) % k] // per_host != rank // per_host:
                sent += phase_bytes
                packets += round(phase_bytes / chunk) * chunk_packets
    return sent, packets


def interface_tx_bytes(proc_net_dev: Path = Path("/proc/net/dev")) -> int:
    """Bytes transmitted by this network namespace's interfaces, loopback excluded."""
    total = 0
    for line in proc_net_dev.read_text().splitlines()[2:]:  # two header lines
        name, _, fields = line.partition(":")
        if name.strip() != "lo":
            total += int(fields.split()[8])  # receive has 8 columns, then transmit bytes
    return total


class HostTraffic:
    """The measured side: local rank 0 reads the counters after the first and the last step."""

    def __init__(self, rank: int, world_size: int):
        self.per_host = ranks_per_host() or world_size  # nothing says: one host
        self.multi_host = self.per_host < world_size
        self.reads = rank % self.per_host == 0 and self.multi_host
        self.first: tuple[int, int] | None = None
        self.last: tuple[int, int] | None = None

    def after_step(self, step: int, start: int, end: int, settle=None) -> None:
        """Call after each step on every rank; `start` is the step the run began from, `end` its
        last; `settle()` waits for what the step left in flight (ZeRO-1/2's parameter gathers)."""
        if not self.multi_host or step not in (start + 1, end):
            return
        # Every rank's sends of this step are out before the counters are read, so a gather still
        # in flight on another host is not counted on the wrong side of a read (measured once as
        # 1% under the theory on a loaded machine).
        if settle is not None:
            settle()
        comm.barrier()
        if not self.reads:
            return
        point = (step, interface_tx_bytes())
        if step == start + 1:
            self.first = point
        if step == end:
            self.last = point

    def tx_bytes_per_step(self) -> float:
        """This host's transmitted bytes per step between the two reads (0 where it did not read)."""
        if self.first is None or self.last is None or self.last[0] == self.first[0]:
            return 0.0
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


def restart_plan(run_dir: Path) -> str:
    """What happens next: torchrun's restart (and from which checkpoint) or the end of the run."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if done >= restarts:
        return "the run stops here" + (" (torchrun --max-restarts is used up)" if restarts else "")
    latest = latest_checkpoint(run_dir)
    start = f"from {latest.relative_to(run_dir)}" if latest is not None else "from the start (no checkpoint yet)"
    return f"torchrun restarts the group (restart {done + 1} of {restarts}) {start}"


def report_failure(error: BaseException, rank: int, step: int | None, run_dir: Path, agreed: bool = False,
                   job: str | None = None) -> str:
    """Append `error`'s traceback to this rank's log; return the one line that describes it
    (`step`: the steps this rank had completed, None before the trainer existed; `agreed`: every
    rank raised it alike, so rank 0's line says all and the launcher adds none; `job`: the sweep's
    job, named first)."""
    log = Path(run_dir) / "logs" / f"rank_{rank}.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with append_file(log) as f:
            f.write(f"rank {rank} stopped with this error:\n{''.join(traceback.format_exception(error))}")
        kept = f"traceback in {log}"
    except (OSError, RunDirectoryUnwritable) as e:  # the logs cannot be written (the error may be just that)
        kept = f"no traceback kept: {log.parent} cannot be written ({e.__class__.__name__}: {getattr(e, 'strerror', 0) or e})"
    text = str(error).strip().splitlines()
    what = text[0] if text else ""
    where = f" after step {step}" if step is not None else " before training started"
    line = (f"error: {job + ': ' if job else ''}rank {rank} stopped{where}: {error.__class__.__name__}: {what}; "
            f"{restart_plan(run_dir)}; {kept}")

    write_record(run_dir, rank, "waited" if isinstance(error, CollectiveFailure) else "agreed" if agreed else "error",
                 step, line)
    return line


# What a rank's failure record says it did: failed on its own (error), gave up waiting for a
# peer (waited: a CollectiveFailure), or was still inside its step when told to stop (stuck).
KINDS = ("error", "waited", "stuck", "agreed")  # agreed: every rank failed alike (rank 0's line says it)


def write_record(run_dir: Path, rank: int, kind: str, step: int | None, line: str) -> None:
    """Leave this rank's failure record for the launcher (best effort: the line is already said)."""
    record = {"rank": rank, "kind": kind, "step": step, "time": time.time(), "line": line}
    try:
        write_replacing(Path(run_dir) / "logs" / f"rank_{rank}.failure.json", json.dumps(record))
    except (OSError, RunDirectoryUnwritable):
        pass


def read_records(run_dir: Path, since: float) -> dict[int, dict]:
    """rank -> its failure record, for those written at or after `since` (this launch's)."""
    records = {}
    for f in (Path(run_dir) / "logs").glob("rank_*.failure.json"):
        try:
            r = json.loads(f.read_text())
            if r.get("time", 0) >= since and r.get("kind") in KINDS:
                records[int(r["rank"])] = r
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def who_failed_first(run_dir: Path, since: float, exitcodes: dict[int, int | None]) -> str:
    """The ranks that failed first and how, in words, from the records since `since` and the exit
    codes the launcher saw (a rank killed by a signal leaves no record).

    A rank that waited for a peer is never first while another failed on its own, stalled, or
    died; among those, the earliest (and any within a second of it: failing alike, at once)."""
    records = read_records(run_dir, since)
    killed = {r: code for r, code in exitcodes.items() if code is not None and code < 0 and r not in records}
    causes = {r: rec for r, rec in records.items() if rec["kind"] != "waited"}
    waited = {r: rec for r, rec in records.items() if rec["kind"] == "waited"}
    first: dict[int, str] = {r: f"killed by {signal_name(-code)}" for r, code in killed.items()}
    pool = causes or ({} if first else waited)
    if pool:
        earliest = min(rec["time"] for rec in pool.values())
        for r, rec in pool.items():
            if rec["time"] <= earliest + 1.0:
                first[r] = _how(rec)
    if not first:  # nothing recorded (the logs could not be written): what the launcher saw
        return f"rank(s) {sorted(exitcodes)}"
    after = sorted(set(records) - set(first))
    said = "; ".join(f"rank {r} {first[r]}" for r in sorted(first))
    then = f"; then rank(s) {after}, waiting for it" if after else ""
    return f"rank(s) {sorted(first)} first ({said}){then}"


def _how(record: dict) -> str:
    step = record.get("step")
    at = f" after step {step}" if step is not None else " before training started"
    return {"error": f"failed{at}", "agreed": f"failed{at}", "waited": f"gave up waiting for a peer{at}",
            "stuck": f"stalled{at}: still inside its step when the launcher stopped it"}[record["kind"]]


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
    """Beats for this rank and watches its ring neighbours; how: docs/internals.md, "train/resilience.py"."""

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
