"""A rank that stops with an error says so in one line; the traceback goes to its log file.

A run that fails on 8 ranks used to print 8 tracebacks, most of them the survivors' view of
the same event (gloo's "Connection reset by peer" when a peer died). Each rank now prints

    error: rank 0 stopped after step 12: CollectiveFailure: step 13: all_reduce of 41,216 bytes (ring) did not complete
    on this rank: ... ; torchrun restarts the group (restart 1 of 2) from checkpoints/step_00000010;
    traceback in runs/a/logs/rank_0.log

and exits with status 1, so the launcher (torchrun, or `python recipes/train.py`'s own) sees
the failure and stops or restarts the group as configured.

Each rank also leaves a record (logs/rank_N.failure.json: when, after which step, and whether it
failed on its own or waiting for a peer), from which our launcher names the ranks that failed
first (`who_failed_first`): the one that stalled or died, not the survivors that timed out on it.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from minidist.train.checkpoint import latest_checkpoint
from minidist.train.run_lock import RunDirectoryUnwritable, append_file, write_replacing
from minidist.train.stop_signal import signal_name


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
    from minidist.train.collective_failure import CollectiveFailure

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
