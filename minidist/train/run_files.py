"""Everything a run writes in its directory: the lock (one run per directory), files written without
following a link, the logs, TensorBoard, the progress bar and the summary (what a user sees:
docs/trainer.md; how the lock and the link checks work: docs/internals.md, "train/run_files.py").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from minidist.dist import process_alive
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
            if holder and (holder.get("host") != socket.gethostname() or process_alive(holder.get("pid"))):
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


class RunLog:
    def __init__(self, cfg, run_dir: Path, ctx):
        self.cfg, self.run_dir, self.ctx = cfg, Path(run_dir), ctx
        self.main = ctx.rank == 0
        self.last: dict = {}
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.logger = logging.getLogger(f"minidist.train.rank{ctx.rank}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        # A Hydra sweep configures logging again for every job, and its disable_existing_loggers
        # switches off this logger, created by the previous job: the later jobs' logs stayed empty.
        self.logger.disabled = False
        self._file = logging.StreamHandler(append_file(self.run_dir / "logs" / f"rank_{ctx.rank}.log"))
        self._file.setFormatter(logging.Formatter("%(asctime)s rank %(rank)s  %(message)s", "%H:%M:%S"))
        self._file.addFilter(lambda record: setattr(record, "rank", ctx.rank) or True)
        self.logger.addHandler(self._file)
        self.bar = None
        self.writer = None
        if self.main:
            # What this run uses (a resumed run with changed settings: its own; each checkpoint's
            # meta.pt keeps the config it was written with).
            write_replacing(self.run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def info(self, message: str) -> None:
        """Into this rank's log file; on rank 0 to the console too (above the progress bar)."""
        self.logger.info(message)
        if self.main:
            if self.bar is not None:
                self.bar.write(message)
            else:
                print(message, flush=True)

    # -- progress
    def start_progress(self, step: int, total: int) -> None:
        if self.main and self.cfg.trainer.progress:
            from tqdm.auto import tqdm

            # Into a file or pipe, every 30 s instead of ten times a second: a log, not an animation.
            self.bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.1 if sys.stderr.isatty() else 30.0)

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def stop_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # -- metrics
    def scalars(self, step: int, metrics: dict) -> None:
        self.last.update(metrics)
        self.logger.info(f"step {step}: " + ", ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
        if not self.main:
            return
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if self.bar is not None:
            post = {"loss": f"{self.last.get('train/loss', float('nan')):.3f}"}
            if "val/loss" in self.last:
                post["val"] = f"{self.last['val/loss']:.3f}"
            rate = self.last.get("throughput/tokens_per_s") or self.last.get("throughput/samples_per_s")
            if rate:
                post["tok/s" if "throughput/tokens_per_s" in self.last else "samples/s"] = f"{rate:,.0f}"
            self.bar.set_postfix(post, refresh=False)

    def finish(self, summary: dict) -> None:
        self.logger.info("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
        if not self.main:
            return
        hparams = {"strategy": self.cfg.strategy.name, "model": self.cfg.model.name, "data": self.cfg.data.name,
                   "world_size": self.ctx.world_size, "micro_batch_size": self.cfg.trainer.micro_batch_size,
                   "grad_accum": self.cfg.trainer.grad_accum, "lr": float(self.cfg.optim.lr),
                   "precision": self.cfg.trainer.precision}
        finals = {f"final/{k}": v for k, v in summary.items() if isinstance(v, (int, float)) and k != "step"}
        self.writer.add_hparams(hparams, finals, run_name=".")
        self.writer.flush()
        # the same figures for scripts (e.g. scripts/make_components.py), beside the resolved config
        write_replacing(self.run_dir / "summary.json",
                        json.dumps({**summary, "config": hparams}, indent=1, default=str) + "\n")
        print(format_summary(summary, self.run_dir), flush=True)

    def close(self) -> None:
        self.stop_progress()
        if self.writer is not None:
            self.writer.close()
        self.logger.removeHandler(self._file)
        self._file.close()
        self._file.stream.close()


def _bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(s: dict, run_dir: Path) -> str:
    """The end-of-run table: losses, speed, memory, and where everything is."""
    rows = [("steps", f"{s['step']}")]
    if s.get("skipped_steps"):
        rows.append(("skipped steps", f"{s['skipped_steps']} (a non-finite gradient norm: their updates skipped)"))
    for key, label in (("train/loss", "train loss"), ("val/loss", "validation loss"), ("val/accuracy", "val accuracy")):
        if key in s:
            rows.append((label, f"{s[key]:.4f}"))
    if "throughput/tokens_per_s" in s:
        rows.append(("throughput", f"{s['throughput/tokens_per_s']:,.0f} tokens/s "
                                   f"({s['throughput/tokens_per_s_per_rank']:,.0f} per rank)" +
                                   (f", MFU {s['mfu']:.1%}" if "mfu" in s else "")))
    elif "throughput/samples_per_s" in s:
        rows.append(("throughput", f"{s['throughput/samples_per_s']:,.1f} samples/s "
                                   f"({s['throughput/samples_per_s_per_rank']:,.1f} per rank)"))
    if "time/step_s" in s:
        split = f"data {s['time/data_s'] * 1e3:.1f}, compute {s['time/compute_s'] * 1e3:.1f}"
        if "time/exposed_comm_s" in s:
            split += f", exposed comm {s['time/exposed_comm_s'] * 1e3:.1f}"
        clock = f"; {s['time/clock']}" if "time/clock" in s else ""
        rows.append(("step time", f"{s['time/step_s'] * 1e3:.1f} ms ({split} ms{clock})"))
    if "comm/bytes_per_step" in s:
        rows.append(("communication", f"{_bytes(s['comm/bytes_per_step'])} sent per step and rank (mean of "
                                      f"{s.get('comm/steps', s['step'])} steps)"))
    if s.get("checkpoint/write_s"):
        rows.append(("checkpointing", f"{s['checkpoint/blocked_s']:.2f} s of training blocked, "
                                      f"{s['checkpoint/write_s']:.2f} s writing"))
    rows.append(("memory (rank 0)", f"model state {_bytes(s['memory/model_state_bytes'])}, "
                                    f"peak {_bytes(s['memory/peak_bytes'])}"))
    rows += [("run directory", str(run_dir)), ("checkpoints", str(run_dir / "checkpoints")),
             ("logs", str(run_dir / "logs")), ("tensorboard", f"tensorboard --logdir {run_dir / 'tensorboard'}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "summary", "-" * 7] + [f"{k:<{width}}  {v}" for k, v in rows])
