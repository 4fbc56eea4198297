"""One run per run directory: an advisory lock on <run dir>/run.lock, held while the run lives.

Two runs started in one directory (the same command twice, a restart while the first still
runs) would interleave their logs and TensorBoard files and prune each other's checkpoints.
So the process that launches the ranks (rank 0's, under torchrun) takes an exclusive flock on
run.lock before any rank starts and holds it until the run ends; the lock file records who
holds it (pid, host, start time). A second run finds the lock taken and stops at once with one
line naming the live one.

The kernel releases a flock when its process dies, however it dies, so a lock left by a
killed run is never in the way: the next run simply takes it. On a file system without
flock (some NFS setups) the recorded pid and host decide instead: a holder on this host
that no longer exists is stale and taken over; one on another host is named, to be removed
by hand once that run is known to be gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from minidist.train.errors import ConfigError

NAME = "run.lock"


class RunDirectoryInUse(ConfigError):
    """Another live run holds the run directory."""


class RunDirectoryUnwritable(ConfigError):
    """The run directory cannot be made or written: no rank could log why it failed."""


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"])) if "started" in holder else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {when}"


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


@contextlib.contextmanager
def run_directory_lock(run_dir: Path):
    """Hold `run_dir`'s lock for the duration; RunDirectoryInUse if another live run holds it."""
    run_dir = Path(run_dir)
    path = run_dir / NAME
    unwritable = lambda e: RunDirectoryUnwritable(  # noqa: E731
        f"the run directory {run_dir} cannot be written ({e.__class__.__name__}: {e.strerror or e}): give a "
        "writable hydra.run.dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise unwritable(e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirectoryInUse(
                    f"the run directory {run_dir} is in use by another run ({_describe(_holder(path))}): wait "
                    "for it to end or stop it, or give this run its own hydra.run.dir") from None
            holder = _holder(path)  # no flock here: the recorded holder decides
            if holder and (holder.get("host") != socket.gethostname() or _alive(holder.get("pid"))):
                raise RunDirectoryInUse(
                    f"the run directory {run_dir} is recorded in use by {_describe(holder)} ({path}; this file "
                    "system takes no locks): if that run is gone, remove the file; else give this run its own "
                    "hydra.run.dir") from None
        try:  # where every rank will write: a failure there could not be logged by them
            (run_dir / "logs").mkdir(exist_ok=True)
            probe = run_dir / "logs" / f".write_test.{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644))
            probe.unlink()
        except OSError as e:
            raise unwritable(e) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
        yield path
    finally:
        os.close(fd)  # releases the flock
