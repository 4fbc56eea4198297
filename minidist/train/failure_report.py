"""A rank that stops with an error says so in one line; the traceback goes to its log file.

A run that fails on 8 ranks used to print 8 tracebacks, most of them the survivors' view of
the same event (gloo's "Connection reset by peer" when a peer died). Each rank now prints

    error: rank 0 stopped after step 12: CollectiveFailure: step 13: all_reduce of 41,216 bytes (ring) did not complete
    on this rank: ... ; torchrun restarts the group (restart 1 of 2) from checkpoints/step_00000010;
    traceback in runs/a/logs/rank_0.log

and exits with status 1, so the launcher (torchrun, or `python recipes/train.py`'s own) sees
the failure and stops or restarts the group as configured.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from minidist.train.checkpoint import latest_checkpoint


def restart_plan(run_dir: Path) -> str:
    """What happens next: torchrun's restart (and from which checkpoint) or the end of the run."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if done >= restarts:
        return "the run stops here" + (" (torchrun --max-restarts is used up)" if restarts else "")
    latest = latest_checkpoint(run_dir)
    start = f"from {latest.relative_to(run_dir)}" if latest is not None else "from the start (no checkpoint yet)"
    return f"torchrun restarts the group (restart {done + 1} of {restarts}) {start}"


def report_failure(error: BaseException, rank: int, step: int | None, run_dir: Path) -> str:
    """Append `error`'s traceback to this rank's log; return the one line that describes it
    (`step`: the steps this rank had completed, None before the trainer existed)."""
    log = Path(run_dir) / "logs" / f"rank_{rank}.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"rank {rank} stopped with this error:\n{''.join(traceback.format_exception(error))}")
        kept = f"traceback in {log}"
    except OSError as e:  # the logs cannot be written (the error may be just that): the line says all
        kept = f"no traceback kept: {log.parent} cannot be written ({e.__class__.__name__}: {e.strerror or e})"
    text = str(error).strip().splitlines()
    what = text[0] if text else ""
    where = f" after step {step}" if step is not None else " before training started"
    return f"error: rank {rank} stopped{where}: {error.__class__.__name__}: {what}; {restart_plan(run_dir)}; {kept}"
