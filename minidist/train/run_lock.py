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

Files handed over are not trusted, and a run directory may be shared: someone who can write
there could plant a symbolic link where the run writes (config.yaml -> a file of yours) and have
the run overwrite what it points to. So nothing the run writes follows a link it did not make:
before any rank starts, the folders the run writes into (logs/, checkpoints/, tensorboard/,
samples/) must be real folders holding no links, and writable (a probe file made and removed,
so a read-only folder is found before the first step, not at the first save); ranks append to
their files with O_NOFOLLOW (`append_file`) and rewrite whole files by renaming a new one over
the old (`write_replacing`: a link there is replaced, never written through).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from minidist.train.config import ConfigError

NAME = "run.lock"
# The folders of a run directory the run writes into, and owns: never links, checked before any rank starts.
OWNED = ("logs", "checkpoints", "tensorboard")


class RunDirectoryInUse(ConfigError):
    """Another live run holds the run directory."""


class RunDirectoryUnwritable(ConfigError):
    """The run directory cannot be made or written: no rank could log why it failed."""


class PlantedLink(RunDirectoryUnwritable):
    """A symbolic link where the run writes: refused, never followed."""


def refuse_link(path: Path) -> None:
    """PlantedLink naming `path` if it is a symbolic link."""
    if os.path.islink(path):
        raise PlantedLink(f"{path} is a symbolic link (to {os.readlink(path)}), where this run writes; it never "
                          "writes through a link it did not make (its target would be overwritten): remove the link, "
                          "or give this run its own hydra.run.dir")


def append_file(path: Path):
    """`path` opened for appending, line-buffered; never through a symbolic link (PlantedLink)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise
    return os.fdopen(fd, "a", buffering=1)


@contextlib.contextmanager
def replacing(path: Path):
    """Yields a new file's path beside `path` (made here, a fresh name) for the caller to write
    whole, then renames it over `path`: a link there is replaced, its target untouched, and a reader
    sees the old file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".new")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_replacing(path: Path, text: str) -> None:
    """Write `path` whole, as `replacing` does."""
    with replacing(path) as tmp:
        Path(tmp).write_text(text)


def check_folders(run_dir: Path, folders: tuple[str, ...] = OWNED) -> None:
    """Every folder of `run_dir` the run writes into: a real folder (made if missing), with no
    symbolic link inside (but checkpoints/, whose step folders may be links the user made to another
    disk: a pruned one loses its link only) and writable: a probe file made and removed there. Raises
    PlantedLink or RunDirectoryUnwritable naming the first that is not."""
    refuse_link(run_dir / NAME)
    for name in folders:
        folder = run_dir / name
        refuse_link(folder)
        try:
            folder.mkdir(exist_ok=True)
            probe = folder / f".write_test.{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
            probe.unlink()
        except OSError as e:
            raise RunDirectoryUnwritable(f"the folder {folder} cannot be written ({e.__class__.__name__}: "
                                         f"{e.strerror or e}): make it writable, or give a writable hydra.run.dir "
                                         "(found before the first step)") from None
        for entry in os.scandir(folder):
            if entry.is_symlink() and (name != "checkpoints" or entry.name.startswith(".")):
                refuse_link(Path(entry.path))


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
def run_directory_lock(run_dir: Path, folders: tuple[str, ...] = OWNED):
    """Hold `run_dir`'s lock for the duration; RunDirectoryInUse if another live run holds it.
    Once held, `folders` are checked (check_folders), before any rank starts."""
    run_dir = Path(run_dir)
    path = run_dir / NAME
    unwritable = lambda e: RunDirectoryUnwritable(  # noqa: E731
        f"the run directory {run_dir} cannot be written ({e.__class__.__name__}: {e.strerror or e}): give a "
        "writable hydra.run.dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        refuse_link(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
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
        check_folders(run_dir, folders)  # where every rank will write: a failure there could not be logged by them
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
        yield path
    finally:
        os.close(fd)  # releases the flock
