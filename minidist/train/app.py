"""From a composed Hydra config to training ranks: validate once, then start (or be) the ranks.

    python recipes/train.py launcher.nproc=4      -> this process validates, then starts 4 local ranks
    torchrun --nproc_per_node 4 recipes/train.py  -> each rank validates, then trains

A config error is one line (`error: ...`), exit status 2, before any rank starts. The command line
of every recipe, `minidist train` and `python -m minidist.train`: docs/internals.md, "train/app.py".
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from minidist.dist import (choose_backend, detect_launch, free_port, launch_rank, ranks_allocator,
                           remove_left_by_dead)
from minidist.train.checkpoint import CheckpointWriteFailed
from minidist.train.config import ConfigError, compose_fresh, config_dir, typed_keys
from minidist.train.config_check import resume_notice, validate
from minidist.train.resilience import dumps_line, enable_flight_recorder, read_records, report_failure, who_failed_first
from minidist.train.run_files import OWNED, RunDirectoryInUse, RunDirectoryUnwritable, append_file, run_directory_lock
from minidist.train.stop_signal import StopSignals, exit_status


def under_launcher() -> bool:
    """True when torchrun or SLURM already started this process as one rank of a job."""
    return "RANK" in os.environ or ("SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ)


# The signals the launcher passes on to its ranks (then waits for them to stop): torch's own
# list, and SIGUSR1, SLURM's warning before preemption (`--signal=USR1@N`), which would
# otherwise kill this process and leave the ranks without a launcher.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"

def run_local(fn: Callable, nproc: int, args: tuple = (), stop_grace_s: float = 30.0) -> dict:
    """Run fn(*args) on `nproc` local ranks (torchrun's machinery, in-process); return rank -> result.

    A rank that fails makes this raise torch's ChildFailedError with that rank's traceback. A
    signal (FORWARDED_SIGNALS) is passed on to the ranks, which get `stop_grace_s` (and 5 s more)
    to stop before they are killed; then torch's SignalException is raised.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A failed rank has said what happened in one line and logged its traceback (the trainer's
    # run_rank does): the elastic agent's copy of that traceback would only bury the line.
    import logging
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # A stop signal: the ranks' own line says what happened ("Received 15 death signal" would not).
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    # torch's agent wants a folder (the ranks' error files); left to it, one stays in /tmp per run.
    # Ours is removed at the end; a launcher killed (kill -9) leaves it to the next launch.
    remove_left_by_dead(Path(tempfile.gettempdir()), "minidist-launch-")
    logs = tempfile.mkdtemp(prefix=f"minidist-launch-{os.getpid()}-")
    try:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
            rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
            monitor_interval=0.1, start_method="spawn", signals_to_handle=FORWARDED_SIGNALS,
            shutdown_timeout=int(math.ceil(stop_grace_s)) + 5, logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        with ranks_allocator():
            return elastic_launch(config, entrypoint=fn)(*args)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


class RanksFailed(RuntimeError):
    """Local ranks that failed (each has logged its own traceback)."""

    def __init__(self, failures: dict):
        self.ranks = sorted(failures)
        self.exitcodes = {r: getattr(f, "exitcode", None) for r, f in failures.items()}
        super().__init__(f"rank(s) {self.ranks} failed")

    def stopped_by(self) -> int | None:
        """The stop signal, when every failed rank ended with a stop's status (128 + SIGINT,
        SIGTERM or SIGUSR1: stop_signal.py's), else None."""
        signums = {code - 128 if code is not None else None for code in self.exitcodes.values()}
        stops = {int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        return signums.pop() if len(signums) == 1 and signums <= stops else None


class Stopped(RuntimeError):
    """The launcher was signalled (Ctrl-C, SIGTERM, SIGUSR1) and its ranks have stopped."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def run_ranks(fn: Callable, nproc: int, args: tuple = (), stop_grace_s: float = 30.0) -> dict:
    """fn(*args) on every rank of the job; rank -> result. Under a launcher (torchrun, SLURM) this
    process is one rank: {its rank: its result}, its exceptions its own. Otherwise `nproc` local
    ranks start now: any that fails raises RanksFailed, and a signal to this process, passed on
    to them, raises Stopped once they have stopped."""
    if under_launcher():
        return {launch_rank(): fn(*args)}
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        return run_local(fn, nproc=nproc, args=args, stop_grace_s=stop_grace_s)
    except ChildFailedError as e:
        raise RanksFailed(e.failures) from None
    except SignalException as e:
        end_leftover_ranks(e.sigval)
        raise Stopped(e.sigval) from None


def end_leftover_ranks(signum: int, wait_s: float = 5.0) -> None:
    """A second signal cut short torch's wait for the ranks to stop: pass it on too (a second
    Ctrl-C stops them at once), give them `wait_s` to say so, then kill what is left."""
    import multiprocessing

    alive = multiprocessing.active_children()
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)
    deadline = time.monotonic() + wait_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()


def run_recipe(fn: Callable, cfg, path_keys: tuple[str, ...] = ()) -> None:
    """A recipe's entry: call fn(cfg_dict) on this rank under torchrun / SLURM, else start
    `cfg.nproc` local ranks that each call it.

    `cfg` (a Hydra DictConfig or a dict) travels to the ranks as a plain dict; the
    `path_keys` given are made absolute first, so every rank writes to the same place.
    """
    cfg_dict = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    for key in path_keys:
        if cfg_dict.get(key):
            cfg_dict[key] = os.path.abspath(cfg_dict[key])
    run_ranks(fn, nproc=int(cfg_dict["nproc"]), args=(cfg_dict,))


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
        for fd in (1, 2):
            os.dup2(out.fileno(), fd)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for fd, kept in zip((1, 2), saved):
                os.dup2(kept, fd), os.close(kept)


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
        if not under_launcher():
            minidist.shutdown()
        elif not getattr(run_rank, "_shutdown_registered", False):
            # The process outlives this run (a --multirun sweep runs its jobs one after the other):
            # keep the process group, whose rendezvous cannot be repeated under torchrun's store,
            # and destroy it when the process exits.
            atexit.register(minidist.shutdown)
            run_rank._shutdown_registered = True


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
        if cfg.get("ft") is not None:  # ft=torchft: here a lighthouse and the groups; under torchrun, one group
            from minidist.train.live_recovery import check_ft
            check_ft(cfg, world, one_group=under_launcher())
        line, to_train = resume_notice(cfg, ckpt, typed_keys(command_line_overrides())) if ckpt else (None, True)
    except ConfigError as e:
        if rank == 0:
            error(e)
        return 2
    if line is not None and rank == 0:
        print(line, flush=True)
    if not to_train:
        return 0
    if cfg.get("ft") is not None and not under_launcher():
        from minidist.train.ft_launch import launch_groups
        try:
            with run_directory_lock(run_dir, ()):
                return launch_groups(cfg, run_dir, command_line_overrides(), world, entry=main)
        except (RunDirectoryInUse, RunDirectoryUnwritable) as e:
            error(e)
            return 2
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


# A --multirun sweep's jobs as they end: (the job, its exit status). The train body records them and
# goes on to the next job; run_app ends the sweep with a tally. VARYING: the keys the sweep varies,
# which name its jobs.
JOBS: list[tuple[str, int]] = []
VARYING: set[str] = set()


def run_app(config_name: str, body: Callable, argv: list[str], prog: str,
            precheck: Callable | None = None) -> None:
    """Run `body(cfg)` as a Hydra app on configs/<config_name>.yaml with `argv`'s overrides.

    A sweep (-m) first composes every job's config and runs `precheck(cfg)` on each (raising
    ConfigError), so that a bad setting in any job is said, one line a job, before any launches."""
    import hydra

    sys.argv = [prog, *argv]
    if launch_rank() != 0:
        sys.argv.append("hydra/hydra_logging=disabled")  # Hydra's own lines come from rank 0 only
    wants_full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors to us instead of printing them
    JOBS.clear()
    VARYING.clear()
    try:
        if {"-m", "--multirun"} & set(argv):
            jobs = sweep_jobs(config_name, argv)
            VARYING.update(k for k in {o.split("=", 1)[0] for job in jobs for o in job}
                           if len({o for job in jobs for o in job if o.split("=", 1)[0] == k}) > 1)
            if precheck is not None:
                check_every_job(config_name, jobs, precheck)
        hydra.main(config_path=str(config_dir()), config_name=config_name, version_base="1.3")(body)()
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, re-raised unless one line says it
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if wants_full or not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        if launch_rank() == 0:
            print(f"error: {override_error(e, config_name, argv)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if not wants_full:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    failed = [(job, status) for job, status in JOBS if status]
    if JOBS and launch_rank() == 0:
        print(f"sweep: {len(JOBS)} job(s), {len(JOBS) - len(failed)} done, {len(failed)} failed"
              + (f" ({'; '.join(job for job, _ in failed)})" if failed else ""), file=sys.stderr, flush=True)
    if failed:
        raise SystemExit(max(status for _, status in failed))


def sweep_jobs(config_name: str, argv: list[str]) -> list[list[str]]:
    """The override list of every job a sweep runs, as Hydra's basic sweeper expands them (the
    command line's sweeps, and those the config itself declares under hydra.sweeper.params)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = parser.parse_overrides([a for a in argv if not a.startswith("-")])
    cfg = compose_fresh(config_name, [o.input_line for o in given if not o.is_sweep_override()],
                        return_hydra_config=True)
    declared = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.get("params") or {}).items()]
    return [job for batch in BasicSweeper.split_arguments(parser.parse_overrides(declared) + given, None)
            for job in batch]


