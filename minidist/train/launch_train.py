"""From a composed Hydra config to training ranks: validate once, then start (or be) the ranks.

    python recipes/train.py launcher.nproc=4      -> this process validates, then starts 4 local ranks
    torchrun --nproc_per_node 4 recipes/train.py  -> each rank validates, then trains

A config error is printed as one line (`error: ...`) and the exit status is 2, before
any rank starts or anything is written.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from minidist.dist import choose_backend, detect_launch, launch_rank
from minidist.launch import RanksFailed, Stopped, run_ranks, under_launcher
from minidist.train.config_check import resume_notice, validate
from minidist.train.checkpoint import CheckpointWriteFailed
from minidist.train.config import ConfigError
from minidist.train.resilience import read_records, report_failure, who_failed_first
from minidist.train.resilience import dumps_line, enable_flight_recorder
from minidist.train.config import typed_keys
from minidist.train.run_files import OWNED, RunDirectoryInUse, RunDirectoryUnwritable, append_file, run_directory_lock
from minidist.train.stop_signal import StopSignals, exit_status


def local_nproc(launcher_cfg) -> int:
    """launcher.nproc, where auto means one rank per GPU (unless backend=gloo), else cpu_nproc."""
    import torch

    if str(launcher_cfg.nproc) != "auto":
        if not isinstance(launcher_cfg.nproc, int) or launcher_cfg.nproc < 1:
            raise ConfigError(f"launcher.nproc={launcher_cfg.nproc!r} must be auto or an integer >= 1")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if launcher_cfg.backend == "nccl" and launcher_cfg.nproc > gpus:
            raise ConfigError(f"launcher.nproc={launcher_cfg.nproc} with launcher.backend=nccl, but this machine has "
                              f"{gpus} GPUs: one rank per GPU, so lower launcher.nproc (or use launcher.backend=gloo)")
        return launcher_cfg.nproc
    if launcher_cfg.backend != "gloo" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return int(launcher_cfg.cpu_nproc)


def world_size_for(cfg) -> int:
    """The world this config will run in: the launcher's, or the local ranks we are about to start."""
    if under_launcher():
        return int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
    return local_nproc(cfg.launcher)


def agree_on_run_dir(run_dir: Path, ctx) -> Path:
    """Under torchrun every rank composed its own config, and a time-stamped run directory can
    differ by a second between ranks: all take rank 0's, and drop their own if it stayed empty."""
    from minidist import comm

    chosen = Path(comm.all_gather_object(str(run_dir))[0])
    if chosen != run_dir and run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
    return chosen


@contextlib.contextmanager
def quiet_unless_rank0(run_dir: Path, rank: int):
    """Ranks other than 0 send stdout and stderr (Python's and native code's) to their log
    folder while the run lasts; rank 0 keeps the console."""
    if rank == 0:
        yield
        return
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with append_file(run_dir / "logs" / f"rank_{rank}.console") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def run_rank(cfg_dict: dict, run_dir: str, resume_from: str | None, job: str | None = None) -> dict:
    """One rank's whole run: init, train, close. Returns the run's summary; a stop signal
    (stop_signal.py) ends it after checkpointing the step reached, with SystemExit(128 + signal)."""
    with StopSignals(grace_s=float(cfg_dict["launcher"]["stop_grace_s"])) as stop:
        summary = _run_rank(cfg_dict, run_dir, resume_from, stop, job)
    if summary.get("stopped_by"):
        # The stop's status, not a return value: torch's launcher keeps a rank that returned one
        # until it next polls, and a signalled launcher does not poll, it waits out its grace.
        raise SystemExit(exit_status(summary["stopped_by"]))
    return summary