def job_name(num: int, overrides) -> str:
    """`job 1 (strategy=zero3)`: its number and what the sweep varies (all its overrides if nothing)."""
    varying = [o for o in overrides if o.split("=", 1)[0] in VARYING] or list(overrides)
    return f"job {num} ({' '.join(varying)})"


def check_every_job(config_name: str, jobs: list[list[str]], precheck: Callable) -> None:
    """Compose each job of a sweep and `precheck` it; any job's ConfigError: one line each, then
    exit 2 with nothing launched."""
    bad = []
    for n, job in enumerate(jobs):
        overrides = [o for o in job if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
        try:
            precheck(compose_fresh(config_name, overrides))
        except ConfigError as e:
            bad.append(f"{job_name(n, overrides)}: {e}")
    if bad:
        for line in bad:
            print(f"error: {line}", file=sys.stderr, flush=True)
        print(f"sweep: {len(bad)} of {len(jobs)} job(s) have settings to fix: nothing was launched", file=sys.stderr,
              flush=True)
        raise SystemExit(2)


def hydra_app(config_name: str):
    """`@hydra_app("bench_ddp")` on a recipe's `main(cfg)`: run_app's command line for it."""
    def decorate(body: Callable) -> Callable:
        def main(argv: list[str] | None = None, prog: str | None = None) -> None:
            run_app(config_name, body, sys.argv[1:] if argv is None else argv, prog or sys.argv[0])
        return main
    return decorate


def override_error(e: Exception, config_name: str, argv: list[str]) -> str:
    """Hydra's composition error as one line: the override, what is wrong, the closest valid names."""
    text, cause = str(e), str(e.__cause__ or "")
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing and getattr(e, "options", None):
        group, name = missing.groups()
        return f"{group}={name}: no such {group}{_did_you_mean(name, e.options)} (the choices: {', '.join(e.options)})"
    unknown = re.search(r"full_key: (\S+)", cause)
    if "not in struct" in cause and unknown:
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        siblings = [str(k) for k in _keys_at(config_name, argv, parent)]
        close = difflib.get_close_matches(leaf, siblings, n=2, cutoff=0.6)
        full = [f"{parent}.{k}" if parent else k for k in (close or siblings)]
        return f"{key}: no such key" + (f"; did you mean {' or '.join(full)}?" if close else
                                        f" (the keys there: {', '.join(full)})")
    appended = re.search(r"An item is already at '([^']+)'", text)
    if appended:
        return f"+{appended.group(1)}: the key exists already; set it without the +: {appended.group(1)}=..."
    bad = [a for a in argv if not _parses(a)]
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"{bad[0]}: not an override Hydra can parse ({first})" if bad else first


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _keys_at(config_name: str, argv: list[str], path: str) -> list[str]:
    """The keys under `path` of the config as composed with argv's group choices (strategy=zero3)."""
    choices = [a for a in argv if "=" in a and "." not in a.split("=", 1)[0] and not a.startswith(("+", "~", "-"))]
    try:
        cfg = compose_fresh(config_name, choices)
    except Exception:  # noqa: BLE001 - a bad choice too: the defaults then
        cfg = compose_fresh(config_name)
    node = OmegaConf.select(cfg, path) if path else cfg
    return list(node.keys()) if hasattr(node, "keys") else []


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if override.startswith("-"):  # --multirun, -m, --help, ...: Hydra's flags
        return True
    try:
        OverridesParser.create().parse_overrides([override])
        return True
    except Exception:  # noqa: BLE001
        return False


def train(cfg) -> None:
    """Validate and train (launch_train.launch); exit with its status. In a sweep, a job that failed
    is recorded (JOBS) and the next one runs; a stop signal (status 128 + N) ends the sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    job = job_name(hydra.job.num, hydra.overrides.task) if hydra.mode == RunMode.MULTIRUN else None
    status = launch(cfg, hydra.runtime.output_dir, job=job)
    if job is not None and status < 128:
        JOBS.append((job, status))
    elif status:
        sys.exit(status)


def check_job(cfg) -> None:
    """A sweep's job's settings, checked before any job launches (the run directory is checked at
    the job's own launch)."""
    import tempfile

    validate(cfg, world_size_for(cfg), Path(tempfile.gettempdir()) / "minidist-sweep-check-no-run-dir")


def main(argv: list[str] | None = None, prog: str = "python -m minidist.train") -> None:
    run_app("train", train, sys.argv[1:] if argv is None else argv, prog, precheck=check_job)