def _run_rank(cfg_dict: dict, run_dir: str, resume_from: str | None, stop: StopSignals, job: str | None) -> dict:
    import torch

    import minidist
    from minidist.train.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if choose_backend(cfg.launcher.backend, detect_launch().local_world_size) == "nccl":
        enable_flight_recorder(Path(run_dir) / "logs")  # a stuck collective is dumped, named (resilience.py)
    try:
        ctx = minidist.init_distributed(backend=cfg.launcher.backend, timeout_s=float(cfg.launcher.timeout_s))
    except minidist.RendezvousError as e:  # a port in use, an unreachable master: the message is the fix
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    trainer, path = None, Path(run_dir)
    try:
        path = agree_on_run_dir(Path(run_dir), ctx)
        with quiet_unless_rank0(path, ctx.rank):
            trainer = Trainer(cfg, path, resume_from=resume_from, stop=stop)
            try:
                return trainer.fit()
            finally:
                trainer.close()
    except Exception as e:  # noqa: BLE001 - one line on the console, the traceback in the rank's log
        # Raised on every rank alike (a write agreed failed; the global gradient norm), rank 0 says it.
        agreed = isinstance(e, (CheckpointWriteFailed, FloatingPointError))
        line = report_failure(e, ctx.rank, trainer.step if trainer is not None else None, path, agreed=agreed,
                              job=job)
        if ctx.rank == 0 or not agreed:
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(1) from e
    finally:
        if under_launcher():
            # The process outlives this run (a --multirun sweep runs its jobs one after the
            # other): keep the process group, whose rendezvous cannot be repeated under
            # torchrun's store, and destroy it when the process exits.
            if not getattr(run_rank, "_shutdown_registered", False):
                atexit.register(minidist.shutdown)
                run_rank._shutdown_registered = True
        else:
            minidist.shutdown()


def command_line_overrides() -> list[str]:
    """The overrides this Hydra job was given (none outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def launch(cfg, run_dir: str | Path, job: str | None = None) -> int:
    """Validate `cfg` and train; return the process exit status. `job`: a sweep's job, named in the
    launcher's error lines."""
    run_dir = Path(run_dir).absolute()
    rank = launch_rank()
    started = time.time()  # the ranks' failure records from this launch on are this run's

    def error(line) -> None:
        print(f"error: {job + ': ' if job else ''}{line}", file=sys.stderr, flush=True)
    try:
        world = world_size_for(cfg)
        ckpt = validate(cfg, world, run_dir)
        line, to_train = resume_notice(cfg, ckpt, typed_keys(command_line_overrides())) if ckpt else (None, True)
    except ConfigError as e:
        if rank == 0:
            error(e)
        return 2
    if line is not None and rank == 0:
        print(line, flush=True)
    if not to_train:
        return 0
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    resume = str(ckpt) if ckpt is not None else None
    try:
        # One run per run directory (run_files.py): taken by the process that starts the ranks
        # (under torchrun, rank 0's), before anything is written there.
        folders = OWNED + (("samples",) if cfg.trainer.get("log_samples") else ())
        with run_directory_lock(run_dir, folders) if rank == 0 else contextlib.nullcontext():
            run_ranks(run_rank, nproc=world, args=(cfg_dict, str(run_dir), resume, job),
                                stop_grace_s=float(cfg.launcher.stop_grace_s))
    except Stopped as e:  # our launcher was signalled too: the ranks, stopped, have said how
        return exit_status(e.signum)
    except (RunDirectoryInUse, RunDirectoryUnwritable) as e:  # before any rank: its logs could not have said it
        error(e)
        return 2
    except RanksFailed as e:
        if (signum := e.stopped_by()) is not None:  # only a rank was signalled: they stopped, as agreed
            return exit_status(signum)
        records = read_records(run_dir, started)
        if records and all(r["kind"] == "agreed" for r in records.values()):
            return 1  # every rank stopped alike, and rank 0 said why
        error(f"training failed on {who_failed_first(run_dir, started, e.exitcodes)}; each rank's log is in "
              f"{run_dir / 'logs'}")
        if (line := dumps_line(run_dir / "logs")) is not None:
            print(line, file=sys.stderr)
        return 1
    return 0
